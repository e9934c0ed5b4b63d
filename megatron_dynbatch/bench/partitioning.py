"""Partitioning primitives the baselines share (pure Python + NumPy; deterministic, ties break on indices):
:func:`karmarkar_karp` (k-way largest differencing; it lives in :mod:`megatron_dynbatch.core.partitioning`
because the verl and slime drop-ins use it too), :func:`first_fit`, :func:`split_largest_bins`,
:func:`modified_first_fit_decreasing` and :func:`adjust_bin_count`. Each re-implements, from public descriptions,
a step of a peer's batching so that the benchmark can model that peer (:mod:`.baselines`)."""

from __future__ import annotations

import bisect
import heapq
from typing import List, Sequence

import numpy as np

from ..core.partitioning import karmarkar_karp

__all__ = ["BaselineInfeasible", "adjust_bin_count", "first_fit", "karmarkar_karp", "modified_first_fit_decreasing",
           "split_largest_bins"]


class BaselineInfeasible(RuntimeError):
    """The modelled system would refuse this batch (assertion, crash or Megatron error); the message says why."""


def first_fit(sizes: Sequence[int], cap: int) -> List[List[int]]:
    """First-fit in the given order: each item goes to the first open bin with room, else opens a new one.
    An item larger than ``cap`` gets a bin of its own. This is the packer slime documents for
    ``--use-dynamic-batch-size`` (its help text: lengths 100, 200, 300 with budget 300 give ``[100, 200],
    [300]``)."""
    bins: List[List[int]] = []
    loads = np.zeros(0, dtype=np.int64)
    for i, s in enumerate(np.asarray(sizes, dtype=np.int64).tolist()):
        fits = np.flatnonzero(loads + s <= cap) if loads.size else np.zeros(0, dtype=np.int64)
        if fits.size:
            j = int(fits[0])
            bins[j].append(i)
            loads[j] += s
        else:
            bins.append([i])
            loads = np.append(loads, s)
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

    Raises :class:`BaselineInfeasible` for an item larger than ``cap`` (NeMo-RL validates this).
    """
    s = np.asarray(sizes, dtype=np.int64)
    if s.size and int(s.max()) > cap:
        raise BaselineInfeasible(f"a sequence of {int(s.max())} tokens exceeds the bin capacity {cap}")
    idx = list(range(s.size))
    large = sorted((i for i in idx if s[i] > cap / 2), key=lambda i: (-s[i], i))
    medium = sorted((i for i in idx if cap / 3 < s[i] <= cap / 2), key=lambda i: (-s[i], i))
    small = sorted((i for i in idx if cap / 6 < s[i] <= cap / 3), key=lambda i: (s[i], i))
    tiny = [i for i in idx if s[i] <= cap / 6]
    bins = [[i] for i in large]
    fill = [int(s[i]) for i in large]
    has_medium = [False] * len(bins)
    for b in range(len(bins)):  # phase 2
        for pos, i in enumerate(medium):
            if s[i] <= cap - fill[b]:
                bins[b].append(medium.pop(pos))
                fill[b] += int(s[i])
                has_medium[b] = True
                break
    for b in reversed(range(len(bins))):  # phase 3
        if has_medium[b] or len(small) < 2:
            continue
        room = cap - fill[b]
        if s[small[0]] + s[small[1]] > room:
            continue
        first = small.pop(0)
        for pos in range(len(small) - 1, -1, -1):
            if s[small[pos]] <= room - s[first]:
                second = small.pop(pos)
                bins[b] += [first, second]
                fill[b] += int(s[first] + s[second])
                break
        else:  # pragma: no cover - the two smallest fit, so some second item does
            small.insert(0, first)
    rest = sorted(medium + small + tiny, key=lambda i: (int(s[i]), -i))  # ascending; pop largest from the end
    rest_sizes = [int(s[i]) for i in rest]
    for b in range(len(bins)):  # phase 4
        while rest:
            room = cap - fill[b]
            pos = bisect.bisect_right(rest_sizes, room) - 1
            if pos < 0:  # rightmost fitting item: the largest size, lowest index among equals
                break
            bins[b].append(rest.pop(pos))
            fill[b] += rest_sizes.pop(pos)
    new_bins: List[List[int]] = []
    heap: list = []  # (fill, creation id, bin index): the least-filled new bin is on top
    for i in sorted(rest, key=lambda i: (-int(s[i]), i)):  # phase 5
        if heap and s[i] <= cap - heap[0][0]:
            f, cid, j = heapq.heappop(heap)
            new_bins[j].append(i)
            heapq.heappush(heap, (f + int(s[i]), cid, j))
        else:
            new_bins.append([i])
            heapq.heappush(heap, (int(s[i]), len(new_bins) - 1, len(new_bins) - 1))
    # NeMo-RL returns its leftover bins in fill order (least-filled first).
    new_order = [j for _, _, j in sorted(heap)]
    return bins + [new_bins[j] for j in new_order]


def adjust_bin_count(bins: List[List[int]], minimum: int, multiple: int) -> List[List[int]]:
    """Raise the bin count to at least ``minimum`` and to a multiple of ``multiple`` by moving single items
    (the last item of the bin with the most items, among the original bins) into new bins -- how NeMo-RL's
    packer meets its ``min_bin_count`` / ``bin_count_multiple`` (both set to the DP size). Raises
    :class:`BaselineInfeasible` when there are fewer items than bins."""
    target = max(len(bins), minimum)
    if multiple > 1 and target % multiple:
        target += multiple - target % multiple
    if target == len(bins):
        return [list(b) for b in bins]
    total = sum(len(b) for b in bins)
    if total < target:
        raise BaselineInfeasible(f"cannot make {target} non-empty bins from {total} sequences")
    out = [list(b) for b in bins]
    by_count = sorted(((len(b), j) for j, b in enumerate(out)), reverse=True)
    src = 0
    for _ in range(target - len(bins)):
        while len(out[by_count[src][1]]) < 2:
            src += 1
        out.append([out[by_count[src][1]].pop()])
    return out


