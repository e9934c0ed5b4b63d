"""Dynamic CP: what every candidate schedule of one optimizer step is built from (:class:`StepData`).

For each group size ``s`` of the pool tree and each sample: its slot length (a multiple of ``2s``, the group's
:func:`~.pool.group_alignment`), whether it fits a GPU's budget there (``padded_total / s <=
max_tokens_per_gpu``, i.e. slot length <= the group's effective cap) and its solo time ``tau(i, s)``
(:meth:`CostModel.group_work`: linear and attention work over ``s`` GPUs with the CP-member terms, the exposed K/V
exchange -- at the inter-node numbers when groups of size ``s`` cross nodes (:meth:`~.pool.PoolTree.spans_by_size`);
no overhead, no floor). ``s_min(i)`` is the smallest size from which on the sample fits every larger size too,
and at least ``min_size`` (``PlanOptions.min_cp_size``: no candidate forms a group below it).
The step also carries the search limits every candidate obeys -- a forced slot count, the refinement rounds --
the decision margin the orchestration applies, and how the fixed-CP candidate plans (:class:`FixedLayout`:
exactly as plain ``plan_global_batch`` on the same layout would).

Everything here is computed once per step and only read afterwards; samples are step-local indices
``0 .. n-1`` (:meth:`~.schedule.Schedule.slots` maps them back to the batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...alignment import Alignment
from ...cost_model import CostModel
from ...parallel import ParallelConfig
from ..ordering import mb_sums
from ..fallback import SearchWork
from ..packer import StepInput, best_fit_bin_count, pack_rank
from .pool import PoolTree, group_alignment

Bins = List[List[int]]


@dataclass
class FixedLayout:
    """What makes the fixed-CP candidate the plan plain ``plan_global_batch`` makes for the same layout and
    arguments: its default refinement rounds (``4 * dp``, not the pool's ``4 * dp * cp``), its balancing
    weight (without a model the plain planner balances tokens), and one bin-search work allowance shared by every
    optimizer step of the batch, as the plain planner shares it."""

    rounds: int
    by_tokens: bool = False
    search: SearchWork = field(default_factory=SearchWork)


@dataclass
class GroupSize:
    """Per-sample arrays of one optimizer step at one group size."""

    size: int
    align: Alignment
    aligned: np.ndarray   # slot length (multiple of 2*size)
    cap: int              # effective cap on the sum of slot lengths of one micro-batch of this group
    fits: np.ndarray      # slot length <= cap
    tau: np.ndarray       # solo seconds (overhead excluded) on a group of this size
    _inp: Optional[StepInput] = field(default=None, repr=False)

    def inp(self, oversize: np.ndarray) -> StepInput:
        """The packer's input for groups of this size (built once)."""
        if self._inp is None:
            self._inp = StepInput(aligned=self.aligned, weight=self.tau, oversize=oversize & ~self.fits,
                                  units=None, cap=self.cap)
        return self._inp


class StepData:
    """Everything the candidates of one optimizer step share (module docstring).

    ``oversize`` marks the samples over the budget even on the whole pool (``oversize="alone"``); ``forced``
    is the slot count every candidate must have (``None``: free) and ``rounds`` bounds local refinement."""

    def __init__(self, lens: np.ndarray, tree: PoolTree, cm: CostModel, par: ParallelConfig, budget: int,
                 tile: int, oversize: np.ndarray, forced: Optional[int] = None, rounds: int = 0,
                 margin: float = 0.0, fixed: Optional[FixedLayout] = None, min_size: int = 1) -> None:
        self.lens, self.tree, self.cm, self.par, self.budget = lens, tree, cm, par, budget
        #: the FP8 token multiple every group's alignment includes
        self.tile = int(tile)
        #: the smallest group a candidate may form (``min_cp_size``; a power of two <= cp, so a tree size)
        self.min_size = int(min_size)
        self.forced, self.rounds, self.margin = forced, rounds, margin
        self.fixed = fixed if fixed is not None else FixedLayout(rounds=4 * par.dp)
        self.sq = lens.astype(np.float64) ** 2
        self.oversize = oversize
        self.n = int(lens.size)
        #: group size -> whether its groups cross nodes (priced at the inter-node numbers)
        self.spans: Dict[int, bool] = tree.spans_by_size(par)
        self.sizes: Dict[int, GroupSize] = {}
        for s in tree.sizes:
            align = group_alignment(par, s, tile)
            aligned = align.seq_len(lens).astype(np.int64)
            cap = align.effective_cap(budget * s)
            tau = cm.group_work(s, aligned, self.sq, self.spans[s])
            self.sizes[s] = GroupSize(s, align, aligned, cap, aligned <= cap, tau)
        s_min = np.full(self.n, tree.root.size, dtype=np.int64)
        ok = np.ones(self.n, dtype=bool)
        for s in reversed(tree.sizes):
            ok &= self.sizes[s].fits
            s_min = np.where(ok, s, s_min)
        self.s_min = np.maximum(s_min, min(s for s in tree.sizes if s >= self.min_size))

    @property
    def allowed_sizes(self) -> List[int]:
        """The tree's group sizes a candidate may use (at least ``min_size``), ascending."""
        return [s for s in self.tree.sizes if s >= self.min_size]

    def bin_times(self, size: int, bins: Bins) -> np.ndarray:
        """Seconds of each micro-batch of ``bins`` on a group of ``size`` (one vectorised call)."""
        return self.bin_stats(size, bins)[1]

    def bin_stats(self, size: int, bins: Bins) -> Tuple[np.ndarray, np.ndarray]:
        """Full packed token counts and seconds of each micro-batch of ``bins`` on a group of ``size``."""
        if not bins:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        sz = self.sizes[size]
        t = sz.align.total_multiple
        tokens = -(-mb_sums(bins, sz.aligned) // t) * t
        return tokens, self.cm.group_microbatch_time(size, tokens, mb_sums(bins, self.sq), self.spans[size])

    def pack(self, size: int, samples: Sequence[int], k: Optional[int] = None) -> Optional[Bins]:
        """``samples`` in ``k`` micro-batches of a group of ``size`` (default: the fewest best fit needs)."""
        sz = self.sizes[size]
        idx = np.asarray(samples, dtype=np.int64)
        if idx.size == 0:
            return [] if not k else None
        over = self.oversize[idx] & ~sz.fits[idx]
        if k is None:
            k = best_fit_bin_count(sz.aligned[idx[~over]], sz.cap) + int(over.sum())
        bins = pack_rank(idx, sz.inp(self.oversize), k)
        return None if bins is None else [sorted(b) for b in bins]

    def tau_at(self, size_of: np.ndarray) -> np.ndarray:
        """Each sample's solo time on a group of ``size_of[i]`` GPUs (a tree size per sample)."""
        out = np.zeros(self.n)
        for s in np.unique(size_of).tolist():
            sel = size_of == s
            out[sel] = self.sizes[int(s)].tau[sel]
        return out


__all__ = ["Bins", "FixedLayout", "GroupSize", "StepData"]
