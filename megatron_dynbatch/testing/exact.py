"""Exact bin packing for tests: does a set of items fit ``k`` bins? (test support, never imported by the library)

The planner's searches are bounded in work, so a refusal from it means "no packing was found". Tests that hit a
refusal on a small step use :func:`bins_feasible` to check independently that no packing exists, so the
planner is never allowed to refuse a count that packs. Plain depth-first search, items in decreasing size,
bins of equal load tried once per item; exponential in the worst case, so callers keep steps small and get
``None`` (undecided) past ``node_limit``.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

__all__ = ["bins_feasible"]


def bins_feasible(sizes: Sequence[int], k: int, cap: int, node_limit: int = 2_000_000) -> Optional[bool]:
    """``True`` if the items fit ``k`` bins of capacity ``cap`` with no bin empty, ``False`` if they cannot,
    ``None`` if ``node_limit`` search nodes did not decide it."""
    items = sorted((int(s) for s in sizes), reverse=True)
    if k < 1 or len(items) < k or any(s > cap for s in items) or sum(items) > k * cap:
        return False
    # A packing into k bins that leaves some bin empty becomes one with none empty by moving single items out
    # of bins with several (a subset of a bin fits), so only "fits k bins" needs deciding.
    loads = [0] * k
    nodes = 0
    sys.setrecursionlimit(max(sys.getrecursionlimit(), len(items) + 100))

    def place(i: int) -> Optional[bool]:
        nonlocal nodes
        nodes += 1
        if nodes > node_limit:
            return None
        if i == len(items):
            return True
        seen = set()
        undecided = False
        for b in range(k):
            if loads[b] in seen or loads[b] + items[i] > cap:
                continue
            seen.add(loads[b])
            loads[b] += items[i]
            found = place(i + 1)
            loads[b] -= items[i]
            if found:
                return True
            undecided = undecided or found is None
        return None if undecided else False

    return place(0)
