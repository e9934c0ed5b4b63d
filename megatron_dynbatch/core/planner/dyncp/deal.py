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
from typing import List, Optional

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
        aligned, tau, used, cap, load = self.aligned, self.tau, self.used, self.cap, self.load
        order = singles[np.lexsort((singles, -aligned[singles], -tau[singles]))]
        heap = [(float(load[g]), g) for g in range(self.need.size) if self.need[g] > 0]
        heapq.heapify(heap)
        suffix_min = np.minimum.accumulate(aligned[order][::-1])[::-1].tolist() + [0]
        for k, i in enumerate(order.tolist()):
            a = int(aligned[i])
            skipped = []
            placed = False
            while heap:
                ld, g = heapq.heappop(heap)
                if used[g] + a <= cap[g]:
                    self.leaves[g].append(i)
                    used[g] += a
                    load[g] += tau[i]
                    heapq.heappush(heap, (float(load[g]), g))
                    placed = True
                    break
                if used[g] + suffix_min[k + 1] <= cap[g]:  # a later (smaller) sample may still fit
                    skipped.append((ld, g))
            for item in skipped:
                heapq.heappush(heap, item)
            if not placed:
                return False
        return True

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
            self.move(x, a, b)
            if y is not None:
                self.move(y, b, a)


__all__ = ["deal_singles"]
