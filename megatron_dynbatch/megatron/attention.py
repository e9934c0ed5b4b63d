"""A core attention for Megatron's LOCAL layer spec that understands THD ``PackedSeqParams``.

Megatron-core's local ``DotProductAttention`` refuses ``packed_seq_params`` (THD is a Transformer Engine
feature), so packed micro-batches could not run without TE. :class:`ThdDotProductAttention` runs them two ways:

* **fused kernel** (GPU without Transformer Engine): when its :class:`~.varlen.VarlenKernel` accepts the input
  -- torch's ``torch.nn.attention.varlen.varlen_attn`` (flash, torch >= 2.11) on CUDA fp16/bf16 -- all
  sequences go through ONE kernel call laid out by :mod:`megatron_dynbatch.megatron.varlen` (padding rows 0;
  under CP every local zig-zag chunk is a query sequence against the gathered keys up to its end, which flash's
  BOTTOM-RIGHT aligned causal mask turns into exact causal attention). ``thd_varlen_kernel`` is the seam: CPU
  tests put :data:`~.varlen.REFERENCE_KERNEL` there to run the same dispatch and layout
  (:func:`set_thd_varlen_kernel`). Dropout during training takes the loop below (the kernel has none);
* **per-sequence loop** (everything else, e.g. CPU): the pure-torch reference described below, unchanged --
  for tests, the CPU demo and debugging. With Transformer Engine installed, its layer spec
  (``TEDotProductAttention``) remains the GPU choice.

What Megatron's ``Attention.forward`` (0.16.x) hands the core attention with ``qkv_format="thd"``:
query ``[t, heads, head_dim]``, key/value ``[t, query_groups, head_dim]`` (GQA not expanded, RoPE already
applied per sequence from ``cu_seqlens_*_padded``); it reshapes our ``[t, heads*head_dim]`` result to
``[t, 1, hidden]`` for the output projection. (This module also accepts a ``[t, 1, heads, head_dim]`` query.)

Semantics, per packed sequence ``i``: the rows ``cu_seqlens_q_padded[i] + [0, L_i)`` (``L_i`` from the real
``cu_seqlens_q``) attend causally to the same rows of key/value -- never to another sequence and never to
padding; padding rows output exactly 0 (so they also get no gradient). Without ``packed_seq_params`` the
module is Megatron's own ``DotProductAttention`` (sbhd), so one spec serves packed and unpacked inputs.
Unpacked input under context parallelism (Megatron's own fixed batches, zig-zag split by
``get_batch_on_this_cp_rank``) runs through the THD CP path below, each row a sequence of the full length.

Context parallelism (``config.context_parallel_size > 1``; the CP group is ``pg_collection.cp`` as Megatron's
``Attention`` passes it, else ``parallel_state.get_context_parallel_group()``): every CP rank holds the zig-zag
chunks ``r`` and ``2cp-1-r`` of every sequence (:mod:`megatron_dynbatch.megatron.context_parallel`), ``t = T/cp``, while
``packed_seq_params`` keeps the FULL ``cu_seqlens``. Key and value are all-gathered over the CP group in one
collective (:class:`_AllGatherCP`: forward ``all_gather``, backward ``reduce_scatter`` of the gradient, so
every rank gets the sum of all ranks' gradients for its own K/V rows), put back in full packed order, and each
LOCAL query (global position from the zig-zag indices) attends causally to the full K/V of its own sequence.
Same result as the ``cp=1`` path on the full batch; a reference, not ring attention (``O(T)`` K/V per rank).

Dynamic context parallelism (``packed_seq_params.local_cp_size`` set, as for Transformer Engine): the micro-batch's
own group ``packed_seq_params.cp_group`` and size replace the model's CP group for this call; ``local_cp_size=1``
runs the plain path on the full micro-batch whatever the model's CP size (:mod:`megatron_dynbatch.megatron.dynamic_cp`).

Limits (a clear error, not silent wrong results): no sliding-window attention, no attention sinks
(``softmax_type != "vanilla"``), no attention bias; under CP q and kv must share ``cu_seqlens`` (self-attention).
"""

from __future__ import annotations

import copy
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from ..core.errors import DynBatchConfigError
from .varlen import VarlenKernel, cp_segments, default_varlen_kernel, note_fallback, thd_segments, varlen_attention

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)
_FULL = (AttnMaskType.no_mask, AttnMaskType.padding)


class ThdDotProductAttention(DotProductAttention):
    """Drop-in for ``DotProductAttention`` (same constructor) that also runs THD varlen causal attention."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Any = None) -> None:
        cp_size = int(getattr(config, "context_parallel_size", 1) or 1)
        # Megatron's DotProductAttention asserts context_parallel_size == 1; build it on a cp=1 view of the config
        # and keep the real config (CP is handled here, in the THD path).
        base_config = copy.copy(config) if cp_size > 1 else config
        if cp_size > 1:
            base_config.context_parallel_size = 1
        super().__init__(base_config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale, cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection)
        self.config = config
        self.thd_cp_size = cp_size
        self.thd_cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        # The sbhd path divides the scale by layer_number and FusedScaleMaskSoftmax multiplies it back.
        coeff = self.scale_mask_softmax.scale
        self.thd_softmax_scale = self.softmax_scale * (coeff if coeff is not None else 1.0)
        self.thd_window_size = self.scale_mask_softmax.window_size
        #: the fused varlen kernel seam (module docstring); None: always the per-sequence loop
        self.thd_varlen_kernel: Optional[VarlenKernel] = default_varlen_kernel()

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Any = None) -> Tensor:
        if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd":
            if packed_seq_params is not None:
                raise DynBatchConfigError("packed_seq_params.qkv_format", packed_seq_params.qkv_format,
                                          "ThdDotProductAttention only understands THD packing",
                                          "pass qkv_format='thd' or no packed_seq_params")
            if self.thd_cp_size > 1:
                return self._sbhd_cp_attention(query, key, value, attention_mask, attn_mask_type, attention_bias)
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        self._check_thd_supported(attention_bias)
        if query.dim() == 4:  # [t, 1, heads, head_dim]
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type in _CAUSAL:
            causal = True
        elif mask_type in _FULL:
            causal = False
        else:
            raise DynBatchConfigError("attn_mask_type", mask_type, "not supported with THD packing",
                                      "use AttnMaskType.causal (or no_mask for bidirectional attention)")
        local = getattr(packed_seq_params, "local_cp_size", None)
        if local is not None:  # dynamic CP: this micro-batch's own group (as Transformer Engine's attention does)
            if int(local) > 1:
                group = getattr(packed_seq_params, "cp_group", None)
                if group is None:
                    raise DynBatchConfigError("packed_seq_params.cp_group", None,
                                              f"local_cp_size={local} needs the micro-batch's CP process group",
                                              "build micro-batches with DynamicBatchIterator (it sets both)")
                return self._thd_cp_attention(query, key, value, packed_seq_params, causal, group, int(local))
            return self._thd_attention(query, key, value, packed_seq_params, causal)
        if self.thd_cp_size > 1:
            return self._thd_cp_attention(query, key, value, packed_seq_params, causal)
        return self._thd_attention(query, key, value, packed_seq_params, causal)

    # ----------------------------------------------------------------------------------------- internals
    def _check_thd_supported(self, attention_bias: Optional[Tensor]) -> None:
        if attention_bias is not None:
            raise DynBatchConfigError("attention_bias", "tensor", "not supported by the CPU THD attention",
                                      "drop the attention bias or use Transformer Engine on GPU")
        if self.softmax_offset is not None:
            raise DynBatchConfigError("config.softmax_type", self.config.softmax_type,
                                      "attention sinks are not implemented in the CPU THD attention",
                                      "use softmax_type='vanilla' or Transformer Engine on GPU")
        if self.thd_window_size is not None:
            raise DynBatchConfigError("config.window_size", self.thd_window_size,
                                      "sliding-window attention is not implemented in the CPU THD attention",
                                      "use full causal attention or Transformer Engine on GPU")

    def _thd_attention(self, query: Tensor, key: Tensor, value: Tensor, params: Any, causal: bool) -> Tensor:
        t, heads, head_dim = query.shape
        groups = key.shape[1]
        cu_q, cu_kv, pad_q, pad_kv = _thd_offsets(params)
        if pad_q[-1] != t or pad_kv[-1] != key.shape[0]:
            raise DynBatchConfigError(
                "query.shape[0]", t,
                f"the packed length is cu_seqlens_q_padded[-1]={pad_q[-1]}, but the context-parallel size is 1 "
                "(a context-parallel slice needs config.context_parallel_size = cp)",
                "pass the full packed micro-batch, or build the model with context_parallel_size=cp",
            )
        kernel = self._varlen_kernel_for(query)
        if kernel is not None:
            if causal and _lengths(cu_q) != _lengths(cu_kv):
                raise DynBatchConfigError("cu_seqlens_kv", cu_kv, "causal self-attention needs equal q/kv lengths",
                                          "pass the same cu_seqlens for q and kv")
            segments = thd_segments(cu_q, cu_kv, pad_q, pad_kv)
            if not segments:
                return query.new_zeros(t, heads * head_dim)
            return varlen_attention(query, key, value, segments, kernel=kernel, scale=self.thd_softmax_scale,
                                    causal=causal)
        rep = heads // groups
        pieces = []
        cursor = 0
        for i in range(len(cu_q) - 1):
            start, length = pad_q[i], cu_q[i + 1] - cu_q[i]
            k_start, k_len = pad_kv[i], cu_kv[i + 1] - cu_kv[i]
            if start > cursor:  # rows not covered by any sequence (should not happen with our packer)
                pieces.append(query.new_zeros(start - cursor, heads * head_dim))
            if causal and length != k_len:
                raise DynBatchConfigError("cu_seqlens_kv", cu_kv, "causal self-attention needs equal q/kv lengths",
                                          "pass the same cu_seqlens for q and kv")
            if length > 0:
                q = query[start:start + length].transpose(0, 1)  # [heads, L, d]
                k = key[k_start:k_start + k_len].transpose(0, 1)  # [groups, Lk, d]
                v = value[k_start:k_start + k_len].transpose(0, 1)
                if rep > 1:  # head h uses query group h // rep, as Megatron's GQA does
                    k = k.repeat_interleave(rep, dim=0)
                    v = v.repeat_interleave(rep, dim=0)
                pieces.append(self._segment(q, k, v, causal).transpose(0, 1).reshape(length, heads * head_dim))
            cursor = start + length
        if t > cursor:
            pieces.append(query.new_zeros(t - cursor, heads * head_dim))
        return torch.cat(pieces, dim=0) if pieces else query.new_zeros(0, heads * head_dim)

    def _cp_group(self) -> Any:
        if self.thd_cp_group is None:
            from megatron.core import parallel_state

            self.thd_cp_group = parallel_state.get_context_parallel_group()
        return self.thd_cp_group

    def _thd_cp_attention(self, query: Tensor, key: Tensor, value: Tensor, params: Any, causal: bool,
                          group: Any = None, expected: Optional[int] = None) -> Tensor:
        """Context-parallel THD attention: local zig-zag queries against the CP-gathered full K/V, over the
        model's CP group, or over ``group`` (a dynamic-CP micro-batch's, of ``expected`` GPUs)."""
        from .context_parallel import _check_cp, zigzag_gather_order

        if group is None:
            group, expected = self._cp_group(), self.thd_cp_size
        cp, cp_rank = self._cp_world(group)
        if cp != expected:
            raise DynBatchConfigError("cp group size", cp, f"the micro-batch is split over {expected} GPUs",
                                      "build the model under the parallel_state it runs with (and pass the "
                                      "micro-batch's own group with dynamic CP)")
        t, heads, head_dim = query.shape
        groups = key.shape[1]
        cu_q, cu_kv, pad_q, pad_kv = _thd_offsets(params)
        if cu_q != cu_kv or pad_q != pad_kv:
            raise DynBatchConfigError("cu_seqlens_kv", cu_kv, "context parallelism in the CPU THD attention needs "
                                      "self-attention (the same cu_seqlens for q and kv)", "pass equal cu_seqlens")
        total = pad_q[-1]
        if total != t * cp or key.shape[0] != t:
            raise DynBatchConfigError(
                "query.shape[0]", t, f"with cp={cp} every rank holds cu_seqlens_q_padded[-1]/cp = {total / cp} rows",
                "slice the packed micro-batch with context_parallel.slice_packed_for_cp (the iterator does)")
        # the CP-gathered rows (rank-major) -> full packed order; rank r's block of ``order`` (its t rows, as
        # total == t * cp) is zigzag_partition_indices(pad_q, cp, r), which validated every slot's divisibility.
        # Built on the CPU from the offsets already read there: no device sync per layer, one copy of the result
        _check_cp(cp, cp_rank)
        order, inverse = zigzag_gather_order(torch.tensor(pad_q, dtype=torch.int64), cp)
        inverse = inverse.to(key.device)
        # ONE collective for K and V (so every rank runs the same backward collectives in the same order)
        kv = torch.cat([key, value.to(key.dtype)], dim=-1)
        kv_full = self._cp_gather(kv, group).index_select(0, inverse)
        key_full, value_full = kv_full.split([key.shape[-1], value.shape[-1]], dim=-1)
        value_full = value_full.to(value.dtype)
        kernel = self._varlen_kernel_for(query)
        if kernel is not None:
            segments = cp_segments(pad_q, cu_q, cp, cp_rank, causal)
            if not segments:  # keep the gather in the graph (see below)
                return query.new_zeros(t, heads * head_dim) + 0.0 * (query.sum() + kv_full.sum())
            return varlen_attention(query, key_full, value_full, segments, kernel=kernel,
                                    scale=self.thd_softmax_scale, causal=causal)
        # only this per-sequence fallback needs this rank's rows -> global packed positions
        local_pos = order[cp_rank * t:(cp_rank + 1) * t].to(query.device)
        rep = heads // groups
        out = query.new_zeros(t, heads * head_dim)
        rows_out = []
        pieces = []
        lens_padded = [b - a for a, b in zip(pad_q[:-1], pad_q[1:], strict=True)]
        local_start = 0
        for i, slot in enumerate(lens_padded):
            n_local = slot // cp
            length = cu_q[i + 1] - cu_q[i]
            rows = torch.arange(local_start, local_start + n_local, device=query.device)
            local_start += n_local
            if length == 0 or n_local == 0:
                continue
            pos = local_pos[rows] - pad_q[i]  # position of each local row inside sequence i
            real = pos < length
            if not bool(real.any()):
                continue
            rows, pos = rows[real], pos[real]
            q = query.index_select(0, rows).transpose(0, 1)  # [heads, n, d]
            k = key_full[pad_q[i]:pad_q[i] + length].transpose(0, 1)  # [groups, L, d]
            v = value_full[pad_q[i]:pad_q[i] + length].transpose(0, 1)
            if rep > 1:
                k = k.repeat_interleave(rep, dim=0)
                v = v.repeat_interleave(rep, dim=0)
            future = None
            if causal:
                future = torch.arange(length, device=query.device).unsqueeze(0) > pos.unsqueeze(1)  # [n, L]
            o = self._segment(q, k, v, causal, future=future)  # [heads, n, d]
            rows_out.append(rows)
            pieces.append(o.transpose(0, 1).reshape(rows.numel(), heads * head_dim))
        if not pieces:
            # only padding rows here: keep q and the K/V gather in the graph (its backward collective must run
            # on every CP rank); the gradients are 0
            return out + 0.0 * (query.sum() + kv_full.sum())
        return out.index_put((torch.cat(rows_out),), torch.cat(pieces, dim=0))

    def _varlen_kernel_for(self, query: Tensor) -> Optional[VarlenKernel]:
        """The fused kernel when it accepts ``query`` (and no attention dropout is active), else None."""
        kernel = self.thd_varlen_kernel
        if kernel is None:
            return None
        if not kernel.accepts(query):
            if query.is_cuda:
                note_fallback(f"{kernel.name} does not take CUDA {query.dtype} with head dim {query.shape[-1]}")
            return None
        if self.attention_dropout.p > 0 and self.training:
            note_fallback(f"{kernel.name} has no attention dropout (attention_dropout={self.attention_dropout.p})")
            return None
        return kernel

    def _cp_world(self, group: Any) -> Tuple[int, int]:
        """``(size, rank)`` of a CP group. With :meth:`_cp_gather`, the one place the CP path touches
        ``torch.distributed`` -- a seam for single-process emulation of one CP member
        (:mod:`megatron_dynbatch.measure`)."""
        return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)

    def _cp_gather(self, kv: Tensor, group: Any) -> Tensor:
        """Every CP rank's ``kv`` rows, rank-major (differentiable: the gradient is reduce-scattered back)."""
        return _AllGatherCP.apply(kv, group)

    def _sbhd_cp_attention(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                           attn_mask_type: Optional[AttnMaskType], attention_bias: Optional[Tensor]) -> Tensor:
        """Unpacked ``[s/cp, b, heads, d]`` input under context parallelism (Megatron's own batches, split by
        ``get_batch_on_this_cp_rank``: chunks ``r`` and ``2cp-1-r`` of each row) = ``b`` THD sequences of the
        full length ``s``, which the THD CP path runs; returns ``[s/cp, b, heads*d]``. Causal attention only; a
        dataloader mask is accepted when it is exactly the causal mask of this rank's rows."""
        from types import SimpleNamespace

        from .context_parallel import zigzag_partition_indices

        self._check_thd_supported(attention_bias)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type not in _CAUSAL:
            raise DynBatchConfigError("attn_mask_type", mask_type, "the CPU attention runs unpacked context-parallel "
                                      "batches with causal masking only", "use AttnMaskType.causal")
        s_local, b, heads, head_dim = query.shape
        cp = self.thd_cp_size
        full = s_local * cp
        cu = torch.arange(0, (b + 1) * full, full, dtype=torch.int32)
        params = SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu)
        if attention_mask is not None:
            group = self._cp_group()
            pos = zigzag_partition_indices(cu[:2], cp, torch.distributed.get_rank(group)).to(attention_mask.device)
            causal = torch.arange(full, device=attention_mask.device).unsqueeze(0) > pos.unsqueeze(1)  # [s/cp, s]
            if tuple(attention_mask.shape[-2:]) != (s_local, full) or not bool((attention_mask == causal).all()):
                raise DynBatchConfigError("attention_mask", tuple(attention_mask.shape), "under context parallelism "
                                          "the CPU attention takes only the causal mask (or none)",
                                          "pass --no-create-attention-mask-in-dataloader or a causal mask")

        def thd(x: Tensor) -> Tensor:  # [s/cp, b, n, d] -> [b * s/cp, n, d], sequence-major
            return x.transpose(0, 1).reshape(b * s_local, *x.shape[2:])

        out = self._thd_cp_attention(thd(query), thd(key), thd(value), params, True)
        return out.view(b, s_local, heads * head_dim).transpose(0, 1).contiguous()

    def _segment(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, future: Optional[Tensor] = None) -> Tensor:
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.thd_softmax_scale  # [heads, L, Lk]
        in_dtype = scores.dtype
        if self.config.attention_softmax_in_fp32:
            scores = scores.float()
        if causal:
            if future is None:
                future = torch.triu(torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device),
                                    diagonal=1)
            scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(in_dtype)
        if self.attention_dropout.p > 0 and self.training:
            from megatron.core import tensor_parallel

            if not self.config.sequence_parallel:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.attention_dropout(probs)
            else:
                probs = self.attention_dropout(probs)
        return torch.matmul(probs, v)  # [heads, L, d]


def set_thd_varlen_kernel(model: Any, kernel: Optional[VarlenKernel]) -> int:
    """Point every :class:`ThdDotProductAttention` in ``model`` (a module or a list of them) at ``kernel``
    (``None``: the per-sequence loop); returns how many were set."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    mods = [m for c in chunks for m in c.modules() if isinstance(m, ThdDotProductAttention)]
    for m in mods:
        m.thd_varlen_kernel = kernel
    return len(mods)


def _dist_fn(new: str, old: str) -> Any:
    """``torch.distributed.<new>`` when this torch has it (2.13 deprecates the ``*_tensor`` names), else ``old``."""
    return getattr(torch.distributed, new, None) or getattr(torch.distributed, old)


class _AllGatherCP(torch.autograd.Function):
    """Differentiable all-gather along dim 0 over a (CP) process group: forward concatenates every rank's
    tensor in rank order; backward reduce-scatters (sums) the gradient and returns this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group = group
        world = torch.distributed.get_world_size(group)
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        _dist_fn("all_gather_single", "all_gather_into_tensor")(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor):  # type: ignore[override]
        world = torch.distributed.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // world,) + tuple(grad.shape[1:]))
        _dist_fn("reduce_scatter_single", "reduce_scatter_tensor")(out, grad, group=ctx.group)
        return out, None


def _lengths(cu: List[int]) -> List[int]:
    return [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]


def _thd_offsets(params: Any) -> Tuple[List[int], List[int], List[int], List[int]]:
    """Sequence offsets of THD ``PackedSeqParams`` with TE's defaults filled in: real ``cu_seqlens`` of q and kv
    (kv defaults to q), padded ones (q defaults to the real q offsets, kv to the padded q), as Python lists."""
    cu_kv_t = params.cu_seqlens_kv if params.cu_seqlens_kv is not None else params.cu_seqlens_q
    pad_q_t = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    pad_kv_t = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else pad_q_t
    return params.cu_seqlens_q.tolist(), cu_kv_t.tolist(), pad_q_t.tolist(), pad_kv_t.tolist()
