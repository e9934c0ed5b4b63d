"""The peers' partitioning and packing primitives, one copy each (pure Python + NumPy; deterministic, ties
break on indices):

* :func:`karmarkar_karp` (k-way largest differencing) -- verl's ``get_seqlen_balanced_partitions`` and slime's
  rank assignment; the verl and slime drop-ins (:mod:`megatron_dynbatch.core.dropin`) keep that contract;
* :func:`first_fit`, :func:`split_largest_bins` -- slime's micro-batch packing and its count alignment;
* :func:`modified_first_fit_decreasing`, :func:`adjust_bin_count` -- NeMo-RL's packer and its bin-count rule;
* :func:`next_fit_packs` -- Megatron-Core's ``DpBalancedScheduler`` packing in loader order.

Each re-implements, from public descriptions (cited per function), a step of a peer's batching. Two users: the
benchmark's models of the peers (:mod:`megatron_dynbatch.bench.baselines`, which re-exports these names from
:mod:`megatron_dynbatch.bench.partitioning`) and the planner's portfolio (:mod:`.planner.portfolio`), which
scores the peers' cap-safe heuristics under the planner's own rules.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Callable, List, Sequence

import numpy as np

from .errors import DynBatchConfigError

__all__ = ["PartitionInfeasible", "adjust_bin_count", "first_fit", "karmarkar_karp", "modified_first_fit_decreasing",
           "next_fit_packs", "split_largest_bins"]


class PartitionInfeasible(RuntimeError):
    """A partitioning step cannot do what it is asked (an item over the bin capacity, too few items for the
    bins); the benchmark calls it ``BaselineInfeasible``: the modelled system would refuse the batch."""


def karmarkar_karp(weights: Sequence[float], k: int, equal_size: bool = False) -> List[List[int]]:
    """k-way largest differencing method (Karmarkar & Karp 1982; k-way form as described on Wikipedia's
    "Largest differencing method" page, which verl's and slime's ``get_seqlen_balanced_partitions`` cite).

    Every item starts as a *state* of ``k`` sets (the item alone, the rest empty); the two states with the
    largest spread (max set sum - min set sum) are merged repeatedly, pairing the heaviest set of one with the
    lightest of the other, until one state remains. Sets of equal sum are ordered fullest first, so ties (zero
    weights, equal lengths) spread items instead of stacking them: with ``n >= k`` non-negative weights no set
    ends empty (verl's contract; its own implementation breaks ties by item count too). With ``equal_size`` the
    initial states are ``k`` consecutive items of the ascending order, one per set, so every final set holds
    ``n / k`` items (when ``k`` does not divide ``n``, zero-weight placeholders make up the difference and are
    dropped, so sizes differ by at most one).

    Implementation: a set is a singly linked list over the items (head/tail arrays), so merging two states is
    ``O(k log k)`` vectorised work regardless of how many items they hold; a heap orders states by
    ``(-spread, -largest sum, creation id)``, which makes the result deterministic. Returns ``k`` lists of item
    indices (each ascending), heaviest set first; sets are empty only when ``n < k`` (or with negative weights).
    """
    w = np.asarray(weights, dtype=np.float64)
    n = w.size
    if k < 1:
        raise DynBatchConfigError("k", k, "must be >= 1", "ask for at least one partition")
    if k == 1:
        return [list(range(n))]
    if k <= SMALL_K:
        return _karmarkar_karp_lists(w, k, equal_size)
    nxt = np.full(n + k, -1, dtype=np.int64)  # linked lists; indices >= n are zero-weight placeholders
    heap: list = []
    counter = 0

    def push(sums: np.ndarray, sizes: np.ndarray, heads: np.ndarray, tails: np.ndarray) -> None:
        nonlocal counter
        order = np.lexsort((np.arange(k), -sizes, -sums))  # heaviest first, then fullest, then by position
        sums, sizes, heads, tails = sums[order], sizes[order], heads[order], tails[order]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), -sums[0], counter, sums, sizes, heads, tails))
        counter += 1

    order = np.lexsort((np.arange(n), w))  # ascending weight, ties by index
    if equal_size:
        pad = (-n) % k
        items = np.concatenate([np.arange(n, n + pad, dtype=np.int64), order])  # placeholders weigh 0: first
        for start in range(0, items.size, k):
            chunk = items[start:start + k]
            sums = np.array([w[i] if i < n else 0.0 for i in chunk])
            push(sums, np.ones(k, dtype=np.int64), chunk.copy(), chunk.copy())
    else:
        for i in order:
            sums = np.zeros(k)
            sums[0] = w[i]
            sizes = np.zeros(k, dtype=np.int64)
            sizes[0] = 1
            heads = np.full(k, -1, dtype=np.int64)
            heads[0] = i
            push(sums, sizes, heads, heads.copy())
    while len(heap) > 1:
        a = heapq.heappop(heap)
        b = heapq.heappop(heap)
        sa, za, ha, ta = a[3], a[4], a[5], a[6]
        sb, zb, hb, tb = b[3][::-1], b[4][::-1], b[5][::-1], b[6][::-1]  # heaviest of a meets lightest of b
        both = (ha >= 0) & (hb >= 0)
        nxt[ta[both]] = hb[both]
        heads = np.where(ha >= 0, ha, hb)
        tails = np.where(tb >= 0, tb, ta)
        push(sa + sb, za + zb, heads, tails)
    if not heap:
        return [[] for _ in range(k)]
    heads = heap[0][5]
    out: List[List[int]] = []
    for h in heads:
        members = []
        i = int(h)
        while i >= 0:
            if i < n:
                members.append(i)
            i = int(nxt[i])
        out.append(sorted(members))
    return out


#: :func:`karmarkar_karp` with at most this many sets runs in plain Python (:func:`_karmarkar_karp_lists`): a merge
#: of two states is then a few list operations, where NumPy's call overhead per merge would dominate
SMALL_K = 32


def _karmarkar_karp_lists(w: np.ndarray, k: int, equal_size: bool) -> List[List[int]]:
    """:func:`karmarkar_karp` in plain Python lists: the same states, the same float64 sums added in the same
    order, the same sort keys and heap keys, so the same partition (``tests/test_planner_fast_paths.py``)."""
    n = w.size
    wl = w.tolist()
    nxt = [-1] * (n + k)
    heap: list = []
    counter = 0
    positions = range(k)

    def push(sums: list, sizes: list, heads: list, tails: list) -> None:
        nonlocal counter
        order = sorted(positions, key=lambda p: (-sums[p], -sizes[p], p))
        sums = [sums[p] for p in order]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), -sums[0], counter, sums, [sizes[p] for p in order],
                              [heads[p] for p in order], [tails[p] for p in order]))
        counter += 1

    order = np.lexsort((np.arange(n), w)).tolist()  # ascending weight, ties by index
    if equal_size:
        items = list(range(n, n + (-n) % k)) + order  # placeholders weigh 0: first
        for start in range(0, len(items), k):
            chunk = items[start:start + k]
            push([wl[i] if i < n else 0.0 for i in chunk], [1] * k, chunk, list(chunk))
    else:
        rest_sums, rest_sizes, rest_heads = [0.0] * (k - 1), [0] * (k - 1), [-1] * (k - 1)
        for i in order:
            push([wl[i]] + rest_sums, [1] + rest_sizes, [i] + rest_heads, [i] + rest_heads)
    while len(heap) > 1:
        _, _, _, sa, za, ha, ta = heapq.heappop(heap)
        _, _, _, sb, zb, hb, tb = heapq.heappop(heap)
        sb, zb, hb, tb = sb[::-1], zb[::-1], hb[::-1], tb[::-1]  # heaviest of a meets lightest of b
        for p in positions:
            if ha[p] >= 0 and hb[p] >= 0:
                nxt[ta[p]] = hb[p]
        push([x + y for x, y in zip(sa, sb, strict=True)], [x + y for x, y in zip(za, zb, strict=True)],
             [x if x >= 0 else y for x, y in zip(ha, hb, strict=True)],
             [y if y >= 0 else x for x, y in zip(ta, tb, strict=True)])
    if not heap:
        return [[] for _ in range(k)]
    out: List[List[int]] = []
    for i in heap[0][5]:
        members = []
        while i >= 0:
            if i < n:
                members.append(i)
            i = nxt[i]
        out.append(sorted(members))
    return out


def first_fit(sizes: Sequence[int], cap: int) -> List[List[int]]:
    """First-fit in the given order: each item goes to the first open bin with room, else opens a new one.
    This is the packer slime documents for ``--use-dynamic-batch-size`` (its help text: lengths 100, 200, 300
    with budget 300 give ``[100, 200], [300]``).
    An item larger than ``cap`` gets a bin of its own. ``O(n log n)``: a tournament tree over the bins holds
    each one's room, and the first bin with room for an item is found by one descent from the root."""
    values = np.asarray(sizes, dtype=np.int64).tolist()
    size = 1
    while size < max(1, len(values)):
        size *= 2
    room = [-1] * (2 * size)  # leaves: a bin's room (-1: no bin yet); inner nodes: the largest room below
    bins: List[List[int]] = []
    for i, s in enumerate(values):
        if room[1] >= s:  # some open bin fits: descend to the leftmost one
            node = 1
            while node < size:
                node = 2 * node if room[2 * node] >= s else 2 * node + 1
            j = node - size
            bins[j].append(i)
        else:
            j = len(bins)
            bins.append([i])
            node = size + j
            room[node] = cap  # an item over the cap leaves a negative room: nothing else joins it
        room[node] -= s
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


def _split_in_two(members: Sequence[int], sizes: np.ndarray) -> List[List[int]]:
    """Split a bin into two halves of similar size: largest items first, each to the lighter half."""
    halves: List[List[int]] = [[], []]
    sums = [0, 0]
    for i in sorted(members, key=lambda m: (-int(sizes[m]), m)):
        h = 0 if sums[0] <= sums[1] else 1
        halves[h].append(i)
        sums[h] += int(sizes[i])
    return halves


def split_largest_bins(bins: List[List[int]], target: int, sizes: Sequence[int]) -> List[List[int]]:
    """Grow ``bins`` to ``target`` bins by splitting the largest splittable bin in two (token-balanced halves;
    the first half stays in place, the second is appended). Stops early when every bin holds one item.
    Models slime's alignment of the micro-batch count to a multiple of ``dp`` (x ``N`` under VPP), which never
    creates a bin larger than an existing one."""
    s = np.asarray(sizes, dtype=np.int64)
    out = [list(b) for b in bins]
    while len(out) < target:
        cands = [(int(s[b].sum()), j) for j, b in enumerate(out) if len(b) > 1]
        if not cands:
            break
        _, j = max(cands)
        left, right = _split_in_two(out[j], s)
        out[j] = left
        out.append(right)
    return out


def modified_first_fit_decreasing(sizes: Sequence[int], cap: int) -> List[List[int]]:
    """Modified first-fit decreasing (Johnson & Garey 1985) as NeMo-RL documents its ``modified_first_fit_
    decreasing`` packer: items are *large* (> C/2), *medium* (> C/3), *small* (> C/6) or *tiny*;

    1. one bin per large item (largest first);
    2. forward over those bins: add the largest medium item that fits;
    3. backward over the bins without a medium item: add the smallest small item plus the largest other small
       item that still fits (only if the two smallest fit together);
    4. forward over the bins: repeatedly add the largest remaining item that fits;
    5. the leftovers, largest first, each into the currently least-filled new bin if it fits, else a new bin
       (NeMo-RL's ``O(n log n)`` leftover pass keeps its new bins sorted by fill and tries the emptiest).

    Raises :class:`PartitionInfeasible` for an item larger than ``cap`` (NeMo-RL validates this).
    """
    s = np.asarray(sizes, dtype=np.int64).tolist()
    if s and max(s) > cap:
        raise PartitionInfeasible(f"a sequence of {max(s)} tokens exceeds the bin capacity {cap}")
    idx = range(len(s))
    large = sorted((i for i in idx if s[i] > cap / 2), key=lambda i: (-s[i], i))
    # medium items ascending by (size, -index): the last one that fits is the largest, lowest index on ties
    medium = sorted((i for i in idx if cap / 3 < s[i] <= cap / 2), key=lambda i: (s[i], -i))
    medium_sizes = [s[i] for i in medium]
    small = sorted((i for i in idx if cap / 6 < s[i] <= cap / 3), key=lambda i: (s[i], i))
    small_sizes = [s[i] for i in small]
    tiny = [i for i in idx if s[i] <= cap / 6]
    bins = [[i] for i in large]
    fill = [s[i] for i in large]
    has_medium = [False] * len(bins)
    for b in range(len(bins)):  # phase 2
        pos = bisect.bisect_right(medium_sizes, cap - fill[b]) - 1
        if pos >= 0:
            medium_sizes.pop(pos)
            i = medium.pop(pos)
            bins[b].append(i)
            fill[b] += s[i]
            has_medium[b] = True
    for b in reversed(range(len(bins))):  # phase 3
        if has_medium[b] or len(small) < 2:
            continue
        room = cap - fill[b]
        if small_sizes[0] + small_sizes[1] > room:
            continue
        first = small.pop(0)
        small_sizes.pop(0)
        pos = bisect.bisect_right(small_sizes, room - s[first]) - 1  # the largest that still fits (the two
        second = small.pop(pos)                                      # smallest fit, so some item does)
        small_sizes.pop(pos)
        bins[b] += [first, second]
        fill[b] += s[first] + s[second]
    rest = sorted(medium + small + tiny, key=lambda i: (s[i], -i))  # ascending; pop largest from the end
    rest_sizes = [s[i] for i in rest]
    for b in range(len(bins)):  # phase 4
        while rest:
            pos = bisect.bisect_right(rest_sizes, cap - fill[b]) - 1
            if pos < 0:  # rightmost fitting item: the largest size, lowest index among equals
                break
            bins[b].append(rest.pop(pos))
            fill[b] += rest_sizes.pop(pos)
    new_bins: List[List[int]] = []
    heap: list = []  # (fill, creation id, bin index): the least-filled new bin is on top
    for i in sorted(rest, key=lambda i: (-s[i], i)):  # phase 5
        if heap and s[i] <= cap - heap[0][0]:
            f, cid, j = heapq.heappop(heap)
            new_bins[j].append(i)
            heapq.heappush(heap, (f + s[i], cid, j))
        else:
            new_bins.append([i])
            heapq.heappush(heap, (s[i], len(new_bins) - 1, len(new_bins) - 1))
    # NeMo-RL returns its leftover bins in fill order (least-filled first).
    new_order = [j for _, _, j in sorted(heap)]
    return bins + [new_bins[j] for j in new_order]


def adjust_bin_count(bins: List[List[int]], minimum: int, multiple: int) -> List[List[int]]:
    """Raise the bin count to at least ``minimum`` and to a multiple of ``multiple`` by moving single items
    (the last item of the bin with the most items, among the original bins) into new bins -- how NeMo-RL's
    packer meets its ``min_bin_count`` / ``bin_count_multiple`` (both set to the DP size). Raises
    :class:`PartitionInfeasible` when there are fewer items than bins."""
    target = max(len(bins), minimum)
    if multiple > 1 and target % multiple:
        target += multiple - target % multiple
    if target == len(bins):
        return [list(b) for b in bins]
    total = sum(len(b) for b in bins)
    if total < target:
        raise PartitionInfeasible(f"cannot make {target} non-empty bins from {total} sequences")
    out = [list(b) for b in bins]
    by_count = sorted(((len(b), j) for j, b in enumerate(out)), reverse=True)
    src = 0
    for _ in range(target - len(bins)):
        while len(out[by_count[src][1]]) < 2:
            src += 1
        out.append([out[by_count[src][1]].pop()])
    return out


def next_fit_packs(sizes: Sequence[int], cap: int, target_count: Callable[[int], int]) -> List[List[int]]:
    """Megatron-Core's ``DpBalancedScheduler`` packing (``megatron/core/datasets/data_schedule.py``, Megatron-LM
    ``main`` / ``dev``, Aug 2026): items next-fit in their given (loader) order into packs of at most ``cap``
    (an item over it starts a pack of its own); then, while there are fewer packs than ``target_count(packs)``
    (upstream: the next multiple of ``dp``, x ``N`` under VPP), the last item of the last pack holding more than
    one moves into a new pack of its own. Raises :class:`PartitionInfeasible` when no pack has an item to give
    (upstream asserts)."""
    packs: List[List[int]] = []
    current: List[int] = []
    used = 0
    for i, n in enumerate(np.asarray(sizes, dtype=np.int64).tolist()):
        if current and used + n > cap:
            packs.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        packs.append(current)
    missing = int(target_count(len(packs))) - len(packs)
    k = len(packs) - 1
    while missing > 0:
        if k < 0:
            raise PartitionInfeasible(f"not enough items to make {len(packs) + missing} packs")
        if len(packs[k]) > 1:
            packs.append([packs[k].pop()])
            missing -= 1
        else:
            k -= 1
    return packs
