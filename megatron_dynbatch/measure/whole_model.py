"""A whole model on one device, trained for real one step at a time: what ``benchmarks/gpu/memory.py`` measures.

:class:`WholeModel` builds a preset's complete megatron-core ``GPTModel`` (random weights; every decoder layer,
the embedding and an untied LM head; this package's THD local layer spec) in a world of one
(:func:`~.mcore_slice.ensure_world_of_one`), wraps it in Megatron's DDP (gradient buffer in fp32 for bf16/fp16
weights, as Megatron-LM runs them; no distributed optimizer: one GPU) and builds Megatron's optimizer
(``get_megatron_optimizer``: Adam, mixed precision with fp32 master weights, gradient clipping on a GPU; Megatron
falls back to torch's AdamW without Transformer Engine or apex). :meth:`WholeModel.step` runs one optimizer step
of a global batch of ``tokens`` tokens packed into ONE micro-batch (sequences of ``seq_len``, the last shorter)
through :func:`~megatron_dynbatch.megatron.schedule.dynamic_forward_backward` -- the THD path a training run takes
-- then ``optimizer.step()``. :meth:`WholeModel.probe` runs the first-step memory probe
(:mod:`megatron_dynbatch.megatron.probe`) on the same model: what the probe reads against the whole step's peak.

:meth:`WholeModel.settings` are the :class:`~megatron_dynbatch.core.memory.MemorySettings` that describe this
run (one GPU: the optimizer state is not sharded; the optimizer step's temporaries are torch AdamW's when that is
the optimizer); :meth:`WholeModel.resident_bytes` sums the tensors that stay allocated (weights, gradient
buffers, master weights, Adam state) -- what a fake memory reader reports as resident on a CPU.
"""

from __future__ import annotations

import gc
from typing import Any, Dict, List

import torch

from ..core.memory import MemorySettings
from ..core.model_spec import ModelSpec
from ..core.planner.options import PlanOptions
from ..megatron.device import device_memory_gb

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class WholeModel:
    """One preset's whole model, its DDP wrapper and optimizer on ``device`` (module docstring)."""

    def __init__(self, model: Any, *, device: str = "cuda", dtype: str = "bf16", seq_len: int = 4096,
                 seed: int = 1234) -> None:
        import torch.nn.functional as F
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.transformer_config import TransformerConfig

        from ..megatron.specs import get_thd_local_layer_spec
        from .mcore_slice import ensure_world_of_one

        self.spec = ModelSpec.from_any(model)
        if self.spec.num_experts or self.spec.multi_latent_attention:
            from ..core.errors import DynBatchConfigError

            raise DynBatchConfigError("--model", self.spec.name, "MoE and MLA models are not built here",
                                      "measure a dense GQA model that fits one GPU, e.g. qwen3-0.6b")
        self.device = torch.device(device)
        self.dtype_name = dtype
        self.dtype = _DTYPES[dtype]
        self.seq_len = int(seq_len)
        ensure_world_of_one(self.device, seed)
        m, half = self.spec, self.dtype != torch.float32
        self.config = TransformerConfig(
            num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
            num_query_groups=m.num_query_groups, kv_channels=m.kv_channels, ffn_hidden_size=m.ffn_hidden_size,
            gated_linear_unit=bool(m.swiglu), activation_func=F.silu if m.swiglu else F.gelu, add_bias_linear=False,
            normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0, params_dtype=self.dtype,
            pipeline_dtype=self.dtype, bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16,
            use_cpu_initialization=self.device.type == "cpu", masked_softmax_fusion=False,
            bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            gradient_accumulation_fusion=False, persist_layer_norm=False, variable_seq_lengths=True,
            moe_token_dispatcher_type="alltoall")
        torch.manual_seed(seed)
        gpt = GPTModel(config=self.config, transformer_layer_spec=get_thd_local_layer_spec(normalization="RMSNorm"),
                       vocab_size=m.padded_vocab_size, max_sequence_length=1 << 20, pre_process=True,
                       post_process=True, position_embedding_type="rope", share_embeddings_and_output_weights=False)
        gpt.to(device=self.device, dtype=self.dtype)
        if self.device.type == "cpu":  # the optimizer's literal CUDA tensors (megatron/cpu.py)
            from ..megatron.cpu import install_cpu_optimizer_shims

            install_cpu_optimizer_shims()
        self.ddp = DistributedDataParallel(config=self.config, module=gpt, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=half, overlap_grad_reduce=False, use_distributed_optimizer=False))
        self.config.no_sync_func = self.ddp.no_sync
        self.config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=1e-6, bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16,
            params_dtype=self.dtype, use_distributed_optimizer=False,
            clip_grad=1.0 if self.device.type == "cuda" else 0.0), [self.ddp])
        self.torch_adam = not _fused_adam_available()
        self._gen = torch.Generator().manual_seed(seed)

    # ------------------------------------------------------------------------------------------ what it is
    def settings(self, **overrides: Any) -> MemorySettings:
        """The memory settings this run has (module docstring)."""
        half = self.dtype != torch.float32
        kw: Dict[str, Any] = dict(optimizer="replicated", recompute="none", param_dtype=self.dtype_name,
                                  grad_dtype="fp32", optimizer_bytes_per_param=12.0 if half else 8.0,
                                  optimizer_step_bytes_per_param=4.0 if self.torch_adam else 0.0,
                                  untie_embeddings=True)
        kw.update(overrides)
        return MemorySettings(**kw)

    def resident_bytes(self) -> int:
        """Bytes of every tensor that stays allocated between steps: parameters, gradient buffers, optimizer
        state (master weights, moments), counted once each by storage."""
        seen, total = set(), 0

        def add(t: Any) -> None:
            nonlocal total
            if isinstance(t, torch.Tensor) and t.device.type == self.device.type:
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()

        for p in self.ddp.module.parameters():
            add(p.data)
            add(getattr(p, "main_grad", None))
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", opt)
            for group in inner.param_groups:
                for p in group["params"]:
                    add(p.data)
                    for v in inner.state.get(p, {}).values():
                        add(v)
        return total

    # ------------------------------------------------------------------------------------------ one step
    def samples(self, tokens: int) -> List[Dict[str, Any]]:
        """Samples of ``seq_len`` tokens (the last shorter) adding up to ``tokens``."""
        out, left = [], int(tokens)
        while left > 0:
            n = min(self.seq_len, left)
            left -= n
            toks = torch.randint(1, self.spec.padded_vocab_size, (n,), generator=self._gen)
            out.append({"tokens": toks, "loss_mask": torch.ones(n)})
        return out

    def step(self, tokens: int) -> Dict[str, Any]:
        """One optimizer step of ``tokens`` tokens in one micro-batch; the plan's figures."""
        from ..megatron.schedule import dynamic_forward_backward

        batch = self.samples(tokens)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        res = dynamic_forward_backward(self.ddp, batch, {"model": self.spec, "parallel": {"dp": 1},
                                                         "max_tokens_per_gpu": int(tokens)},
                                       device=self.device, memory_probe=False)  # the step alone is measured
        self.optimizer.step()
        plan = res.iterator.plan
        return {"microbatches": int(plan.num_microbatches), "max_microbatch_tokens": int(plan.max_microbatch_tokens)}

    def probe(self, tokens: int, *, reader: Any, card_bytes: float, settings: Any = None, profile: Any = None,
              multiple: int = 256) -> Any:
        """The first-step memory probe (:class:`~megatron_dynbatch.megatron.probe.FirstStepProbe`) at a budget of
        ``tokens``: one synthetic micro-batch, forward + backward, read by ``reader``; its
        :class:`~megatron_dynbatch.megatron.probe.ProbeResult` (measured vs predicted, kept or lowered)."""
        from ..megatron.probe import FirstStepProbe
        from ..megatron.schedule import dynamic_forward_backward

        probe = FirstStepProbe(card_bytes, reader=reader, merge=lambda v: v, log=None, settings=settings,
                               profile=profile, multiple=multiple, stage=0, device=self.device)
        options = PlanOptions(model=self.spec, parallel={"dp": 1}, max_tokens_per_gpu=int(tokens),
                              memory=settings).resolve()
        self.ddp.zero_grad_buffer()
        return probe.run(options, lambda smp, plan: dynamic_forward_backward(
            self.ddp, smp, plan, device=self.device, reduce_loss=False, memory_probe=False), model=self.ddp)

    def recover(self) -> None:
        """After an out-of-memory error: drop gradients and cached blocks so the next attempt starts clean."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _fused_adam_available() -> bool:
    """Whether Megatron's optimizer found a fused Adam (Transformer Engine's or apex's) rather than torch's AdamW."""
    try:
        from megatron.core import optimizer as mo
    except ImportError:  # pragma: no cover
        return False
    adam = getattr(mo, "Adam", None)
    return adam is not None and getattr(adam, "__module__", "").split(".")[0] in ("transformer_engine", "apex")


__all__ = ["WholeModel", "device_memory_gb"]  # device_memory_gb: megatron/device.py, re-exported
