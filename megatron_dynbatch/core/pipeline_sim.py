"""Makespan of Megatron's non-interleaved 1F1B pipeline schedule (used by :mod:`.cost_model` and the dynamic-CP
pool simulator). Pure NumPy.

Stage ``s`` of ``pp`` runs ``w = min(pp - s - 1, M)`` warm-up forwards, then alternates one forward / one
backward, then drains the remaining backwards; forward ``j`` on stage ``s`` waits for forward ``j`` on stage
``s - 1``, backward ``j`` on stage ``s`` for backward ``j`` on stage ``s + 1``. Every stage holds the same
plan, so micro-batch ``j`` takes the same time on each (forward one third, backward two thirds).

Two ways to the same makespan:

* **operation by operation** (:func:`_schedule_1f1b`: the ``2 * M * pp`` operations in a dependency order, each
  one ``max`` and one ``+``): exact to the last bit of the arithmetic it models, used while a simulation has
  few operations;
* **compressed** (:func:`_fast_batch`), for long pipelines and many micro-batches (:func:`uses_fast_form`):
  the same longest path, computed with fewer steps. Stages ``s < pp - M`` run all their forwards before any
  backward (their warm-up covers every micro-batch): their forward ends are a proportionate flow shop --
  forward ``j`` on stage ``s`` ends at ``max`` over the group chains of ``sum(f) + s * max(f)`` (every extra
  stage adds the largest forward on the path) -- and so are their backward ends, fed by the first full
  1F1B stage; both take ``M`` vectorised steps whatever ``pp`` is. The remaining ``min(pp, M)`` stages are
  simulated column by column (forward ``j`` of stage ``s`` and backward ``i`` of every stage in column
  ``k = s + j = i + T - 1``), each column's backward chain up the stages one cumulative maximum. Equal to the
  operation-by-operation result up to float rounding (``tests/test_cost_model.py`` compares them); planning
  time is ``O(M + min(pp, M))`` NumPy steps per simulation instead of ``O(M * pp)`` operations.

The choice depends only on ``(M, pp)``, and a single rank's simulation in the compressed form runs the batch
code on one row, so every caller -- plain-Python fast paths and vectorised ones -- gets the same value.
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

#: stages whose warm-up covers every micro-batch (``pp - M`` of them) from which on the simulation compresses
#: them (below, and below :data:`FAST_OPS` operations, it simulates operation by operation: bit for bit the
#: values plans were made with before the compressed form existed)
COMPRESS_HEAD = 64
#: simulated operations (``2 * M * pp``) from which on the compressed form is used anyway
FAST_OPS = 1 << 14

Sync = Callable[[np.ndarray, int], np.ndarray]


def uses_fast_form(m: int, pp: int) -> bool:
    """Whether a simulation of ``m`` micro-batches over ``pp`` stages uses the compressed form (module
    docstring): a head of at least :data:`COMPRESS_HEAD` all-forward stages, or :data:`FAST_OPS` operations."""
    return pp - m >= COMPRESS_HEAD or 2 * m * pp >= FAST_OPS


#: one column step of the compressed form costs about as much time as this many operations (a dozen NumPy calls:
#: ~16 us against ~0.55 us per operation on one core)
COLUMN_OPS = 32


def simulated_steps(m: int, pp: int) -> int:
    """The work one simulation of ``m`` micro-batches over ``pp`` stages takes, in operations (a column step of
    the compressed form counts :data:`COLUMN_OPS`): the unit callers bound their simulations in."""
    if m == 0:
        return 0
    if uses_fast_form(m, pp):
        return COLUMN_OPS * (m + min(pp, m))
    return 2 * m * pp


def simulation_cost_us(m: int, pp: int, ranks: int) -> float:
    """A model of one :func:`simulate_1f1b_batch` call's CPU microseconds (``ranks`` rows of ``m`` micro-batches
    over ``pp`` stages), fitted on one core: operation by operation, each of the ``2 * m * pp`` operations is a
    few NumPy calls over the ranks; in the compressed form each of the ``m + min(pp, m)`` columns is a dozen calls
    over ``min(pp, m) x ranks`` values. Deterministic (a function of the sizes), so callers can bound
    their work with it."""
    if m == 0:
        return 0.0
    if uses_fast_form(m, pp):
        t = min(pp, m)
        return (m + t) * (15.0 + 0.012 * t * ranks) + 10.0 * m
    return 2.0 * m * pp * (2.5 + 0.01 * ranks)


def simulate_1f1b(stage_times: Sequence[float], pp: int) -> float:
    """Makespan of Megatron's non-interleaved 1F1B schedule (module docstring): the time the first stage
    finishes its last backward. ``stage_times[j]`` is micro-batch ``j``'s forward+backward time on one stage."""
    t = [float(x) for x in stage_times]
    m = len(t)
    if m == 0:
        return 0.0
    if uses_fast_form(m, pp):
        return float(_fast_batch(np.asarray([t], dtype=np.float64), pp)[0])
    order = _schedule_1f1b(m, pp)
    end = [0.0] * len(order)
    for k, (j, is_b, prev, dep) in enumerate(order):
        start = end[prev] if prev >= 0 else 0.0
        if dep >= 0 and end[dep] > start:
            start = end[dep]
        end[k] = start + (t[j] - t[j] / 3.0 if is_b else t[j] / 3.0)
    return max(end)


def simulate_1f1b_batch(stage_times: np.ndarray, pp: int, sync: Optional[Sync] = None) -> np.ndarray:
    """:func:`simulate_1f1b` of every row of ``stage_times`` (``[ranks, M]``) at once. ``sync(start, j)``, if
    given, moves the start times of micro-batch ``j``'s forward or backward across ranks before it runs (the
    dynamic-CP pool: the GPUs of one CP group start together, ``planner/dyncp/pool_sim.py``); it must take the
    maximum over blocks of ranks whose times in micro-batch ``j`` are equal (what the pool's groups are), and in
    the compressed form it is also called with ``start`` of shape ``[n, ranks]`` and ``j`` an array of ``n``
    micro-batches (row ``r`` synchronised as micro-batch ``j[r]``)."""
    times = np.asarray(stage_times, dtype=np.float64)
    if times.ndim != 2 or times.shape[1] == 0:
        return np.zeros(times.shape[0] if times.ndim == 2 else 0)
    if uses_fast_form(times.shape[1], pp):
        return _fast_batch(times, pp, sync)
    return _ops_batch(times, pp, sync)


def _ops_batch(times: np.ndarray, pp: int, sync: Optional[Sync]) -> np.ndarray:
    """Operation by operation, vectorised over ranks."""
    fwd = times / 3.0
    bwd = times - fwd
    order = _schedule_1f1b(times.shape[1], pp)
    end = np.zeros((len(order), times.shape[0]))
    zero = np.zeros(times.shape[0])
    for k, (j, is_b, prev, dep) in enumerate(order):
        start = end[prev] if prev >= 0 else zero
        if dep >= 0:
            start = np.maximum(start, end[dep])
        if sync is not None:
            start = sync(start, j)
        end[k] = start + (bwd[:, j] if is_b else fwd[:, j])
    return end.max(axis=0)


def _head_forwards(fwd: np.ndarray, head: int, sync: Optional[Sync]) -> np.ndarray:
    """``[ranks, M]`` forward ends on the last of ``head`` all-forward stages: the longest path over the group
    chains of ``sum(f) + (head - 1) * max(f)`` (module docstring), in ``M`` steps: ``plain`` is the best path so
    far with no stage descended, ``extra`` the best with all ``head - 1`` descents taken at one column."""
    ranks, m = fwd.shape
    out = np.empty((ranks, m))
    plain = np.zeros(ranks)
    extra = None
    for j in range(m):
        a = plain if sync is None else sync(plain, j)
        f = fwd[:, j]
        here = a + head * f  # all head - 1 descents at this column
        if extra is not None:
            here = np.maximum((extra if sync is None else sync(extra, j)) + f, here)
        plain = a + f
        extra = here
        out[:, j] = here
    return out


def _head_backwards(bwd: np.ndarray, arrive: np.ndarray, head: int, sync: Optional[Sync]) -> np.ndarray:
    """Each rank's finish: the first stage's last backward after ``head`` all-forward stages whose backward ``i``
    waits for ``arrive[:, i]`` (the first full 1F1B stage's backward ends) -- a flow shop as in
    :func:`_head_forwards`, entered at any column."""
    plain = extra = None
    for i in range(bwd.shape[1]):
        x = arrive[:, i] if plain is None else np.maximum(plain, arrive[:, i])
        if sync is not None:
            x = sync(x, i)
        b = bwd[:, i]
        here = x + head * b
        if extra is not None:
            here = np.maximum((extra if sync is None else sync(extra, i)) + b, here)
        plain = x + b
        extra = here
    return extra


def _fast_batch(times: np.ndarray, pp: int, sync: Optional[Sync] = None) -> np.ndarray:
    """The compressed form (module docstring) of every row."""
    fwd = times / 3.0
    bwd = times - fwd
    m = times.shape[1]
    head = max(0, pp - m)
    release = _head_forwards(fwd, head, sync) if head else None
    tail_end, stage0_b = _columns(fwd, bwd, pp - head, release, sync)
    return _head_backwards(bwd, stage0_b, head, sync) if head else tail_end


def _columns(fwd: np.ndarray, bwd: np.ndarray, stages: int, release: Optional[np.ndarray],
             sync: Optional[Sync] = None):
    """A full 1F1B of ``stages`` stages (warm-up ``stages - 1 - s``), column by column: ``(each rank's finish,
    [ranks, M] backward ends of the first stage)``. ``release[:, j]``: the earliest start of the first stage's
    forward ``j``. Arrays are ``[stage, rank]`` and updated in place (a column is a dozen NumPy calls)."""
    ranks, m = fwd.shape
    t = stages
    f_by_mb = np.ascontiguousarray(fwd.T)  # [M, ranks]
    rel = None if release is None else np.ascontiguousarray(release.T)
    last = np.zeros((t, ranks))       # end of each stage's latest operation
    fwd_end = np.zeros((t, ranks))    # end of each stage's latest forward (the next stage's dependency)
    dep = np.empty((t, ranks))
    ramp_b = np.empty((t, ranks))
    top = np.empty((t, ranks))
    stage0_b = np.empty((ranks, m))
    ramp = np.arange(t, dtype=np.float64)[:, None]
    for k in range(m + t - 1):
        lo, hi = max(0, k - m + 1), min(t - 1, k)  # stages with a forward in this column: j = k - s
        if lo <= hi:
            n = hi - lo + 1
            d = dep[:n]
            if lo == 0:
                d[0] = 0.0 if rel is None else rel[k]
                d[1:] = fwd_end[0:hi]
            else:
                d[:] = fwd_end[lo - 1:hi]
            ends = last[lo:hi + 1]
            np.maximum(ends, d, out=ends)
            if sync is not None:
                ends[:] = sync(ends, np.arange(k - lo, k - hi - 1, -1))
            ends += f_by_mb[k - hi:k - lo + 1][::-1]  # stage s runs forward k - s
            fwd_end[lo:hi + 1] = ends
        i = k - (t - 1)
        if i >= 0:  # backward i on every stage, up from the last: end(s) = max_{s' >= s} last(s') + (s'-s+1) b
            b = bwd[:, i]
            if sync is not None:  # every stage's backward i is synchronised as micro-batch i
                last[:] = sync(last, np.full(t, i))
            np.multiply(ramp, b, out=ramp_b)
            np.add(last, ramp_b, out=top)
            np.maximum.accumulate(top[::-1], axis=0, out=top[::-1])
            np.subtract(top, ramp_b, out=last)
            last += b
            stage0_b[:, i] = last[0]
    return last[0].copy(), stage0_b


def _schedule_1f1b(m: int, pp: int) -> Tuple[Tuple[int, bool, int, int], ...]:
    """The 1F1B operations in a dependency-respecting order: ``(microbatch, is_backward, previous op on the
    same stage, op it waits for on a neighbouring stage)`` (indices into the order; -1 for none)."""
    return _schedule(m, pp)


@functools.lru_cache(maxsize=64)
def _schedule(m: int, pp: int) -> Tuple[Tuple[int, bool, int, int], ...]:
    """:func:`_schedule_1f1b`, built column by column in ``O(M * pp)``: forward ``j`` of stage ``s`` sits in
    column ``s + j`` and backward ``i`` of every stage in column ``i + pp - 1``; in a column the forwards go
    first, from the last stage down, then the backwards from the last stage up -- each stage's operations keep
    their 1F1B order, and every dependency comes earlier (forward ``j`` of stage ``s - 1`` one column before,
    backward ``i`` of stage ``s + 1`` just before). The values do not depend on which dependency order is
    simulated: each operation is the same ``max`` and ``+`` of the same inputs."""
    out: List[Tuple[int, bool, int, int]] = []
    last = [-1] * pp
    fwd_at = [-1] * pp  # index of each stage's latest forward
    for k in range(m + pp - 1):
        for s in range(min(pp - 1, k), max(0, k - m + 1) - 1, -1):  # down: stage s - 1's is the column before's
            out.append((k - s, False, last[s], fwd_at[s - 1] if s > 0 else -1))
            last[s] = fwd_at[s] = len(out) - 1
        i = k - (pp - 1)
        if i >= 0:
            below = -1
            for s in range(pp - 1, -1, -1):
                dep = last[s] if s == pp - 1 else below  # the last stage's backward waits for its own forward
                out.append((i, True, last[s], dep))
                last[s] = below = len(out) - 1
    return tuple(out)


__all__ = ["simulate_1f1b", "simulate_1f1b_batch", "uses_fast_form", "simulated_steps", "simulation_cost_us",
           "COMPRESS_HEAD", "FAST_OPS", "COLUMN_OPS"]
