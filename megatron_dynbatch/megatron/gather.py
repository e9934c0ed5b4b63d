"""Results back in sample order: per-micro-batch outputs -> per-sample, CP slices reassembled, DP ranks gathered.

* :func:`split_per_sample`: a full-length per-token tensor of one packed micro-batch -> each sample's real tokens;
* :func:`gather_cp_output`: a CP-local per-token tensor all-gathered over the micro-batch's CP group (Megatron's,
  or a dynamic-CP micro-batch's own) and put back in packed order;
* :func:`per_microbatch_outputs`: the last stage's :class:`~.loss.MicroBatchResult` list matched to its micro-batches
  (by their samples) and split per sample;
* :func:`restore_order`: one row's per-micro-batch results -> per-sample results in ascending global sample order;
* :func:`gather_across_dp`: every DP rank's per-sample results in global sample order (one ``all_gather_object``).

Invariant: each sample is in exactly one micro-batch of one row, so matching by sample indices is exact.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from ..core.errors import DynBatchConfigError
from .rank_plan import parallel_state

__all__ = ["split_per_sample", "gather_cp_output", "per_microbatch_outputs", "restore_order", "gather_across_dp"]


def split_per_sample(per_token: Any, packed: Any) -> List[Any]:
    """Split a FULL-length per-token tensor (``[1, T, ...]`` or ``[T, ...]``) of ``packed``'s layout into each
    sample's real-token slice, in packing order. Works on CP-sliced micro-batches too (they keep the full
    ``cu_seqlens``), as long as ``per_token`` was already reassembled to the full length."""
    total = int(packed.cu_seqlens_padded[-1])
    x = per_token
    if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == total:
        x = x[0]
    if x.dim() < 1 or x.shape[0] != total:
        raise DynBatchConfigError("per_token.shape", tuple(per_token.shape),
                                  f"expected [1, {total}, ...] or [{total}, ...] (the full packed length)",
                                  "gather context-parallel outputs first (context_parallel.gather_cp_outputs)")
    starts = packed.cu_seqlens_padded[:-1].tolist()
    return [x[s:s + n] for s, n in zip(starts, packed.seqlens, strict=True)]


def gather_cp_output(local: Any, packed: Any, cp: int, group: Any = None) -> Any:
    """All-gather a CP-local per-token tensor ``[1, T/cp, ...]`` over the CP group (default: Megatron's) and
    reassemble it."""
    import torch
    import torch.distributed as dist

    from .context_parallel import gather_cp_outputs

    if group is None:
        from megatron.core import parallel_state as ps

        group = ps.get_context_parallel_group()
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return gather_cp_outputs(parts, packed.cu_seqlens_padded, cp)


def per_microbatch_outputs(results: Sequence[Any], mbs: Sequence[Any], cp: int) -> List[List[Any]]:
    """Each micro-batch's collected per-token outputs, per sample (CP slices gathered), in ``mbs``' order.
    ``results``: the last stage's :class:`~.loss.MicroBatchResult` of every micro-batch, in any order; ``cp``: the
    layout's CP size (a dynamic-CP micro-batch says its own)."""
    if len(results) != len(mbs):
        raise RuntimeError(f"expected {len(mbs)} micro-batch results on the last stage, got {len(results)}")
    position = {tuple(mb.sample_indices): k for k, mb in enumerate(mbs)}
    slots: List[Any] = [None] * len(mbs)
    for r in results:
        slots[position[tuple(r.sample_indices)]] = r
    out = []
    for r, mb in zip(slots, mbs, strict=True):
        full = r.outputs
        if mb.dynamic_cp:  # this micro-batch's own group
            full = gather_cp_output(full, mb, mb.cp_size, mb.cp_group) if mb.cp_size > 1 else full
        elif cp > 1:
            full = gather_cp_output(full, mb, cp)
        out.append(split_per_sample(full, mb))
    return out


def restore_order(mbs: Sequence[Any], per_microbatch_outputs: Sequence[Any]) -> List[Any]:
    """Per-sample results of one row in ascending global sample order. ``per_microbatch_outputs[k]`` belongs to
    ``mbs[k]`` and is either a sequence with one entry per sample in packing order, or a full per-token tensor
    ``[1, T, ...]`` / ``[T, ...]`` (un-sliced) that is split into each sample's real tokens."""
    if len(per_microbatch_outputs) != len(mbs):
        raise DynBatchConfigError("per_microbatch_outputs", f"{len(per_microbatch_outputs)} entries",
                                  f"expected one per micro-batch ({len(mbs)})",
                                  "pass the outputs of every micro-batch of the step, in execution order")
    found: Dict[int, Any] = {}
    for k, (mb, out) in enumerate(zip(mbs, per_microbatch_outputs, strict=True)):
        per_sample = split_per_sample(out, mb) if _is_tensor(out) else list(out)
        if len(per_sample) != len(mb.sample_indices):
            raise DynBatchConfigError(f"per_microbatch_outputs[{k}]", f"{len(per_sample)} entries",
                                      f"micro-batch {k} holds {len(mb.sample_indices)} samples",
                                      "give one output per sample, in packing order")
        for i, o in zip(mb.sample_indices, per_sample, strict=True):
            found[i] = o
    return [found[i] for i in sorted(found)]


def gather_across_dp(mine: Sequence[int], per_sample_local: Sequence[Any], *, group: Any = None,
                     with_context_parallel: bool = False) -> List[Any]:
    """Every rank's per-sample results (``mine``: this rank's global sample indices, ascending, one result
    each) in global sample order: one ``torch.distributed.all_gather_object`` over ``group`` (default: Megatron's
    data-parallel group, with the CP ranks when ``with_context_parallel``); every rank of it must call this."""
    import torch.distributed as dist

    if len(per_sample_local) != len(mine):
        raise DynBatchConfigError("per_sample_local", f"{len(per_sample_local)} entries",
                                  f"this rank has {len(mine)} samples", "pass restore_order(...)'s result")
    if group is None:
        ps = parallel_state()
        group = ps.get_data_parallel_group(with_context_parallel=with_context_parallel) if ps is not None else None
    world = dist.get_world_size(group=group)
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, (list(mine), list(per_sample_local)), group=group)
    found: Dict[int, Any] = {}
    for indices, values in gathered:
        found.update(zip(indices, values, strict=True))
    return [found[i] for i in sorted(found)]


def _is_tensor(x: Any) -> bool:
    try:
        import torch

        return isinstance(x, torch.Tensor)
    except ImportError:  # pragma: no cover
        return False
