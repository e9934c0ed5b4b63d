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
from typing import Dict, Iterable, Tuple

import numpy as np

from .parallel import ParallelConfig


def _stage_offsets(par: ParallelConfig) -> Tuple[int, ...]:
    """The distinct rank offsets of the pipeline stages modulo a node (at most ``gpus_per_node`` of them)."""
    width = par.tp * par.cp * par.dp
    return tuple(sorted({(s * width) % par.gpus_per_node for s in range(min(par.pp, par.gpus_per_node))}))


def group_spans_nodes(start: int, size: int, par: ParallelConfig) -> bool:
    """Whether the CP group of pool GPUs ``start .. start + size - 1`` (module docstring) crosses a node boundary
    in some pipeline stage."""
    n = par.gpus_per_node
    first, last = par.tp * int(start), par.tp * (int(start) + int(size)) - 1
    return any((first + off) // n != (last + off) // n for off in _stage_offsets(par))


def groups_span_nodes(starts, sizes, par: ParallelConfig) -> np.ndarray:
    """:func:`group_spans_nodes` of many groups at once (``starts``, ``sizes``: arrays of pool GPUs)."""
    n = par.gpus_per_node
    first = par.tp * np.asarray(starts, dtype=np.int64)
    last = par.tp * (np.asarray(starts, dtype=np.int64) + np.asarray(sizes, dtype=np.int64)) - 1
    out = np.zeros(first.shape, dtype=bool)
    for off in _stage_offsets(par):
        out |= (first + off) // n != (last + off) // n
    return out


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
