"""Dynamic CP: one candidate schedule of an optimizer step (:class:`Schedule`), as the candidates build it.

A schedule is given as the micro-batches of every pool-tree node it uses (``node_bins``: step-local sample
indices). A node's micro-batches run in consecutive slots BEFORE those of its descendants, so every GPU of a
group reaches it at the same slot index: a node's first slot is the number of micro-batches of its ancestors
(its ``offset``), and every GPU must end with the same slot count ``M`` (checked: an ``AssertionError``
otherwise, a bug in the candidate that built it).

From that the schedule derives the slot arrays the simulator reads -- ``times[j, g]`` (seconds of GPU ``g``'s
micro-batch in slot ``j``), which node and which of its micro-batches that is, and each slot's group starts --
its simulated makespan (:func:`~.pool_sim.simulate_pool`), and, with ``pp > 1``, the slot permutation with the
shortest makespan (:meth:`Schedule.arrange`: one permutation for all GPUs, so groups stay aligned). Inside a
node micro-batches are ordered longest first, unless the schedule keeps the order it was given (the fixed-CP
candidate: the fixed-layout planner already ordered each rank's micro-batches).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .plan import SlotList
from .step import Bins, StepData
from ..ordering import PATTERNS, arrangement
from .pool_sim import simulate_pool


class Schedule:
    """A candidate (module docstring): ``name`` says which one (``fixed-cp``, ``tree-<x>``, ``all-root``)."""

    def __init__(self, step: StepData, name: str, node_bins: Dict[int, Bins], *, keep_order: bool = False) -> None:
        self.step, self.name, self.keep_order = step, name, keep_order
        tree = step.tree
        self.node_bins: Dict[int, Bins] = {}
        self.node_times: Dict[int, List[float]] = {}
        self.node_tokens: Dict[int, List[int]] = {}
        by_size: Dict[int, List[int]] = {}
        for v, bins in node_bins.items():
            if bins:
                by_size.setdefault(tree.nodes[v].size, []).append(v)
        for size, nodes in by_size.items():  # one vectorised timing per group size
            tokens, times = step.bin_stats(size, [mb for v in nodes for mb in node_bins[v]])
            first = 0
            for v in nodes:
                bins = node_bins[v]
                t = times[first:first + len(bins)]
                if keep_order:
                    order = np.arange(t.size)
                else:
                    order = np.lexsort((np.arange(t.size), -t))  # longest first, ties by position
                self.node_bins[v] = [bins[k] for k in order]
                self.node_times[v] = t[order].tolist()
                self.node_tokens[v] = tokens[first:first + len(bins)][order].tolist()
                first += len(bins)
        counts = np.zeros(tree.size, dtype=np.int64)
        self.offset: Dict[int, int] = {}
        for v in sorted(self.node_bins, key=lambda x: tree.nodes[x].depth):
            node = tree.nodes[v]
            off = counts[node.start:node.stop]
            if off.min() != off.max():  # pragma: no cover - node bins always run before descendants'
                raise AssertionError("tree schedule with unequal counts inside a node")
            self.offset[v] = int(off[0])
            counts[node.start:node.stop] += len(self.node_bins[v])
        if counts.min() != counts.max():
            raise AssertionError(f"GPU slot counts differ: {counts.min()}..{counts.max()}")
        self.m = int(counts[0])
        used = {tree.nodes[v].size for v in self.node_bins}
        #: the widest group it uses, and whether any of its groups crosses nodes (the tie-break of orchestrate.py)
        self.widest = max(used, default=1)
        self.crosses_nodes = any(step.spans[s] for s in used)
        self.order = list(range(self.m))  # slot permutation (execution order)
        self._finish: Optional[np.ndarray] = None
        self._arrays()

    def _arrays(self) -> None:
        tree, m = self.step.tree, self.m
        self.times = np.zeros((m, tree.size))
        self.node_at = np.zeros((m, tree.size), dtype=np.int64)
        self.bin_at = np.zeros((m, tree.size), dtype=np.int64)
        # single-GPU nodes (most of them) in one indexed assignment; every (slot, GPU) cell has one writer
        rows: list = []
        cols: list = []
        vals: list = []
        nodes: list = []
        idx: list = []
        for v, bins in self.node_bins.items():
            node = tree.nodes[v]
            times = self.node_times[v]
            if node.stop - node.start == 1:
                k = len(times)
                rows += range(self.offset[v], self.offset[v] + k)
                cols += [node.start] * k
                vals += list(times)
                nodes += [v] * k
                idx += range(k)
                continue
            for b, t in enumerate(times):
                j = self.offset[v] + b
                self.times[j, node.start:node.stop] = t
                self.node_at[j, node.start:node.stop] = v
                self.bin_at[j, node.start:node.stop] = b
        if rows:
            self.times[rows, cols] = vals
            self.node_at[rows, cols] = nodes
            self.bin_at[rows, cols] = idx
        gpu = np.arange(tree.size)
        self.blocks = [np.flatnonzero(tree.starts[self.node_at[j]] == gpu) for j in range(m)]

    # ------------------------------------------------------------------ simulation
    def finish(self, order: Optional[Sequence[int]] = None) -> np.ndarray:
        """Each GPU's simulated finish time with the slots in ``order`` (default: the current order)."""
        order = self.order if order is None else list(order)
        cm = self.step.cm
        ep_width = self.step.par.cp * cm.ep_group if cm.ep_group > 1 else 1
        return simulate_pool(self.times[order], [self.blocks[j] for j in order], cm, ep_width=ep_width)

    def makespan(self) -> float:
        if self._finish is None:
            self._finish = self.finish()
        return float(self._finish.max())

    def arrange(self) -> None:
        """With ``pp > 1``: the slot permutation (as built / decreasing / increasing / valley by each slot's
        longest micro-batch) with the shortest simulated makespan. A schedule that keeps its order is left."""
        if self.keep_order or self.step.cm.pp == 1 or self.m < 2:
            return
        best = (self.makespan(), self.order)
        rep = self.times.max(axis=1)
        for pattern in PATTERNS:
            perm = arrangement(rep, pattern).tolist()
            f = self.finish(perm)
            if float(f.max()) < best[0] * (1 - 1e-12):
                best = (float(f.max()), perm)
                self._finish = f
        self.order = best[1]

    # ------------------------------------------------------------------ output
    def slots(self, step_samples: np.ndarray) -> Tuple[SlotList, List[int], List[float]]:
        """The slots in execution order -- each slot's groups in pool order as ``(start, size, global samples)``
        with ``step_samples`` mapping step-local to batch indices -- and each group's full packed token count and
        seconds, in the same (slot-major) order."""
        tree = self.step.tree
        glob = {v: [[int(step_samples[i]) for i in mb] for mb in bins] for v, bins in self.node_bins.items()}
        out: SlotList = []
        tokens: List[int] = []
        times: List[float] = []
        for j in self.order:
            slot = []
            for g in self.blocks[j].tolist():
                v = int(self.node_at[j, g])
                b = int(self.bin_at[j, g])
                node = tree.nodes[v]
                slot.append((node.start, node.size, glob[v][b]))
                tokens.append(int(self.node_tokens[v][b]))
                times.append(float(self.node_times[v][b]))
            out.append(slot)
        return out, tokens, times


__all__ = ["Schedule"]
