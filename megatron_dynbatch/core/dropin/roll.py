"""ROLL's dynamic batching (``roll/utils/dynamic_batching.py::dynamic_batching_shard``, the entry point behind
``max_tokens_per_microbatch_in_train``) with this project's guarantees -- the pure part;
:mod:`megatron_dynbatch.integrations.roll` adds the DataProto glue.

Contract kept (ROLL, read Aug 2026): the batch is reordered so that the equal chunks ROLL's dispatch sends to the
``dp`` ranks are the shards; every shard holds ``n / dp`` samples; ``micro_batch_indices`` are ``[start, end)``
ranges shared by all shards, ascending and tiling the shard; ``micro_batch_lengths[j]`` is the padded length
(a multiple of ``sequence_length_round``, at least one round) every shard's ``j``-th micro-batch is cut to
(``[b, s]`` padded micro-batches, not packed); ``b_j * s_j <= max_tokens_per_microbatch``; with pipeline and
virtual pipeline parallelism the count is raised by splitting micro-batches; a sample whose rounded length is
over the budget is an error.

What changes: ROLL sorts by length, strides the sorted samples over ranks and closes a micro-batch greedily
when the next row would not fit; under VPP it rounds the count up to a multiple of ``pp`` (Megatron wants
``microbatch_group_size_per_vp_stage``'s rule) and asserts when too few micro-batches can be split. Here the
rows are cut by dynamic programming to minimise the cost model's time of the padded micro-batches (overhead per
micro-batch against padding waste; ROLL's greedy cut only minimises the count), the count follows Megatron's
exact interleaving rule (:class:`~megatron_dynbatch.core.planner.counts.CountRule`), samples are dealt to
ranks row by row in a snake (rank ``0..dp-1``, then ``dp-1..0``) so real tokens per rank even out, and a
sample over the budget raises :class:`OversizeSampleError` naming it. With padded micro-batches shared by
all shards every rank runs the same padded work, so the cap and the count are what balance means here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np

from ..checks import as_int
from ..cost_model import CostModel
from ..errors import DynBatchConfigError, OversizeSampleError
from ..parallel import ParallelConfig
from ..planner.counts import CountRule
from ..planner.inputs import check_lengths

__all__ = ["RollShard", "roll_shard"]

#: (counts x rows) the dynamic programme may evaluate; beyond it, the greedy cut plus splits
DP_BUDGET = 60_000
#: counts scored: from the fewest that fit ``m0`` up to ``max(MAX_COUNT_FACTOR * m0, m0 + EXTRA_COUNTS)``
EXTRA_COUNTS = 16
MAX_COUNT_FACTOR = 4


@dataclass
class RollShard:
    """The reordering and the shared micro-batch layout of one call."""

    order: List[int]                        # global sample index at each position of the reordered batch
    micro_batch_indices: List[List[int]]    # [start, end) per micro-batch, positions inside a shard
    micro_batch_lengths: List[int]          # padded length of each micro-batch
    shard_size: int

    def rank_micro_batches(self) -> List[List[List[int]]]:
        """``[rank][j]`` -> global sample indices (for scoring)."""
        n = self.shard_size
        return [[self.order[r * n + a:r * n + b] for a, b in self.micro_batch_indices]
                for r in range(len(self.order) // n)]


def roll_shard(lengths, dp: int, max_tokens_per_microbatch: int, sequence_length_round: int,
               pipeline_model_parallel_size: int = 1, virtual_pipeline_model_parallel_size: Optional[int] = None,
               microbatch_group_size_per_vp_stage: Optional[int] = None, *, model: Any = None,
               cost_model: Optional[CostModel] = None) -> RollShard:
    """See the module docstring."""
    lens = check_lengths(lengths)
    dp = as_int(dp, "dp_size", minimum=1)
    cap = as_int(max_tokens_per_microbatch, "max_tokens_per_microbatch", minimum=1)
    rnd = as_int(sequence_length_round, "sequence_length_round", minimum=1)
    if lens.size % dp:
        raise DynBatchConfigError("dp_size", dp, f"the batch of {lens.size} samples does not split into {dp} equal "
                                  "shards", f"pass a multiple of {dp} samples")
    pp = as_int(pipeline_model_parallel_size or 1, "pipeline_model_parallel_size", minimum=1)
    vpp = 1 if not virtual_pipeline_model_parallel_size else as_int(virtual_pipeline_model_parallel_size,
                                                                    "virtual_pipeline_model_parallel_size", minimum=1)
    par = ParallelConfig(dp=1, pp=pp, vpp=vpp if pp > 1 else 1,
                         microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage if vpp > 1 else None)
    rule = CountRule(par)
    if cost_model is None:
        cost_model = CostModel.from_model(model, par) if model is not None else CostModel.tokens_only(par)
    cm = cost_model.with_layout(par)

    order = np.lexsort((np.arange(lens.size), lens))  # ascending length, ties by index
    rows = order.reshape(-1, dp)
    s = np.maximum(-(-lens[rows].max(axis=1) // rnd) * rnd, rnd)
    if int(s[-1]) > cap:
        i = int(rows[-1][np.argmax(lens[rows[-1]])])
        raise OversizeSampleError("max_tokens_per_microbatch", cap,
                                  f"sample {i} has {int(lens[i])} tokens, {int(s[-1])} after rounding to "
                                  f"{rnd}, more than a micro-batch may hold",
                                  f"raise max_tokens_per_microbatch_in_train to at least {int(s[-1])}, or truncate")
    bounds = _cut(s, cap, rule, cm)
    shard = [[] for _ in range(dp)]
    for i, row in enumerate(rows.tolist()):
        for r, sample in enumerate(row if i % 2 == 0 else row[::-1]):
            shard[r].append(int(sample))
    return RollShard(order=[i for r in shard for i in r],
                     micro_batch_indices=[[a, b] for a, b in zip(bounds[:-1], bounds[1:])],
                     micro_batch_lengths=[int(s[b - 1]) for b in bounds[1:]], shard_size=rows.shape[0])


def _cut(s: np.ndarray, cap: int, rule: CountRule, cm: CostModel) -> List[int]:
    """Row boundaries ``0 = b_0 < ... < b_M = R`` of the cheapest valid cut (see the module docstring)."""
    rows = s.size
    width = np.maximum(cap // s, 1)                # rows a micro-batch ending at row j-1 may hold
    greedy = _greedy(s, cap)
    m0 = rule.next(len(greedy) - 1)
    if m0 > rows:
        raise DynBatchConfigError("micro-batch count", m0,
                                  f"the interleaved pipeline needs {m0} micro-batches but a shard has {rows} samples",
                                  "pass more samples per DP rank, or lower pp / vpp")
    hi = min(rows, max(MAX_COUNT_FACTOR * m0, m0 + EXTRA_COUNTS), max(m0, DP_BUDGET // rows))
    cands = [m for m in range(m0, hi + 1) if rule.is_valid(m)]
    if m0 * rows > DP_BUDGET:
        return _split(greedy, s, m0)
    best = None
    for m, bounds in _dp(s, width, cands, cm).items():
        b = np.asarray(bounds)
        size = np.diff(b)
        times = cm.microbatch_time(size * s[b[1:] - 1], size * s[b[1:] - 1].astype(np.float64) ** 2)
        t = cm.rank_time(times)
        if best is None or t < best[0] - 1e-15:
            best = (t, bounds)
    return best[1]


def _greedy(s: np.ndarray, cap: int) -> List[int]:
    """ROLL's cut: extend the micro-batch while ``rows * padded length`` fits (the fewest micro-batches)."""
    bounds = [0]
    start = 0
    for j in range(1, s.size + 1):
        if (j - start) * int(s[j - 1]) > cap:
            bounds.append(j - 1)
            start = j - 1
    bounds.append(s.size)
    return bounds


def _split(bounds: List[int], s: np.ndarray, target: int) -> List[int]:
    """Split the micro-batch with the most padded tokens in two until ``target`` (halves keep the cap)."""
    b = list(bounds)
    while len(b) - 1 < target:
        area = [(b[k + 1] - b[k]) * int(s[b[k + 1] - 1]) if b[k + 1] - b[k] > 1 else -1 for k in range(len(b) - 1)]
        k = int(np.argmax(area))
        b.insert(k + 1, (b[k] + b[k + 1]) // 2)
    return b


def _dp(s: np.ndarray, width: np.ndarray, counts: List[int], cm: CostModel) -> dict:
    """For each count in ``counts``, the cut minimising the summed micro-batch times (rows ascending, so a
    micro-batch's padded length is that of its last row)."""
    rows = s.size
    inf = np.inf
    f = np.full(rows + 1, inf)
    f[0] = 0.0
    back = []
    out = {}
    sf = s.astype(np.float64)
    for m in range(1, max(counts) + 1):
        g = np.full(rows + 1, inf)
        arg = np.zeros(rows + 1, dtype=np.int64)
        for j in range(m, rows + 1):
            lo = max(m - 1, j - int(width[j - 1]))
            i = np.arange(lo, j)
            b = j - i
            cost = f[i] + cm.microbatch_time(b * sf[j - 1], b * sf[j - 1] ** 2)
            k = int(np.argmin(cost))
            g[j], arg[j] = cost[k], i[k]
        back.append(arg)
        f = g
        if m in counts and np.isfinite(f[rows]):
            bounds = [rows]
            for level in range(m - 1, -1, -1):
                bounds.append(int(back[level][bounds[-1]]))
            out[m] = bounds[::-1]
    return out
