"""Where the GPUs of a layout sit: which CP groups stay inside one node and which cross nodes.

megatron-core numbers the ranks of the dense layers in the order ``tp-cp-ep-dp-pp`` (the default ``order`` of
``parallel_state.initialize_model_parallel``; tensor parallelism fastest; expert parallelism is carved out of
data parallelism for the expert layers only, so it does not move these ranks)::

    global rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

and a node holds ``gpus_per_node`` consecutive ranks (``rank // gpus_per_node``; ``ParallelConfig.gpus_per_node``,
default 8). Pool GPU ``i = dp_rank * cp + cp_rank`` of pipeline stage ``s`` (the dynamic-CP pool,
``planner/dyncp/pool.py``) holds the ranks ``tp * i + s * tp * cp * dp`` up to ``+ tp - 1``, so the CP group of
pool GPUs ``start .. start + size - 1`` covers the consecutive ranks ``[tp * start, tp * (start + size))`` shifted
by the stage's offset. It **crosses nodes** when that range does in ANY stage (every stage runs the same plan, so
the slowest stage's ring sets the pace). A ring whose GPUs span nodes moves every step over the inter-node network
(the slowest link paces a ring), which :meth:`~.cost_model.CostModel.cp_comm_time` prices separately.

Pure functions of the layout; no torch.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, Iterable, Tuple

import numpy as np

from .parallel import ParallelConfig


@functools.lru_cache(maxsize=256)
def _stage_offsets(width: int, n: int, pp: int) -> np.ndarray:
    """The distinct rank offsets ``(s * width) % n`` of the pipeline stages modulo a node of ``n`` ranks, sorted:
    every multiple of ``gcd(width, n)`` once the stages go round the whole period, else the stages' own."""
    g = math.gcd(width, n)
    if min(pp, n) >= n // g:
        return np.arange(0, n, g, dtype=np.int64)
    return np.unique(np.arange(min(pp, n), dtype=np.int64) * width % n)


def group_spans_nodes(start: int, size: int, par: ParallelConfig) -> bool:
    """Whether the CP group of pool GPUs ``start .. start + size - 1`` (module docstring) crosses a node boundary
    in some pipeline stage."""
    return bool(groups_span_nodes(np.asarray([start]), np.asarray([size]), par)[0])


def groups_span_nodes(starts, sizes, par: ParallelConfig) -> np.ndarray:
    """:func:`group_spans_nodes` of many groups at once (``starts``, ``sizes``: arrays of pool GPUs). A group of
    ``L = tp * size`` ranks starting at position ``p`` of its node in some stage crosses a boundary iff ``p + L >
    n``; the largest position over the stages is the largest offset that does not wrap (found by a binary search
    over the sorted offsets) or, wrapped, the largest offset: ``O(groups log offsets)``, however many stages."""
    n = par.gpus_per_node
    first = par.tp * np.asarray(starts, dtype=np.int64)
    span = par.tp * np.asarray(sizes, dtype=np.int64)
    offsets = _stage_offsets(par.tp * par.cp * par.dp, n, par.pp)
    pos = first % n
    below = np.searchsorted(offsets, n - pos, side="left") - 1  # the largest offset with pos + off < n
    best = np.where(below >= 0, pos + offsets[np.maximum(below, 0)], -1)
    wrapped = pos + offsets[-1] - n  # with the largest offset, if that one wraps
    best = np.maximum(best, np.where(pos + offsets[-1] >= n, wrapped, -1))
    return (span > n) | (best + span > n)


@functools.lru_cache(maxsize=256)
def _spans_cached(par: ParallelConfig, blocks: Tuple[Tuple[int, int], ...]) -> Tuple[Tuple[int, bool], ...]:
    out: Dict[int, bool] = {}
    for start, size in blocks:
        out[size] = out.get(size, False) or group_spans_nodes(start, size, par)
    return tuple(sorted(out.items()))


def spans_by_size(par: ParallelConfig, blocks: Iterable[Tuple[int, int]]) -> Dict[int, bool]:
    """For each group size among ``blocks`` (``(start, size)`` pairs): whether ANY group of that size crosses a
    node boundary -- the planner prices a size once, conservatively (with ``dp``, ``cp``, ``tp`` and
    ``gpus_per_node`` powers of two, groups of one size either all cross or none does)."""
    return dict(_spans_cached(par, tuple(blocks)))


def fixed_cp_spans_nodes(par: ParallelConfig) -> bool:
    """Whether the layout's own CP groups (each DP rank's ``cp`` GPUs) cross nodes."""
    return any(group_spans_nodes(r * par.cp, par.cp, par) for r in range(min(par.dp, par.gpus_per_node)))


__all__ = ["group_spans_nodes", "groups_span_nodes", "spans_by_size", "fixed_cp_spans_nodes"]
