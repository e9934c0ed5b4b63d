"""The grid ``megatron-dynbatch calibrate`` times: packed micro-batches and CP shares that pin every cost-model term.

A grid point is one micro-batch share ``(group_size, lengths)`` -- the record format of :mod:`..cost_fit`. For every
group size the layout can use (:func:`layout_group_sizes`: the layout's ``cp``, or under dynamic CP every group size
of the ``dp x cp`` pool tree) the default grid holds

* **packed micro-batches** of ``tokens`` tokens PER GPU (default: the budget and its halvings down to 1/32, never
  below 32 tokens), each with ``seqs`` sequences (default 1, 2, 4, 8) of equal length -- equal lengths at a fixed
  token count vary ``sum(L^2)`` by the sequence count, which separates the linear from the attention term -- plus
  one *mixed* micro-batch per size (half the tokens in one sequence, the rest in seven);
* **floor points**: one sample of 16 tokens, one of 64, and four of 32 -- small inputs, where the per-micro-batch
  floor shows.

A micro-batch on ``g`` GPUs holds ``g`` times the per-GPU tokens (each member's share is ``1/g`` of it). Points are
ordered so that every prefix of the list covers what the fit needs (:func:`spread_order` per group size, then round
robin over group sizes): a run cut short by ``--max-seconds`` still has small and large inputs of every group size.

Invariants: no point holds more than ``max_tokens_per_gpu * g`` tokens (a calibration run never exceeds the
training budget, so it never risks an OOM the training run would not); every grid :func:`check_grid` accepts
determines both the linear and the attention term (at least two token counts and two ``sum(L^2) / T^2`` ratios).
Pure Python + NumPy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..checks import as_int
from ..errors import DynBatchConfigError
from ..parallel import ParallelConfig

if TYPE_CHECKING:
    from ..parallel import ParallelLike

#: the shortest sequence a packed grid point holds
MIN_SEQ_TOKENS = 16
#: halvings of the budget the default token sizes go down to (budget / 2**5)
DEFAULT_HALVINGS = 5
DEFAULT_SEQS = (1, 2, 4, 8)
#: floor points: (sequences, tokens each)
FLOOR_POINTS = ((1, 16), (1, 64), (4, 32))
#: the fewest points a grid (or a run cut short) may have
MIN_POINTS = 6


@dataclass(frozen=True)
class GridPoint:
    """One micro-batch share to time: ``lengths`` of a micro-batch on a CP group of ``group_size`` GPUs; ``kind``
    ``"packed"``, ``"mixed"`` or ``"floor"``."""

    group_size: int
    lengths: Tuple[int, ...]
    kind: str = "packed"

    @property
    def tokens(self) -> int:
        return int(sum(self.lengths))

    def item(self) -> Tuple[int, List[int]]:
        """``(group_size, lengths)``: what :meth:`~megatron_dynbatch.measure.ModelSlice.time_records` takes."""
        return self.group_size, list(self.lengths)


def layout_group_sizes(parallel: ParallelLike, dynamic_cp: bool = False) -> List[int]:
    """The CP group sizes a layout's micro-batches run on: ``[cp]``, or with dynamic CP every node size of the
    ``dp x cp`` pool tree (:mod:`..planner.dyncp.pool`)."""
    par = ParallelConfig.from_any(parallel)
    if not dynamic_cp:
        return [par.cp]
    from ..planner.dyncp.pool import pool_tree

    return list(pool_tree(par.dp, par.cp).sizes)


def _int_list(values: Any, field: str, *, low: int, high: Optional[int] = None, fix: str) -> List[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise DynBatchConfigError(field, values, "must be a list of integers", fix)
    out = sorted({as_int(v, field, minimum=low, maximum=high, fix=fix) for v in values})
    if not out:
        raise DynBatchConfigError(field, list(values), "is empty", fix)
    return out


def default_tokens(max_tokens_per_gpu: int) -> List[int]:
    """Per-GPU token sizes of the default grid: the budget and its halvings (module docstring)."""
    out = {max(32, max_tokens_per_gpu >> k) for k in range(DEFAULT_HALVINGS + 1)}
    return sorted(t for t in out if t <= max_tokens_per_gpu)


def _equal_split(total: int, n: int) -> Tuple[int, ...]:
    base, extra = divmod(total, n)
    return tuple(base + (1 if i < extra else 0) for i in range(n))


def build_grid(max_tokens_per_gpu: Any, group_sizes: Sequence[Any], *, tokens: Optional[Sequence[Any]] = None,
               seqs: Optional[Sequence[Any]] = None, floor: bool = True) -> List[GridPoint]:
    """The grid of the module docstring, in timing order (:func:`order_points`). ``tokens`` (per GPU) and ``seqs``
    replace the defaults; every token size must fit the budget. Raises ``DynBatchConfigError`` (naming the
    ``--grid-*`` flag) for bad values and for a grid that cannot determine the fit (:func:`check_grid`)."""
    budget = as_int(max_tokens_per_gpu, "--max-tokens-per-gpu", minimum=1,
                    fix="pass the per-GPU token budget of your training run")
    sizes = _int_list(group_sizes, "--group-sizes", low=1, high=2 ** 16,
                      fix="pass the CP group sizes your layout uses, e.g. --group-sizes 1,2,4")
    toks = default_tokens(budget) if tokens is None else _int_list(
        tokens, "--grid-tokens", low=1, fix="pass per-GPU token counts, e.g. --grid-tokens 256,1024,4096")
    over = [t for t in toks if t > budget]
    if over:
        raise DynBatchConfigError("--grid-tokens", over[0], f"is over the budget of {budget} tokens per GPU (a "
                                  "calibration micro-batch must fit what training may run)",
                                  f"use token counts <= --max-tokens-per-gpu {budget}")
    counts = list(DEFAULT_SEQS) if seqs is None else _int_list(
        seqs, "--grid-seqs", low=1, high=4096, fix="pass sequences per micro-batch, e.g. --grid-seqs 1,2,4,8")
    points: List[GridPoint] = []
    for g in sizes:
        for t in toks:
            total = t * g
            for n in counts:
                if total // n >= MIN_SEQ_TOKENS:
                    points.append(GridPoint(g, _equal_split(total, n)))
            if seqs is None and total // 2 // 7 >= MIN_SEQ_TOKENS:
                half = total // 2
                points.append(GridPoint(g, (half,) + _equal_split(total - half, 7), "mixed"))
        if floor:
            for n, each in FLOOR_POINTS:
                if each * n <= budget * g:
                    points.append(GridPoint(g, (each,) * n, "floor"))
    points = _unique(points)
    check_grid(points)
    return order_points(points)


def _unique(points: Sequence[GridPoint]) -> List[GridPoint]:
    seen, out = set(), []
    for p in points:
        key = (p.group_size, tuple(sorted(p.lengths, reverse=True)))
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def check_grid(points: Sequence[GridPoint], field: str = "--grid-tokens") -> None:
    """Refuse a grid that cannot determine the fit: fewer than :data:`MIN_POINTS` points, or token counts and
    squared-length sums that do not vary independently (the linear and attention terms would be confounded)."""
    if len(points) < MIN_POINTS:
        raise DynBatchConfigError(field, len(points), f"the grid has {len(points)} micro-batches, fewer than the "
                                  f"{MIN_POINTS} a fit needs", "give more token sizes (--grid-tokens) or sequence "
                                  "counts (--grid-seqs), or leave both at their defaults")
    t = np.array([p.tokens / p.group_size for p in points], dtype=np.float64)
    sq = np.array([sum(x * x for x in p.lengths) / p.group_size for p in points], dtype=np.float64)
    x = np.column_stack([np.ones_like(t), t / t.max(), sq / sq.max()])
    if np.linalg.matrix_rank(x, tol=1e-9) < 3:
        raise DynBatchConfigError(field, sorted({int(v) for v in t}), "the grid's token counts and sequence lengths "
                                  "do not vary independently, so the linear and attention costs cannot be told apart",
                                  "time at least two token sizes and two sequence counts (--grid-tokens, --grid-seqs)")


def spread_order(n: int) -> List[int]:
    """Indices ``0 .. n-1`` ordered so that every prefix is spread over the range: both ends first, then the
    midpoints of the largest gaps (a sorted list cut after ``k`` entries keeps its small and large values)."""
    if n <= 2:
        return list(range(n))
    out, gaps = [0, n - 1], [(0, n - 1)]
    while len(out) < n:
        nxt = []
        for lo, hi in gaps:
            if hi - lo > 1:
                mid = (lo + hi) // 2
                out.append(mid)
                nxt += [(lo, mid), (mid, hi)]
        gaps = nxt
    return out


def order_points(points: Sequence[GridPoint]) -> List[GridPoint]:
    """Timing order (module docstring): per group size the points sorted by tokens in :func:`spread_order`, then
    round robin over the group sizes."""
    by_g: dict = {}
    for p in points:
        by_g.setdefault(p.group_size, []).append(p)
    lanes = []
    for g in sorted(by_g):
        lane = sorted(by_g[g], key=lambda p: (p.tokens, len(p.lengths)))
        lanes.append([lane[i] for i in spread_order(len(lane))])
    out: List[GridPoint] = []
    for k in range(max(len(lane) for lane in lanes)):
        out += [lane[k] for lane in lanes if k < len(lane)]
    return out


__all__ = ["GridPoint", "build_grid", "check_grid", "default_tokens", "layout_group_sizes", "order_points",
           "spread_order", "MIN_POINTS", "MIN_SEQ_TOKENS"]
