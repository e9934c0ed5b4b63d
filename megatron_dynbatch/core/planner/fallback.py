"""Feasibility-first packings for a count ``M`` that the balancing packer (:mod:`.packer`) could not fill.

The balancing packer assigns ranks by load before it looks inside a rank, so it can refuse a count that a
packing exists for (``[7, 9, 7, 5, 4, 6]`` over ``dp=2`` ranks, ``M=2``, budget 11: it puts 24 tokens on one
rank). Before the planner declares a count infeasible, it tries, in order:

1. **global bins** (no groups; computed and cached by the caller): every sample packed into ``dp * M``
   micro-batches, then dealt out ``M`` per rank by size tier (:func:`.packer.plan_global_bins`) -- with no
   groups, any ``dp * M`` non-empty bins make a valid plan;
2. **units by best fit** (groups): groups in decreasing tokens, each onto the rank with the most room whose
   ``M`` micro-batches take all its samples (best fit inside the rank); bounded work; then, only when the count
   search would otherwise refuse the batch or a forced count, a **unit search** (:func:`units_search`):
   depth-first over groups -> ranks, pruned by rank capacity, by the items the short ranks still need and by the
   Martello-Toth bound of a rank's items (:func:`_rank_bounds`), each complete rank packed -- and charged what
   its packing costs, so its work limit bounds the time (issue 33: a tight grouped step once packed ~43,000
   ranks, 4-12 s) -- groups whose item counts must split exactly (``dp * M`` items in
   all: every rank exactly ``M``) are a number-partitioning problem that no greedy order solves reliably;
3. **bin search** (no groups; only when the count search would otherwise refuse the batch or a forced count):
   when best fit needs more than ``dp * M`` bins but the Martello-Toth bound (:func:`.bounds.min_bins`) says
   ``dp * M`` might do, a depth-first bin packing (best fit first, bins of equal load tried once, dead room
   pruned) within :data:`BIN_SEARCH_WORK`; where it fails, a bin-completion search (bins filled one at a time,
   each around the largest item left, fullest sets first, the room the bins may waste in all bounded by
   ``dp * M * cap - tokens``) within another share -- item-by-item search drowns in tight instances (bins
   90-100% full) that bin completion solves in a few hundred nodes; its bins are dealt ``M`` per rank by size
   tier. A count that Megatron's VPP rule forces (``M = N``, say) is then refused only when no packing was
   found, not whenever best fit misses one;
4. **exact search** for small steps (at most :data:`EXACT_MAX_SAMPLES` samples): depth-first over
   (rank, micro-batch) slots with symmetry breaking and a node limit, so the answer for a small case is
   right, not heuristic.

Every strategy keeps the hard cap, places every sample once, leaves no micro-batch empty and keeps a group's
samples on one rank; under ``equal_samples`` (no global bins then) every rank also gets exactly its share of
samples. Deterministic: ties break on indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from .bounds import min_bins
from .packer import StepInput, _fill_empty_bins, deal_by_tier

#: largest step solved exactly
EXACT_MAX_SAMPLES = 14
#: depth-first nodes the exact search may visit
EXACT_NODE_LIMIT = 200_000
#: (units x ranks x micro-batches) the unit best-fit may touch
UNIT_FIT_WORK = 4_000_000
#: bins the bin search may examine for one count (nodes x bins), and in all for one ``plan_global_batch``
#: call (every step and count together): bounded time on every input, ~0.1 s and ~0.9 s on one core
BIN_SEARCH_WORK = 100_000
PLAN_SEARCH_WORK = 800_000
#: work the unit search (:func:`units_search`: units looked at, each about one Python loop step; a rank it packs
#: is charged PACK_UNITS and more) may spend on one count, and in all for one ``plan_global_batch`` call: a
#: refusal that spends a whole share took 1.0-1.6 s of CPU on the 2-core VM at load average ~12 (where the
#: reference plan of docs/benchmarks.md runs 3x its idle time): about 0.4 s idle, scaled, not measured
UNIT_SEARCH_WORK = 2_500_000
PLAN_UNIT_SEARCH_WORK = 3_000_000
#: the unit search's charge for one rank it packs (units as counted by ``UNIT_SEARCH_WORK``, each about one
#: Python loop step): the lower bound checked first, per item; then the packers, per call and per item
BOUND_UNITS_PER_ITEM = 4
#: the bin search's share for one rank the unit search completes (taken from the plan's bin-search work)
RANK_SEARCH_WORK = 2_000
#: thresholds of the L2 bound the unit search carries per unit (:func:`_rank_bounds`)
BOUND_THRESHOLDS = 16
PACK_UNITS = 200
PACK_UNITS_PER_ITEM = 16
#: most items bin completion puts with the largest one into a bin (bins of many small items are easy for the
#: item-by-item search; this bounds the set enumeration's recursion)
MAX_COMPLETION_ITEMS = 64


@dataclass
class SearchWork:
    """Work the bin search (``left``, in examined bins) and the unit search (``units_left``, in units looked at)
    may still spend, shared by every step and count of one plan (deterministic: counted in work, not seconds)."""

    left: int = PLAN_SEARCH_WORK
    units_left: int = PLAN_UNIT_SEARCH_WORK
    #: items the portfolio (:mod:`.portfolio`) may still try its strategies on, over every step of one plan
    portfolio_items: int = 4_096

    def take(self) -> int:
        return min(BIN_SEARCH_WORK, self.left)

    def take_units(self) -> int:
        return min(UNIT_SEARCH_WORK, self.units_left)

Bins = List[List[List[int]]]


def feasible_packing(inp: StepInput, dp: int, m: int, global_bins: Optional[Bins] = None,
                     search: Optional[SearchWork] = None) -> Optional[Bins]:
    """A valid packing of the step into ``dp`` ranks of ``m`` micro-batches, or ``None`` if none was found.

    ``global_bins``: the global-bins packing of this count when the caller already has it (the count search
    caches it, and skips it where best fit cannot fill ``dp * m`` bins); with ``dp == 1`` it is the balancing
    packer's own attempt, so it is not repeated. ``search``: also run the bounded bin search, spending this work
    (the count search asks for it only before it would refuse the batch: elsewhere a missed count costs one more
    micro-batch, while the search's work, spent on every count of every step, would cost seconds)."""
    if inp.singletons and not inp.equal_samples:
        if global_bins is not None and dp > 1:
            return global_bins
        found = search_bins(inp, dp * m, search) if search is not None else None
        if found is not None:
            return deal_by_tier(found, inp, dp, m)
    else:
        found = _units_best_fit(inp, dp, m)
        if found is not None:
            return found
        found = units_search(inp, dp, m, search) if search is not None else None
        if found is not None:
            return found
    if inp.aligned.size <= EXACT_MAX_SAMPLES:
        return _exact(inp, dp, m)
    return None


def search_bins(inp: StepInput, k: int, search: Optional[SearchWork] = None) -> Optional[List[List[int]]]:
    """Exactly ``k`` non-empty bins of an ungrouped step within the cap (over-budget samples alone), found by a
    depth-first search, or ``None`` (none exists, or none was found within the work's share for one count;
    what the search spends is taken from ``search``).

    Items in decreasing size; each goes, best fit first, into a bin whose load no earlier candidate of that
    item had (bins of equal load are interchangeable); a branch dies when the room left in bins that cannot
    take even the smallest item leaves too little for the items still to place. Skipped outright when the
    Martello-Toth bound needs more than ``k`` bins or one greedy dive alone would exceed its share. Iterative,
    so deep steps do not hit Python's recursion limit."""
    search = SearchWork() if search is None else search
    work = search.take()
    over = np.flatnonzero(inp.oversize)
    normal = np.flatnonzero(~inp.oversize)
    kk = k - over.size
    if kk <= 0 or normal.size < kk or normal.size * kk > work:
        return None
    order = normal[np.lexsort((normal, -inp.aligned[normal]))]
    size = inp.aligned[order].tolist()
    cap = int(inp.cap)
    if min_bins(inp.aligned[normal], cap) > kk:
        return None
    left = np.concatenate((np.cumsum(size[::-1])[::-1], [0])).tolist()  # left[p]: sizes of items p..end
    spent = [0]
    try:
        choice = _dive(size, left, cap, kk, work, spent)
    finally:
        search.left -= spent[0]
    if choice is None:  # tight instances: fill whole bins instead, from a share of its own
        work, spent = search.take(), [0]
        try:
            choice = _complete_bins(size, cap, kk, work, spent)
        finally:
            search.left -= spent[0]
    if choice is None:
        return None
    bins: List[List[int]] = [[int(i)] for i in over] + [[] for _ in range(kk)]
    for p, b in enumerate(choice):
        bins[over.size + b].append(int(order[p]))
    return bins if _fill_empty_bins(bins) else None


def _dive(size: List[int], left: List[int], cap: int, k: int, work: int, spent: List[int]) -> Optional[List[int]]:
    """The depth-first search of :func:`search_bins` over items of ``size`` (decreasing) into ``k`` bins: the
    bin of every item, or ``None``. ``spent[0]`` counts bins examined (``k`` per candidate list built and per
    placement tried), and the search stops once it would pass ``work``."""
    n, smallest = len(size), size[-1]
    loads = [0] * k
    choice = [-1] * n
    cands: List[Optional[List[int]]] = [None] * n
    ptr = [0] * n
    pos = 0
    while pos < n:
        if cands[pos] is None:
            need, seen, lst = size[pos], set(), []
            for b in sorted(range(k), key=loads.__getitem__, reverse=True):
                load = loads[b]
                if load + need <= cap and load not in seen:
                    seen.add(load)
                    lst.append(b)
            cands[pos], ptr[pos] = lst, 0
        if choice[pos] >= 0:  # coming back: undo this item's last placement
            loads[choice[pos]] -= size[pos]
            choice[pos] = -1
        lst = cands[pos]
        while ptr[pos] < len(lst):
            spent[0] += k
            if spent[0] > work:
                return None
            b = lst[ptr[pos]]
            ptr[pos] += 1
            loads[b] += size[pos]
            if sum(cap - load for load in loads if cap - load >= smallest) >= left[pos + 1]:
                choice[pos] = b
                break
            loads[b] -= size[pos]
        if choice[pos] >= 0:
            pos += 1
            continue
        cands[pos] = None
        pos -= 1
        if pos < 0:
            return None
    return choice


def _complete_bins(size: List[int], cap: int, k: int, work: int, spent: List[int]) -> Optional[List[int]]:
    """Bin completion over items of ``size`` (decreasing) into at most ``k`` bins of ``cap``: the bin of every
    item, or ``None``. Each level opens a bin with the largest item left and tries the sets of other items that
    complete it, fullest first, skipping a set to which another item left would still fit (a fuller bin with
    the same items is as good) and sets of equal sizes already tried; a branch dies once the bins' waste passes
    ``k * cap - sum(size)`` (no packing into ``k`` bins wastes more). ``spent[0]`` counts the items looked at
    while building sets (the dive counts the bins it looks at: comparable work per unit); the search stops once
    it would pass ``work``. Deterministic; iterative over bins, recursive only inside one
    bin's set enumeration (depth at most the items of one bin)."""
    n = len(size)
    slack = k * cap - sum(size)
    if slack < 0 or n == 0:
        return None if n else []
    placed = [-1] * n

    def completions(first: int, room: int):
        """Sets of unplaced items after ``first`` (positions, decreasing size) that fit ``room``, fullest
        first, each maximal (no further unplaced item fits what it leaves), as (the room it leaves, its
        positions)."""
        free = [p for p in range(first + 1, n) if placed[p] < 0 and size[p] <= room]
        found: List[tuple] = []

        def extend(i: int, room_left: int, chosen: List[int]) -> None:
            spent[0] += len(free) - i + 1  # the items this step looks at (as the dive counts the bins it looks at)
            if spent[0] > work or len(chosen) > MAX_COMPLETION_ITEMS:
                raise _OutOfWork
            tried = set()
            grew = False
            for j in range(i, len(free)):
                p = free[j]
                if size[p] <= room_left and size[p] not in tried:
                    tried.add(size[p])
                    grew = True
                    chosen.append(p)
                    extend(j + 1, room_left - size[p], chosen)
                    chosen.pop()
            if not grew:  # nothing after free[i] fits, and chosen holds only items before it: a leaf
                found.append((room_left, tuple(chosen)))

        extend(0, room, [])
        spent[0] += len(found)  # the sort and the maximality filter below
        if spent[0] > work:
            raise _OutOfWork
        found.sort()  # least room left first; ties by positions (deterministic)
        return [(r, c) for r, c in found if not any(size[q] <= r for q in free if q not in c)]

    # one frame per open bin: (its first item, its completions, the next one to try, the waste before it)
    stack: List[list] = []
    waste = 0
    try:
        while True:
            first = next((p for p in range(n) if placed[p] < 0), None)
            if first is None:
                return placed
            if len(stack) < k:  # open the next bin around the largest item left
                placed[first] = len(stack)
                stack.append([first, completions(first, cap - size[first]), 0, waste])
            while stack:  # take the next completion of the innermost bin that has one, else close bins
                top = stack[-1]
                b, (item, options, i, base) = len(stack) - 1, top
                if i > 0:  # undo the completion tried last
                    for p in options[i - 1][1]:
                        placed[p] = -1
                if i < len(options) and base + options[i][0] <= slack:  # [0]: the room the completion leaves
                    for p in options[i][1]:
                        placed[p] = b
                    waste = base + options[i][0]
                    top[2] = i + 1
                    break
                placed[item] = -1  # no completion left within the waste: close this bin, back to the previous
                stack.pop()
            else:
                return None
    except _OutOfWork:
        return None


class _OutOfWork(Exception):
    """The bin-completion search spent its share."""


def _units_best_fit(inp: StepInput, dp: int, m: int) -> Optional[Bins]:
    n_units = inp.unit_tokens.size
    if n_units * dp * m > UNIT_FIT_WORK:
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
    return bins if all(_fill_empty_bins(rank) for rank in bins) else None


def units_search(inp: StepInput, dp: int, m: int, search: SearchWork) -> Optional[Bins]:
    """A packing of a grouped step into ``dp`` ranks of ``m`` micro-batches found by bin completion over ranks,
    or ``None`` (none exists, or none was found within the work's share for one count; what it spends is taken
    from ``search.units_left``).

    Two resources are short: every rank needs ``m`` items, so the items beyond ``dp * m`` are the step's *item
    slack*; every rank holds at most ``m * cap`` tokens, so the room the step leaves, ``dp * m * cap`` less its
    tokens, is its *token slack*. A rank spends item slack on items beyond ``m`` (its excess) and token slack on
    room it leaves empty (its waste). Ranks are filled one at a time: each opens with the largest unit left and
    tries the sets of later units that give it at least ``m`` items (under ``equal_samples``, exactly the rank's
    sample share) within ``m * cap`` tokens, cheapest first -- the smallest share of what is left of the two
    slacks together -- sets of equal (items, tokens, samples) tried once; a branch dies once the ranks' excess
    or waste passes its slack. A rank's micro-batches are packed as soon as it is complete
    (:func:`.packer.pack_rank`, then the bounded bin search on the rank alone); the last rank takes every unit
    left. Groups whose item counts must split exactly (no item slack) are a number-partitioning problem, groups
    that must fill every rank (no token slack) a bin-packing one; greedy orders miss both, bin completion solves
    them in a few hundred nodes. Deterministic."""
    from .packer import pack_rank

    work = search.take_units()
    spent = [0]
    n_units = inp.unit_count.size
    counts, tokens, samples = inp.unit_count.tolist(), inp.unit_tokens.tolist(), inp.unit_samples.tolist()
    order = sorted(range(n_units), key=lambda u: (-counts[u], -tokens[u], u))
    cnt = [counts[u] for u in order]
    smp = [samples[u] for u in order]
    capacity = m * inp.cap
    big, tok, lanes, lane_bias, lane_high = _rank_bounds(inp, order, capacity)
    slack = sum(cnt) - dp * m
    token_slack = dp * capacity - sum(tok)
    target = inp.sample_target(dp)
    if slack < 0 or token_slack < 0 or n_units < dp:
        return None
    placed = [False] * n_units

    def charge(amount: int) -> None:
        spent[0] += amount
        if spent[0] > work:
            raise _OutOfWork

    def packed(positions) -> Optional[List[List[int]]]:
        members = inp.members([order[p] for p in positions])
        charge(members.size * BOUND_UNITS_PER_ITEM)
        over = inp.oversize[members]
        if min_bins(inp.aligned[members[~over]], inp.cap, n_alone=int(over.sum())) > m:
            return None  # no packing of these items into m micro-batches exists (what both packers would find)
        charge(PACK_UNITS + members.size * PACK_UNITS_PER_ITEM)
        bins = pack_rank(members, inp, m)
        if bins is not None:
            return bins
        before = search.left
        try:
            return _rank_bin_search(inp, members, m, search)
        finally:
            charge(before - search.left)  # the bin search's work is the unit search's too

    def completions(first: int, excess_left: int, waste_left: int) -> List[tuple]:
        """Sets of unplaced units after ``first`` completing its rank within the slacks left, as (excess, waste,
        positions), cheapest first."""
        free = [p for p in range(first + 1, n_units) if not placed[p]]
        found: List[tuple] = []

        def extend(i: int, items: int, used: int, held: int, bigs: int, lane: int, chosen: List[int]) -> None:
            charge(len(free) - i + 1)
            if len(chosen) > MAX_COMPLETION_ITEMS:
                raise _OutOfWork
            if items >= m and (target is None or held == target) and capacity - used <= waste_left:
                excess, waste = items - m, capacity - used
                cost = excess / (excess_left + 1) + waste / (waste_left + 1)
                found.append((cost, excess, waste, tuple(chosen)))
            if target is not None and held >= target:
                return
            tried = set()
            for j in range(i, len(free)):
                p = free[j]
                key = (cnt[p], tok[p], smp[p])
                if (key in tried or used + tok[p] > capacity or items + cnt[p] - m > excess_left
                        or (target is not None and held + smp[p] > target)):
                    continue
                if bigs + big[p] > m or (lane + lanes[p] + lane_bias) & lane_high:
                    continue  # the rank's items cannot fill m micro-batches (_rank_bounds); not marked tried:
                    # a unit with the same key may pass
                tried.add(key)
                chosen.append(p)
                extend(j + 1, items + cnt[p], used + tok[p], held + smp[p], bigs + big[p], lane + lanes[p], chosen)
                chosen.pop()

        if big[first] > m or (lanes[first] + lane_bias) & lane_high:
            return []
        extend(0, cnt[first], tok[first], smp[first], big[first], lanes[first], [])
        found.sort()
        return [(excess, waste, chosen) for _, excess, waste, chosen in found]

    ranks: List[List[int]] = []
    # one frame per open rank but the last: [its first unit, its completions, the next one to try, (excess,
    # waste) of the ranks before]
    stack: List[list] = []
    spent_slack = (0, 0)
    try:
        while True:
            first = next((p for p in range(n_units) if not placed[p]), None)
            if len(stack) == dp - 1 and first is not None:  # the last rank takes every unit left
                rest = [p for p in range(n_units) if not placed[p]]
                if (sum(cnt[p] for p in rest) >= m and sum(tok[p] for p in rest) <= capacity
                        and (target is None or sum(smp[p] for p in rest) == target)):
                    bins = packed(rest)
                    if bins is not None:
                        return [*ranks, bins] if len(ranks) == dp - 1 else None
            elif len(stack) < dp - 1 and first is not None:  # open the next rank around the largest unit left
                placed[first] = True
                stack.append([first, completions(first, slack - spent_slack[0], token_slack - spent_slack[1]), 0,
                              spent_slack])
                ranks.append([])
            while stack:  # the next completion of the innermost rank that has one, else close ranks
                top = stack[-1]
                head, options, i, base = top
                if i > 0:  # undo the completion tried last
                    for p in options[i - 1][2]:
                        placed[p] = False
                    ranks[-1] = []
                found = None
                while i < len(options):
                    for p in options[i][2]:
                        placed[p] = True
                    bins = packed((head,) + options[i][2])
                    i += 1
                    if bins is not None:
                        found = bins
                        break
                    for p in options[i - 1][2]:
                        placed[p] = False
                top[2] = i
                if found is not None:
                    ranks[-1] = found
                    spent_slack = (base[0] + options[i - 1][0], base[1] + options[i - 1][1])
                    break
                placed[head] = False  # no completion left within the slack: close this rank
                stack.pop()
                ranks.pop()
            else:
                return None
    except _OutOfWork:
        return None
    finally:
        search.units_left -= min(spent[0], work)


def _rank_bounds(inp: StepInput, order: List[int], capacity: int):
    """Necessary conditions for a rank's units to fill ``m`` micro-batches (``capacity = m * cap``), additive
    over units so the unit search carries them while a set grows -- the Martello-Toth L2 bound
    (:mod:`.bounds`) split by unit: ``(big, tok, lanes, bias, high)``, per unit in ``order``.

    * ``big``: items over half the cap (or over budget), each needing a micro-batch of its own: at most ``m``;
    * ``lanes``: for a few thresholds ``k <= cap/2`` (the smallest item, then quantiles of the item sizes), the
      items over ``cap - k`` fill a micro-batch alone (no item of ``>= k`` joins them) and are charged ``cap``,
      items under ``k`` nothing, the rest their tokens; the rank's charge must stay within ``capacity``. L2 at
      ``k`` is exactly this with the ``big`` count. The charges of every threshold share one Python integer, a
      lane of bits each, so a sum is one addition and the test ``(lanes + bias) & high`` one more (a lane
      passes ``capacity`` iff its top bit is set; lanes are wide enough that no sum carries into the next);
    * ``tok``: the first lane alone (``k`` the smallest item: every item charged at least its tokens), the
      token measure of the search's waste and slack."""
    cap = int(inp.cap)
    normal = inp.aligned[~inp.oversize]
    small = np.sort(normal[2 * normal <= cap])
    ks = [int(normal.min()) if normal.size else 0]
    if small.size:
        ks += small[np.linspace(0, small.size - 1, BOUND_THRESHOLDS).astype(np.int64)].tolist()
    ks = sorted(set(ks))
    big = _per_unit(inp, (inp.oversize | (2 * inp.aligned > cap)).astype(np.int64))[order]
    charges = [_per_unit(inp, np.where(inp.oversize | (inp.aligned > cap - k), cap,
                                       np.where(inp.aligned >= k, inp.aligned, 0)).astype(np.int64))[order]
               for k in ks]
    width = (int(charges[0].sum()) + capacity + 1).bit_length() + 1  # top bit of a lane: over capacity
    lanes = [0] * len(order)
    bias = high = 0
    for lane, charge in enumerate(charges):
        shift = lane * width
        bias |= ((1 << (width - 1)) - 1 - capacity) << shift
        high |= (1 << (width - 1)) << shift
        lanes = [acc | (int(c) << shift) for acc, c in zip(lanes, charge.tolist(), strict=True)]
    return big.tolist(), charges[0].tolist(), lanes, bias, high


def _per_unit(inp: StepInput, values: np.ndarray) -> np.ndarray:
    """Per-item ``values`` summed over each unit (units are never empty)."""
    if inp.singletons:
        return values
    starts = np.concatenate(([0], np.cumsum([len(members) for members in inp.units])[:-1]))
    return np.add.reduceat(values[np.concatenate(inp.units)], starts)


def _rank_bin_search(inp: StepInput, members, m: int, search: SearchWork) -> Optional[List[List[int]]]:
    """One rank's items in exactly ``m`` micro-batches by the bounded bin search (:func:`search_bins` on the
    rank alone), or ``None``."""
    members = np.asarray(members, dtype=np.int64)
    sub = StepInput(aligned=inp.aligned[members], weight=inp.weight[members], oversize=inp.oversize[members],
                    units=None, cap=inp.cap)
    share = SearchWork(left=min(RANK_SEARCH_WORK, search.left))  # one rank of many: a small share
    try:
        found = search_bins(sub, m, share)
    finally:
        search.left -= min(RANK_SEARCH_WORK, search.left) - share.left
    return None if found is None else [[int(members[i]) for i in b] for b in found]


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
        if nodes[0] > EXACT_NODE_LIMIT:
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
