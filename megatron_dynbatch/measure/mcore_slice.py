"""The megatron-core slice: a ``GPTModel`` of ``num_layers`` layers with the per-TP-rank widths, built with this
package's THD local spec, so its core attention is :class:`~megatron_dynbatch.megatron.attention.
ThdDotProductAttention` -- torch's fused varlen kernel on a GPU, the per-sequence loop on CPU -- or, with
``layout.spec == "te"``, with Transformer Engine's layer spec (its fused THD attention and layers; whole
micro-batches only, ``group_size == 1``: TE's context-parallel attention needs the group's GPUs).

* **Process state.** megatron-core needs ``torch.distributed`` and its ``parallel_state``.
  :func:`ensure_world_of_one` creates a world of one (NCCL on CUDA, gloo on CPU, where it also installs the
  documented CPU shims of :mod:`megatron_dynbatch.megatron.cpu`) unless the process has one already; a
  process whose ``parallel_state`` has ``tp``, ``pp`` or ``cp`` > 1 is refused (the slice emulates TP by its
  widths, so it must not be split again) -- time in a separate process there.
* **Without embedding / LM head** (``vocab == 0``) the model is a middle pipeline stage (``pre_process`` and
  ``post_process`` False): hidden states go in through ``set_input_tensor`` and a fixed random output gradient
  comes back. With them, random tokens and labels, the per-token loss summed.
* **CP member share** (``group_size > 1``): ``PackedSeqParams`` carry the FULL ``cu_seqlens`` with
  ``local_cp_size = g`` and an :class:`~.share.EmulatedCPGroup`, the dynamic-CP entry of the THD attention; the
  attention modules are :class:`EmulatedCPAttention`, whose ``_cp_world``/``_cp_gather`` answer for that group
  (:mod:`.share`); :func:`~megatron_dynbatch.megatron.dynamic_cp.microbatch_cp_group` points megatron-core's RoPE
  at it, so the member's rows get their zig-zag positions.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace
from typing import Any, Callable

import torch

from ..core.errors import DynBatchConfigError
from .layout import SliceLayout, SliceWidths
from .share import EmulatedCPGroup, ShareGeometry, emulated_gather


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_world_of_one(device: torch.device, seed: int) -> None:
    """A ``torch.distributed`` world and megatron-core ``parallel_state`` this process can build a slice in
    (module docstring)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if device.type == "cpu":
        from ..megatron.cpu import install_cpu_shims  # megatron-core on CPU needs them (docs/packing.md)

        install_cpu_shims()
    elif device.index is not None:
        torch.cuda.set_device(device.index)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    ours = not ps.model_parallel_is_initialized()
    if ours:
        ps.initialize_model_parallel()
    sizes = {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
             "cp": ps.get_context_parallel_world_size()}
    split = {k: v for k, v in sizes.items() if v != 1}
    if split:
        raise DynBatchConfigError("parallel_state", split, "the timing slice emulates tensor parallelism by its "
                                  "widths and must run unsplit", "time in a separate process (a world of one)")
    if ours:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _emulated_attention_class() -> type:
    from ..megatron.attention import ThdDotProductAttention

    class EmulatedCPAttention(ThdDotProductAttention):
        """The THD attention with the CP collectives answered locally for an :class:`EmulatedCPGroup`."""

        def _cp_world(self, group: Any):
            if isinstance(group, EmulatedCPGroup):
                return group.size(), group.rank()
            return super()._cp_world(group)

        def _cp_gather(self, kv: torch.Tensor, group: Any) -> torch.Tensor:
            if isinstance(group, EmulatedCPGroup):
                return emulated_gather(kv, group)
            return super()._cp_gather(kv, group)

    return EmulatedCPAttention


class McoreSlice:
    """A megatron-core ``GPTModel`` slice (module docstring). :meth:`prepare` builds one share's inputs and
    returns the callable that runs its forward + backward."""

    def __init__(self, widths: SliceWidths, layout: SliceLayout, device: torch.device, dtype: torch.dtype) -> None:
        import torch.nn.functional as F
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        from ..megatron.specs import get_thd_local_layer_spec

        ensure_world_of_one(device, layout.seed)
        config = TransformerConfig(
            num_layers=layout.num_layers, hidden_size=widths.hidden_size, num_attention_heads=widths.heads,
            num_query_groups=widths.groups, kv_channels=widths.kv, ffn_hidden_size=widths.ffn,
            gated_linear_unit=widths.swiglu, activation_func=F.silu if widths.swiglu else F.gelu,
            add_bias_linear=False, normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0,
            params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
            use_cpu_initialization=device.type == "cpu", masked_softmax_fusion=False, bias_activation_fusion=False,
            bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
            persist_layer_norm=False)
        if layout.spec == "te":
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            spec = get_gpt_layer_with_transformer_engine_spec()
        else:
            spec = get_thd_local_layer_spec(normalization="RMSNorm")
            spec.submodules.self_attention.submodules.core_attention = _emulated_attention_class()
        torch.manual_seed(layout.seed)
        with_vocab = widths.vocab > 0
        self.model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=max(widths.vocab, 1),
                              max_sequence_length=1 << 20, pre_process=with_vocab, post_process=with_vocab,
                              position_embedding_type="rope", share_embeddings_and_output_weights=False)
        self.model.to(device=device, dtype=dtype)  # norms too, as Megatron's Float16Module does
        self.widths, self.device, self.dtype, self.spec = widths, device, dtype, layout.spec

    def prepare(self, geo: ShareGeometry, generator: torch.Generator) -> Callable[[], None]:
        from megatron.core.packed_seq_params import PackedSeqParams

        from ..megatron.dynamic_cp import microbatch_cp_group

        g = geo.group_size
        if g > 1 and self.spec == "te":
            raise DynBatchConfigError("group_size", g, "a Transformer Engine slice times whole micro-batches only "
                                      "(its CP attention needs the group's GPUs)", "time CP shares with spec='local'")
        cu = torch.tensor(geo.cu_seqlens, dtype=torch.int32, device=self.device)
        cu_p = torch.tensor(geo.cu_seqlens_padded, dtype=torch.int32, device=self.device)
        group = geo.group if g > 1 else None
        extra = {"local_cp_size": g, "cp_group": group} if g > 1 else {}
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_p,
                                 cu_seqlens_kv_padded=cu_p, max_seqlen_q=geo.max_seqlen,
                                 max_seqlen_kv=geo.max_seqlen, **extra)
        marker = SimpleNamespace(dynamic_cp=g > 1, cp_group=group)  # what microbatch_cp_group reads
        model, t = self.model, geo.local_tokens
        if self.widths.vocab:
            tokens = torch.randint(0, self.widths.vocab, (1, t), generator=generator).to(self.device)
            labels = torch.randint(0, self.widths.vocab, (1, t), generator=generator).to(self.device)
            positions = geo.positions.view(1, t).to(self.device)

            def run() -> None:
                with microbatch_cp_group(model, marker):
                    loss = model(tokens, positions, None, labels=labels, packed_seq_params=params)
                loss.float().sum().backward()

            return run
        h = self.widths.hidden_size
        hidden = torch.randn(t, 1, h, generator=generator).to(self.device, self.dtype).requires_grad_(True)
        grad = torch.randn(t, 1, h, generator=generator).to(self.device, self.dtype)

        def run_layers() -> None:
            hidden.grad = None
            model.set_input_tensor(hidden)
            with microbatch_cp_group(model, marker):
                out = model(None, None, None, packed_seq_params=params)
            out.backward(grad)

        return run_layers


__all__ = ["McoreSlice", "ensure_world_of_one"]
