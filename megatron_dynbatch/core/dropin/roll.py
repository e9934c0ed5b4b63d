"""ROLL's dynamic batching (``roll/utils/dynamic_batching.py::dynamic_batching_shard``, the entry point behind
``max_tokens_per_microbatch_in_train``) with this project's guarantees -- the pure part;
:mod:`megatron_dynbatch.integrations.roll` adds the DataProto glue.

Contract kept (ROLL, read Aug 2026): the batch is reordered so that the equal chunks ROLL's dispatch sends to the
``dp`` ranks are the shards; every shard holds ``n / dp`` samples; ``micro_batch_indices`` are ``[start, end)``
ranges shared by all shards, ascending and tiling the shard; ``micro_batch_lengths[j]`` is the padded length
(a multiple of ``sequence_length_round``, at least one round) every shard's ``j``-th micro-batch is cut to
(``[b, s]`` padded micro-batches, not packed); ``b_j * s_j <= max_tokens_per_microbatch``; a sample whose
rounded length is over the budget is an error (an ``AssertionError`` in ROLL: here an
:class:`~megatron_dynbatch.core.errors.OversizeAssertionError`, which is both).

**The micro-batch count is ROLL's.** ROLL's training loop groups ``ga_steps`` consecutive micro-batches into
one optimizer step (``make_mini_batch_iter_for_dynamic_batching``), so one micro-batch more can add an
optimizer step. The count is therefore the one ROLL computes -- its greedy cut (the fewest micro-batches),
raised to a multiple of ``pp`` when the pipeline is interleaved, which ROLL (like megatron-core 0.16.1) decides
by ``pp > 1`` and a virtual size that is set, **even to 1** -- moved to Megatron's exact interleaving rule when
``microbatch_group_size_per_vp_stage`` is passed. With ``ga_steps`` the caller allows any valid count that keeps
ROLL's number of optimizer steps (``ceil(M / ga_steps)``). The count is ROLL's whatever the rows hold, rows
whose samples are all empty (an all-zero ``attention_mask``) included: ROLL's cut gives its first micro-batch at
least one round, but a later one that holds only empty rows gets length 0 and any number of them. Every
micro-batch here is at least one round long while ROLL's count allows it; where it does not (only where ROLL's
own cut has such a length-0 micro-batch), the first ``k`` rows, all empty, form one micro-batch of length 0 --
``k`` the empty rows, or fewer where the rest must keep a row per micro-batch -- and the rest is cut as usual into
ROLL's count less one. ``b x 0 = 0`` tokens keeps the budget; ROLL's own micro-batch iterator then narrows that
micro-batch's columns to 0 (and fails on fields one column narrower, as it does on ROLL's own length-0 ones).

What changes: ROLL closes a micro-batch greedily when the next row would not fit, and splits the largest ones
to reach a multiple of ``pp``. Here the rows are cut, for the same count, by dynamic programming to minimise
the cost model's time of the padded micro-batches (per-micro-batch overhead against padding waste), samples are
dealt to ranks row by row in a snake (rank ``0..dp-1``, then ``dp-1..0``) so real tokens per rank even out, and
a sample over the budget raises naming it. With padded micro-batches shared by all shards every rank runs the
same padded work, so the cap and the count are what balance means here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

import numpy as np

from ..checks import as_budget, as_int
from ..cost_model import CostModel
from ..errors import DynBatchConfigError, OversizeSampleError
from ..parallel import ParallelConfig
from ..planner.counts import CountRule
from ..planner.inputs import check_lengths
from .words import ROLL_WORDS, speaks

if TYPE_CHECKING:
    from ..model_spec import ModelLike

__all__ = ["RollShard", "roll_count_rule", "roll_shard"]

#: (counts x rows) the dynamic programme may evaluate; beyond it, the greedy cut plus splits
DP_CELLS = 60_000


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


def roll_count_rule(pp: int, vpp: Optional[int], microbatch_group_size_per_vp_stage: Optional[int] = None
                    ) -> CountRule:
    """The counts Megatron accepts for ROLL's pipeline arguments. ROLL and megatron-core 0.16.1 run the
    interleaved schedule when ``pp > 1`` and the virtual size is set at all (``vpp=1`` included); its rule
    depends only on ``pp`` and ``N`` (default ``pp``: then a multiple of ``pp``, ROLL's own rounding)."""
    if pp < 2 or not vpp:
        return CountRule(ParallelConfig(dp=1, pp=pp))
    n = microbatch_group_size_per_vp_stage
    return CountRule(ParallelConfig(dp=1, pp=pp, vpp=max(int(vpp), 2), microbatch_group_size_per_vp_stage=n))


@speaks(ROLL_WORDS, assertion=True)
def roll_shard(lengths, dp: int, max_tokens_per_microbatch: int, sequence_length_round: int,
               pipeline_model_parallel_size: int = 1, virtual_pipeline_model_parallel_size: Optional[int] = None,
               microbatch_group_size_per_vp_stage: Optional[int] = None, *, ga_steps: Optional[int] = None,
               model: Optional[ModelLike] = None, cost_model: Optional[CostModel] = None) -> RollShard:
    """See the module docstring. ``ga_steps``: ROLL's ``gradient_accumulation_steps`` for a training batch --
    lets the count grow while ``ceil(M / ga_steps)`` (the optimizer steps) stays ROLL's; ``None``: ROLL's count."""
    lens = check_lengths(lengths)
    dp = as_int(dp, "dp_size", minimum=1)
    cap = as_budget(max_tokens_per_microbatch, "max_tokens_per_microbatch", trainer="ROLL")
    rnd = as_int(sequence_length_round, "sequence_length_round", minimum=1)
    if lens.size % dp:
        raise DynBatchConfigError("dp_size", dp, f"the batch of {lens.size} samples does not split into {dp} equal "
                                  "shards", f"pass a multiple of {dp} samples")
    pp = as_int(pipeline_model_parallel_size or 1, "pipeline_model_parallel_size", minimum=1)
    vpp = None if virtual_pipeline_model_parallel_size is None else as_int(
        virtual_pipeline_model_parallel_size, "virtual_pipeline_model_parallel_size", minimum=0)
    ga = None if ga_steps is None else as_int(ga_steps, "ga_steps", minimum=1,
                                              fix="pass gradient_accumulation_steps, or None for ROLL's count")
    rule = roll_count_rule(pp, vpp, microbatch_group_size_per_vp_stage)
    par = ParallelConfig(dp=1, pp=pp, vpp=vpp if vpp and pp > 1 else 1,
                         microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage if vpp and vpp > 1
                         and pp > 1 else None)
    if cost_model is None:
        cost_model = CostModel.from_model(model, par) if model is not None else CostModel.tokens_only(par)
    cm = cost_model.with_layout(par)

    order = np.lexsort((np.arange(lens.size), lens))  # ascending length, ties by index
    rows = order.reshape(-1, dp)
    rounded = -(-lens[rows].max(axis=1) // rnd) * rnd  # ROLL's padded row length (0 for an all-empty row)
    longest = max(int(rounded[-1]), rnd)
    if longest > cap:
        i = int(rows[-1][np.argmax(lens[rows[-1]])])
        raise OversizeSampleError("max_tokens_per_microbatch", cap,
                                  f"sample {i} has {int(lens[i])} tokens, {longest} after rounding to "
                                  f"{rnd}, more than a micro-batch may hold",
                                  f"raise max_tokens_per_microbatch_in_train to at least {longest}, or truncate")
    bounds, s = _cut(rounded, rnd, cap, rule, cm, ga)
    shard = [[] for _ in range(dp)]
    for i, row in enumerate(rows.tolist()):
        for r, sample in enumerate(row if i % 2 == 0 else row[::-1]):
            shard[r].append(int(sample))
    return RollShard(order=[i for r in shard for i in r],
                     micro_batch_indices=[[a, b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)],
                     micro_batch_lengths=[int(s[b - 1]) for b in bounds[1:]], shard_size=rows.shape[0])


def roll_greedy_count(rounded: np.ndarray, rnd: int, cap: int) -> int:
    """How many micro-batches ROLL's greedy cut makes of rows with these rounded lengths (ascending): a
    micro-batch grows while ``rows x its longest row`` fits ``cap``; the first one's length is at least one
    round, later ones start from their first row's length (0 for an empty row, as in ROLL)."""
    count, size, longest = 1, 0, rnd
    for r in rounded.tolist():
        if (size + 1) * max(longest, r) <= cap:
            size, longest = size + 1, max(longest, r)
        else:
            count, size, longest = count + 1, 1, r
    return count


def _cut(rounded: np.ndarray, rnd: int, cap: int, rule: CountRule, cm: CostModel, ga_steps: Optional[int]
         ) -> Tuple[List[int], np.ndarray]:
    """Row boundaries ``0 = b_0 < ... < b_M = R`` of the cheapest cut with an allowed count (see the module
    docstring: ROLL's count, or with ``ga_steps`` any valid count with as many optimizer steps), and each row's
    padded length in that cut (a micro-batch's length is its last row's)."""
    rows = rounded.size
    target = rule.next(roll_greedy_count(rounded, rnd, cap))
    if target > rows:
        raise DynBatchConfigError("pipeline_model_parallel_size", rule.parallel.pp,
                                  f"the interleaved pipeline needs {target} micro-batches but a shard has {rows} "
                                  "samples", "pass more samples per DP rank, or lower pp / vpp")
    hi = target if ga_steps is None else min(rows, -(-target // ga_steps) * ga_steps, max(target, DP_CELLS // rows))
    s = np.maximum(rounded, rnd)
    lo = max(target, rule.next(len(_greedy(s, cap)) - 1))
    if lo <= hi:  # every micro-batch at least one round long
        return _cheapest(s, cap, [m for m in range(lo, hi + 1) if rule.is_valid(m)], cm), s
    # ROLL's count needs a length-0 micro-batch of empty rows (its own cut has one): the first k rows
    k = min(int(np.count_nonzero(rounded == 0)), rows - target + 1)
    s[:k] = 0
    rest = _cheapest(s[k:], cap, [target - 1], cm)
    return [0] + [k + b for b in rest], s


def _cheapest(s: np.ndarray, cap: int, cands: List[int], cm: CostModel) -> List[int]:
    """The cut of rows with padded lengths ``s`` (ascending, each at most ``cap``) with the least modelled time
    among the counts ``cands`` (each at least the greedy count and at most the rows): dynamic programming, or the
    greedy cut plus splits where that would cost too much."""
    rows = s.size
    if min(cands) * rows > DP_CELLS:
        return _split(_greedy(s, cap), s, min(cands))
    width = np.maximum(cap // s, 1)                # rows a micro-batch ending at row j-1 may hold
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
