"""Dynamic CP: dealing the floor-size samples of a tree candidate over its floor units (:func:`deal_singles`).

The floor units are single GPUs, or the DP ranks' own CP groups (a ``cp<cp>-tree`` candidate). Unit ``u`` has
``need[u]`` slots left after the micro-batches its ancestors in the pool tree run there, and starts with
``pre[u]`` seconds of them. The dealing, in three passes:

1. **LPT**: samples heaviest first (solo time, then slot length, then index) to the unit with the least
   inherited + own time that still has token room (``need[u] * cap`` slot-length tokens; a unit that no later
   sample fits any more is dropped from the heap);
2. **counts**: every unit with fewer samples than slots takes the lightest sample that fits from a unit with
   a surplus (each slot must hold at least one sample);
3. **refinement**: one move or swap between the slowest and the fastest unit while it lowers the slower of the
   two, at most ``step.rounds`` times.

Each pass keeps the token limits and the counts the previous ones established; ``None`` when LPT or the count
repair finds no room (the candidate then tries another slot count). Deterministic: ties break by index.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from .step import StepData


def deal_singles(step: StepData, singles: np.ndarray, pre: np.ndarray, need: np.ndarray,
                 floor: int = 1) -> Optional[List[List[int]]]:
    """The samples ``singles`` (all of group size ``floor``) over the floor units (module docstring): each
    unit's list of step-local samples, or ``None``."""
    if (need < 0).any() or int(need.sum()) > singles.size:
        return None
    one = step.sizes[floor]
    units = _Units(leaves=[[] for _ in range(need.size)], need=need, used=np.zeros(need.size, dtype=np.int64),
                   cap=need * one.cap, aligned=one.aligned, tau=one.tau, load=pre + need * step.cm.overhead_s)
    if not units.lpt(singles) or not units.fix_counts():
        return None
    units.refine(step.rounds)
    return units.leaves


@dataclass
class _Units:
    """The floor units while dealing: samples, slots to fill, slot-length tokens used and allowed, seconds."""

    leaves: List[List[int]]
    need: np.ndarray
    used: np.ndarray
    cap: np.ndarray
    aligned: np.ndarray
    tau: np.ndarray
    load: np.ndarray

    def move(self, i: int, src: int, dst: int) -> None:
        """Sample ``i`` from unit ``src`` to unit ``dst``, with the units' token and time totals."""
        self.leaves[src].remove(i)
        self.leaves[dst].append(i)
        self.used[src] -= self.aligned[i]
        self.used[dst] += self.aligned[i]
        self.load[src] -= self.tau[i]
        self.load[dst] += self.tau[i]

    def lpt(self, singles: np.ndarray) -> bool:
        """Pass 1: heaviest first to the least loaded unit with token room; ``False`` if one finds none."""
        # Python lists in the loop (a NumPy scalar per element is several times slower; the same integers and
        # the same float64 sums), written back to the arrays at the end
        order = singles[np.lexsort((singles, -self.aligned[singles], -self.tau[singles]))]
        used, cap, load = self.used.tolist(), self.cap.tolist(), self.load.tolist()
        heap = [(load[g], g) for g, need in enumerate(self.need.tolist()) if need > 0]
        heapq.heapify(heap)
        sizes = self.aligned[order].tolist()
        suffix_min = np.minimum.accumulate(self.aligned[order][::-1])[::-1].tolist() + [0]
        placed = True
        for k, (i, a, t) in enumerate(zip(order.tolist(), sizes, self.tau[order].tolist(), strict=True)):
            skipped = []
            placed = False
            while heap:
                ld, g = heap[0]  # peek: a unit that fits is updated by one heapreplace (one entry per unit)
                if used[g] + a <= cap[g]:
                    self.leaves[g].append(i)
                    used[g] += a
                    load[g] += t
                    heapq.heapreplace(heap, (load[g], g))
                    placed = True
                    break
                heapq.heappop(heap)
                if used[g] + suffix_min[k + 1] <= cap[g]:  # a later (smaller) sample may still fit
                    skipped.append((ld, g))
            for item in skipped:
                heapq.heappush(heap, item)
            if not placed:
                break
        self.used[:] = used
        self.load[:] = load
        return placed

    def fix_counts(self) -> bool:
        """Pass 2: every unit with fewer samples than slots takes the lightest fitting sample of a unit with a
        surplus; ``False`` if none fits."""
        need, used, cap, aligned, tau = self.need, self.used, self.cap, self.aligned, self.tau
        cnt = np.array([len(x) for x in self.leaves], dtype=np.int64)
        for g in np.flatnonzero(cnt < need).tolist():
            while cnt[g] < need[g]:
                best = None
                for d in np.flatnonzero(cnt > need).tolist():
                    for i in self.leaves[d]:
                        if used[g] + aligned[i] <= cap[g] and (best is None or (tau[i], i) < best[0]):
                            best = ((tau[i], i), d, i)
                if best is None:
                    return False
                _, d, i = best
                self.move(i, d, g)
                cnt[d] -= 1
                cnt[g] += 1
        return True

    def refine(self, rounds: int) -> None:
        """Pass 3: move or swap one sample between the slowest and the fastest unit while that lowers the slower
        of the two (at most ``rounds`` times)."""
        need, used, cap, aligned, tau, load = self.need, self.used, self.cap, self.aligned, self.tau, self.load
        active = need > 0
        if active.sum() < 2:
            return
        for _ in range(rounds):
            a = int(np.argmax(np.where(active, load, -np.inf)))
            b = int(np.argmin(np.where(active, load, np.inf)))
            gap = load[a] - load[b]
            if gap <= 1e-9 * load[a]:
                return
            xa = np.asarray(self.leaves[a], dtype=np.int64)
            best = None
            if len(self.leaves[a]) > need[a]:  # a move keeps a's count
                ok = (tau[xa] < gap) & (used[b] + aligned[xa] <= cap[b]) & (tau[xa] > 0)
                if ok.any():
                    dev = np.where(ok, np.abs(tau[xa] - gap / 2), np.inf)
                    k = int(np.argmin(dev))
                    best = (dev[k], int(xa[k]), None)
            xb = np.asarray(self.leaves[b], dtype=np.int64)
            if xb.size and xa.size:
                swap = best_swap(tau[xa], tau[xb], aligned[xa], aligned[xb], gap, cap[a] - used[a], cap[b] - used[b])
                if swap is not None and (best is None or swap[0] < best[0]):
                    best = (swap[0], int(xa[swap[1]]), int(xb[swap[2]]))
            if best is None or best[0] >= gap / 2:
                return
            _, x, y = best
            self.move(x, a, b)
            if y is not None:
                self.move(y, b, a)


#: below this many (a, b) pairs :func:`best_swap` scans the whole matrix
SMALL_SWAP = 4096


def best_swap(ta: np.ndarray, tb: np.ndarray, ala: np.ndarray, alb: np.ndarray, gap: float, room_a: float,
              room_b: float) -> Optional[Tuple[float, int, int]]:
    """The swap of pass 3: ``(dev, p, q)`` minimising ``dev = |(ta[p] - tb[q]) - gap / 2|`` over the pairs with
    ``0 < ta[p] - tb[q] < gap`` whose slot-length tokens still fit both units (``alb[q] - ala[p] <= room_a``,
    ``ala[p] - alb[q] <= room_b``), the first ``(p, q)`` in row-major order on a tie; ``None`` if no pair fits.

    Exact, in ``O((|a| + |b|) log |b|)`` instead of the ``|a| x |b|`` matrix: for each ``p`` only the values of
    ``tb`` nearest to ``ta[p] - gap / 2`` can be best (the first element of each run of equal values: the lowest
    ``q``). When such a nearest value does not fit and could still have beaten the answer, the full matrix
    decides (rare: the token room binds)."""
    if ta.size * tb.size <= SMALL_SWAP:  # the matrix is cheaper than the search for small units
        dev, q = _rows_best(ta, tb, ala, alb, gap, room_a, room_b)
        p = int(np.argmin(dev))
        return (float(dev[p]), p, int(q[p])) if np.isfinite(dev[p]) else None
    half = gap / 2
    order = np.argsort(tb, kind="stable")
    ts = tb[order]
    pos = np.searchsorted(ts, ta - half, side="left")
    right = np.minimum(pos, ts.size - 1)
    left = np.searchsorted(ts, ts[np.maximum(pos - 1, 0)], side="left")  # first of the run left of the target
    cands = []
    for c, exists in ((left, pos > 0), (right, pos < ts.size)):
        q = order[c]
        delta = ta - tb[q]
        dev = np.abs(delta - half)
        # a nearest value outside (0, gap) means every value beyond it on its side is too; one without token
        # room does not: another element of its run, or a value further out, may still fit
        ranged = exists & (delta > 0) & (delta < gap)
        room = (alb[q] - ala <= room_a) & (ala - alb[q] <= room_b)
        cands.append((np.where(ranged & room, dev, np.inf), np.where(ranged & ~room, dev, np.inf), q))
    (dev_l, miss_l, q_l), (dev_r, miss_r, q_r) = cands
    take_r = (dev_r < dev_l) | ((dev_r == dev_l) & (q_r < q_l))
    dev = np.where(take_r, dev_r, dev_l)
    q = np.where(take_r, q_r, q_l)
    p = int(np.argmin(dev))
    missed = np.minimum(miss_l, miss_r)
    worry = np.isfinite(missed) & ((missed < dev[p]) | ((missed == dev[p]) & (np.arange(ta.size) <= p)))
    if worry.any():  # those rows in full: their best fitting value may lie anywhere
        rows = np.flatnonzero(worry)
        dev[rows], q[rows] = _rows_best(ta[rows], tb, ala[rows], alb, gap, room_a, room_b)
        p = int(np.argmin(dev))
    return (float(dev[p]), p, int(q[p])) if np.isfinite(dev[p]) else None


def _rows_best(ta, tb, ala, alb, gap, room_a, room_b) -> Tuple[np.ndarray, np.ndarray]:
    """Per row of ``ta``: the least ``dev`` of :func:`best_swap` over all of ``tb`` (inf if none fits) and its
    first ``q``."""
    delta = ta[:, None] - tb[None, :]
    ok = (delta > 0) & (delta < gap) & (alb[None, :] - ala[:, None] <= room_a) & (ala[:, None] - alb[None, :] <= room_b)
    dev = np.where(ok, np.abs(delta - gap / 2), np.inf)
    q = np.argmin(dev, axis=1)
    return dev[np.arange(ta.size), q], q


__all__ = ["deal_singles", "best_swap"]
