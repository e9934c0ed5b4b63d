"""The GPU pool of dynamic context parallelism and the CP groups a plan may use.

With dynamic CP the ``dp * cp`` GPUs of one pipeline stage (Megatron's data-parallel-with-context-parallel
group, ranked ``dp_rank * cp + cp_rank``) form one pool; every micro-batch runs on a *group* of consecutive
pool GPUs. The groups form a tree (:class:`PoolTree`), built so that

* each DP rank's ``cp`` GPUs are one node (the layout's own CP group: the fixed-CP plan is a special case);
* above that, DP ranks pair up binarily (``n`` ranks split into the largest power of two below ``n`` and the
  rest); inside a DP rank, its GPUs split the same way down to single GPUs.

With ``dp`` and ``cp`` powers of two every node is an aligned power-of-two block -- exactly the groups
megatron-core's ``parallel_state`` builds for hybrid context parallelism (``create_hybrid_dp_cp_groups``) plus
the whole pool and single GPUs; other layouts give non-power-of-two nodes (e.g. ``dp = 3``: a root of ``3 * cp``
GPUs), for which the Megatron edge creates its own process groups. A node's size is its CP degree, and a
micro-batch on it is padded by that degree's rules (:func:`group_alignment`: ``2 * size`` per sequence).

Planning on the tree (not on arbitrary GPU subsets) is what keeps the plan cheap and the schedule free of
waiting: a node's micro-batches run before its children's, so the GPUs of a group always arrive at it
together (see :mod:`.orchestrate`). Pure Python; no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Tuple

from ...alignment import Alignment
from ...errors import DynBatchConfigError
from ...parallel import ParallelConfig


def _largest_pow2_below(n: int) -> int:
    """The largest power of two strictly below ``n`` (``n >= 2``)."""
    p = 1
    while p * 2 < n:
        p *= 2
    return p


@dataclass(frozen=True)
class PoolNode:
    """One CP group of the pool: GPUs ``start .. start + size - 1``; ``parent`` is ``-1`` for the root."""

    index: int
    start: int
    size: int
    parent: int
    children: Tuple[int, ...]
    depth: int

    @property
    def stop(self) -> int:
        return self.start + self.size


class PoolTree:
    """The CP-group tree of a ``dp x cp`` pool (module docstring). Nodes are numbered top-down, left to right."""

    def __init__(self, dp: int, cp: int) -> None:
        if dp < 1 or cp < 1:
            raise DynBatchConfigError("parallel", f"dp={dp}, cp={cp}", "the pool needs dp >= 1 and cp >= 1",
                                      "pass the running layout")
        self.dp, self.cp = int(dp), int(cp)
        self.size = self.dp * self.cp
        nodes: List[PoolNode] = []
        pending = [(0, self.size, -1, 0)]
        raw: List[list] = []
        while pending:  # breadth-first: parents get lower indices than their children
            nxt = []
            for start, size, parent, depth in pending:
                idx = len(raw)
                raw.append([start, size, parent, [], depth])
                if parent >= 0:
                    raw[parent][3].append(idx)
                for c_start, c_size in self._split(start, size):
                    nxt.append((c_start, c_size, idx, depth + 1))
            pending = nxt
        for idx, (start, size, parent, children, depth) in enumerate(raw):
            nodes.append(PoolNode(idx, start, size, parent, tuple(children), depth))
        self.nodes: Tuple[PoolNode, ...] = tuple(nodes)
        self._by_block: Dict[Tuple[int, int], int] = {(n.start, n.size): n.index for n in nodes}
        self.leaf_of: Tuple[int, ...] = tuple(self._by_block[(g, 1)] for g in range(self.size))
        self.sizes: Tuple[int, ...] = tuple(sorted({n.size for n in nodes}))

    def _split(self, start: int, size: int) -> List[Tuple[int, int]]:
        if size > self.cp:  # several DP ranks: split on DP-rank boundaries
            h = _largest_pow2_below(size // self.cp) * self.cp
        elif size > 1:      # inside one DP rank
            h = _largest_pow2_below(size)
        else:
            return []
        return [(start, h), (start + h, size - h)]

    # ------------------------------------------------------------------ queries
    @property
    def root(self) -> PoolNode:
        return self.nodes[0]

    def node(self, start: int, size: int) -> PoolNode:
        """The node of GPUs ``start .. start + size - 1``; a ``DynBatchConfigError`` if it is not a tree group."""
        idx = self._by_block.get((int(start), int(size)))
        if idx is None:
            raise DynBatchConfigError("group", (start, size), f"is not a CP group of the dp={self.dp} x cp={self.cp} "
                                      f"pool tree", "use groups of PoolTree(dp, cp).nodes (plan_global_batch does)")
        return self.nodes[idx]

    def has_block(self, start: int, size: int) -> bool:
        return (int(start), int(size)) in self._by_block

    def dp_rank_node(self, r: int) -> PoolNode:
        """The node of DP rank ``r``'s ``cp`` GPUs (the layout's own CP group)."""
        return self.node(r * self.cp, self.cp)

    def path(self, gpu: int) -> List[int]:
        """Node indices from the root down to GPU ``gpu``'s leaf."""
        out = [self.leaf_of[gpu]]
        while self.nodes[out[-1]].parent >= 0:
            out.append(self.nodes[out[-1]].parent)
        return out[::-1]


@functools.lru_cache(maxsize=64)
def pool_tree(dp: int, cp: int) -> PoolTree:
    """A cached :class:`PoolTree` (trees are immutable)."""
    return PoolTree(dp, cp)


def group_alignment(parallel: ParallelConfig, size: int, tile: int) -> Alignment:
    """Padding rules of a micro-batch on a CP group of ``size`` pool GPUs: the layout's TP / sequence parallelism
    and FP8 ``tile``, with CP degree ``size`` (each sequence a multiple of ``2 * size``)."""
    return Alignment.for_layout(ParallelConfig(tp=parallel.tp, cp=int(size),
                                               sequence_parallel=parallel.sequence_parallel), tile)


__all__ = ["PoolNode", "PoolTree", "pool_tree", "group_alignment"]
