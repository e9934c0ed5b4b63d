"""Zig-zag context-parallel (CP) slicing of a packed THD micro-batch, and the inverse gather.

With CP size ``cp`` every sequence's padded slot (length divisible by ``2*cp``) is cut into ``2*cp`` equal
chunks; CP rank ``r`` keeps chunks ``r`` and ``2*cp-1-r`` of EVERY sequence, in sequence order, first chunk
first. Pairing an early chunk with a late one balances causal-attention work across ranks. This is the same
token selection as Transformer Engine's ``thd_get_partitioned_indices`` (which Megatron-based trainers use to
slice THD batches), re-implemented here in plain torch so it runs anywhere.

The sliced batch keeps the FULL ``cu_seqlens`` / ``cu_seqlens_padded`` / ``max_seqlen`` in its
``PackedSeqParams``: TE's CP attention and Megatron's THD RoPE divide them by ``cp`` themselves.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence, Tuple

import torch

from ..core.checks import is_int
from ..core.errors import DynBatchConfigError
from .packing import PackedMicroBatch


def _check_cp(cp_size: int, cp_rank: int) -> None:
    if not is_int(cp_size) or cp_size < 1:
        raise DynBatchConfigError("cp_size", cp_size, "must be an integer >= 1", "pass the context-parallel size")
    if not is_int(cp_rank) or not 0 <= cp_rank < cp_size:
        raise DynBatchConfigError("cp_rank", cp_rank, f"must be in [0, {cp_size})", "pass this rank's CP rank")


def zigzag_partition_indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Indices (int64, ``[T/cp]``, on the input's device) of the packed tokens CP rank ``cp_rank`` holds.

    ``cu_seqlens_padded`` is ``[n+1]`` cumulative padded slot lengths; each slot must divide by ``2*cp``.
    """
    _check_cp(cp_size, cp_rank)
    cu = torch.as_tensor(cu_seqlens_padded).to(torch.int64).flatten()
    lengths = cu[1:] - cu[:-1]
    if cp_size > 1 and bool((lengths % (2 * cp_size) != 0).any()):
        bad = lengths[lengths % (2 * cp_size) != 0].tolist()
        raise DynBatchConfigError(
            "cu_seqlens_padded", cu.tolist(),
            f"padded sequence lengths {bad} are not divisible by 2*cp={2 * cp_size}",
            "pack with Alignment.for_layout(ParallelConfig(cp=...)) so every slot is a multiple of 2*cp",
        )
    if cp_size == 1:
        return torch.arange(int(cu[-1]), dtype=torch.int64, device=cu.device)
    chunk = lengths // (2 * cp_size)  # per sequence
    local_len = 2 * chunk
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), local_len)
    local_start = torch.cumsum(local_len, 0) - local_len
    j = torch.arange(seq_id.numel(), device=cu.device) - local_start[seq_id]
    c = chunk[seq_id]
    second = j >= c
    which_chunk = torch.where(second, 2 * cp_size - 1 - cp_rank, cp_rank)
    return cu[:-1][seq_id] + which_chunk * c + (j - second.to(torch.int64) * c)


def zigzag_gather_order(cu_seqlens_padded: torch.Tensor, cp_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(order, inverse)`` for rows gathered from every CP rank, rank-major: ``order`` = each rank's
    :func:`zigzag_partition_indices` in rank order (the packed position of every gathered row); indexing the
    gather with ``inverse`` (its argsort) puts it back in packed order. Both on the input's device."""
    order = torch.cat([zigzag_partition_indices(cu_seqlens_padded, cp_size, r) for r in range(cp_size)])
    return order, torch.argsort(order)


def slice_packed_for_cp(packed: PackedMicroBatch, cp_size: int, cp_rank: int) -> PackedMicroBatch:
    """This CP rank's share of ``packed``: tokens, position_ids, labels, loss_mask and extras indexed along
    ``T`` with :func:`zigzag_partition_indices`; lengths and ``cu_seqlens`` stay those of the full batch."""
    if packed.cp_size != 1:
        raise DynBatchConfigError("packed.cp_size", packed.cp_size, "this micro-batch is already CP-sliced",
                                  "slice the full (un-sliced) micro-batch")
    idx = zigzag_partition_indices(packed.cu_seqlens_padded, cp_size, cp_rank).to(packed.tokens.device)
    if cp_size == 1:
        return packed

    def take(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(1, idx)

    return replace(
        packed,
        tokens=take(packed.tokens),
        position_ids=take(packed.position_ids),
        labels=take(packed.labels),
        loss_mask=take(packed.loss_mask),
        extras={k: take(v) for k, v in packed.extras.items()},
        cp_size=cp_size,
        cp_rank=cp_rank,
        _packed_seq_params=None,
    )


def gather_cp_outputs(
    per_rank_outputs: Sequence[torch.Tensor],
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    seq_dim: Optional[int] = None,
) -> torch.Tensor:
    """Reassemble per-CP-rank outputs (``per_rank_outputs[r]`` from rank ``r``) into full packed order.

    Each output holds ``T/cp`` positions along ``seq_dim``; by default dim 1 when the tensors look like
    ``[1, T/cp, ...]`` and dim 0 otherwise. Differentiable (a cat and one index_select).
    """
    if len(per_rank_outputs) != cp_size:
        raise DynBatchConfigError("per_rank_outputs", f"{len(per_rank_outputs)} tensors",
                                  f"expected one output per CP rank ({cp_size})", "pass outputs ordered by CP rank")
    cu = torch.as_tensor(cu_seqlens_padded).to(torch.int64).flatten()
    total = int(cu[-1])
    local = total // cp_size
    first = per_rank_outputs[0]
    if seq_dim is None:
        seq_dim = 1 if first.dim() >= 2 and first.shape[0] == 1 and first.shape[1] == local else 0
    for r, out in enumerate(per_rank_outputs):
        if out.dim() <= seq_dim or out.shape[seq_dim] != local:
            raise DynBatchConfigError(
                f"per_rank_outputs[{r}].shape", tuple(out.shape),
                f"expected {local} (= T/cp) positions along dim {seq_dim}", "pass each rank's un-modified output",
            )
    if cp_size == 1:
        return first
    inverse = zigzag_gather_order(cu, cp_size)[1].to(first.device)
    return torch.cat(list(per_rank_outputs), dim=seq_dim).index_select(seq_dim, inverse)
