"""Dynamic context parallelism: ``plan_global_batch(..., dynamic_cp=True)`` -> :class:`DynamicCPPlan`.

The ``dp * cp`` GPUs of a pipeline stage form one pool. Every GPU runs the same number ``M`` of micro-batch
slots; in each slot the pool is cut into CP groups -- nodes of the :class:`~.pool.PoolTree` -- and each group
runs one packed micro-batch, every sequence of it zig-zag split over the group's GPUs. A sequence therefore
gets as many GPUs as pay off: short ones stay on one GPU (no K/V exchange at all), long ones are spread, and
one that would set the step time alone is spread wider than memory needs.

Strategy (per optimizer step; deterministic, no communication)
----------------------------------------------------------------
1. **Sizes.** For every tree size ``s`` each sample's slot length (a multiple of ``2s``), whether it fits a
   GPU's budget there (``padded_total / s <= max_tokens_per_gpu``) and its solo time ``tau(i, s)``
   (:meth:`CostModel.group_microbatch_time`: linear + attention work over ``s``, per-micro-batch overhead, the
   exposed K/V exchange). ``s_min(i)``: the smallest size it fits.
2. **Candidates**, each a complete schedule, scored by simulating it (:mod:`.pool_sim`, group members wait
   for each other; 1F1B with ``pp > 1``):

   * ``fixed-cp`` -- the fixed-layout planner's plan (:func:`.search.plan_step`), every micro-batch on its DP
     rank's ``cp`` GPUs. Keeping the better plan makes the result never slower than fixed CP *in the model*;
   * ``tree-<x>`` -- every sample gets a size: ``s_min``, widened (doubling along the tree) while its solo
     time exceeds ``x`` times the mean per-GPU load and a wider group is faster (``x = inf``: memory only;
     ``1, 1/2, 1/4``; with ``pp > 1`` also down to ``1/64``, since there one long micro-batch stalls every
     stage). Samples wider than one GPU are placed top-down: at each node those that need the
     node stay, the rest go to the child with the least load per GPU (largest first). A node packs its own
     samples into the fewest micro-batches (LPT with the cap), which run BEFORE its children's -- so a group's
     GPUs always reach it together. Single-GPU samples are then dealt over the GPUs by LPT on (inherited time
     + own), with per-GPU token and count limits, refined by single moves/swaps, and packed per GPU into
     exactly the slots its ancestors left (``M - inherited``);
   * ``all-root`` -- everything on the whole pool (always feasible: a fallback and the right plan for a few
     giant sequences).

   ``M`` starts at the fewest slots the budget allows; with ``pp > 1`` a few larger counts are scored too
   (smaller micro-batches shrink the 1F1B bubble), and the winner's slots are ordered by the arrangement
   (as built, decreasing, increasing, valley) with the shortest simulated makespan -- one permutation for all
   GPUs, so groups stay aligned.
3. The winner becomes the step's slots; steps follow each other.

Invariants (``tests/test_dyncp_planner.py``; ``DynamicCPPlan.validate``)
-----------------------------------------------------------------------
* every sample in exactly one (slot, group); no group empty; every GPU runs ``M`` slots (the same ``M`` per
  optimizer step on all GPUs) and ``M`` obeys Megatron's interleaved-schedule rule;
* no GPU holds more than ``max_tokens_per_gpu`` tokens after ``2 * g`` alignment and tail padding -- except
  a sample over the budget even on the whole pool, placed alone there under ``oversize="alone"``;
* the modelled step time is never above the fixed-CP plan's (same cost model, same simulator);
* the plan depends only on the arguments.

Not supported together with dynamic CP (a clear error): ``group_ids`` (a sample spread over several DP ranks'
GPUs belongs to none of them) and ``pp == 2`` with ``vpp > 1`` (megatron-core 0.16's shape exchange needs one
length per rank there, which CP groups of different sizes do not give).
"""

from __future__ import annotations

import copy
import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..alignment import Alignment, fp8_multiple
from ..checks import as_int
from ..cost_model import CostModel
from ..errors import DynBatchConfigError, OversizeSampleError, OversizeSampleWarning
from ..parallel import ParallelConfig
from .api import rank_times_of
from .dyncp_plan import DynamicCPPlan
from .plan import Plan
from .inputs import check_budget, check_lengths, check_oversize_policy, resolve_costs, sample_flops
from .ordering import PATTERNS, arrangement, mb_sums
from .packer import StepInput, best_fit_bin_count, pack_rank
from .pool import PoolTree, pool_tree
from .pool_sim import simulate_pool
from .search import plan_step
from .steps import _step_of_sample
from .vpp import check_forced_count, next_valid_microbatch_count

#: widening thresholds of the tree candidates, as multiples of the mean per-GPU load (None: memory only) ...
THRESHOLDS: Tuple[Optional[float], ...] = (None, 1.0, 0.5, 0.25)
#: ... and the smaller ones tried with pp > 1, where one long micro-batch stalls the whole 1F1B pipeline
PIPELINE_THRESHOLDS: Tuple[float, ...] = (0.125, 0.0625, 0.03125, 0.015625)
#: extra slot counts scored with pp > 1 (besides the first feasible one)
EXTRA_COUNTS = 3

Bins = List[List[int]]


# ============================================================================================ per-size data
@dataclass
class _Size:
    """Per-sample arrays of one optimizer step at one group size."""

    size: int
    align: Alignment
    aligned: np.ndarray   # slot length (multiple of 2*size)
    cap: int              # effective cap on the sum of slot lengths of one micro-batch of this group
    fits: np.ndarray      # slot length <= cap
    tau: np.ndarray       # solo seconds (overhead excluded) on a group of this size
    _inp: Optional[StepInput] = field(default=None, repr=False)

    def inp(self, oversize: np.ndarray) -> StepInput:
        if self._inp is None:
            self._inp = StepInput(aligned=self.aligned, weight=self.tau, oversize=oversize & ~self.fits,
                                  units=None, cap=self.cap)
        return self._inp


class _Step:
    """Everything the candidates of one optimizer step share."""

    def __init__(self, lens: np.ndarray, tree: PoolTree, cm: CostModel, par: ParallelConfig, budget: int,
                 tile: int, oversize: np.ndarray) -> None:
        self.lens, self.tree, self.cm, self.par, self.budget = lens, tree, cm, par, budget
        self.sq = lens.astype(np.float64) ** 2
        self.oversize = oversize  # over the budget even on the whole pool ("alone")
        self.n = int(lens.size)
        self.sizes: Dict[int, _Size] = {}
        for s in tree.sizes:
            align = Alignment.for_layout(ParallelConfig(tp=par.tp, cp=s, sequence_parallel=par.sequence_parallel),
                                         tile)
            aligned = align.seq_len(lens).astype(np.int64)
            cap = align.effective_cap(budget * s)
            tau = cm.group_microbatch_time(s, aligned, self.sq) - cm.overhead_s
            self.sizes[s] = _Size(s, align, aligned, cap, aligned <= cap, tau)
        # smallest size from which on a sample fits every larger size too
        order = list(tree.sizes)
        s_min = np.full(self.n, tree.root.size, dtype=np.int64)
        ok = np.ones(self.n, dtype=bool)
        for s in reversed(order):
            ok &= self.sizes[s].fits
            s_min = np.where(ok, s, s_min)
        self.s_min = s_min

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
        return tokens, self.cm.group_microbatch_time(size, tokens, mb_sums(bins, self.sq))

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


# ============================================================================================ schedules
class _Schedule:
    """A candidate: the micro-batches of every tree node (each node's run before its children's)."""

    def __init__(self, step: _Step, name: str, node_bins: Dict[int, Bins]) -> None:
        self.step, self.name = step, name
        tree = step.tree
        self.node_bins, self.node_times, self.node_tokens = {}, {}, {}
        by_size: Dict[int, List[int]] = {}
        for v, bins in node_bins.items():
            if bins:
                by_size.setdefault(tree.nodes[v].size, []).append(v)
        for size, nodes in by_size.items():  # one vectorised timing per group size
            tokens, times = step.bin_stats(size, [mb for v in nodes for mb in node_bins[v]])
            first = 0
            for v in nodes:
                bins = node_bins[v]
                t = times[first:first + len(bins)]
                order = np.lexsort((np.arange(t.size), -t))  # longest first, ties by position
                self.node_bins[v] = [bins[k] for k in order]
                self.node_times[v] = t[order].tolist()
                self.node_tokens[v] = tokens[first:first + len(bins)][order].tolist()
                first += len(bins)
        counts = np.zeros(tree.size, dtype=np.int64)
        self.offset: Dict[int, int] = {}
        for v in sorted(self.node_bins, key=lambda x: tree.nodes[x].depth):
            node = tree.nodes[v]
            off = counts[node.start:node.stop]
            if off.min() != off.max():  # pragma: no cover - node bins always run before descendants'
                raise AssertionError("tree schedule with unequal counts inside a node")
            self.offset[v] = int(off[0])
            counts[node.start:node.stop] += len(self.node_bins[v])
        if counts.min() != counts.max():
            raise AssertionError(f"GPU slot counts differ: {counts.min()}..{counts.max()}")
        self.m = int(counts[0])
        self.order = list(range(self.m))  # slot permutation (execution order)
        self._arrays()

    def _arrays(self) -> None:
        tree, m = self.step.tree, self.m
        self.times = np.zeros((m, tree.size))
        self.node_at = np.zeros((m, tree.size), dtype=np.int64)
        self.bin_at = np.zeros((m, tree.size), dtype=np.int64)
        for v, bins in self.node_bins.items():
            node = tree.nodes[v]
            for b, t in enumerate(self.node_times[v]):
                j = self.offset[v] + b
                self.times[j, node.start:node.stop] = t
                self.node_at[j, node.start:node.stop] = v
                self.bin_at[j, node.start:node.stop] = b
        starts = np.array([n.start for n in tree.nodes], dtype=np.int64)
        gpu = np.arange(tree.size)
        self.blocks = [np.flatnonzero(starts[self.node_at[j]] == gpu) for j in range(m)]

    def finish(self, order: Optional[Sequence[int]] = None) -> np.ndarray:
        order = self.order if order is None else list(order)
        cm = self.step.cm
        ep_width = self.step.par.cp * cm.ep_group if cm.ep_group > 1 else 1
        return simulate_pool(self.times[order], [self.blocks[j] for j in order], cm, ep_width=ep_width)

    def slots(self, step_samples: np.ndarray) -> Tuple[SlotList, List[int], List[float]]:
        """The slots in execution order -- each slot's groups in pool order as ``(start, size, global samples)``
        -- and each group's full packed token count and seconds, in the same (slot-major) order."""
        tree = self.step.tree
        glob = {v: [[int(step_samples[i]) for i in mb] for mb in bins] for v, bins in self.node_bins.items()}
        out: SlotList = []
        tokens: List[int] = []
        times: List[float] = []
        for j in self.order:
            slot = []
            for g in self.blocks[j].tolist():
                v = int(self.node_at[j, g])
                b = int(self.bin_at[j, g])
                node = tree.nodes[v]
                slot.append((node.start, node.size, glob[v][b]))
                tokens.append(int(self.node_tokens[v][b]))
                times.append(float(self.node_times[v][b]))
            out.append(slot)
        return out, tokens, times

    def makespan(self) -> float:
        if not hasattr(self, "_finish"):
            self._finish = self.finish()
        return float(self._finish.max())

    def arrange(self) -> None:
        """With ``pp > 1``: the slot permutation (as built / decreasing / increasing / valley by each slot's
        longest micro-batch) with the shortest simulated makespan."""
        if self.step.cm.pp == 1 or self.m < 2:
            return
        best = (self.makespan(), self.order)
        rep = self.times.max(axis=1)
        for pattern in PATTERNS:
            perm = arrangement(rep, pattern).tolist()
            f = self.finish(perm)
            if float(f.max()) < best[0] * (1 - 1e-12):
                best = (float(f.max()), perm)
                self._finish = f
        self.order = best[1]


# ============================================================================================ candidates
def _fixed_cp(step: _Step, forced: Optional[int], rounds: int, cap_eff: int,
              align: Alignment) -> Optional[_Schedule]:
    """The fixed-layout planner's plan as a pool schedule (every micro-batch on its DP rank's CP group)."""
    par, tree = step.par, step.tree
    aligned = align.seq_len(step.lens).astype(np.int64)
    if (aligned > cap_eff).any() or step.n < par.dp:
        return None
    inp = StepInput(aligned=aligned, weight=step.cm.work(aligned, step.sq), oversize=np.zeros(step.n, dtype=bool),
                    units=None, cap=cap_eff)
    try:
        bins, _ = plan_step(inp, par, step.cm, step.sq, forced, rounds, align, step.budget)
    except DynBatchConfigError:
        return None
    if par.cp not in step.sizes or any(len(r) != len(bins[0]) for r in bins):  # pragma: no cover
        return None
    sched = _Schedule.__new__(_Schedule)
    sched.step, sched.name = step, "fixed-cp"
    sched.node_bins = {tree.dp_rank_node(r).index: [sorted(mb) for mb in bins[r]] for r in range(par.dp)}
    stats = {v: step.bin_stats(par.cp, b) for v, b in sched.node_bins.items()}
    sched.node_times = {v: t.tolist() for v, (_, t) in stats.items()}
    sched.node_tokens = {v: tok.tolist() for v, (tok, _) in stats.items()}
    sched.offset = {v: 0 for v in sched.node_bins}
    sched.m = len(bins[0])
    sched.order = list(range(sched.m))  # the fixed planner already ordered each rank's micro-batches
    sched._arrays()
    return sched


def _widen(step: _Step, threshold: Optional[float]) -> np.ndarray:
    """Each sample's group size: ``s_min`` widened along the tree sizes while its solo time exceeds the
    threshold (seconds) and the next size is faster."""
    s = step.s_min.copy()
    if threshold is None:
        return s
    sizes = list(step.tree.sizes)
    taus = np.stack([step.sizes[x].tau for x in sizes])           # [sizes, n]
    pos = np.searchsorted(sizes, s)
    idx = np.arange(step.n)
    for _ in range(len(sizes)):
        cur = taus[pos, idx]
        nxt_pos = np.minimum(pos + 1, len(sizes) - 1)
        nxt = taus[nxt_pos, idx]
        grow = (cur > threshold) & (nxt_pos > pos) & (nxt < cur)
        if not grow.any():
            break
        pos = np.where(grow, nxt_pos, pos)
    return np.asarray(sizes, dtype=np.int64)[pos]


def _place_wide(step: _Step, cls: np.ndarray, floor: int = 1) -> Dict[int, List[int]]:
    """Samples wider than the floor size, top-down: at each node those no child can host stay, the others go
    (largest class, then largest GPU-seconds first) to the child with the least load per GPU that hosts them."""
    tree, o = step.tree, step.cm.overhead_s
    tau_at = np.zeros(step.n)
    for s in np.unique(cls).tolist():
        sel = cls == s
        tau_at[sel] = step.sizes[int(s)].tau[sel]
    gpu_s = cls * (tau_at + o)
    own: Dict[int, List[int]] = {}
    stack = [(0, np.flatnonzero(cls > floor))]
    while stack:
        v, samples = stack.pop()
        node = tree.nodes[v]
        if not samples.size:
            continue
        kids = [tree.nodes[c] for c in node.children]
        widest = max((k.size for k in kids), default=0)
        stay = cls[samples] > widest
        if stay.any():
            own[v] = samples[stay].tolist()
        rest = samples[~stay]
        if not rest.size:
            continue
        order = rest[np.lexsort((rest, -gpu_s[rest], -cls[rest]))]
        load = [0.0] * len(kids)
        parts: List[List[int]] = [[] for _ in kids]
        for i in order.tolist():
            best = None
            for k, kid in enumerate(kids):
                if kid.size >= cls[i]:
                    key = ((load[k] + gpu_s[i]) / kid.size, k)
                    if best is None or key < best:
                        best = key
            k = best[1]
            parts[k].append(i)
            load[k] += gpu_s[i]
        for kid, part in zip(kids, parts):
            stack.append((kid.index, np.asarray(part, dtype=np.int64)))
    return own


def _tree_schedule(step: _Step, name: str, cls: np.ndarray, forced: Optional[int], rounds: int,
                   extra_counts: int, floor: int = 1) -> List[_Schedule]:
    """Tree candidates of one size assignment: the first feasible slot count, and with ``pp > 1`` a few more.
    ``floor``: the smallest groups, which the remaining samples are dealt over -- single GPUs (1), or the DP
    ranks' own CP groups (``cp``: the fixed layout below, the wide samples above it)."""
    tree, par = step.tree, step.par
    units = list(tree.leaf_of) if floor == 1 else [tree.dp_rank_node(r).index for r in range(par.dp)]
    starts = np.asarray([tree.nodes[u].start for u in units], dtype=np.int64)
    own = _place_wide(step, cls, floor)
    node_bins: Dict[int, Bins] = {}
    for v, samples in own.items():
        bins = step.pack(tree.nodes[v].size, samples)
        if bins is None:
            return []
        node_bins[v] = bins
    # inherited slots and time per GPU, then per floor unit (every node above a unit covers all of it)
    inherited = np.zeros(tree.size, dtype=np.int64)
    pre = np.zeros(tree.size)
    for v, bins in node_bins.items():
        node = tree.nodes[v]
        inherited[node.start:node.stop] += len(bins)
        pre[node.start:node.stop] += float(step.bin_times(node.size, bins).sum())
    inherited, pre = inherited[starts], pre[starts]
    singles = np.flatnonzero(cls == floor)
    one = step.sizes[floor]
    lo = max(1, int(inherited.max()))
    if singles.size:
        need_bins = best_fit_bin_count(one.aligned[singles], one.cap)
        lo = max(lo, -(-(need_bins + int(inherited.sum())) // len(units)))
    hi = (singles.size + int(inherited.sum())) // len(units)

    def build(m: int) -> Optional[_Schedule]:
        if m < int(inherited.max()) or m > hi:
            return None
        leaves = _deal_singles(step, singles, pre, m - inherited, rounds, floor)
        if leaves is None:
            return None
        bins = dict(node_bins)
        for u, leaf in enumerate(units):
            need = int(m - inherited[u])
            if need:
                packed = step.pack(floor, leaves[u], need)
                if packed is None:
                    return None
                bins[leaf] = packed
        return _Schedule(step, name, bins)

    if forced is not None:
        sched = build(forced)
        return [sched] if sched is not None else []
    out: List[_Schedule] = []
    m = next_valid_microbatch_count(lo, par)
    for _ in range(6):  # the first count that packs (usually ``lo``)
        if m > hi:
            break
        sched = build(m)
        if sched is not None:
            out.append(sched)
            break
        m = next_valid_microbatch_count(m + 1, par)
    if out and extra_counts and step.cm.overhead_s > 0:
        # more, smaller micro-batches shrink the 1F1B bubble: up to the count that balances it with overhead
        bubble = (par.pp - 1) / max(1, par.vpp)
        mean = (float(pre.sum()) + float(one.tau[singles].sum())) / len(units)
        target = int(math.ceil(math.sqrt(bubble * max(mean, 1e-12) / step.cm.overhead_s)))
        top = min(hi, max(m, target))
        if top > m:
            raw = np.unique(np.geomspace(m + 1, top, num=min(extra_counts, top - m)).round().astype(int))
            for c in sorted({next_valid_microbatch_count(int(x), par) for x in raw}):
                sched = build(c) if c > m else None
                if sched is not None:
                    out.append(sched)
    return out


def _deal_singles(step: _Step, singles: np.ndarray, pre: np.ndarray, need: np.ndarray,
                  rounds: int, floor: int = 1) -> Optional[List[List[int]]]:
    """Floor-size samples over the floor units (single GPUs, or DP ranks' CP groups): LPT (heaviest first, to
    the unit with the least inherited + own time that has token room), then counts fixed (every unit needs
    ``need[u]`` samples, at most ``need[u] * cap`` tokens), then single moves/swaps between the slowest and
    fastest unit while they help."""
    pool = need.size
    one = step.sizes[floor]
    o = step.cm.overhead_s
    if (need < 0).any() or int(need.sum()) > singles.size:
        return None
    cap = need * one.cap
    tau = one.tau
    load = pre + need * o
    used = np.zeros(pool, dtype=np.int64)
    leaves: List[List[int]] = [[] for _ in range(pool)]
    order = singles[np.lexsort((singles, -one.aligned[singles], -tau[singles]))]
    heap = [(float(load[g]), g) for g in range(pool) if need[g] > 0]
    heapq.heapify(heap)
    tok_sorted = one.aligned[order]
    suffix_min = np.minimum.accumulate(tok_sorted[::-1])[::-1].tolist() + [0]
    for k, i in enumerate(order.tolist()):
        a = int(one.aligned[i])
        skipped = []
        placed = False
        while heap:
            ld, g = heapq.heappop(heap)
            if used[g] + a <= cap[g]:
                leaves[g].append(i)
                used[g] += a
                load[g] += tau[i]
                heapq.heappush(heap, (float(load[g]), g))
                placed = True
                break
            if used[g] + suffix_min[k + 1] <= cap[g]:
                skipped.append((ld, g))
        for item in skipped:
            heapq.heappush(heap, item)
        if not placed:
            return None
    if not _fix_counts(leaves, need, used, cap, one.aligned, tau, load):
        return None
    _refine(leaves, need, used, cap, one.aligned, tau, load, rounds)
    return leaves


def _fix_counts(leaves, need, used, cap, aligned, tau, load) -> bool:
    """Every GPU with fewer samples than slots takes the lightest fitting sample of a GPU with a surplus."""
    cnt = np.array([len(x) for x in leaves], dtype=np.int64)
    for g in np.flatnonzero(cnt < need).tolist():
        while cnt[g] < need[g]:
            best = None
            for d in np.flatnonzero(cnt > need).tolist():
                for i in leaves[d]:
                    if used[g] + aligned[i] <= cap[g] and (best is None or (tau[i], i) < best[0]):
                        best = ((tau[i], i), d, i)
            if best is None:
                return False
            _, d, i = best
            _move(leaves, used, load, aligned, tau, i, d, g)
            cnt[d] -= 1
            cnt[g] += 1
    return True


def _refine(leaves, need, used, cap, aligned, tau, load, rounds: int) -> None:
    """Move or swap one sample between the slowest GPU and the fastest GPU while that lowers the slower of the
    two (bounded by ``rounds``)."""
    active = need > 0
    if active.sum() < 2:
        return
    for _ in range(rounds):
        masked = np.where(active, load, -np.inf)
        a = int(np.argmax(masked))
        b = int(np.argmin(np.where(active, load, np.inf)))
        gap = load[a] - load[b]
        if gap <= 1e-9 * load[a]:
            return
        xa = np.asarray(leaves[a], dtype=np.int64)
        best = None
        if len(leaves[a]) > need[a]:  # a move keeps a's count
            ok = (tau[xa] < gap) & (used[b] + aligned[xa] <= cap[b]) & (tau[xa] > 0)
            if ok.any():
                dev = np.where(ok, np.abs(tau[xa] - gap / 2), np.inf)
                k = int(np.argmin(dev))
                best = (dev[k], int(xa[k]), None)
        xb = np.asarray(leaves[b], dtype=np.int64)
        if xb.size and xa.size:
            delta = tau[xa][:, None] - tau[xb][None, :]
            ok = ((delta > 0) & (delta < gap)
                  & (used[b] - aligned[xb][None, :] + aligned[xa][:, None] <= cap[b])
                  & (used[a] - aligned[xa][:, None] + aligned[xb][None, :] <= cap[a]))
            if ok.any():
                dev = np.where(ok, np.abs(delta - gap / 2), np.inf)
                p, q = np.unravel_index(int(np.argmin(dev)), dev.shape)
                if best is None or dev[p, q] < best[0]:
                    best = (dev[p, q], int(xa[p]), int(xb[q]))
        if best is None or best[0] >= gap / 2:
            return
        _, x, y = best
        _move(leaves, used, load, aligned, tau, x, a, b)
        if y is not None:
            _move(leaves, used, load, aligned, tau, y, b, a)


def _move(leaves, used, load, aligned, tau, i: int, src: int, dst: int) -> None:
    """Sample ``i`` from unit ``src`` to unit ``dst``, with the units' token and time totals."""
    leaves[src].remove(i)
    leaves[dst].append(i)
    used[src] -= aligned[i]
    used[dst] += aligned[i]
    load[src] -= tau[i]
    load[dst] += tau[i]


def _all_root(step: _Step, forced: Optional[int]) -> Optional[_Schedule]:
    """Every sample on the whole pool, in the fewest valid micro-batches (or ``forced``)."""
    root = step.tree.root
    everything = np.arange(step.n)
    if forced is None:
        over = step.oversize & ~step.sizes[root.size].fits
        k = best_fit_bin_count(step.sizes[root.size].aligned[~over], step.sizes[root.size].cap) + int(over.sum())
        k = next_valid_microbatch_count(k, step.par)
    else:
        k = forced
    if k > step.n:
        return None
    bins = step.pack(root.size, everything, k)
    return None if bins is None else _Schedule(step, "all-root", {root.index: bins})


def _plan_step(step: _Step, forced: Optional[int], rounds: int, cap_eff: int, align: Alignment) -> Tuple[_Schedule, Optional[_Schedule]]:
    """The best schedule of one step, and the fixed-CP one (for reporting)."""
    cands: List[_Schedule] = []
    fixed = _fixed_cp(step, forced, rounds, cap_eff, align)
    if fixed is not None:
        cands.append(fixed)
    extra = EXTRA_COUNTS if step.par.pp > 1 else 0
    # mean per-GPU load if every sample ran on its smallest group: the widening scale
    tau_min = np.zeros(step.n)
    for s in np.unique(step.s_min).tolist():
        sel = step.s_min == s
        tau_min[sel] = step.sizes[int(s)].tau[sel]
    mean_load = float((step.s_min * tau_min).sum()) / step.tree.size
    seen = set()
    floors = (1, step.par.cp) if step.par.cp > 1 else (1,)
    for floor in floors:
        for x in THRESHOLDS + (PIPELINE_THRESHOLDS if step.par.pp > 1 else ()):
            cls = np.maximum(_widen(step, None if x is None else x * mean_load), floor)
            key = (floor, cls.tobytes())
            if key in seen or (floor > 1 and not (cls > floor).any()):  # (the fixed-CP plan covers that)
                continue
            seen.add(key)
            name = ("tree-" if floor == 1 else f"cp{floor}-tree-") + ("mem" if x is None else f"{x:g}")
            cands += _tree_schedule(step, name, cls, forced, rounds, extra, floor)
    root = _all_root(step, forced)
    if root is not None:
        cands.append(root)
    if not cands:
        if forced is not None:
            lb = _lower_bound(step, step.cm)[1]
            raise DynBatchConfigError(
                "num_microbatches", forced, f"no dynamic-CP schedule of these {step.n} samples over a pool of "
                f"{step.tree.size} GPUs has exactly {forced} slots within the budget (at least {lb} are needed: "
                f"tokens over pool x budget; and at most {step.n}, one sample per slot)",
                "pass None to let the planner choose, or a larger count / --max-tokens-per-gpu")
        raise DynBatchConfigError(
            "len(lengths)", step.n, f"no dynamic-CP schedule of these {step.n} samples over a pool of "
            f"{step.tree.size} GPUs has a micro-batch count Megatron's interleaved schedule accepts",
            "pass more samples, or lower vpp")
    for c in cands:
        if c is not fixed:
            c.arrange()
    best = cands[0]
    for c in cands[1:]:
        if c.makespan() < best.makespan() * (1 - 1e-9):
            best = c
    return best, fixed


# ============================================================================================ entry point
def plan_dynamic_cp(
    lengths: Union[Sequence[int], np.ndarray],
    *,
    model: Any = None,
    parallel: Union[ParallelConfig, Mapping[str, Any], None] = None,
    max_tokens_per_gpu: int,
    group_ids: Optional[Sequence[Any]] = None,
    samples_per_step: Optional[int] = None,
    oversize: str = "error",
    fp8_alignment: Union[None, str, int] = None,
    cost_model: Optional[CostModel] = None,
    num_microbatches: Optional[int] = None,
    refine_rounds: Optional[int] = None,
) -> DynamicCPPlan:
    """The dynamic-CP plan of a global batch (module docstring); called by ``plan_global_batch(...,
    dynamic_cp=True)``, which documents the arguments. Balancing is always by the cost model's seconds."""
    t_start = time.perf_counter()
    par = ParallelConfig.from_any(parallel)
    lens = check_lengths(lengths)
    _, align, cap_eff = check_budget(max_tokens_per_gpu, par, fp8_alignment)
    budget = int(max_tokens_per_gpu)
    check_oversize_policy(oversize)
    if group_ids is not None:
        raise DynBatchConfigError(
            "group_ids", "given", "dynamic CP spreads a sample over CP groups that span several DP ranks, so "
            "'a group stays on one DP rank' has no meaning there", "drop group_ids, or plan with dynamic_cp=False")
    if par.pp == 2 and par.vpp > 1:
        raise DynBatchConfigError(
            "parallel.vpp", par.vpp, "dynamic CP with pp=2 and interleaving needs one micro-batch length per "
            "rank (megatron-core 0.16's pipeline shape exchange, NVIDIA/Megatron-LM #5100), which CP groups of "
            "different sizes do not give", "use vpp=1, pp != 2, or dynamic_cp=False")
    coeffs, cm = resolve_costs(model, par, cost_model)
    cm = _with_comm(cm, model, par)
    tile = fp8_multiple(fp8_alignment)
    tree = pool_tree(par.dp, par.cp)
    if num_microbatches is not None:
        num_microbatches = check_forced_count(num_microbatches, par)
    rounds = 4 * tree.size if refine_rounds is None else as_int(refine_rounds, "refine_rounds", minimum=0,
                                                               fix="pass None for the default (4 * dp * cp)")
    over = _oversize(lens, tree, par, budget, tile, oversize)

    steps: List[Tuple[SlotList, np.ndarray, Any]] = []
    fixed_time = 0.0
    lb_time, lb_count = 0.0, 0
    chosen = []
    step_of, n_steps = _step_of_sample(int(lens.size), samples_per_step, None, None)
    for step_samples in (np.flatnonzero(step_of == k) for k in range(n_steps)):
        st = _Step(lens[step_samples], tree, cm, par, budget, tile, over[step_samples])
        best, fixed = _plan_step(st, num_microbatches, rounds, cap_eff, align)
        chosen.append(best.name)
        fixed_time += fixed.makespan() if fixed is not None else float("nan")
        slots, tokens, times = best.slots(step_samples)
        steps.append((slots, best.finish(), (tokens, times)))
        t, c = _lower_bound(st, cm)
        lb_time += t
        lb_count += c
    plan = _assemble(lens, steps, par, align, budget, tile, cm, coeffs, lower_bound_microbatches=lb_count,
                     lower_bound_step_time=lb_time, oversize_samples=[int(i) for i in np.flatnonzero(over)],
                     fixed_cp_step_time=fixed_time, candidate=",".join(chosen))
    plan.planning_time_s = time.perf_counter() - t_start
    return plan


def build_dynamic_cp_plan(
    lengths: Union[Sequence[int], np.ndarray],
    slots: Sequence[Sequence[Tuple[int, int, Sequence[int]]]],
    *,
    parallel: Union[ParallelConfig, Mapping[str, Any], None] = None,
    max_tokens_per_gpu: int,
    model: Any = None,
    cost_model: Optional[CostModel] = None,
    fp8_alignment: Union[None, str, int] = None,
    microbatches_per_step: Optional[Sequence[int]] = None,
) -> DynamicCPPlan:
    """A :class:`DynamicCPPlan` from explicit slots -- ``slots[j]`` lists slot ``j``'s groups as ``(start, size,
    sample indices)`` -- scored like the planner's (synchronised simulation, CP communication). For running a
    schedule of your own (or another system's) through the iterator; call ``plan.validate(len(lengths))`` to
    check it. ``microbatches_per_step``: slots of each optimizer step (default: one step)."""
    par = ParallelConfig.from_any(parallel)
    lens = check_lengths(lengths)
    _, align, _ = check_budget(max_tokens_per_gpu, par, fp8_alignment)
    coeffs, cm = resolve_costs(model, par, cost_model)
    cm = _with_comm(cm, model, par)
    tile = fp8_multiple(fp8_alignment)
    per_step = list(microbatches_per_step) if microbatches_per_step is not None else [len(slots)]
    if sum(per_step) != len(slots):
        raise DynBatchConfigError("microbatches_per_step", per_step, f"does not sum to the {len(slots)} slots",
                                  "give the slot count of every optimizer step")
    steps = []
    first = 0
    for count in per_step:
        chunk = [[(int(a), int(b), [int(i) for i in mb]) for a, b, mb in slot] for slot in slots[first:first + count]]
        times = _slot_times(chunk, lens, par, tile, cm)
        blocks = [np.asarray([a for a, _, _ in slot], dtype=np.int64) for slot in chunk]
        ep_width = par.cp * cm.ep_group if cm.ep_group > 1 else 1
        steps.append((chunk, simulate_pool(times, blocks, cm, ep_width=ep_width), None))
        first += count
    return _assemble(lens, steps, par, align, int(max_tokens_per_gpu), tile, cm, coeffs, algorithm="external")


SlotList = List[List[Tuple[int, int, List[int]]]]


def _group_stats(slots: SlotList, lens: np.ndarray, par: ParallelConfig, tile: int,
                 cm: CostModel) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every group of every slot (slot-major, pool order): its size, its full padded token count and its
    time on each member (one vectorised :meth:`CostModel.group_microbatch_time` call)."""
    aligned: Dict[int, np.ndarray] = {}
    sizes, tokens, sq = [], [], []
    sq_all = lens.astype(np.float64) ** 2
    for slot in slots:
        for _, size, samples in slot:
            if size not in aligned:
                aligned[size] = (_align(par, size, tile), _align(par, size, tile).seq_len(lens).astype(np.int64))
            a, al = aligned[size]
            sizes.append(size)
            tokens.append(a.padded_total(int(al[samples].sum())))
            sq.append(float(sq_all[samples].sum()))
    size_a = np.asarray(sizes, dtype=np.int64)
    tok_a = np.asarray(tokens, dtype=np.int64)
    return size_a, tok_a, cm.group_microbatch_time(size_a, tok_a, np.asarray(sq, dtype=np.float64))


def _slot_times(slots: SlotList, lens: np.ndarray, par: ParallelConfig, tile: int, cm: CostModel) -> np.ndarray:
    """``[slots, pool]`` seconds of every GPU's micro-batch."""
    times = np.zeros((len(slots), par.dp * par.cp))
    t = _group_stats(slots, lens, par, tile, cm)[2].tolist()
    k = 0
    for j, slot in enumerate(slots):
        for start, size, _ in slot:
            times[j, start:start + size] = t[k]
            k += 1
    return times


def _align(par: ParallelConfig, size: int, tile: int) -> Alignment:
    return Alignment.for_layout(ParallelConfig(tp=par.tp, cp=size, sequence_parallel=par.sequence_parallel), tile)


def _assemble(lens: np.ndarray, steps: Sequence[Tuple[SlotList, np.ndarray, Any]], par: ParallelConfig,
              align: Alignment, budget: int, tile: int, cm: CostModel, coeffs: Any, **extra: Any) -> DynamicCPPlan:
    """The plan of consecutive steps: their slots in execution order, each GPU's finish time per step, and the
    groups' (full token counts, seconds) in slot-major order when already known (else computed here)."""
    pool = par.dp * par.cp
    micro_batches: List[List[List[int]]] = [[] for _ in range(pool)]
    groups: List[List[Tuple[int, int]]] = [[] for _ in range(pool)]
    mb_time: List[List[float]] = [[] for _ in range(pool)]
    mb_tokens: List[List[int]] = [[] for _ in range(pool)]
    rank_time = np.zeros(pool)
    rank_flops = np.zeros(pool)
    flops = sample_flops(coeffs, lens.astype(np.float64), lens.astype(np.float64) ** 2)
    for slots, finish, stats in steps:
        tokens, times = stats if stats is not None else _group_stats(slots, lens, par, tile, cm)[1:]
        rank_time += finish
        k = 0
        for slot in slots:
            for start, size, samples in slot:
                local, t = int(tokens[k]) // size, float(times[k])
                share = float(flops[samples].sum()) / size if coeffs is not None else 0.0
                k += 1
                for g in range(start, start + size):
                    micro_batches[g].append(samples)
                    groups[g].append((start, size))
                    mb_time[g].append(t)
                    mb_tokens[g].append(local)
                rank_flops[start:start + size] += share
    extra.setdefault("algorithm", "dynbatch-dyncp")
    extra.setdefault("lower_bound_microbatches", 0)
    extra.setdefault("lower_bound_step_time", 0.0)
    return DynamicCPPlan(
        micro_batches=micro_batches, microbatches_per_step=[len(s[0]) for s in steps], parallel=par, alignment=align,
        cap=budget, balance_by_flops=True, microbatch_tokens=mb_tokens, microbatch_time=mb_time,
        rank_tokens=np.array([sum(t) for t in mb_tokens], dtype=np.int64), rank_flops=rank_flops,
        rank_time=rank_time, padding_tokens=int(sum(sum(t) for t in mb_tokens) - lens.sum()),
        real_tokens=int(lens.sum()), groups=groups, max_tokens_per_gpu=budget, fp8_tile=tile, **extra)


def score_with_cp_comm(plan: Plan, *, model: Any = None, cost_model: Optional[CostModel] = None) -> Plan:
    """A copy of a fixed-layout ``plan`` (``plan_global_batch`` or ``score_assignment``) whose micro-batch and
    rank times include the CP communication of its ``cp``-GPU groups, so it compares with a dynamic-CP plan.

    ``cost_model`` must be the one the plan was scored with (default: from ``model``): the attention part of each
    micro-batch is recovered as ``time - overhead - linear * tokens``."""
    if isinstance(plan, DynamicCPPlan):
        return plan
    par = plan.parallel
    _, cm = resolve_costs(model, par, cost_model)
    cm = _with_comm(cm, model, par)
    times = []
    for tok, t in zip(plan.microbatch_tokens, plan.microbatch_time):
        tok_a, t_a = np.asarray(tok, dtype=np.float64), np.asarray(t, dtype=np.float64)
        att = np.maximum(t_a - cm.overhead_s - cm.linear_s_per_token * tok_a, 0.0)
        times.append((t_a + cm.cp_comm_time(par.cp, tok_a, att)).tolist())
    out = copy.copy(plan)
    out.microbatch_time = times
    out.rank_time = rank_times_of(times, plan.microbatches_per_step, cm)
    return out


def _with_comm(cm: CostModel, model: Any, par: ParallelConfig) -> CostModel:
    """The cost model with its CP communication term: as given, else the model's defaults, else none."""
    if cm.has_cp_comm:
        return cm
    if model is not None:
        d = CostModel.from_model(model, par)
        return cm.with_cp_comm(d.cp_comm_s_per_token, d.cp_comm_s_per_step, d.cp_comm_overlap)
    return cm.with_cp_comm(0.0, 0.0, 0.0)


def _oversize(lens: np.ndarray, tree: PoolTree, par: ParallelConfig, budget: int, tile: int,
              policy: str) -> np.ndarray:
    """Samples over the budget even spread over the whole pool: an error, or (``"alone"``) a warning."""
    import warnings

    root = tree.root.size
    align = _align(par, root, tile)
    aligned = align.seq_len(lens)
    over = aligned > align.effective_cap(budget * root)
    if over.any():
        first = int(np.flatnonzero(over)[0])
        where = (f"sample {first} has {int(lens[first])} tokens but even spread over the whole pool of {root} GPUs "
                 f"(dp x cp) a GPU may hold {budget} tokens (max_tokens_per_gpu); {int(over.sum())} sample(s) are over")
        if policy == "error":
            need = align.budget_for(int(aligned[over].max()), root)
            raise OversizeSampleError("--max-tokens-per-gpu", budget, where,
                                      f"raise --max-tokens-per-gpu to at least {need}, truncate the sample, or run it "
                                      f"alone on the whole pool over the budget with oversize='alone'")
        warnings.warn(f"oversize='alone': {where}; each runs alone on the whole pool over the budget",
                      OversizeSampleWarning, stacklevel=4)
    return over


def _lower_bound(step: _Step, cm: CostModel) -> Tuple[float, int]:
    """A bound no schedule of the step beats: the least GPU-seconds of every sample (over the sizes it fits)
    spread over the pool, the fewest slots the budget allows, the 1F1B bubble (``pp > 1``), and the fastest
    any single sample can run."""
    pool = step.tree.size
    best_gpu_s = np.full(step.n, np.inf)
    best_t = np.full(step.n, np.inf)
    for s, sz in step.sizes.items():
        ok = sz.fits | step.oversize
        best_gpu_s = np.where(ok, np.minimum(best_gpu_s, s * sz.tau), best_gpu_s)
        best_t = np.where(ok, np.minimum(best_t, sz.tau), best_t)
    one = step.sizes[1]
    tokens = int(np.minimum(one.aligned, one.cap).sum())
    m_lo = max(1, -(-tokens // (pool * max(1, one.cap))))
    bound = cm.lower_bound(float(best_gpu_s.sum()), float(best_t.max()), pool, m_lo, max(m_lo, step.n))
    return bound, m_lo


__all__ = ["plan_dynamic_cp", "build_dynamic_cp_plan", "score_with_cp_comm", "THRESHOLDS"]
