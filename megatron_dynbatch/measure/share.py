"""One context-parallel member's share of a micro-batch, emulated on ONE device.

A micro-batch of ``lengths`` on a CP group of ``g`` GPUs (``g = 1``: no CP) is packed the package's way
(:class:`~megatron_dynbatch.core.alignment.Alignment` of a ``cp=g`` layout: every sequence padded to a multiple of
``2g``); member ``r`` holds the zig-zag chunks ``r`` and ``2g-1-r`` of every sequence (``T/g`` rows). Its work, as
the method of ``../shared/gpu/README.md`` section 1 describes it: the linear layers on its own rows, and the
attention of each of its chunks on the keys up to the chunk's end -- causal on itself, full on the keys before it.
Those earlier keys belong to the other members; on one device they are stand-ins (:func:`emulated_gather`: zero
rows that require a gradient, so the backward computes dK/dV for them as a real member does). NOT emulated: the
K/V exchange itself (all-gather or ring transfers) and its backward reduction -- compute only.

:class:`EmulatedCPGroup` stands in for the CP process group wherever the model asks it for ``size()``/``rank()``
(megatron-core's THD RoPE picks the member's positions with them); the THD attention's two ``torch.distributed``
touches (``_cp_world``, ``_cp_gather``) are overridden for it by the megatron-core slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
from torch import Tensor

from ..core.alignment import Alignment
from ..core.checks import is_int
from ..core.errors import DynBatchConfigError
from ..core.parallel import ParallelConfig


class EmulatedCPGroup:
    """A CP "group" of ``size`` members seen from member ``rank``, for one process (module docstring)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = int(size), int(rank)

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"EmulatedCPGroup(size={self._size}, rank={self._rank})"


def emulated_gather(x: Tensor, group: EmulatedCPGroup) -> Tensor:
    """What an all-gather over ``group`` returns on member ``group.rank()``: every member's rows, rank-major --
    here this member's ``x`` and zero stand-ins (leaves requiring a gradient) for the others."""
    g, r = group.size(), group.rank()
    if g == 1:
        return x
    others = x.new_zeros(((g - 1) * x.shape[0],) + tuple(x.shape[1:])).requires_grad_(True)
    before, after = others[:r * x.shape[0]], others[r * x.shape[0]:]
    return torch.cat([before, x, after], dim=0)


@dataclass(frozen=True)
class ShareGeometry:
    """The packed layout of member ``member`` of a ``group_size``-GPU micro-batch of ``lengths``: real and padded
    cumulative lengths (Python lists) of the FULL micro-batch, its largest slot, and this member's ``rows``
    (packed positions it holds, in local order) and ``positions`` (each row's position inside its sequence)."""

    group_size: int
    member: int
    lengths: Tuple[int, ...]
    cu_seqlens: List[int]
    cu_seqlens_padded: List[int]
    max_seqlen: int
    rows: Tensor
    positions: Tensor

    @property
    def local_tokens(self) -> int:
        return int(self.rows.numel())

    @property
    def group(self) -> EmulatedCPGroup:
        return EmulatedCPGroup(self.group_size, self.member)


def check_share(group_size: int, lengths: Sequence[int], member: int) -> Tuple[int, ...]:
    """Validate a share request; returns the lengths as a tuple of ints."""
    if not is_int(group_size) or group_size < 1:
        raise DynBatchConfigError("group_size", group_size, "must be an integer >= 1", "pass the CP group size")
    try:
        lens = tuple(int(n) for n in lengths)
        bad = [n for n, raw in zip(lens, lengths, strict=True) if not is_int(raw) or n < 0]
    except (TypeError, ValueError):
        lens, bad = (), [lengths]
    if bad or not lens:
        raise DynBatchConfigError("lengths", lengths,
                                  "must be a non-empty sequence of integers >= 0",
                                  "pass the sample lengths of one micro-batch, e.g. [4096, 1200]")
    if not is_int(member) or not 0 <= member < group_size:
        raise DynBatchConfigError("member", member, f"must be in [0, {group_size})", "pass a CP rank of the group")
    return lens


def share_geometry(group_size: int, lengths: Sequence[int], member: int) -> ShareGeometry:
    """The :class:`ShareGeometry` of one member (module docstring)."""
    from ..megatron.context_parallel import zigzag_partition_indices

    lens = check_share(group_size, lengths, member)
    align = Alignment.for_layout(ParallelConfig(cp=group_size))
    slots = [int(s) for s in align.seq_len(list(lens))]
    slots[-1] += align.padded_total(sum(slots)) - sum(slots)  # tail padding on the last slot, as the packer does
    cu, cu_p = [0], [0]
    for n, s in zip(lens, slots, strict=True):
        cu.append(cu[-1] + n)
        cu_p.append(cu_p[-1] + s)
    rows = zigzag_partition_indices(torch.tensor(cu_p), group_size, member)
    seq = torch.searchsorted(torch.tensor(cu_p[1:]), rows, right=True)
    positions = rows - torch.tensor(cu_p[:-1])[seq]
    return ShareGeometry(group_size, member, lens, cu, cu_p, max(slots), rows, positions)


__all__ = ["EmulatedCPGroup", "ShareGeometry", "emulated_gather", "share_geometry", "check_share"]
