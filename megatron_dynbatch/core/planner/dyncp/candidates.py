"""Dynamic CP: the family of candidate schedules of one optimizer step.

Interface: a *generator* takes the step's shared data (:class:`~.step.StepData`, which also carries the
forced slot count and the refinement rounds) and returns zero or more complete :class:`~.schedule.Schedule`
s; :func:`candidates` runs the :data:`FAMILY` in order. The orchestration (:mod:`.orchestrate`) scores them all by
simulation and keeps the fastest, the earliest on a tie -- so the order below is part of the result.

* ``fixed-cp`` (:func:`fixed_cp`) -- the plan plain ``plan_global_batch`` makes for the same layout and
  arguments (:func:`..search.plan_step` on the layout's alignment, with the plain planner's balancing weight,
  refinement rounds and shared bin-search work: :class:`~.step.FixedLayout`), every micro-batch on its DP
  rank's ``cp`` GPUs, in that planner's order. Having it in the family is what makes dynamic CP never slower
  than the plain planner's plan *in the model*. None when the fixed layout cannot hold a sample or has fewer
  samples than DP ranks.
* ``tree-<x>`` and ``cp<cp>-tree-<x>`` (:func:`tree_candidates`) -- every sample gets a group size: ``s_min``,
  widened along the tree sizes while its solo time exceeds ``x`` times the mean per-GPU load and the wider
  group is faster (:data:`THRESHOLDS`, ``mem``: memory only; with ``pp > 1`` also :data:`PIPELINE_THRESHOLDS`,
  since there one long micro-batch stalls every stage), at least the floor size (1, or ``cp``: the fixed
  layout below, the wide samples above it; with ``min_cp_size`` the floors are it and ``cp``, so no group is
  smaller). Samples wider than the floor are placed top-down
  (:func:`place_wide`) and each node packs its own into the fewest micro-batches; the floor-size samples are
  dealt over the floor units (:func:`~.deal.deal_singles`) and packed per unit into exactly the slots its
  ancestors left. The slot count is the first feasible one from the budget's lower bound; with ``pp > 1``
  up to :data:`EXTRA_COUNTS` larger ones too (smaller micro-batches shrink the 1F1B bubble; fewer when the step is
  so large that they would deal more than :data:`EXTRA_COUNT_SAMPLES` samples). Size assignments already tried
  are skipped.
* ``all-root`` (:func:`all_root`) -- everything on the whole pool in the fewest valid micro-batches: always
  feasible when there are enough samples, a fallback and the right plan for a few giant sequences.

Every candidate obeys the forced slot count when one is given, Megatron's interleaved-schedule rule on its
count, and the per-GPU budget (samples over it even on the whole pool excepted, ``oversize="alone"``).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ...errors import DynBatchConfigError
from .deal import deal_singles
from .schedule import Schedule
from .step import Bins, StepData
from ..packer import StepInput, best_fit_bin_count
from ..counts import CountRule
from ..search import SearchSettings, plan_step
from ..vpp import next_valid_microbatch_count

#: widening thresholds of the tree candidates, as multiples of the mean per-GPU load (None: memory only) ...
THRESHOLDS: Tuple[Optional[float], ...] = (None, 1.0, 0.5, 0.25)
#: ... and the smaller ones tried with pp > 1, where one long micro-batch stalls the whole 1F1B pipeline
PIPELINE_THRESHOLDS: Tuple[float, ...] = (0.125, 0.0625, 0.03125, 0.015625)
#: extra slot counts scored with pp > 1 (besides the first feasible one) ...
EXTRA_COUNTS = 3
#: ... while the tree candidates' extra counts deal at most this many samples in all (planning time of huge steps)
EXTRA_COUNT_SAMPLES = 65_536
#: the name of the fixed-layout candidate (the plan's ``fixed_cp_step_time`` is its makespan)
FIXED_CP = "fixed-cp"

Generator = Callable[[StepData], List[Schedule]]


def candidates(step: StepData) -> List[Schedule]:
    """Every candidate schedule of the step, in :data:`FAMILY` order (possibly none)."""
    return [sched for generate in FAMILY for sched in generate(step)]


# ============================================================================================ fixed CP
def fixed_cp(step: StepData) -> List[Schedule]:
    """The fixed-layout planner's plan as a pool schedule (every micro-batch on its DP rank's CP group)."""
    par, tree = step.par, step.tree
    own = step.sizes[par.cp]  # the DP ranks' groups: the layout's own alignment and cap
    if (~own.fits).any() or step.n < par.dp:
        return []
    how = step.fixed
    weight = own.aligned.astype(np.float64) if how.by_tokens else step.cm.work(own.aligned, step.sq)
    inp = StepInput(aligned=own.aligned, weight=weight, oversize=np.zeros(step.n, dtype=bool), units=None,
                    cap=own.cap)
    try:
        settings = SearchSettings(parallel=par, cost_model=step.cm, alignment=own.align,
                                  max_tokens_per_gpu=step.budget, count_rule=CountRule(par),
                                  refine_rounds=how.rounds, margin=step.margin)
        bins, _ = plan_step(inp, step.sq, settings, forced=step.forced, search=how.search)
    except DynBatchConfigError:
        return []
    if any(len(r) != len(bins[0]) for r in bins):  # pragma: no cover - the fixed planner's counts are equal
        return []
    node_bins = {tree.dp_rank_node(r).index: [sorted(mb) for mb in bins[r]] for r in range(par.dp)}
    return [Schedule(step, FIXED_CP, node_bins, keep_order=True)]


# ============================================================================================ tree
def tree_candidates(step: StepData) -> List[Schedule]:
    """The tree candidates of every (floor, threshold) pair whose size assignment is new (module docstring)."""
    par = step.par
    # mean per-GPU load if every sample ran on its smallest group: the widening scale
    mean_load = float((step.s_min * step.tau_at(step.s_min)).sum()) / step.tree.size
    todo = []
    seen = set()
    low = step.min_size  # min_cp_size: the smallest floor, where its groups tile the pool
    floors = tuple(dict.fromkeys(f for f in (low, par.cp) if floor_units(step, f) is not None))
    for floor in floors:
        for x in THRESHOLDS + (PIPELINE_THRESHOLDS if par.pp > 1 else ()):
            cls = np.maximum(widen(step, None if x is None else x * mean_load), floor)
            key = (floor, cls.tobytes())
            if key in seen or (floor == par.cp > 1 and not (cls > floor).any()):  # (the fixed-CP plan covers that)
                continue
            seen.add(key)
            prefix = "tree-" if floor == 1 else f"cp{floor}-tree-"
            todo.append((prefix + ("mem" if x is None else f"{x:g}"), cls, floor))
    # extra slot counts (pp > 1) within a limit of samples dealt: large batches score fewer
    extra = min(EXTRA_COUNTS, EXTRA_COUNT_SAMPLES // max(1, step.n * len(todo))) if par.pp > 1 else 0
    return [sched for name, cls, floor in todo for sched in _tree_schedules(step, name, cls, extra, floor)]


def floor_units(step: StepData, floor: int) -> Optional[np.ndarray]:
    """The floor units of a tree candidate: the tree's groups of ``floor`` GPUs in pool order (single GPUs for
    1, the DP ranks' own groups for ``cp``), or None where they do not tile the pool (e.g. ``cp=6``: its DP
    ranks split into 4 + 2 GPUs, so groups of 4 leave GPUs over)."""
    tree = step.tree
    if floor == 1:
        return tree.leaves
    if floor == step.par.cp:
        return np.asarray([tree.dp_rank_node(r).index for r in range(step.par.dp)])
    nodes = np.flatnonzero(tree.sizes_of == floor)
    if nodes.size * floor != tree.size:
        return None
    return nodes[np.argsort(tree.starts[nodes], kind="stable")]


def widen(step: StepData, threshold: Optional[float]) -> np.ndarray:
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


def place_wide(step: StepData, cls: np.ndarray, floor: int = 1) -> Dict[int, List[int]]:
    """Samples wider than the floor size, top-down: at each node those no child can host stay, the others go
    (largest class, then largest GPU-seconds first) to the child with the least load per GPU that hosts them."""
    tree = step.tree
    gpu_s = cls * (step.tau_at(cls) + step.cm.overhead_s)
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
        sizes = [kid.size for kid in kids]
        # Python numbers in the loop (the same float64 values; a NumPy scalar per element is several times slower)
        for i, c, g in zip(order.tolist(), cls[order].tolist(), gpu_s[order].tolist(), strict=True):
            best = None
            for k, size in enumerate(sizes):
                if size >= c:
                    key = ((load[k] + g) / size, k)
                    if best is None or key < best:
                        best = key
            k = best[1]
            parts[k].append(i)
            load[k] += g
        for kid, part in zip(kids, parts, strict=True):
            stack.append((kid.index, np.asarray(part, dtype=np.int64)))
    return own


def _tree_schedules(step: StepData, name: str, cls: np.ndarray, extra_counts: int, floor: int) -> List[Schedule]:
    """Tree candidates of one size assignment: the first feasible slot count, and with ``pp > 1`` a few more.
    ``floor``: the smallest groups, which the remaining samples are dealt over -- single GPUs (1), or the DP
    ranks' own CP groups (``cp``)."""
    tree, par = step.tree, step.par
    units = floor_units(step, floor)
    starts = tree.starts[units]
    node_bins: Dict[int, Bins] = {}
    for v, samples in place_wide(step, cls, floor).items():
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

    def build(m: int) -> Optional[Schedule]:
        if m < int(inherited.max()) or m > hi:
            return None
        leaves = deal_singles(step, singles, pre, m - inherited, floor)
        if leaves is None:
            return None
        bins = dict(node_bins)
        for u, leaf in enumerate(units.tolist()):
            need = int(m - inherited[u])
            if need:
                packed = step.pack(floor, leaves[u], need)
                if packed is None:
                    return None
                bins[leaf] = packed
        return Schedule(step, name, bins)

    if step.forced is not None:
        sched = build(step.forced)
        return [sched] if sched is not None else []
    out: List[Schedule] = []
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
        # (and never past micro-batches at the cost model's floor)
        bubble = (par.pp - 1) / max(1, par.vpp)
        mean = (float(pre.sum()) + float(one.tau[singles].sum())) / len(units)
        target = step.cm.pipeline_count_target(max(mean, 1e-12), bubble, floor)
        top = min(hi, max(m, target))
        if top > m:
            raw = np.unique(np.geomspace(m + 1, top, num=min(extra_counts, top - m)).round().astype(int))
            for c in sorted({next_valid_microbatch_count(int(x), par) for x in raw}):
                sched = build(c) if c > m else None
                if sched is not None:
                    out.append(sched)
    return out


# ============================================================================================ whole pool
def all_root(step: StepData) -> List[Schedule]:
    """Every sample on the whole pool, in the fewest valid micro-batches (or the forced count)."""
    root = step.tree.root
    top = step.sizes[root.size]
    if step.forced is None:
        over = step.oversize & ~top.fits
        k = next_valid_microbatch_count(best_fit_bin_count(top.aligned[~over], top.cap) + int(over.sum()), step.par)
    else:
        k = step.forced
    if k > step.n:
        return []
    bins = step.pack(root.size, np.arange(step.n), k)
    return [] if bins is None else [Schedule(step, "all-root", {root.index: bins})]


#: the candidate generators, in scoring order (on a tie the earlier wins)
FAMILY: Tuple[Generator, ...] = (fixed_cp, tree_candidates, all_root)

__all__ = ["candidates", "fixed_cp", "tree_candidates", "all_root", "floor_units", "widen", "place_wide", "FAMILY",
           "FIXED_CP", "THRESHOLDS", "PIPELINE_THRESHOLDS", "EXTRA_COUNTS", "EXTRA_COUNT_SAMPLES", "Generator"]
