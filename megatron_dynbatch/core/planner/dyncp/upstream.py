"""Megatron-LM dev's dynamic-CP scheduler (``DefaultDynamicCPScheduler``), re-implemented from its public
behaviour, and its schedule as one more candidate of our dynamic-CP planner (:func:`upstream_candidate`).

Read at NVIDIA/Megatron-LM ``dev`` commit ``d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1`` (2026-08-21):
``megatron/core/datasets/data_schedule.py::DefaultDynamicCPScheduler.get_groups_and_subsamples`` and
``megatron/core/datasets/data_schedule_utils.py::next_hdp_group_packing_aware``, ``align_sample_id_groups``,
``dcp_gpus_needed``; selected with ``--dynamic-context-parallel --sequence-packing-scheduler default_dynamic_cp``
and ``--min-dynamic-context-parallel-size``. We re-wrote the behaviour; no code is copied.

Why it is here, in the planner: a user who compares our dynamic CP with upstream's on their own batch should
never find ours slower in our own model. Our candidate family (:mod:`.candidates`) is a different search
(tree-shaped groups, every node's micro-batches before its descendants'); on some batches upstream's greedy
rounds -- any power-of-two group at any free offset, groups doubled to fill the pool -- find a slightly shorter
schedule (random batches in ``tests/test_megatron_dynamic_cp.py`` found such cases). So every step also scores
upstream's schedule of the step's samples (:class:`SlotSchedule`, timed by the same group statistics and pool
simulation as the plan's own scoring, :func:`~.assembly.group_stats`) and :func:`~.orchestrate.choose` treats
it as one more candidate. It is skipped -- and says nothing -- where upstream would not run or not keep our
rules: a sample over the budget even on the whole pool, a pool that is not a power of two, a forced slot count
it does not meet, a count Megatron's interleaved schedule rejects, a group that is not a block of our pool tree
(the CP groups the runtime creates), a group over the per-GPU budget after our alignment, or a step whose
scheduling work (:func:`scheduling_work`: rounds x samples left x groups and sizes tried) would exceed
:data:`UPSTREAM_MAX_WORK` -- the planning-time bound.

What it does, as we model it
----------------------------
* The ``dp * cp`` GPUs of a stage are one pool; upstream's ``max_seqlen_per_dp_cp_rank`` is our
  ``max_tokens_per_gpu``. The scheduler sees each sequence's ``padded_seq_len``: upstream's SFT dataset pads
  every sequence for the whole pool under dynamic CP (a multiple of ``2 * dp * cp`` times the TP/SP factor,
  ``sft_dataset.py::_calculate_padding_divisor``), which we take as the pool-wide group's alignment. A
  sequence of ``L`` tokens needs ``max(min_cp, next power of two of L / per_rank)`` GPUs (:func:`gpus_needed`)
  and its workload on ``g`` GPUs is ``L^2 / g`` (no linear term, no exchange).
* The samples are sorted longest first; each round builds ONE micro-batch over the whole pool from the samples
  still to place (:func:`next_microbatch`), and the next round gets the leftovers:

  - the tallest sample opens a group of its needed size on the first GPUs; the per-GPU workload cap of the
    round is ``tallest x per_rank x 1.05``;
  - every further sample tries each power-of-two size from its need up to the pool -- a LARGER group than it
    needs is allowed -- joining an existing group of that size (while the group's packed per-GPU length
    ``sum L / g`` stays within ``per_rank``) or opening one on the lowest free GPUs; of all options under the
    cap it takes the one with the lowest resulting pool-wide maximum workload (the first on a tie: smaller
    sizes first, existing groups before a new one); with none it waits for a later round;
  - GPUs left empty are filled by doubling the first group of the smallest size in place (it grows to the
    right, later groups shift right); where no group can grow, the round falls back to the whole pool: the
    samples of the round, longest first, that fit ``per_rank`` once spread over every GPU.
* With VPP (``vpp > 1``) the micro-batch count is brought to a multiple of upstream's
  ``microbatch_group_size_per_vp_stage`` (default ``pp``) by splitting micro-batches from the last one back:
  the groups of a micro-batch are cut at the first boundary past half the pool, each half is shifted to the
  pool's start and its empty GPUs filled by doubling groups (:func:`align_for_vpp`).

Where upstream would stop with an assertion or an index error (a sample needing more GPUs than the pool, a
round whose empty GPUs cannot be filled, a VPP split that cannot fill its halves) the scheduler raises
:class:`UpstreamInfeasible`; the candidate is then skipped (the bench's ``megatron-dynamic-cp`` row shows the
error).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ...parallel import ParallelConfig
from ...topology import group_spans_nodes
from ..vpp import is_valid_microbatch_count
from .assembly import group_stats, simulate_slots
from .plan import SlotList
from .pool import group_alignment
from .step import StepData

#: the candidate's name in a plan's ``candidate`` field
UPSTREAM_CP = "megatron-dcp"
#: the per-GPU workload cap of a round: tallest sample x per-rank length x (1 + this)
CAP_SLACK = 0.05
#: steps whose estimated scheduling work (:func:`scheduling_work`) is above this skip the candidate: upstream's
#: rounds each revisit every sample left and every group, in Python (about 0.3 s of one core at the limit)
UPSTREAM_MAX_WORK = 1_000_000

#: one group of a micro-batch: (first GPU, GPUs, sample ids)
Group = Tuple[int, int, List[int]]


class UpstreamInfeasible(Exception):
    """Upstream's scheduler would stop (an assertion, an index error or a loop without progress) on this input."""


def gpus_needed(length: int, per_rank: int, min_cp: int = 1) -> int:
    """GPUs a sequence needs: the next power of two of ``length / per_rank`` (at least 1), at least ``min_cp``."""
    ratio = length / per_rank
    need = 1 if ratio <= 1 else 2 ** math.ceil(math.log2(ratio))
    return max(int(min_cp), need)


class _Group:
    __slots__ = ("start", "size", "ids", "lens", "packed", "load")

    def __init__(self, start: int, size: int) -> None:
        self.start, self.size = start, size
        self.ids: List[int] = []
        self.lens: List[int] = []
        self.packed = 0.0   # sum of L / size over its samples: the per-GPU length memory sees
        self.load = 0.0     # sum of L^2 / size: each member's workload

    def add(self, i: int, length: int) -> None:
        self.ids.append(i)
        self.lens.append(length)
        self.packed += length / self.size
        self.load += length * length / self.size


def next_microbatch(items: Sequence[Tuple[int, int]], pool: int, per_rank: int,
                    min_cp: int = 1) -> Tuple[List[Group], List[Tuple[int, int]]]:
    """One round (module docstring): the micro-batch's groups in pool order and the samples left for later.
    ``items``: ``(sample id, length)`` longest first."""
    items = sorted(items, key=lambda x: -x[1])  # stable: equal lengths keep their order
    first_id, tall = items[0]
    cap = float(tall) * float(per_rank) * (1.0 + CAP_SLACK)
    need = gpus_needed(tall, per_rank, min_cp)
    if need > pool:
        raise UpstreamInfeasible(f"a sample of {tall} tokens needs {need} GPUs at {per_rank} per GPU, the pool "
                                 f"has {pool} (upstream asserts)")
    groups: List[_Group] = [_Group(0, need)]
    groups[0].add(first_id, tall)
    used = need          # GPUs 0 .. used-1 are in a group (new groups take the lowest free GPUs)
    peak = groups[0].load
    leftovers: List[Tuple[int, int]] = []
    for i, length in items[1:]:
        best: Optional[Tuple[float, int, Optional[_Group]]] = None
        size = gpus_needed(length, per_rank, min_cp)
        while size <= pool:
            cost = length * length / size
            for g in groups:
                if g.size != size or g.packed + length / size > per_rank:
                    continue
                proj = max(peak, g.load + cost)
                if proj <= cap and (best is None or proj < best[0]):
                    best = (proj, size, g)
            if pool - used >= size:
                proj = max(peak, cost)
                if proj <= cap and (best is None or proj < best[0]):
                    best = (proj, size, None)
            size *= 2
        if best is None:
            leftovers.append((i, length))
            continue
        proj, size, g = best
        if g is None:
            g = _Group(used, size)
            groups.append(g)
            used += size
        g.add(i, length)
        peak = max(peak, g.load)
    while used < pool:
        if not _double_smallest(groups, used, pool):
            return _whole_pool(items, pool, per_rank)
        used = sum(g.size for g in groups)
    groups.sort(key=lambda g: g.start)
    return [(g.start, g.size, list(g.ids)) for g in groups], leftovers


def _double_smallest(groups: List[_Group], used: int, pool: int) -> bool:
    """Double the first (oldest) group of the smallest size that can grow in place; False if none can. Its GPUs
    grow to the right and the groups behind it shift right (the empty GPUs are at the end of the pool)."""
    smallest = min(g.size for g in groups)
    grown = min(2 * smallest, pool)
    add = grown - smallest
    for g in groups:
        end = g.start + g.size - 1
        if g.size != smallest or end + add >= pool:
            continue
        if used + add > pool:  # the shifted groups would run past the pool: upstream indexes out of range
            raise UpstreamInfeasible(f"upstream cannot widen a group of {smallest} GPUs with only {pool - used} "
                                     f"empty in a pool of {pool}")
        for other in groups:
            if other.start > end:
                other.start += add
        g.size = grown
        g.load = sum(x * x / grown for x in g.lens)
        return True
    return False


def _whole_pool(items: Sequence[Tuple[int, int]], pool: int,
                per_rank: int) -> Tuple[List[Group], List[Tuple[int, int]]]:
    """The fallback: the round's samples, longest first, that fit ``per_rank`` spread over the whole pool."""
    chosen: List[int] = []
    rest: List[Tuple[int, int]] = []
    packed = 0.0
    for i, length in items:
        if packed + length / pool <= per_rank:
            chosen.append(i)
            packed += length / pool
        else:
            rest.append((i, length))
    if not chosen:
        raise UpstreamInfeasible("no sample fits the whole pool (upstream asserts)")
    return [(0, pool, chosen)], rest


def _fill_by_doubling(groups: List[Group], pool: int) -> List[Group]:
    """A half micro-batch of the VPP split (groups from GPU 0, sizes non-increasing, empty GPUs at the end):
    double the first group of the trailing run of smallest groups (the first group when all are equal) until no
    GPU is empty."""
    groups = [(s, z, list(ids)) for s, z, ids in groups]
    while sum(z for _, z, _ in groups) < pool:
        empty = pool - sum(z for _, z, _ in groups)
        k = len(groups) - 1
        while k > 0 and groups[k - 1][1] == groups[k][1]:
            k -= 1
        size = groups[k][1]
        if k == 0 and size > empty:  # upstream loops without progress here
            raise UpstreamInfeasible("a VPP split cannot fill its empty GPUs by doubling (upstream does not end)")
        if size > empty:
            raise UpstreamInfeasible("a VPP split would double a group past the pool's empty GPUs")
        start, _, ids = groups[k]
        groups[k] = (start, 2 * size, ids)
        groups = groups[:k + 1] + [(s + size, z, i) for s, z, i in groups[k + 1:]]
    return groups


def _split(mb: List[Group], pool: int) -> Optional[Tuple[List[Group], List[Group]]]:
    """Upstream's split of one micro-batch into two (the later half first), or None when it is one group."""
    if len(mb) == 1:
        return None
    sizes = [z for _, z, _ in mb]
    if any(b > a for a, b in zip(sizes, sizes[1:], strict=False)):
        raise UpstreamInfeasible("a VPP split needs group sizes that do not grow along the pool (upstream asserts)")
    k = next(j for j, (s, _, _) in enumerate(mb) if s >= pool // 2 and j > 0)
    first, second = mb[:k], mb[k:]
    shift = second[0][0]
    second = [(s - shift, z, ids) for s, z, ids in second]
    return _fill_by_doubling(second, pool), _fill_by_doubling(first, pool)


def align_for_vpp(microbatches: List[List[Group]], multiple: int, pool: int) -> List[List[Group]]:
    """Split micro-batches (from the last back, cycling) until their count is a multiple of ``multiple``: the
    later half stays in place, the earlier half goes to the end (upstream's ``align_sample_id_groups``)."""
    mbs = list(microbatches)
    todo = (-len(mbs)) % multiple
    i = len(mbs) - 1
    misses = 0
    while todo > 0:
        if i < 0:
            if misses >= len(mbs):
                raise UpstreamInfeasible("no micro-batch left to split for the VPP count (upstream asserts)")
            i = len(mbs) - 1
        halves = _split(mbs[i], pool)
        if halves is None:
            misses += 1
        else:
            mbs[i] = halves[0]
            mbs.append(halves[1])
            todo -= 1
            misses = 0
        i -= 1
    return mbs


def upstream_microbatches(lengths: Sequence[int], parallel: ParallelConfig, max_tokens_per_gpu: int,
                          min_cp_size: int = 1, tile: int = 1) -> List[List[Group]]:
    """Upstream's micro-batches for ``lengths`` over the ``dp * cp`` pool: per micro-batch its groups
    ``(start, size, sample ids)`` in pool order. Raises :class:`UpstreamInfeasible` where upstream would not run."""
    pool = parallel.dp * parallel.cp
    raw = np.asarray(lengths, dtype=np.int64)
    if (raw <= 0).any():
        raise UpstreamInfeasible("upstream expects no empty samples")
    # the dataset's padded_seq_len: every sequence padded for the whole pool
    lens = [int(x) for x in group_alignment(parallel, pool, tile).seq_len(raw).tolist()]
    if min_cp_size > pool:
        raise UpstreamInfeasible(f"min CP size {min_cp_size} is above the pool's {pool} GPUs (upstream asserts)")
    items = sorted(enumerate(lens), key=lambda x: -x[1])
    out: List[List[Group]] = []
    while items:
        mb, items = next_microbatch(items, pool, max_tokens_per_gpu, min_cp_size)
        out.append(mb)
    if parallel.vpp > 1 and parallel.pp > 1:  # microbatch_group_size_per_vp_stage defaults to pp
        out = align_for_vpp(out, parallel.pp, pool)
    return out


class SlotSchedule:
    """A step's schedule given as explicit pool-wide slots (upstream's micro-batches), with the interface the
    orchestration reads from a :class:`~.schedule.Schedule`: ``name``, ``widest``, ``crosses_nodes``, ``m``,
    :meth:`makespan`, :meth:`finish`, :meth:`arrange` (a no-op: slots run in upstream's order) and :meth:`slots`."""

    def __init__(self, step: StepData, name: str, slots: SlotList, tile: int) -> None:
        self.step, self.name, self.local = step, name, slots
        par = step.par
        sizes, self.tokens, self.times = group_stats(slots, step.lens, par, tile, step.cm)
        self.m = len(slots)
        self.widest = int(sizes.max()) if sizes.size else 1
        self.crosses_nodes = bool(_spans(slots, par).any())
        self._finish: Optional[np.ndarray] = None

    def finish(self) -> np.ndarray:
        if self._finish is None:
            self._finish = simulate_slots(self.local, self.times, self.step.par, self.step.cm)
        return self._finish

    def makespan(self) -> float:
        return float(self.finish().max())

    def arrange(self) -> None:
        """Upstream feeds its micro-batches in the order it built them; so does this candidate."""

    def slots(self, step_samples: np.ndarray) -> Tuple[SlotList, List[int], List[float]]:
        """The slots with global sample indices, and each group's full token count and seconds (slot-major)."""
        out = [[(a, b, [int(step_samples[i]) for i in ids]) for a, b, ids in slot] for slot in self.local]
        return out, [int(t) for t in self.tokens], [float(t) for t in self.times]


def _spans(slots: SlotList, par: ParallelConfig) -> np.ndarray:
    return np.asarray([group_spans_nodes(a, b, par) for slot in slots for a, b, _ in slot], dtype=bool)


def scheduling_work(lengths: np.ndarray, pool: int, per_rank: int) -> float:
    """An estimate of the checks upstream's rounds make: ``rounds x samples left / 2`` sample visits (``rounds``:
    the batch's tokens over the pool's budget), each trying every size and every group of a round."""
    n = int(lengths.size)
    rounds = max(1, -(-int(np.asarray(lengths, dtype=np.int64).sum()) // (pool * max(1, per_rank))))
    groups = min(pool, -(-n // rounds))
    return rounds * n / 2 * (pool.bit_length() + groups + 3)


def upstream_candidate(step: StepData, tile: int) -> List[SlotSchedule]:
    """Upstream's schedule of the step as a candidate, or none where it does not apply (module docstring)."""
    par = step.par
    pool = par.dp * par.cp
    if (step.n == 0 or pool & (pool - 1) or step.oversize.any() or (step.lens <= 0).any()
            or scheduling_work(step.lens, pool, step.budget) > UPSTREAM_MAX_WORK):
        return []
    try:
        mbs = upstream_microbatches(step.lens, par, step.budget, step.min_size, tile)
    except UpstreamInfeasible:
        return []
    if (step.forced is not None and len(mbs) != step.forced) or not is_valid_microbatch_count(len(mbs), par):
        return []
    if not all(step.tree.has_block(start, size) for slot in mbs for start, size, _ in slot):
        return []  # a group at an offset that is not a block of our pool tree: the runtime has no group for it
    sched = SlotSchedule(step, UPSTREAM_CP, mbs, tile)
    for (_, size, _), tokens in zip((g for slot in mbs for g in slot), sched.tokens, strict=True):
        if tokens > group_alignment(par, size, tile).effective_cap(step.budget * size):
            return []  # over our per-GPU budget after our alignment: not a candidate
    return [sched]
