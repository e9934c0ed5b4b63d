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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np

from ...alignment import Alignment
from ...errors import DynBatchConfigError
from ...parallel import ParallelConfig
from ...topology import groups_span_nodes


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
    """The CP-group tree of a ``dp x cp`` pool (module docstring). Nodes are numbered top-down, left to right.

    The tree is built level by level as arrays (``starts``, ``sizes``, parents, first children, depths: NumPy,
    so a pool of a million GPUs takes milliseconds); :attr:`nodes` makes a :class:`PoolNode` when one is read,
    and :meth:`node` finds a block by walking down from the root."""

    def __init__(self, dp: int, cp: int) -> None:
        if dp < 1 or cp < 1:
            raise DynBatchConfigError("parallel", f"dp={dp}, cp={cp}", "the pool needs dp >= 1 and cp >= 1",
                                      "pass the running layout")
        self.dp, self.cp = int(dp), int(cp)
        self.size = self.dp * self.cp
        starts, sizes, parents, depths, first_child = [], [], [], [], []
        level_start = np.zeros(1, dtype=np.int64)
        level_size = np.full(1, self.size, dtype=np.int64)
        level_parent = np.full(1, -1, dtype=np.int64)
        count, depth = 0, 0
        while level_start.size:  # breadth-first: parents get lower indices than their children
            starts.append(level_start)
            sizes.append(level_size)
            parents.append(level_parent)
            depths.append(np.full(level_start.size, depth, dtype=np.int64))
            split = np.flatnonzero(level_size > 1)
            half = self._split_sizes(level_size[split])
            kids = np.full(level_start.size, -1, dtype=np.int64)
            kids[split] = count + level_start.size + 2 * np.arange(split.size)
            first_child.append(kids)
            count += level_start.size
            level_start = np.stack((level_start[split], level_start[split] + half), axis=1).ravel()
            level_size = np.stack((half, level_size[split] - half), axis=1).ravel()
            level_parent = np.repeat(count - kids.size + split, 2)
            depth += 1
        #: per node: first GPU, GPUs, parent (-1 for the root), first child (-1 for a leaf), depth
        self.starts = np.concatenate(starts)
        self.sizes_of = np.concatenate(sizes)
        self.parents = np.concatenate(parents)
        self.first_child = np.concatenate(first_child)
        self.depths = np.concatenate(depths)
        self.nodes = _Nodes(self)
        #: the leaf node of every GPU (a NumPy array)
        self.leaves = np.empty(self.size, dtype=np.int64)
        is_leaf = self.first_child < 0
        self.leaves[self.starts[is_leaf]] = np.flatnonzero(is_leaf)
        self.sizes: Tuple[int, ...] = tuple(int(x) for x in np.unique(self.sizes_of))
        self._spans: Dict[ParallelConfig, Dict[int, bool]] = {}

    def _split_sizes(self, size: np.ndarray) -> np.ndarray:
        """Size of the first child of nodes of ``size`` (each > 1): on DP-rank boundaries while a node holds
        several DP ranks, then inside one DP rank; the largest power of two strictly below (module docstring)."""
        ranks = size // self.cp
        several = size > self.cp
        below = np.where(several, ranks, size)
        return _largest_pow2_below_array(below) * np.where(several, self.cp, 1)

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

    @functools.cached_property
    def leaf_of(self) -> Tuple[int, ...]:
        """The leaf node of every GPU (:attr:`leaves` as a tuple)."""
        return tuple(self.leaves.tolist())

    def _find(self, start: int, size: int) -> int:
        """Index of the node of GPUs ``start .. start + size - 1``, or -1: down from the root through the child
        holding ``start`` (``O(depth)``)."""
        v = 0
        if not (0 <= start and size >= 1 and start + size <= self.size):
            return -1
        while True:
            if int(self.starts[v]) == start and int(self.sizes_of[v]) == size:
                return v
            c = int(self.first_child[v])
            if c < 0:
                return -1
            v = c if start < int(self.starts[c + 1]) else c + 1

    def node(self, start: int, size: int) -> PoolNode:
        """The node of GPUs ``start .. start + size - 1``; a ``DynBatchConfigError`` if it is not a tree group."""
        idx = self._find(int(start), int(size))
        if idx < 0:
            raise DynBatchConfigError("group", (start, size), f"is not a CP group of the dp={self.dp} x cp={self.cp} "
                                      f"pool tree", "use groups of PoolTree(dp, cp).nodes (plan_global_batch does)")
        return self.nodes[idx]

    def has_block(self, start: int, size: int) -> bool:
        return self._find(int(start), int(size)) >= 0

    def dp_rank_node(self, r: int) -> PoolNode:
        """The node of DP rank ``r``'s ``cp`` GPUs (the layout's own CP group)."""
        return self.node(r * self.cp, self.cp)

    def path(self, gpu: int) -> List[int]:
        """Node indices from the root down to GPU ``gpu``'s leaf."""
        out = [int(self.leaves[gpu])]
        while self.parents[out[-1]] >= 0:
            out.append(int(self.parents[out[-1]]))
        return out[::-1]

    def spans_by_size(self, par: ParallelConfig) -> Dict[int, bool]:
        """For each group size of the tree: whether ANY of its groups crosses a node boundary in ``par``'s
        layout (:func:`~...topology.spans_by_size`, vectorised over the nodes; remembered per layout)."""
        found = self._spans.get(par)
        if found is None:
            crossing = set(np.unique(self.sizes_of[groups_span_nodes(self.starts, self.sizes_of, par)]).tolist())
            found = self._spans[par] = {s: s in crossing for s in self.sizes}
        return dict(found)


class _Nodes(Sequence):
    """:attr:`PoolTree.nodes`: the nodes in index order, each a :class:`PoolNode` made when first read."""

    def __init__(self, tree: PoolTree) -> None:
        self._tree = tree
        self._made: Dict[int, PoolNode] = {}

    def __len__(self) -> int:
        return int(self._tree.starts.size)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = int(index)
        if i < 0:
            i += len(self)
        found = self._made.get(i)
        if found is None:
            t = self._tree
            if not 0 <= i < len(self):
                raise IndexError(index)
            c = int(t.first_child[i])
            found = self._made[i] = PoolNode(i, int(t.starts[i]), int(t.sizes_of[i]), int(t.parents[i]),
                                             () if c < 0 else (c, c + 1), int(t.depths[i]))
        return found


def _largest_pow2_below_array(n: np.ndarray) -> np.ndarray:
    """:func:`_largest_pow2_below` of every element (each ``>= 2``): ``2 ** floor(log2(n - 1))``, exact for the
    integers a pool holds (``frexp`` of a double)."""
    exponent = np.frexp((np.asarray(n, dtype=np.int64) - 1).astype(np.float64))[1]
    return np.left_shift(np.ones_like(exponent, dtype=np.int64), exponent - 1)


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
