"""Packing one optimizer step's samples into ``dp x M`` micro-batches for a fixed ``M``.

Pure NumPy + heapq; no torch, no distributed state. Three phases, each deterministic (ties break on the lower
index), so every rank computes the identical result:

1. **Rank assignment** (:func:`assign_ranks`): units (a sample, or every sample of one GRPO group) in
   decreasing weight go to the least-loaded rank whose token capacity ``M * cap`` still fits them (LPT with
   capacity). Ranks short of ``M`` samples then take the lightest units from ranks with a surplus, so no
   micro-batch will be empty.
2. **Refinement** (:func:`refine_ranks`): the most- and least-loaded ranks exchange one unit or one pair of
   units, chosen by binary search to halve their gap, while capacity and sample counts allow (a bounded number
   of rounds).
3. **Micro-batches** (:func:`pack_rank`): inside a rank, samples in decreasing weight go to the lightest
   micro-batch with room (LPT with capacity), which both respects the hard cap and evens the micro-batches
   (what shortens the pipeline bubble); if that leaves a sample with nowhere to go, best-fit-decreasing on
   tokens is tried before declaring ``M`` infeasible. Over-budget samples (``oversize='alone'``) get a
   micro-batch of their own, which nothing else joins.

Any phase may return ``None``: the caller then tries a larger ``M``.

With ``equal_samples_per_rank`` (``StepInput.equal_samples``) every rank must end with exactly ``n / dp`` samples:
phase 1 only offers a unit to ranks with that many free sample slots, and phase 2 only swaps units holding the
same number of samples (a move would change two ranks' counts). An *item* is what a micro-batch holds: a sample,
or all samples of one ``microbatch_group_ids`` group merged into one (``StepInput.samples`` counts them).
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..smallops import is_small, np_sum


class UnitLists(NamedTuple):
    """:class:`StepInput`'s per-unit arrays as Python lists (:attr:`StepInput.unit_lists`)."""

    weight: list
    tokens: list
    items: list
    samples: list


class ItemLists(NamedTuple):
    """:class:`StepInput`'s per-item arrays as Python lists (:attr:`StepInput.item_lists`)."""

    aligned: list
    weight: list
    oversize: list


@dataclass
class StepInput:
    """Per-sample arrays of one optimizer step (local indices ``0..n-1``)."""

    aligned: np.ndarray      # int64, per-sequence padded slot length (counts against the cap)
    weight: np.ndarray       # float64, balancing weight (FLOPs, tokens or modelled seconds)
    oversize: np.ndarray     # bool, slot longer than the cap (placed alone)
    units: Optional[List[np.ndarray]]  # item indices of each unit (a group); None: one unit per item
    cap: int                 # effective cap on the sum of slot lengths of one micro-batch
    samples: Optional[np.ndarray] = None  # samples merged into each item (None: one each)
    equal_samples: bool = False           # every rank gets exactly (samples of the step) / dp samples

    def __post_init__(self) -> None:
        n_units = self.aligned.size if self.units is None else len(self.units)
        # An over-budget sample occupies a whole micro-batch: charge it ``cap`` tokens of the rank capacity.
        charged = np.where(self.oversize, self.cap, self.aligned)
        self.singletons = self.units is None
        item_samples = np.ones(self.aligned.size, dtype=np.int64) if self.samples is None \
            else np.asarray(self.samples, dtype=np.int64)
        if self.singletons:  # one unit per item (no groups): unit u is item u
            self.unit_weight = self.weight.astype(np.float64)
            self.unit_tokens = charged.astype(np.int64)
            self.unit_count = np.ones(n_units, dtype=np.int64)
            self.unit_samples = item_samples
        else:
            unit_of = np.empty(self.aligned.size, dtype=np.int64)
            for u, members in enumerate(self.units):
                unit_of[members] = u
            self.unit_weight = np.bincount(unit_of, weights=self.weight, minlength=n_units)
            self.unit_tokens = np.bincount(unit_of, weights=charged, minlength=n_units).round().astype(np.int64)
            self.unit_count = np.bincount(unit_of, minlength=n_units).astype(np.int64)
            self.unit_samples = np.bincount(unit_of, weights=item_samples, minlength=n_units).round().astype(np.int64)

    @functools.cached_property
    def unit_lists(self) -> "UnitLists":
        """``unit_weight``, ``unit_tokens``, ``unit_count`` and ``unit_samples`` as Python lists, made once per
        step: the plain-Python fast paths read them one element at a time (a NumPy scalar per element is several
        times slower)."""
        return UnitLists(self.unit_weight.tolist(), self.unit_tokens.tolist(), self.unit_count.tolist(),
                         self.unit_samples.tolist())

    @functools.cached_property
    def item_lists(self) -> "ItemLists":
        """``aligned``, ``weight`` and ``oversize`` as Python lists, made once per step (see :attr:`unit_lists`)."""
        return ItemLists(self.aligned.tolist(), self.weight.tolist(), self.oversize.tolist())

    def sample_target(self, dp: int) -> Optional[int]:
        """Samples every rank must hold under ``equal_samples`` (the caller checked divisibility), else None."""
        return int(self.unit_samples.sum()) // dp if self.equal_samples else None

    def members(self, units: Sequence[int]) -> np.ndarray:
        """Sample indices of these units."""
        if self.singletons:
            return np.asarray(units, dtype=np.int64)
        if not units:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self.units[u] for u in units])


def _desc_order(primary: np.ndarray, secondary: np.ndarray) -> np.ndarray:
    """Indices by decreasing ``primary``, then decreasing ``secondary``, then increasing index."""
    idx = np.arange(primary.size)
    return np.lexsort((idx, -secondary, -primary))


def _desc_order_of(items, primary: Sequence, secondary: Sequence) -> List[int]:
    """:func:`_desc_order` in plain Python: ``items`` by decreasing ``primary[i]``, then decreasing
    ``secondary[i]``; the sort is stable, so ties keep the order of ``items`` as the index key does."""
    return sorted(items, key=lambda i: (-primary[i], -secondary[i]))


def _units_heaviest_first(inp: StepInput) -> Tuple[List[int], List[int], List[float], List[int]]:
    """The units by decreasing weight, then tokens, then index (:func:`_desc_order`); each one's tokens and weight
    in that order; and the smallest tokens among the units from each position on (``0`` past the last). A small
    step in plain Python (:func:`_desc_order_of`, a running minimum), others in NumPy: the same lists."""
    if is_small(inp.unit_weight.size):  # small steps: no NumPy call at all
        weights, tokens = inp.unit_lists.weight, inp.unit_lists.tokens
        order = _desc_order_of(range(len(weights)), weights, tokens)
        need_of = [tokens[u] for u in order]
        suffix_min = list(itertools.accumulate(reversed(need_of), min))[::-1] + [0]
        return order, need_of, [weights[u] for u in order], suffix_min
    order_arr = _desc_order(inp.unit_weight, inp.unit_tokens)
    tok_sorted = inp.unit_tokens[order_arr]
    suffix_min = np.minimum.accumulate(tok_sorted[::-1])[::-1].tolist() + [0]
    return order_arr.tolist(), tok_sorted.tolist(), inp.unit_weight[order_arr].tolist(), suffix_min


def assign_ranks(inp: StepInput, dp: int, m: int) -> Optional[List[List[int]]]:
    """Phase 1: units per rank, or ``None`` if some unit fits no rank's ``m * cap`` token capacity."""
    if inp.equal_samples:
        return _assign_equal(inp, dp, m)
    capacity = m * inp.cap
    # Plain Python lists in the hot loop: indexing NumPy scalars one at a time is several times slower. A rank
    # that cannot take even the smallest token demand among the units still to place (suffix_min) is retired.
    order, need_of, weight_of, suffix_min = _units_heaviest_first(inp)
    used = [0] * dp
    ranks: List[List[int]] = [[] for _ in range(dp)]
    heap = [(0.0, r) for r in range(dp)]
    pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
    for k, u in enumerate(order):
        need = need_of[k]
        skipped = []
        placed = False
        while heap:
            load, r = heap[0]  # peek: a rank that fits is updated in place by one heapreplace (ranks are distinct
            if used[r] + need <= capacity:  # entries, so the pop order does not depend on the heap's layout)
                ranks[r].append(u)
                used[r] += need
                replace(heap, (load + weight_of[k], r))
                placed = True
                break
            pop(heap)
            if used[r] + suffix_min[k + 1] <= capacity:
                skipped.append((load, r))
        for item in skipped:
            push(heap, item)
        if not placed:
            return None
    if not _fill_counts(inp, ranks, m, capacity):
        return None
    return ranks


def _assign_equal(inp: StepInput, dp: int, m: int) -> Optional[List[List[int]]]:
    """Phase 1 under ``equal_samples``: every rank takes exactly ``T = samples / dp`` samples.

    First LPT as in :func:`assign_ranks`, offering each unit (heaviest first) only to ranks with room for its
    samples and tokens; with units of unequal sample counts that can strand slots, so a second pass places
    units by decreasing sample count into the rank with the fewest free slots that takes them (best fit on
    slots, lightest load on ties). ``None`` when both fail or a rank ends with fewer than ``m`` items."""
    target = inp.sample_target(dp)
    capacity = m * inp.cap
    ranks = _lpt_equal(inp, dp, target, capacity)
    if ranks is not None and min(int(inp.unit_count[r].sum()) if r else 0 for r in ranks) >= m:
        return ranks
    n_units = inp.unit_weight.size
    by_samples = np.lexsort((np.arange(n_units), -inp.unit_weight, -inp.unit_samples))
    for order, slots_first in ((by_samples, True),):
        ranks = [[] for _ in range(dp)]
        used = np.zeros(dp, dtype=np.int64)
        free = np.full(dp, target, dtype=np.int64)
        load = np.zeros(dp)
        items = np.zeros(dp, dtype=np.int64)
        ok = True
        for u in order.tolist():
            s_u, t_u = int(inp.unit_samples[u]), int(inp.unit_tokens[u])
            fits = np.flatnonzero((free >= s_u) & (used + t_u <= capacity))
            if not fits.size:
                ok = False
                break
            if slots_first:
                r = int(fits[np.lexsort((fits, load[fits], free[fits]))[0]])
            else:
                r = int(fits[np.lexsort((fits, load[fits]))[0]])
            ranks[r].append(u)
            used[r] += t_u
            free[r] -= s_u
            load[r] += inp.unit_weight[u]
            items[r] += inp.unit_count[u]
        if ok and not free.any() and (items >= m).all():
            return ranks
    return None


def _lpt_equal(inp: StepInput, dp: int, target: int, capacity: int) -> Optional[List[List[int]]]:
    """LPT (heaviest unit to the least-loaded rank) among ranks with room for the unit's samples and tokens;
    a rank whose sample slots are all taken leaves the heap. ``None`` if some unit finds no rank."""
    order = _desc_order(inp.unit_weight, inp.unit_tokens).tolist()
    free = [target] * dp
    used = [0] * dp
    ranks: List[List[int]] = [[] for _ in range(dp)]
    heap = [(0.0, r) for r in range(dp)]
    samples, tokens, weight = inp.unit_samples.tolist(), inp.unit_tokens.tolist(), inp.unit_weight.tolist()
    pop, push = heapq.heappop, heapq.heappush
    for u in order:
        s_u, t_u = samples[u], tokens[u]
        skipped = []
        placed = False
        while heap:
            load, r = pop(heap)
            if free[r] >= s_u and used[r] + t_u <= capacity:
                ranks[r].append(u)
                free[r] -= s_u
                used[r] += t_u
                if free[r]:
                    push(heap, (load + weight[u], r))
                placed = True
                break
            skipped.append((load, r))
        for item in skipped:
            push(heap, item)
        if not placed:
            return None
    return ranks if not any(free) else None


def _fill_counts(inp: StepInput, ranks: List[List[int]], m: int, capacity: int) -> bool:
    """Move the lightest units from ranks with more than ``m`` samples to ranks with fewer."""
    if is_small(inp.unit_count.size):
        counts = inp.unit_lists.items
        if all(sum([counts[u] for u in r]) >= m for r in ranks):
            return True  # no rank is short: nothing to move (what the loop below finds, without NumPy)
    cnt = np.array([inp.unit_count[r].sum() if r else 0 for r in ranks], dtype=np.int64)
    used = np.array([inp.unit_tokens[r].sum() if r else 0 for r in ranks], dtype=np.int64)
    for r in np.flatnonzero(cnt < m):
        while cnt[r] < m:
            best = None
            for d in np.argsort(-(cnt - m), kind="stable"):
                surplus = cnt[d] - m
                if surplus <= 0:
                    break
                for u in ranks[d]:
                    c = inp.unit_count[u]
                    if c <= surplus and used[r] + inp.unit_tokens[u] <= capacity:
                        key = (inp.unit_weight[u], u)
                        if best is None or key < best[0]:
                            best = (key, d, u)
                if best is not None:
                    break
            if best is None:
                return False
            _, d, u = best
            ranks[d].remove(u)
            ranks[r].append(u)
            cnt[d] -= inp.unit_count[u]
            cnt[r] += inp.unit_count[u]
            used[d] -= inp.unit_tokens[u]
            used[r] += inp.unit_tokens[u]
    return True


# ============================================================================================ phase 2: refinement
# Every rule below has ONE definition in words (the docstring of the function a caller uses: refine_ranks,
# pair_exchange, global_exchange), and two implementations next to each other when a small step runs it in plain
# Python: ``*_lists`` over Python lists and ``*_arrays`` over NumPy arrays -- the same candidates in the same order,
# the same float64 arithmetic, the same tie-breaks (tests/test_planner_fast_paths.py proves them equal).

#: at most this many candidate pairs: the global exchange search runs in plain Python (:func:`_global_lists`)
SMALL_GLOBAL = 256
#: at most this many units on the two ranks: the pair exchange search runs in plain Python (:func:`_pair_lists`)
SMALL_PAIR = 24


@dataclass
class UnitColumns:
    """What the exchange searches read of each unit, as Python lists or as NumPy arrays: its balancing
    ``weight``, the slot ``tokens`` it charges to its rank's capacity, the ``items`` (micro-batch members) it
    brings, and -- only under ``equal_samples``, where an exchange must keep every rank's samples -- its
    ``samples`` (``None`` otherwise: moves allowed)."""

    weight: Sequence
    tokens: Sequence
    items: Sequence
    samples: Optional[Sequence]

    @classmethod
    def of(cls, inp: StepInput, as_lists: bool) -> "UnitColumns":
        if as_lists:
            weight, tokens, items, samples = inp.unit_lists
        else:
            weight, tokens, items, samples = inp.unit_weight, inp.unit_tokens, inp.unit_count, inp.unit_samples
        return cls(weight, tokens, items, samples if inp.equal_samples else None)


@dataclass
class RankState:
    """The ranks while refining: each rank's ``units`` and its ``load`` (sum of unit weights), ``used`` tokens
    and ``items`` (Python lists for a small step, else NumPy arrays), with the token ``capacity`` of a rank and
    the ``m`` items every rank must keep (one per micro-batch)."""

    units: List[List[int]]
    load: Sequence
    used: Sequence
    items: Sequence
    capacity: int
    m: int

    def apply(self, a: int, b: int, x: int, y: Optional[int], cols: UnitColumns) -> None:
        """Move unit ``x`` from rank ``a`` to ``b`` and, if ``y`` is given, unit ``y`` from ``b`` to ``a``."""
        self.units[a].remove(x)
        self.units[b].append(x)
        d_weight, d_tokens, d_items = cols.weight[x], cols.tokens[x], cols.items[x]
        if y is not None:
            self.units[b].remove(y)
            self.units[a].append(y)
            d_weight, d_tokens, d_items = (cols.weight[x] - cols.weight[y], cols.tokens[x] - cols.tokens[y],
                                           cols.items[x] - cols.items[y])
        self.load[a] -= d_weight
        self.load[b] += d_weight
        self.used[a] -= d_tokens
        self.used[b] += d_tokens
        self.items[a] -= d_items
        self.items[b] += d_items


def refine_ranks(inp: StepInput, ranks: List[List[int]], m: int, max_rounds: int, rtol: float = 1e-4,
                 global_pairs: int = 1_000_000) -> None:
    """Phase 2: in place, shrink the heaviest rank by moving or swapping one unit with a light rank.

    Cheap first: the heaviest rank against each of the four lightest, the exchange closest to half their gap
    (:func:`pair_exchange`). When that stalls (units large relative to the gap, e.g. few samples per rank), one
    search over every other rank and every unit finds the exchange that lowers the heaviest rank the most while
    keeping its partner below it (:func:`global_exchange`); those searches stop before they would exceed
    ``global_pairs`` candidate pairs in all (bounded time and memory: on large steps, where pairwise exchanges
    suffice, they do not run).

    A step of at most :data:`~megatron_dynbatch.core.smallops.SMALL_STEP` units keeps the rank loads in Python
    lists (sums and mean in NumPy's order, :func:`~megatron_dynbatch.core.smallops.np_sum`; first maximum and
    stable order as ``argmax`` / ``argsort``); small searches run in plain Python. Same exchanges either way.
    """
    dp = len(ranks)
    if dp < 2:
        return
    small = is_small(inp.unit_weight.size)
    cols = UnitColumns.of(inp, as_lists=small)
    weight, tokens, items = cols.weight, cols.tokens, cols.items
    if small:
        state = RankState(ranks, [np_sum([weight[u] for u in r]) for r in ranks],
                          [sum([tokens[u] for u in r]) for r in ranks], [sum([items[u] for u in r]) for r in ranks],
                          m * inp.cap, m)
        mean = np_sum(state.load) / dp
    else:
        state = RankState(ranks, np.array([weight[r].sum() if r else 0.0 for r in ranks]),
                          np.array([tokens[r].sum() if r else 0 for r in ranks], dtype=np.int64),
                          np.array([items[r].sum() if r else 0 for r in ranks], dtype=np.int64), m * inp.cap, m)
        mean = state.load.mean()
    if mean <= 0:
        return
    load = state.load
    global_left = global_pairs
    for _ in range(max_rounds):
        a = load.index(max(load)) if small else int(np.argmax(load))
        if load[a] - mean <= rtol * mean:
            return
        lightest = sorted(range(dp), key=load.__getitem__) if small else np.argsort(load, kind="stable").tolist()
        found = None
        for b in lightest[: min(4, dp - 1)]:
            if b != a:
                found = pair_exchange(state, a, b, inp, small)
                if found is not None:
                    x, y = found
                    break
        if found is None:
            cost = len(ranks[a]) * len(weight)  # candidate pairs the vectorised search builds
            if cost > global_left or not ranks[a]:
                return
            found = global_exchange(state, a, inp, cost)
            if found is None:
                return
            x, y, b = found
            global_left -= cost
        state.apply(a, b, x, y, cols)


# -------------------------------------------------------------------------------------------- global exchange
def global_exchange(state: RankState, a: int, inp: StepInput, cost: int):
    """The best single move or swap between rank ``a`` and any other rank, ``(x, y, b)`` (unit ``x`` of ``a``
    goes to rank ``b``; unit ``y`` of ``b`` comes back, or ``None`` for a move) or ``None``: among the exchanges
    that keep both ranks within the token capacity and at ``>= m`` items (under ``equal_samples`` only swaps of
    units with equal sample counts, and no moves), the one whose new maximum of the two ranks' loads is
    smallest, and below ``load[a]`` (it must lower rank ``a``). Candidates are compared in a fixed order -- moves
    by (unit of ``a``, rank), then swaps by (unit of ``a``, unit of another rank in rank order) -- and the first
    of equal maxima wins. Up to :data:`SMALL_GLOBAL` candidate pairs (``cost``) in plain Python
    (:func:`_global_lists`), else vectorised (:func:`_global_arrays`)."""
    bound = state.load[a] * (1 - 1e-12)  # an exchange must lower rank a's load
    if cost <= SMALL_GLOBAL:
        return _global_lists(state.units, a, float(bound), load=_as_list(state.load), used=_as_list(state.used),
                             items=_as_list(state.items), capacity=state.capacity, m=state.m,
                             cols=UnitColumns.of(inp, as_lists=True))
    return _global_arrays(state.units, a, bound, load=np.asarray(state.load),
                          used=np.asarray(state.used, dtype=np.int64), items=np.asarray(state.items, dtype=np.int64),
                          capacity=state.capacity, m=state.m, cols=UnitColumns.of(inp, as_lists=False))


def _as_list(values):
    """Python list of ``values`` (a list already, a NumPy array or None)."""
    return values.tolist() if isinstance(values, np.ndarray) else values


def _global_arrays(ranks, a, bound, *, load, used, items, capacity, m, cols: UnitColumns):
    """:func:`global_exchange` vectorised over (unit of ``a``, rank or unit of another rank)."""
    weight, tokens, unit_items, samples = cols.weight, cols.tokens, cols.items, cols.samples
    ua = np.asarray(ranks[a], dtype=np.int64)
    others = [(b, u) for b, units in enumerate(ranks) if b != a for u in units]
    la = load[a]
    best = (bound, None)
    # Moves a -> b for every rank b.
    bs = np.array([b for b in range(len(ranks)) if b != a], dtype=np.int64)
    new_max = np.maximum(la - weight[ua][:, None], load[bs][None, :] + weight[ua][:, None])
    ok = ((used[bs][None, :] + tokens[ua][:, None] <= capacity) & (items[a] - unit_items[ua] >= m)[:, None]
          & (weight[ua][:, None] > 0) & (samples is None))
    new_max = np.where(ok, new_max, np.inf)
    if new_max.size:
        i, j = np.unravel_index(int(np.argmin(new_max)), new_max.shape)
        if new_max[i, j] < best[0]:
            best = (new_max[i, j], (int(ua[i]), None, int(bs[j])))
    if others:
        yb = np.array([b for b, _ in others], dtype=np.int64)
        yu = np.array([u for _, u in others], dtype=np.int64)
        delta = weight[ua][:, None] - weight[yu][None, :]
        lb = load[yb][None, :]
        new_max = np.maximum(la - delta, lb + delta)
        ok = ((delta > 0)
              & (used[yb][None, :] - tokens[yu][None, :] + tokens[ua][:, None] <= capacity)
              & (used[a] - tokens[ua][:, None] + tokens[yu][None, :] <= capacity)
              & (items[a] - unit_items[ua][:, None] + unit_items[yu][None, :] >= m)
              & (items[yb][None, :] - unit_items[yu][None, :] + unit_items[ua][:, None] >= m))
        if samples is not None:
            ok &= samples[ua][:, None] == samples[yu][None, :]
        new_max = np.where(ok, new_max, np.inf)
        i, j = np.unravel_index(int(np.argmin(new_max)), new_max.shape)
        if new_max[i, j] < best[0]:
            best = (new_max[i, j], (int(ua[i]), int(yu[j]), int(yb[j])))
    return best[1]


def _global_lists(ranks, a, bound, *, load, used, items, capacity, m, cols: UnitColumns):
    """:func:`global_exchange` in plain Python over lists: the candidates in the same (row-major) order and a
    running minimum with ``<`` from ``bound`` -- what "``argmin``, kept if below the best so far" selects."""
    weight, tokens, unit_items, samples = cols.weight, cols.tokens, cols.items, cols.samples
    la, used_a, items_a = load[a], used[a], items[a]
    best_max, best = bound, None
    if samples is None:  # moves a -> b
        for x in ranks[a]:
            wx = weight[x]
            if not (items_a - unit_items[x] >= m and wx > 0):
                continue
            for b in range(len(ranks)):
                if b != a and used[b] + tokens[x] <= capacity:
                    new_max = max(la - wx, load[b] + wx)
                    if new_max < best_max:
                        best_max, best = new_max, (x, None, b)
    others = [(b, y) for b, units in enumerate(ranks) if b != a for y in units]
    for x in ranks[a]:  # swaps: x of a for y of b
        wx, tx, cx = weight[x], tokens[x], unit_items[x]
        for b, y in others:
            delta = wx - weight[y]
            if (delta > 0 and used[b] - tokens[y] + tx <= capacity and used_a - tx + tokens[y] <= capacity
                    and items_a - cx + unit_items[y] >= m and items[b] - unit_items[y] + cx >= m
                    and (samples is None or samples[x] == samples[y])):
                new_max = max(la - delta, load[b] + delta)
                if new_max < best_max:
                    best_max, best = new_max, (x, y, b)
    return best


# ---------------------------------------------------------------------------------------------- pair exchange
def pair_exchange(state: RankState, a: int, b: int, inp: StepInput, small: bool):
    """Move one unit from rank ``a`` to ``b``, or swap a unit of ``a`` with a lighter one of ``b``: the exchange
    ``(x, y)`` (``y`` None for a move) whose weight change is closest to half their gap (``load[a] - load[b]``), if
    it shrinks the gap (closer than half of it), within both ranks' token capacity and ``>= m`` items (under
    ``equal_samples``: swaps of equal sample counts only), else None. Moves first, then for each unit ``x`` of
    ``a`` the two units of ``b`` whose weights are nearest below and above ``weight[x] - gap / 2`` (a binary
    search over ``b`` sorted by weight, stably); the first of equal deviations wins. Small steps and pairs of up
    to :data:`SMALL_PAIR` units search in plain Python (:func:`_pair_lists`), others vectorised
    (:func:`_pair_arrays`)."""
    gap = state.load[a] - state.load[b]
    if gap <= 0:
        return None
    query = dict(gap=float(gap), used_a=int(state.used[a]), used_b=int(state.used[b]),
                 items_a=int(state.items[a]), items_b=int(state.items[b]), capacity=state.capacity, m=state.m)
    if small or len(state.units[a]) + len(state.units[b]) <= SMALL_PAIR:
        return _pair_lists(state.units[a], state.units[b], **query, cols=UnitColumns.of(inp, as_lists=True))
    return _pair_arrays(state.units[a], state.units[b], **query, cols=UnitColumns.of(inp, as_lists=False))


def _pair_arrays(units_a, units_b, *, gap, used_a, used_b, items_a, items_b, capacity, m, cols: UnitColumns):
    """:func:`pair_exchange` vectorised over units: a move of ``x`` changes the pair maximum to
    ``max(La - x, Lb + x)``, best at ``x = gap / 2``, and for a swap each unit of ``a`` binary-searches ``b``'s
    units (by weight) for the partner closest to ``wa - gap / 2``."""
    weight, tokens, unit_items, samples = cols.weight, cols.tokens, cols.items, cols.samples
    ua = np.asarray(units_a, dtype=np.int64)
    ub = np.asarray(units_b, dtype=np.int64)
    best_dev, best = np.inf, None
    wa = weight[ua]
    ok = ((wa > 0) & (wa < gap) & (used_b + tokens[ua] <= capacity) & (items_a - unit_items[ua] >= m)
          & (samples is None))
    if ok.any():
        dev = np.where(ok, np.abs(wa - gap / 2), np.inf)
        i = int(np.argmin(dev))
        best_dev, best = dev[i], (ua[i], None)
    if ub.size:
        ord_b = np.argsort(weight[ub], kind="stable")
        wb_sorted = weight[ub][ord_b]
        pos = np.searchsorted(wb_sorted, wa - gap / 2)
        for shift in (0, -1):
            j = np.clip(pos + shift, 0, ub.size - 1)
            cand_b = ub[ord_b[j]]
            delta = wa - weight[cand_b]
            ok = ((delta > 0) & (delta < gap)
                  & (used_b - tokens[cand_b] + tokens[ua] <= capacity)
                  & (used_a - tokens[ua] + tokens[cand_b] <= capacity)
                  & (items_a - unit_items[ua] + unit_items[cand_b] >= m)
                  & (items_b - unit_items[cand_b] + unit_items[ua] >= m))
            if samples is not None:
                ok &= samples[ua] == samples[cand_b]
            if ok.any():
                dev = np.where(ok, np.abs(delta - gap / 2), np.inf)
                i = int(np.argmin(dev))
                if dev[i] < best_dev:
                    best_dev, best = dev[i], (ua[i], cand_b[i])
    if best is None or best_dev >= gap / 2:
        return None
    return int(best[0]), None if best[1] is None else int(best[1])


def _pair_lists(units_a, units_b, *, gap, used_a, used_b, items_a, items_b, capacity, m, cols: UnitColumns):
    """:func:`pair_exchange` in plain Python over lists: the same candidates in the same order (moves, then the
    swaps of both binary-search neighbours), the same float64 arithmetic (Python floats are IEEE doubles, as
    NumPy's) and ``bisect_left`` for ``searchsorted``; NumPy's "``argmin`` of each candidate set, kept if strictly
    better" is a running minimum with ``<``, which keeps the first of equal deviations the same way."""
    weight, tokens, unit_items, samples = cols.weight, cols.tokens, cols.items, cols.samples
    half = gap / 2
    best_dev, best = math.inf, None
    if samples is None:  # moves a -> b
        for x in units_a:
            wx = weight[x]
            if 0 < wx < gap and used_b + tokens[x] <= capacity and items_a - unit_items[x] >= m:
                dev = abs(wx - half)
                if dev < best_dev:
                    best_dev, best = dev, (x, None)
    if units_b:  # swaps: x of a for y of b
        ord_b = sorted(units_b, key=weight.__getitem__)  # stable, as argsort(kind="stable")
        wb_sorted = [weight[y] for y in ord_b]
        last = len(ord_b) - 1
        pos = [bisect.bisect_left(wb_sorted, weight[x] - half) for x in units_a]
        for shift in (0, -1):
            for x, p in zip(units_a, pos, strict=True):
                j = p + shift
                y = ord_b[0 if j < 0 else last if j > last else j]
                delta = weight[x] - weight[y]
                if (0 < delta < gap and used_b - tokens[y] + tokens[x] <= capacity
                        and used_a - tokens[x] + tokens[y] <= capacity
                        and items_a - unit_items[x] + unit_items[y] >= m
                        and items_b - unit_items[y] + unit_items[x] >= m
                        and (samples is None or samples[x] == samples[y])):
                    dev = abs(delta - half)
                    if dev < best_dev:
                        best_dev, best = dev, (x, y)
    if best is None or best_dev >= half:
        return None
    return best


# ============================================================================================ phase 3: micro-batches
def _items_heaviest_first(samples: Sequence[int], inp: StepInput) -> Tuple[List[int], List[int], List[int],
                                                                           List[float]]:
    """``(oversize, normal, needs, weights)`` of a rank's items: its over-budget items in the given order, the
    others by decreasing weight, then slot tokens, then index (:func:`_desc_order`), with their slot tokens and
    weights. A small rank in plain Python over the step's lists (:func:`_desc_order_of`; NumPy's call overhead
    would dominate), others in NumPy: the same lists."""
    if is_small(len(samples)):
        aligned, weight, oversize = inp.item_lists
        over = [int(i) for i in samples if oversize[i]]
        normal = _desc_order_of([int(i) for i in samples if not oversize[i]], weight, aligned)
        return over, normal, [aligned[i] for i in normal], [weight[i] for i in normal]
    samples = np.asarray(samples, dtype=np.int64)
    normal_arr = samples[~inp.oversize[samples]]
    normal_arr = normal_arr[_desc_order(inp.weight[normal_arr], inp.aligned[normal_arr])]
    return (samples[inp.oversize[samples]].tolist(), normal_arr.tolist(), inp.aligned[normal_arr].tolist(),
            inp.weight[normal_arr].tolist())


def pack_rank(samples: Sequence[int], inp: StepInput, m: int) -> Optional[List[List[int]]]:
    """Phase 3: exactly ``m`` non-empty micro-batches of ``samples`` within the cap, or ``None``."""
    over, normal, needs, weights = _items_heaviest_first(samples, inp)
    k = m - len(over)
    if k < 0 or (k == 0 and normal) or len(normal) < k:
        return None
    bins: List[List[int]] = [[i] for i in over]
    if k == 0:
        return bins
    packed = _lpt_bins(normal, needs, weights, k, inp.cap)
    if packed is None:
        packed = _best_fit_bins(np.asarray(normal, dtype=np.int64), inp.aligned, k, inp.cap)
        if packed is None:
            return None
    return bins + packed


#: full bins the LPT packer may pop per item on average (and per pass at most) before it asks the room index
SKIPS_PER_ITEM = 16
MAX_SKIPS = 200_000
#: full bins popped per item once that allowance is spent
SKIP_LIMIT = 4


def _lpt_bins(items: List[int], needs: List[int], weights: List[float], k: int,
              cap: int) -> Optional[List[List[int]]]:
    """Each item (heaviest first; ``needs`` and ``weights`` are its slot tokens and weight) into the least-loaded
    bin with room for it. Popping full bins to find it is
    paid from an allowance of ``SKIPS_PER_ITEM`` per item, ``MAX_SKIPS`` per pass (real workloads use 0-4 per
    item); once spent, an item that
    meets ``SKIP_LIMIT`` full bins goes to the bin with the most room (a lazy max-heap on room), and a count
    fails at once when not even that bin fits the item -- so one pass is ``O(n log k)`` however full bins get."""
    bins: List[List[int]] = [[] for _ in range(k)]
    used = [0] * k
    load = [0.0] * k
    count = [0] * k
    version = [0] * k
    heap = [(0.0, 0, b, 0) for b in range(k)]
    # max-heap on room, built only once an item needs it (most passes never do); an entry is current iff it
    # matches used[b], and its top is the bin with the most room, lowest index on ties, however it was built
    rooms: Optional[list] = None
    pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
    allowance = min(SKIPS_PER_ITEM * len(items), MAX_SKIPS)
    for i, need, w in zip(items, needs, weights, strict=True):
        skipped = []
        target = -1
        limit = max(SKIP_LIMIT, allowance)
        while heap and len(skipped) < limit:
            entry = heap[0]  # peek: the bin found stays on top, and one heapreplace below updates it
            b = entry[2]
            if entry[3] != version[b]:
                pop(heap)
                continue  # stale: the bin was filled through the room index
            if used[b] + need <= cap:
                target = b
                break
            skipped.append(pop(heap))
        used_rooms = target < 0
        if used_rooms:
            if rooms is None:
                rooms = [(u - cap, b) for b, u in enumerate(used)]
                heapq.heapify(rooms)
            while rooms and -rooms[0][0] != cap - used[rooms[0][1]]:
                pop(rooms)
            if not rooms or -rooms[0][0] < need:
                return None
            target = rooms[0][1]
            version[target] += 1  # its entry in ``heap`` (if still there) is now stale
        allowance -= len(skipped)
        bins[target].append(i)
        used[target] += need
        load[target] += w
        count[target] += 1
        entry = (load[target], count[target], target, version[target])
        if used_rooms:
            push(heap, entry)
        else:
            replace(heap, entry)  # pops the target's old entry (the top) and pushes its new one
        for old in skipped:
            push(heap, old)
        if rooms is not None:
            push(rooms, (used[target] - cap, target))
    return bins


def _best_fit_bins(items: np.ndarray, aligned, k: int, cap: int) -> Optional[List[List[int]]]:
    """Best-fit decreasing on tokens (the feasibility fallback): each item into the bin with the least room
    that still holds it (lowest index on ties), then bins are split so none is empty. ``O(n log k)``: bins
    are indexed by their room value (a sorted list of distinct rooms, a heap of bins per room)."""
    order = items[np.lexsort((items, -aligned[items]))]
    bins: List[List[int]] = [[] for _ in range(k)]
    distinct = [cap]                      # distinct room values, ascending
    holders = {cap: list(range(k))}       # room -> heap of bin indices
    for i, need in zip(order.tolist(), aligned[order].tolist(), strict=True):
        j = bisect.bisect_left(distinct, need)
        if j == len(distinct):
            return None
        room = distinct[j]
        heap = holders[room]
        b = heapq.heappop(heap)
        if not heap:
            del holders[room]
            distinct.pop(j)
        bins[b].append(i)
        left = room - need
        same = holders.get(left)
        if same is None:
            holders[left] = [b]
            bisect.insort(distinct, left)
        else:
            heapq.heappush(same, b)
    return bins if _fill_empty_bins(bins) else None


def best_fit_bin_count(sizes: np.ndarray, cap: int) -> int:
    """Bins best-fit decreasing opens for ``sizes`` (each ``<= cap``) with no limit on bins. Best fit into
    ``K`` empty bins opens a fresh bin only when no used one fits, exactly as here, so it succeeds iff this
    count is ``<= K``: one ``O(n log n)`` pass answers "does BFD fit" for every count at once."""
    distinct: List[int] = []              # distinct room values of open bins, ascending
    holders: dict = {}                    # room -> number of open bins with that room
    opened = 0
    for need in np.sort(np.asarray(sizes, dtype=np.int64))[::-1].tolist():
        j = bisect.bisect_left(distinct, need)
        if j == len(distinct):
            opened += 1
            room = cap
        else:
            room = distinct[j]
            holders[room] -= 1
            if not holders[room]:
                del holders[room]
                distinct.pop(j)
        left = room - need
        if left in holders:
            holders[left] += 1
        else:
            holders[left] = 1
            bisect.insort(distinct, left)
    return opened


def _fill_empty_bins(bins: List[List[int]]) -> bool:
    """In place: each empty bin (in index order) takes the last item of the bin with the most items (lowest
    index on ties); ``False`` when no bin has two items to give."""
    empty = [b for b, items in enumerate(bins) if not items]
    if not empty:
        return True
    donors = [(-len(items), b) for b, items in enumerate(bins) if len(items) > 1]
    heapq.heapify(donors)
    for b in empty:
        if not donors:
            return False
        _, d = heapq.heappop(donors)
        bins[b].append(bins[d].pop())
        if len(bins[d]) > 1:
            heapq.heappush(donors, (-len(bins[d]), d))
    return True


def plan_global_bins(inp: StepInput, dp: int, m: int) -> Optional[List[List[List[int]]]]:
    """Lockstep variant (expert parallelism): pack all samples into ``dp * m`` even micro-batches, then deal
    them out by size tier, so the ``j``-th micro-batches of all ranks are alike (each rank gets one bin of
    every tier of ``dp`` bins). Only for ungrouped samples."""
    bins = pack_rank(np.arange(inp.aligned.size), inp, dp * m)
    return None if bins is None else deal_by_tier(bins, inp, dp, m)


def deal_by_tier(bins: List[List[int]], inp: StepInput, dp: int, m: int) -> List[List[List[int]]]:
    """``dp * m`` non-empty bins of an ungrouped step -> ``m`` per rank: bins by decreasing weight in tiers of
    ``dp``, each rank one bin of every tier (any such dealing is a valid plan; this one evens the ranks)."""
    loads = np.array([inp.weight[b].sum() for b in bins])
    order = np.lexsort((np.arange(loads.size), -loads))
    out: List[List[List[int]]] = [[] for _ in range(dp)]
    for tier in range(m):
        tier_bins = order[tier * dp:(tier + 1) * dp]
        # Snake the tiers so the small remainders of each tier do not pile on the same ranks.
        ranks = range(dp) if tier % 2 == 0 else range(dp - 1, -1, -1)
        for r, b in zip(ranks, tier_bins, strict=True):
            out[r].append(bins[b])
    return out


def plan_for_count(inp: StepInput, dp: int, m: int, refine_rounds: int) -> Optional[List[List[List[int]]]]:
    """All three phases for one ``m``: per rank, ``m`` micro-batches of local sample indices, or ``None``."""
    ranks = assign_ranks(inp, dp, m)
    if ranks is None:
        return None
    refine_ranks(inp, ranks, m, refine_rounds)
    out = []
    for units in ranks:
        bins = pack_rank(units if inp.singletons else inp.members(units), inp, m)  # a unit is an item, or a group
        if bins is None:
            return None
        out.append(bins)
    return out


def split_bins(bins: List[List[int]], target: int, aligned: np.ndarray) -> bool:
    """In place: grow ``bins`` to ``target`` micro-batches by splitting the one with the most slot tokens among
    those holding several items into two token-balanced halves (largest item first, each to the lighter half).
    A half is a subset of its micro-batch, so no split breaks the cap. ``False`` if fewer than ``target`` items."""
    if sum(len(b) for b in bins) < target:
        return False
    heap = [(-int(aligned[b].sum()), j) for j, b in enumerate(bins) if len(b) > 1]
    heapq.heapify(heap)
    while len(bins) < target:
        _, j = heapq.heappop(heap)
        halves: List[List[int]] = [[], []]
        sums = [0, 0]
        for i in sorted(bins[j], key=lambda x: (-int(aligned[x]), x)):
            h = 0 if sums[0] <= sums[1] else 1
            halves[h].append(i)
            sums[h] += int(aligned[i])
        bins[j] = halves[0]
        bins.append(halves[1])
        for k in (j, len(bins) - 1):
            if len(bins[k]) > 1:
                heapq.heappush(heap, (-int(aligned[bins[k]].sum()), k))
    return True
