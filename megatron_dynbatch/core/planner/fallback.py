"""Feasibility-first packings for a count ``M`` that the balancing packer (:mod:`.packer`) could not fill.

The balancing packer assigns ranks by load before it looks inside a rank, so it can refuse a count that a
packing exists for (``[7, 9, 7, 5, 4, 6]`` over ``dp=2`` ranks, ``M=2``, budget 11: it puts 24 tokens on one
rank). Before the planner declares a count infeasible, it tries, in order:

1. **global bins** (no groups; computed and cached by the caller): every sample packed into ``dp * M``
   micro-batches, then dealt out ``M`` per rank by size tier (:func:`.packer.plan_global_bins`) -- with no
   groups, any ``dp * M`` non-empty bins make a valid plan;
2. **units by best fit** (groups): groups in decreasing tokens, each onto the rank with the most room whose
   ``M`` micro-batches take all its samples (best fit inside the rank); bounded work;
3. **exact search** for small steps (at most :data:`EXACT_MAX_SAMPLES` samples): depth-first over
   (rank, micro-batch) slots with symmetry breaking and a node budget, so the answer for a small case is
   right, not heuristic.

Every strategy keeps the hard cap, places every sample once, leaves no micro-batch empty and keeps a group's
samples on one rank; under ``equal_samples`` (no global bins then) every rank also gets exactly its share of
samples. Deterministic: ties break on indices.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from .packer import StepInput

#: largest step solved exactly
EXACT_MAX_SAMPLES = 14
#: depth-first nodes the exact search may visit
EXACT_NODE_BUDGET = 200_000
#: (units x ranks x micro-batches) the unit best-fit may touch
UNIT_FIT_BUDGET = 4_000_000

Bins = List[List[List[int]]]


def feasible_packing(inp: StepInput, dp: int, m: int, global_bins: Optional[Bins] = None) -> Optional[Bins]:
    """A valid packing of the step into ``dp`` ranks of ``m`` micro-batches, or ``None`` if none was found.

    ``global_bins``: the global-bins packing of this count when the caller already has it (the count search
    caches it, and skips it where best fit cannot fill ``dp * m`` bins); with ``dp == 1`` it is the balancing
    packer's own attempt, so it is not repeated."""
    if inp.singletons and not inp.equal_samples:
        if global_bins is not None and dp > 1:
            return global_bins
    else:
        found = _units_best_fit(inp, dp, m)
        if found is not None:
            return found
    if inp.aligned.size <= EXACT_MAX_SAMPLES:
        return _exact(inp, dp, m)
    return None


def _units_best_fit(inp: StepInput, dp: int, m: int) -> Optional[Bins]:
    n_units = inp.unit_tokens.size
    if n_units * dp * m > UNIT_FIT_BUDGET:
        return None
    cap = inp.cap
    order = np.lexsort((np.arange(n_units), -inp.unit_tokens))
    if inp.equal_samples:  # many-sample units first, so the sample slots of the ranks are not stranded
        order = np.lexsort((np.arange(n_units), -inp.unit_tokens, -inp.unit_samples))
    target = inp.sample_target(dp)
    free = np.full(dp, target if target is not None else 0, dtype=np.int64)
    room = np.full((dp, m), cap, dtype=np.int64)
    bins: Bins = [[[] for _ in range(m)] for _ in range(dp)]
    for u in order.tolist():
        members = inp.members([u])
        members = members[np.lexsort((members, -inp.aligned[members]))]
        placed = False
        for r in np.lexsort((np.arange(dp), -room.sum(axis=1))).tolist():
            if target is not None and free[r] < inp.unit_samples[u]:
                continue
            trial = room[r].copy()
            slots = []
            for i in members.tolist():
                need = int(inp.aligned[i])
                if inp.oversize[i]:
                    fits = np.flatnonzero(trial == cap)
                    k = int(fits[0]) if fits.size else -1
                    need = cap
                else:
                    fits = np.flatnonzero(trial >= need)
                    k = int(fits[np.argmin(trial[fits])]) if fits.size else -1
                if k < 0:
                    break
                trial[k] -= need
                slots.append((k, i))
            if len(slots) == members.size:
                room[r] = trial
                free[r] -= inp.unit_samples[u]
                for k, i in slots:
                    bins[r][k].append(i)
                placed = True
                break
        if not placed:
            return None
    return bins if all(_fill_empty(rank, inp) for rank in bins) else None


def _fill_empty(rank: List[List[int]], inp: StepInput) -> bool:
    """In place: give every empty micro-batch one sample from a micro-batch with several (never an oversize
    sample's own); ``False`` if the rank has too few samples."""
    for k in range(len(rank)):
        if rank[k]:
            continue
        donors = [d for d in range(len(rank)) if len(rank[d]) > 1]
        if not donors:
            return False
        d = max(donors, key=lambda j: (len(rank[j]), -j))
        rank[k].append(rank[d].pop())
    return True


def _exact(inp: StepInput, dp: int, m: int) -> Optional[Bins]:
    """Depth-first search over (rank, micro-batch) slots for a small step."""
    n = inp.aligned.size
    if n < dp * m:
        return None
    cap = inp.cap
    unit_of = np.zeros(n, dtype=np.int64)
    if not inp.singletons:
        for u, members in enumerate(inp.units):
            unit_of[members] = u
    else:
        unit_of = np.arange(n)
    size = [cap if inp.oversize[i] else int(inp.aligned[i]) for i in range(n)]
    order = sorted(range(n), key=lambda i: (-size[i], i))
    load = [[0] * m for _ in range(dp)]
    count = [[0] * m for _ in range(dp)]
    rank_of_unit: dict = {}
    assign = [(-1, -1)] * n
    nodes = [0]
    target = inp.sample_target(dp)
    rank_samples = [0] * dp

    def empty_slots() -> int:
        return sum(1 for r in range(dp) for k in range(m) if count[r][k] == 0)

    def rec(pos: int) -> bool:
        nodes[0] += 1
        if nodes[0] > EXACT_NODE_BUDGET:
            return False
        if n - pos < empty_slots():
            return False
        if pos == n:
            return True
        i = order[pos]
        u = int(unit_of[i])
        ranks = [rank_of_unit[u]] if u in rank_of_unit else range(dp)
        tried_empty_rank = False
        for r in ranks:
            if target is not None and u not in rank_of_unit and rank_samples[r] + inp.unit_samples[u] > target:
                continue
            rank_empty = all(c == 0 for c in count[r])
            if rank_empty and u not in rank_of_unit:
                if tried_empty_rank:
                    continue  # empty ranks are interchangeable
                tried_empty_rank = True
            tried_empty_bin = False
            for k in range(m):
                if count[r][k] == 0:
                    if tried_empty_bin:
                        continue  # empty micro-batches of one rank are interchangeable
                    tried_empty_bin = True
                if load[r][k] + size[i] > cap or (inp.oversize[i] and count[r][k]) or _holds_oversize(r, k):
                    continue
                load[r][k] += size[i]
                count[r][k] += 1
                assign[i] = (r, k)
                fresh = u not in rank_of_unit
                if fresh:
                    rank_of_unit[u] = r
                    rank_samples[r] += int(inp.unit_samples[u])
                if rec(pos + 1):
                    return True
                if fresh:
                    del rank_of_unit[u]
                    rank_samples[r] -= int(inp.unit_samples[u])
                assign[i] = (-1, -1)
                load[r][k] -= size[i]
                count[r][k] -= 1
        return False

    def _holds_oversize(r: int, k: int) -> bool:
        return any(assign[j] == (r, k) and inp.oversize[j] for j in range(n))

    if not rec(0):
        return None
    bins: Bins = [[[] for _ in range(m)] for _ in range(dp)]
    for i in range(n):
        r, k = assign[i]
        bins[r][k].append(i)
    return bins
