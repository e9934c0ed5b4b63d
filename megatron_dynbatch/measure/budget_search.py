"""The largest budget that really fits, found by real attempts: :func:`search_largest_fit`.

``attempt(tokens) -> bool`` runs one real training step at ``tokens`` tokens and says whether it fitted (the
caller catches the out-of-memory error on its one GPU and cleans up). From ``start`` (the auto budget) the search
grows by ``growth`` until an attempt fails, then bisects between the largest success and the smallest failure
until they are within ``resolution`` of each other (never finer than ``multiple``). When ``start`` itself fails
it shrinks by ``growth`` until one fits. At most ``max_attempts`` attempts; every one is recorded in order.
Sizes are multiples of ``multiple``. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

from ..core.checks import as_float, as_int


@dataclass
class SearchResult:
    """``largest_fit`` (``None`` when nothing tried fitted), ``smallest_fail`` (``None`` when nothing failed) and
    every ``(tokens, fitted)`` attempt in order."""

    largest_fit: Optional[int] = None
    smallest_fail: Optional[int] = None
    attempts: List[Tuple[int, bool]] = field(default_factory=list)


def search_largest_fit(attempt: Callable[[int], bool], start: int, *, multiple: int = 256, growth: float = 1.25,
                       resolution: float = 0.02, max_attempts: int = 16,
                       max_tokens: Optional[int] = None) -> SearchResult:
    """Search (module docstring)."""
    mult = as_int(multiple, "multiple", minimum=1)
    first = max(mult, as_int(start, "start", minimum=1) // mult * mult)
    g = as_float(growth, "growth", minimum=1.01, maximum=16.0)
    res = as_float(resolution, "resolution", minimum=0.0, maximum=1.0)
    tries = as_int(max_attempts, "max_attempts", minimum=1, maximum=1000)
    cap = None if max_tokens is None else as_int(max_tokens, "max_tokens", minimum=mult)
    out = SearchResult()

    def run(tokens: int) -> bool:
        ok = bool(attempt(tokens))
        out.attempts.append((tokens, ok))
        if ok:
            out.largest_fit = max(out.largest_fit or 0, tokens)
        else:
            out.smallest_fail = tokens if out.smallest_fail is None else min(out.smallest_fail, tokens)
        return ok

    def step(tokens: int, up: bool) -> int:
        nxt = int(tokens * g) if up else int(tokens / g)
        nxt = nxt // mult * mult
        return max(nxt, tokens + mult) if up else min(nxt, tokens - mult)

    tokens = first
    ok = run(tokens)
    while len(out.attempts) < tries:  # find a bracket
        if ok:
            nxt = step(tokens, True)
            if cap is not None and nxt > cap:
                if tokens >= cap:
                    return out
                nxt = cap // mult * mult
            tokens = nxt
        else:
            tokens = step(tokens, False)
            if tokens < mult:
                return out
        ok = run(tokens)
        if out.largest_fit is not None and out.smallest_fail is not None:
            break
    while len(out.attempts) < tries and out.largest_fit is not None and out.smallest_fail is not None:
        lo, hi = out.largest_fit, out.smallest_fail
        if hi - lo <= max(mult, int(lo * res)):
            break
        mid = (lo + hi) // 2 // mult * mult
        if mid <= lo:
            break
        run(mid)
    return out


__all__ = ["SearchResult", "search_largest_fit"]
