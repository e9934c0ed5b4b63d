"""Makespan of Megatron's non-interleaved 1F1B pipeline schedule (used by :mod:`.cost_model` and the dynamic-CP
pool simulator). Pure NumPy."""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np


def simulate_1f1b(stage_times: Sequence[float], pp: int) -> float:
    """Makespan of Megatron's non-interleaved 1F1B schedule.

    ``stage_times[j]`` is micro-batch ``j``'s forward+backward time on one stage (the same on every stage);
    forward takes one third and backward two thirds. Stage ``s`` runs ``min(pp - s - 1, M)`` warm-up forwards,
    then alternates one forward / one backward, then drains the remaining backwards; forward ``j`` on stage
    ``s`` waits for forward ``j`` on stage ``s-1``, backward ``j`` on stage ``s`` for backward ``j`` on
    stage ``s+1``. Returns the time the first stage finishes its last backward (the step's compute end).

    The dependency graph depends only on ``(M, pp)``, so it is built once (:func:`_schedule_1f1b`) and each
    call is one pass of max-plus arithmetic over it; :func:`simulate_1f1b_batch` does many ranks at once.
    """
    t = [float(x) for x in stage_times]
    m = len(t)
    if m == 0:
        return 0.0
    order = _schedule_1f1b(m, pp)
    end = [0.0] * len(order)
    for k, (j, is_b, prev, dep) in enumerate(order):
        start = end[prev] if prev >= 0 else 0.0
        if dep >= 0 and end[dep] > start:
            start = end[dep]
        end[k] = start + (t[j] - t[j] / 3.0 if is_b else t[j] / 3.0)
    return max(end)


def simulate_1f1b_batch(stage_times: np.ndarray, pp: int,
                        sync: Optional[Callable[[np.ndarray, int], np.ndarray]] = None) -> np.ndarray:
    """:func:`simulate_1f1b` of every row of ``stage_times`` (``[ranks, M]``) at once. ``sync(start, j)``, if
    given, moves the start times of micro-batch ``j``'s forward or backward across ranks before it runs (the
    dynamic-CP pool: the GPUs of one CP group start together, ``planner/dyncp/pool_sim.py``)."""
    times = np.asarray(stage_times, dtype=np.float64)
    if times.ndim != 2 or times.shape[1] == 0:
        return np.zeros(times.shape[0] if times.ndim == 2 else 0)
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


@functools.lru_cache(maxsize=64)
def _schedule_1f1b(m: int, pp: int) -> Tuple[Tuple[int, bool, int, int], ...]:
    """The 1F1B operations in a dependency-respecting order: ``(microbatch, is_backward, previous op on the
    same stage, op it waits for on a neighbouring stage)`` (indices into the order; -1 for none)."""
    orders = []
    for s in range(pp):
        warm = min(pp - s - 1, m)
        ops = [(False, j) for j in range(warm)]
        for i in range(m - warm):
            ops.append((False, warm + i))
            ops.append((True, i))
        ops.extend((True, j) for j in range(m - warm, m))
        orders.append(ops)
    index: Dict[Tuple[int, bool, int], int] = {}
    out: List[Tuple[int, bool, int, int]] = []
    pos = [0] * pp
    last = [-1] * pp
    while len(out) < 2 * m * pp:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                is_b, j = orders[s][pos[s]]
                if is_b:
                    dep_key = (s, False, j) if s == pp - 1 else (s + 1, True, j)
                else:
                    dep_key = None if s == 0 else (s - 1, False, j)
                if dep_key is not None and dep_key not in index:
                    break
                dep = index[dep_key] if dep_key is not None else -1
                index[(s, is_b, j)] = len(out)
                out.append((j, is_b, last[s], dep))
                last[s] = len(out) - 1
                pos[s] += 1
                progressed = True
        if not progressed:  # pragma: no cover - the schedule is deadlock-free by construction
            raise RuntimeError("1F1B schedule deadlocked")
    return tuple(out)


__all__ = ["simulate_1f1b", "simulate_1f1b_batch"]
