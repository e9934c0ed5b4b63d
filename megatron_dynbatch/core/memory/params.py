"""Parameters and the memory they pin: what each pipeline stage of one GPU holds before any token arrives.

:func:`parameter_counts` counts a model's parameters by kind (norms and biases, < 0.1%, are left out).
:func:`stage_static` turns them into bytes per pipeline stage of one GPU:

* dense parameters (attention, dense MLPs, shared experts, routers) are split over ``tp x pp``; the embedding
  and LM head are ``V x h`` with ``V`` padded to a multiple of ``make_vocab_size_divisible_by x tp``; routed experts
  over ``etp x ep x pp``; the input embedding sits on the first stage and the LM head on the last (both on the
  one stage when ``pp == 1``; a tied head is stored once there, and as a copy on the last stage when
  ``pp > 1``, as Megatron does);
* bytes per parameter: ``weight + grad`` plus the optimizer state (``optimizer_bytes_per_param``), divided over
  the data-parallel ranks that shard it with the distributed optimizer -- ``dp x cp`` for dense parameters, the
  expert-data-parallel ranks ``world / (etp x ep x pp)`` for experts -- whole when replicated, on the host with
  CPU offload. A log-prob pass has the same resident state (``log_prob_static="training"``) or the weights
  only (``"weights"``, a separate forward-only model);
* the optimizer step's temporary buffers (``optimizer_step_bytes_per_param`` per parameter of the GPU's shard)
  are returned separately: they exist only while the step runs, when no activations do.

Pure Python.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from ..model_spec import ModelLike, ModelSpec
from ..parallel import ParallelConfig
from .settings import MemorySettings


def _mlp_mult(spec: ModelSpec) -> int:
    """Weight matrices of one MLP: 3 with a gated (SwiGLU) MLP, else 2."""
    return 3 if spec.swiglu else 2


def parameter_counts(model: ModelLike, *, untie_embeddings: bool = True, tp: int = 1) -> Dict[str, float]:
    """Parameter counts: ``attention`` and ``dense_mlp`` (all layers), ``shared_experts``, ``routed_experts``,
    ``router``, ``embedding`` (input), ``output`` (LM head; 0 when tied) and ``total``. Norms and biases are
    ignored (< 0.1%). The embedding and head are ``V x h`` with ``V`` padded for tensor parallelism ``tp`` as
    Megatron pads it (:meth:`~megatron_dynbatch.core.model_spec.ModelSpec.padded_vocab_for`)."""
    m = ModelSpec.from_any(model)
    vocab = m.padded_vocab_for(tp)
    h, nq = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        qk = int(m.qk_head_dim or 0) + int(m.qk_pos_emb_head_dim or 0)
        q = h * m.q_lora_rank + m.q_lora_rank * nq * qk if m.q_lora_rank else h * nq * qk
        kv = h * (int(m.kv_lora_rank or 0) + int(m.qk_pos_emb_head_dim or 0)) \
            + int(m.kv_lora_rank or 0) * nq * (int(m.qk_head_dim or 0) + int(m.v_head_dim or 0))
        attn_layer = q + kv + nq * int(m.v_head_dim or 0) * h
    else:
        d, ng = int(m.kv_channels or 0), int(m.num_query_groups or nq)
        attn_layer = h * (nq * d + 2 * ng * d) + nq * d * h
    pattern = m.moe_layer_pattern()
    n_moe = sum(pattern)
    mult = _mlp_mult(m)
    out = {
        "attention": float(attn_layer * m.num_layers),
        "dense_mlp": float(mult * h * m.ffn_hidden_size * (m.num_layers - n_moe)),
        "shared_experts": float(mult * h * int(m.moe_shared_expert_intermediate_size or 0) * n_moe),
        "routed_experts": float(mult * h * int(m.moe_ffn_hidden_size or 0) * int(m.num_experts or 0) * n_moe),
        "router": float(h * int(m.num_experts or 0) * n_moe),
        "embedding": float(vocab * h),
        "output": float(vocab * h) if untie_embeddings else 0.0,
    }
    out["total"] = sum(out.values())
    return out


def stage_static(model: ModelLike, parallel: ParallelConfig, settings: MemorySettings,
                 pass_: str = "train") -> List[Tuple[float, float]]:
    """``(resident bytes, optimizer-step bytes)`` of one GPU of every pipeline stage (module docstring)."""
    m = ModelSpec.from_any(model)
    p = parallel
    st = settings
    etp = st.expert_tensor_parallel_size or p.tp
    counts = parameter_counts(m, untie_embeddings=st.untie_embeddings, tp=p.tp)
    dense = (counts["attention"] + counts["dense_mlp"] + counts["shared_experts"] + counts["router"]) / (p.tp * p.pp)
    expert = counts["routed_experts"] / (etp * p.ep * p.pp)
    emb = counts["embedding"] / p.tp
    head = (counts["output"] if st.untie_embeddings else counts["embedding"]) / p.tp
    expert_dp = max(1, (p.dp * p.tp * p.pp * p.cp) // (etp * p.ep * p.pp))
    weights_only = pass_ == "log_prob" and st.log_prob_static == "weights"

    def per_param(shard: int) -> Tuple[float, float]:
        """(resident bytes, step bytes) per parameter with the optimizer state sharded over ``shard`` ranks."""
        if weights_only:
            return st.weight_bytes, 0.0
        base = st.weight_bytes + st.grad_bytes
        if st.optimizer == "cpu_offload":
            return base, 0.0
        div = shard if st.optimizer == "distributed" else 1
        return base + st.optimizer_bytes_per_param / div, st.optimizer_step_bytes_per_param / div

    dense_b, dense_s = per_param(p.dp * p.cp)
    expert_b, expert_s = per_param(expert_dp)
    out: List[Tuple[float, float]] = []
    for s in range(p.pp):
        d = dense
        if s == 0:
            d += emb
        if s == p.pp - 1 and (p.pp > 1 or st.untie_embeddings):
            d += head
        out.append((d * dense_b + expert * expert_b, d * dense_s + expert * expert_s))
    return out


__all__ = ["parameter_counts", "stage_static"]
