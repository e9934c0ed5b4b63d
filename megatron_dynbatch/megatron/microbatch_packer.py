"""This GPU's micro-batches as packed THD tensors: pack with the plan's alignment, slice to this GPU's CP share.

Micro-batch ``j`` of the row (:class:`~.rank_plan.RankPlan`) is packed by :func:`~.packing.pack_microbatch` with
:meth:`~..core.planner.plan_kind.PlanKind.microbatch_alignment` (with ``uniform_length``: padded to the row's
longest micro-batch) and, when its CP group has more than one GPU, cut to this GPU's zig-zag share
(:func:`~.context_parallel.slice_packed_for_cp`). Under a fixed layout the group is Megatron's CP group and this
GPU is ``cp_rank`` in it; under dynamic CP it is the micro-batch's own group (``groups[row][j]``), this GPU is
``row - start`` in it, and the packed micro-batch carries that group's process group
(:class:`~.dynamic_cp.DynamicCPGroups`).

Invariant: the packed loss mask of every sample sums to what the loss normaliser counted from the sample dict
(checked on every pack: packing and loss may never disagree). Packing is cached per micro-batch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Mapping, Optional, Sequence

import numpy as np

from ..core.alignment import Alignment
from ..core.errors import DynBatchConfigError
from .rank_plan import RankPlan, parallel_state

__all__ = ["MicroBatchPacker", "dynamic_cp_groups_for"]


def dynamic_cp_groups_for(rank_plan: RankPlan, cp_groups: Any) -> Any:
    """The process groups a dynamic-CP plan's micro-batches carry: ``cp_groups`` as given (checked against the
    plan's pool), else Megatron's when ``parallel_state`` runs the plan's layout, else ``None``. ``None`` for a
    plain plan unless given."""
    par = rank_plan.plan.parallel
    if not rank_plan.plan.dynamic_cp:
        return cp_groups
    ps = parallel_state()
    if cp_groups is None and ps is not None and \
            (ps.get_data_parallel_world_size(), ps.get_context_parallel_world_size()) == (par.dp, par.cp):
        from .dynamic_cp import get_dynamic_cp_groups

        cp_groups = get_dynamic_cp_groups()
    if cp_groups is not None and (cp_groups.dp, cp_groups.cp) != (par.dp, par.cp):
        raise DynBatchConfigError("cp_groups", f"dp={cp_groups.dp}, cp={cp_groups.cp}",
                                  f"the plan's pool is dp={par.dp} x cp={par.cp}",
                                  "plan with the running layout (the groups come from parallel_state)")
    return cp_groups


class MicroBatchPacker:
    """Packs (and caches) this row's micro-batches (module docstring)."""

    def __init__(self, samples: Sequence[Mapping[str, Any]], rank_plan: RankPlan, mask_sums: np.ndarray, *,
                 pad_token_id: int, device: Any, cp_groups: Any) -> None:
        self.samples = samples
        self.rank_plan = rank_plan
        self.mask_sums = mask_sums
        self.pad_token_id = int(pad_token_id)
        self.device = device
        self.cp_groups = cp_groups
        self._packed: Dict[int, Any] = {}
        self._index_of = {tuple(mb): j for j, mb in enumerate(rank_plan.plan.micro_batches[rank_plan.row])}

    def index_of(self, packed: Any) -> Optional[int]:
        """The index in this row of a micro-batch this packer made (``None`` for any other object)."""
        return self._index_of.get(tuple(getattr(packed, "sample_indices", ())))

    def pack(self, j: int) -> Any:
        """Micro-batch ``j`` of this row, packed and sliced (cached)."""
        if j not in self._packed:
            self._packed[j] = self._pack(j)
        return self._packed[j]

    def _pack(self, j: int) -> Any:
        from .context_parallel import slice_packed_for_cp
        from .packing import pack_microbatch

        rp = self.rank_plan
        plan, row = rp.plan, rp.row
        idx = plan.micro_batches[row][j]
        align = plan.microbatch_alignment(row, j)
        if rp.uniform_length:  # the longest micro-batch is a multiple of total_multiple
            align = Alignment(seq_multiple=align.seq_multiple, total_multiple=rp.max_seq_length())
        packed = pack_microbatch([self.samples[i] for i in idx], align,
                                 pad_token_id=self.pad_token_id, sample_indices=idx, device=self.device)
        self._check_loss_mask(packed, idx)
        start, size = plan.cp_group(row, j)
        if size > 1:
            packed = slice_packed_for_cp(packed, size, rp.gpu - start)
        if plan.dynamic_cp:  # the micro-batch carries its own group (a plain one runs on Megatron's CP group)
            group = self.cp_groups.group(start, size) if self.cp_groups is not None else None
            packed = replace(packed, dynamic_cp=True, cp_group=group, _packed_seq_params=None)
        return packed

    def _check_loss_mask(self, packed: Any, idx: Sequence[int]) -> None:
        """The normaliser counted each sample's loss tokens from the sample dict; the packer must agree."""
        mask = packed.loss_mask[0].detach().to("cpu").double()
        starts = packed.cu_seqlens_padded[:-1].tolist()
        for i, s, n in zip(idx, starts, packed.seqlens, strict=True):
            got = float(mask[s:s + n].sum())
            if abs(got - self.mask_sums[i]) > 1e-6 * max(1.0, self.mask_sums[i]):
                raise DynBatchConfigError(f"samples[{i}]['loss_mask']", got,
                                          f"the packed loss mask sums to {got}, the normaliser counted "
                                          f"{self.mask_sums[i]}", "report this: packing and loss disagree")
