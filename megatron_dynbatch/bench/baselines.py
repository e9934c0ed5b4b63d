"""Re-implementations of the dynamic-batching schemes users run today, for the benchmark.

Every baseline is a :class:`Baseline`: a name, a description of the public behaviour it models, and a function
``(lengths, ctx) -> micro_batches`` where ``micro_batches[r][j]`` lists the sample indices of DP rank ``r``'s
``j``-th micro-batch in execution order -- the same layout as :attr:`Plan.micro_batches`. :func:`run_baseline`
scores that assignment with :func:`megatron_dynbatch.core.planner.score_assignment`, i.e. with exactly the cost model
the planner uses, so the benchmark compares like with like. Nothing here enforces the invariants the planner
guarantees (same micro-batch count on every rank, hard token cap): the baselines are measured as they behave,
and the benchmark counts what they break.

Family (``BASELINES``; :func:`get_baseline` is the factory):

* ``fixed_padded`` -- Megatron's default: a fixed micro-batch size, padded batches (see :func:`fixed_padded`);
* ``slime`` -- slime ``--use-dynamic-batch-size --balance-data`` (pack first, distribute second);
* ``slime_flops`` -- slime ``--use-dynamic-batch-size --balance-by-flops``;
* ``slime_legacy`` -- slime's scheme before it moved scheduling to the rollout side (DP split first);
* ``verl`` -- verl ``balance_batch`` + ``use_dynamic_bsz`` (``rearrange_micro_batches``);
* ``nemo_rl`` -- NeMo-RL sequence packing with the modified first-fit-decreasing packer;
* ``roll`` -- ROLL dynamic batching (padded ``[b, s]`` micro-batches; in ``EXTRA_BASELINES``, outside the
  default table, compared by ``megatron-dynbatch bench --dropins``);
* ``megatron-dp-balanced``, ``megatron-rl-packing`` (fifo), ``megatron-rl-packing-rr`` (round-robin) --
  Megatron-LM's own packing paths (:mod:`.megatron_upstream`); Megatron RL's bins are scored as the fixed
  ``[1, seq_length]`` rows they are (``fixed_bins``: padding and empty filler bins run).

The code is ours, written from the public documentation, help texts and observable behaviour of those
projects (cited per function); no code was copied. Every baseline is deterministic: ties break on indices.

The partitioning primitives they share live in :mod:`.partitioning`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from ..core.alignment import Alignment
from ..core.cost_model import CostModel
from ..core.checks import is_int
from ..core.errors import DynBatchConfigError
from ..core.parallel import ParallelConfig
from .megatron_upstream import megatron_dp_balanced, megatron_rl_packing, megatron_rl_packing_rr
from .partitioning import (BaselineInfeasible, adjust_bin_count, first_fit, karmarkar_karp,
                           modified_first_fit_decreasing, split_largest_bins)

if TYPE_CHECKING:
    from ..core.model_spec import ModelLike
    from ..core.parallel import ParallelLike
    from ..core.planner.plan_kind import PlanKind

MicroBatches = List[List[List[int]]]

#: verl's ``calculate_workload`` uses a fixed, model-independent estimate ``24576 * L + L**2`` (calibrated
#: for hidden size 4096); we model it with the same published constant.
VERL_WORKLOAD_LINEAR = 24576.0


@dataclass(frozen=True)
class BaselineContext:
    """What a baseline may know about the job: the layout, the token budget and (optionally) the model.

    ``max_tokens_per_gpu`` has the planner's meaning: a micro-batch holds at most ``cap =
    max_tokens_per_gpu * cp`` tokens (slime's ``--max-tokens-per-gpu`` and verl's ``ppo_max_token_len_per_gpu``
    are scaled by the CP size the same way).
    """

    parallel: ParallelConfig
    max_tokens_per_gpu: int
    model: Any = None
    fp8_alignment: Union[None, str, int] = None

    @classmethod
    def build(cls, parallel: ParallelLike, max_tokens_per_gpu: int, model: Optional[ModelLike] = None,
              fp8_alignment: Union[None, str, int] = None) -> "BaselineContext":
        par = ParallelConfig.from_any(parallel)
        spec = None
        if model is not None:
            from ..core.model_spec import ModelSpec

            spec = ModelSpec.from_any(model)
        if not is_int(max_tokens_per_gpu) \
                or max_tokens_per_gpu < 1:
            raise DynBatchConfigError("max_tokens_per_gpu", max_tokens_per_gpu, "must be a positive integer",
                                      "pass the per-GPU token budget, e.g. 16384")
        return cls(par, int(max_tokens_per_gpu), spec, fp8_alignment)

    @property
    def cap(self) -> int:
        return self.max_tokens_per_gpu * self.parallel.cp

    @property
    def alignment(self) -> Alignment:
        return Alignment.for_layout(self.parallel, self.fp8_alignment)

    @property
    def mb_multiple(self) -> int:
        """Micro-batch counts per rank must be a multiple of this under VPP (Megatron's N), else 1."""
        return self.parallel.vp_group_size if self.parallel.vpp > 1 else 1

    def fwd_flops(self, lengths: np.ndarray) -> np.ndarray:
        """Model-aware forward FLOPs per sample (slime's ``calculate_fwd_flops`` is model-aware too);
        tokens when no model is given."""
        lens = np.asarray(lengths, dtype=np.float64)
        if self.model is None:
            return lens
        from ..core.flops import flops_coefficients

        c = flops_coefficients(self.model)
        return c.linear * lens + c.quadratic * lens * lens


def _valley(order_desc: List[Any]) -> List[Any]:
    """verl's bubble-reducing order: given items heaviest first, small ones at both ends, large in the middle
    (every other item reversed, then the rest)."""
    return order_desc[::2][::-1] + order_desc[1::2]


def _check_fits(lengths: np.ndarray, cap: int, who: str) -> None:
    if lengths.size and int(lengths.max()) > cap:
        raise BaselineInfeasible(f"{who} requires every sample to fit the budget: a sample has "
                                 f"{int(lengths.max())} tokens > {cap}")


# ============================================================================================ baselines
def fixed_padded(lengths: np.ndarray, ctx: BaselineContext) -> MicroBatches:
    """Megatron's default fixed micro-batch size (``--micro-batch-size``) without packing.

    The global batch is cut into ``dp`` contiguous chunks in sample order (sizes differ by at most one when
    ``dp`` does not divide the batch), and every rank runs consecutive groups of ``mbs`` samples padded to the
    longest of the group (the benchmark scores it with ``pad_to_longest=True``, which is kinder than
    Megatron's padding to ``--seq-length``). ``mbs`` is the largest power of two with ``mbs * max_len <= cap``
    (``max_len``: the longest aligned sample of the batch, as a user sizing a fixed micro-batch must plan for
    it), at least 1 and at most the smallest chunk; under VPP it is halved until the per-rank count is one
    Megatron accepts. A short last group is kept (ragged) rather than dropped.
    """
    par = ctx.parallel
    aligned = ctx.alignment.seq_len(lengths)
    chunks = np.array_split(np.arange(lengths.size), par.dp)
    max_len = int(aligned.max())
    mbs = 1
    while mbs * 2 * max_len <= ctx.cap and mbs * 2 <= min(c.size for c in chunks):
        mbs *= 2
    if par.vpp > 1:
        from ..core.planner.vpp import is_valid_microbatch_count

        while mbs > 1 and not is_valid_microbatch_count(-(-chunks[0].size // mbs), par):
            mbs //= 2
    return [[c[j:j + mbs].tolist() for j in range(0, c.size, mbs)] for c in chunks]


def _distribute_kk(bins: List[List[int]], flops: np.ndarray, dp: int) -> MicroBatches:
    weights = [float(flops[b].sum()) for b in bins]
    parts = karmarkar_karp(weights, dp, equal_size=True)
    return [[bins[j] for j in part] for part in parts]


def _slime_align(bins: List[List[int]], lengths: np.ndarray, ctx: BaselineContext) -> List[List[int]]:
    align_to = ctx.parallel.dp * ctx.mb_multiple
    target = max(-(-len(bins) // align_to) * align_to, align_to)
    out = split_largest_bins(bins, target, lengths)
    if len(out) != target:
        raise BaselineInfeasible(f"slime could make only {len(out)} micro-batches after splitting every bin; "
                                 f"it needs a multiple of {align_to}")
    return out


def slime(lengths: np.ndarray, ctx: BaselineContext) -> MicroBatches:
    """slime ``--use-dynamic-batch-size --balance-data`` ("pack first, distribute second", slime's
    ``dp_schedule`` since mid-2026).

    1. first-fit over the step's samples in their order into micro-batches of ``<= max_tokens_per_gpu * cp``
       real tokens (a sample over the budget sits alone);
    2. the micro-batch count is raised to a multiple of ``dp`` (x ``microbatch_group_size_per_vp_stage`` under
       VPP) by splitting the largest micro-batch in two token-balanced halves;
    3. micro-batches go to ranks by Karmarkar-Karp on their estimated FLOPs with equal counts per rank; a
       rank runs its micro-batches in index order.

    Budget checks use real lengths: CP/TP alignment padding added later can push a micro-batch a few tokens
    over the cap, which the benchmark counts.
    """
    bins = _slime_align(first_fit(lengths, ctx.cap), lengths, ctx)
    return _distribute_kk(bins, ctx.fwd_flops(lengths), ctx.parallel.dp)


def slime_flops(lengths: np.ndarray, ctx: BaselineContext) -> MicroBatches:
    """slime ``--use-dynamic-batch-size --balance-by-flops`` (which implies ``--balance-data``).

    The micro-batch count is ``ceil(total tokens / cap)`` (every sample alone if that is not below the sample
    count); the samples are split into that many micro-batches by Karmarkar-Karp on estimated FLOPs
    (``equal_size=False``), which balances FLOPs but does not enforce the token cap -- slime's help text and
    code comment warn that such a micro-batch can exceed ``max_tokens_per_gpu`` and OOM. Then as
    :func:`slime`: align the count to ``dp`` (x ``N``) by splitting, and distribute by Karmarkar-Karp.
    """
    flops = ctx.fwd_flops(lengths)
    m = max(1, -(-int(lengths.sum()) // ctx.cap))
    if m >= lengths.size:
        bins = [[i] for i in range(lengths.size)]
    else:
        bins = karmarkar_karp(flops, m, equal_size=False)
    bins = _slime_align(bins, lengths, ctx)
    return _distribute_kk(bins, flops, ctx.parallel.dp)


def slime_legacy(lengths: np.ndarray, ctx: BaselineContext) -> MicroBatches:
    """slime ``--use-dynamic-batch-size --balance-data`` before scheduling moved to the rollout side (slime
    releases up to spring 2026; still what many pinned deployments run).

    1. the rollout is split over DP ranks by Karmarkar-Karp on token counts with equal sample counts;
    2. each rank counts the micro-batches a first-fit pass over its samples needs; the count is all-reduced to
       the maximum over DP ranks (under VPP it is then rounded *down* to a multiple of N, at least 1);
    3. each rank splits its samples into that many micro-batches by Karmarkar-Karp on token counts
       (``equal_size=False``): balanced, but not capped -- a rank whose first-fit needed fewer bins now has
       more, and rounding down under VPP can leave a micro-batch over the budget.
    """
    par = ctx.parallel
    parts = karmarkar_karp(lengths, par.dp, equal_size=True)
    m = max(len(first_fit(lengths[p], ctx.cap)) for p in parts)
    if par.vpp > 1:
        n = par.vp_group_size
        m = max(1, m // n * n)
    out: MicroBatches = []
    for p in parts:
        if m > len(p):
            raise BaselineInfeasible(f"slime_legacy: {m} micro-batches for a rank with {len(p)} samples")
        local = karmarkar_karp(lengths[p], m, equal_size=False)
        out.append([[p[i] for i in mb] for mb in local])
    return out


def verl(lengths: np.ndarray, ctx: BaselineContext) -> MicroBatches:
    """verl with ``balance_batch=True`` and ``use_dynamic_bsz=True`` (Megatron actor).

    1. ``balance_batch``: the batch is split over DP ranks by Karmarkar-Karp on verl's workload estimate
       ``24576 * L + L**2`` (a fixed 7B-calibrated constant, not the trained model) with equal sample counts;
       each rank's samples are ordered light-heavy-light;
    2. ``rearrange_micro_batches``: each rank needs ``min(samples, ceil(tokens / cap))`` micro-batches, the count
       is all-reduced to the maximum over DP, and under VPP rounded *up* to a multiple of N; the rank's samples
       are split into that many micro-batches by Karmarkar-Karp on the workload (``equal_size=False``). That
       balances workload but does not enforce the cap -- verl issues #6735 and #7553 report the resulting OOMs;
    3. ``use_dynamic_bsz_balance``: micro-batches sorted by workload, then placed small at both ends.

    verl asserts every sample fits the budget and that the count does not exceed a rank's samples; both
    raise :class:`BaselineInfeasible` here.
    """
    par = ctx.parallel
    _check_fits(lengths, ctx.cap, "verl")
    work = VERL_WORKLOAD_LINEAR * lengths.astype(np.float64) + lengths.astype(np.float64) ** 2
    parts = karmarkar_karp(work, par.dp, equal_size=True)
    ranks = []
    for p in parts:
        asc = sorted(p, key=lambda i: (work[i], i))
        ranks.append(asc[::2] + asc[1::2][::-1])
    m = max(min(len(r), -(-int(lengths[r].sum()) // ctx.cap)) for r in ranks)
    if ctx.mb_multiple > 1:
        m = -(-m // ctx.mb_multiple) * ctx.mb_multiple
    out: MicroBatches = []
    for r in ranks:
        if m > len(r):
            raise BaselineInfeasible(f"verl: {m} micro-batches for a rank with {len(r)} samples")
        local = karmarkar_karp(work[r], m, equal_size=False)
        local.sort(key=lambda mb: (float(work[[r[i] for i in mb]].sum()), mb[0] if mb else 0), reverse=True)
        out.append([[r[i] for i in mb] for mb in _valley(local)])
    return out


def nemo_rl(lengths: np.ndarray, ctx: BaselineContext) -> MicroBatches:
    """NeMo-RL sequence packing (``algorithm: modified_first_fit_decreasing``).

    Each sample is padded to the sequence pad multiple (here the CP alignment ``2*cp``), the whole batch is
    packed by :func:`modified_first_fit_decreasing` into bins of ``<= max_tokens_per_gpu * cp`` tokens, the
    bin count is raised to at least ``dp`` and to a multiple of ``dp`` by :func:`adjust_bin_count` (single
    sequences moved into new bins; NeMo-RL's ``min_bin_count`` and ``bin_count_multiple`` are the shard count),
    and bin ``j`` goes to rank ``j % dp`` (round-robin), run in packer order. Under VPP we align to
    ``dp * N`` instead, the change a user must make for Megatron to accept the per-rank count.
    """
    par = ctx.parallel
    aligned = ctx.alignment.seq_len(lengths)
    bins = modified_first_fit_decreasing(aligned, ctx.cap)
    bins = adjust_bin_count(bins, par.dp, par.dp * ctx.mb_multiple)
    return [bins[r::par.dp] for r in range(par.dp)]


#: ROLL's default ``sequence_length_round_in_train``
ROLL_SEQUENCE_ROUND = 64


def roll_layout(lengths: np.ndarray, ctx: BaselineContext, sequence_round: int = ROLL_SEQUENCE_ROUND):
    """ROLL ``use_dynamic_batching_in_train`` (``dynamic_batching_shard``): ``(micro_batches, padded lengths)``.

    1. samples sorted by length (ascending) are strided over ranks: rank ``r`` takes positions ``r, r+dp, ...``
       (every shard holds ``n / dp`` samples);
    2. one list of ``[start, end)`` ranges is shared by all shards: a micro-batch grows row by row while
       ``rows x padded length`` fits ``max_tokens_per_microbatch`` (here ``cap``), the padded length being the
       longest sample of those rows on any shard, rounded up to ``sequence_round`` (at least one round);
    3. with ``pp > 1`` and VPP the count is rounded up to a multiple of ``pp`` by halving the micro-batches
       with the most padded tokens.

    Micro-batches are padded ``[b, s]`` (shared ``s`` per index): score with the padded lengths returned.
    ROLL asserts when a rounded sample is over the budget, a shard is uneven, or too few micro-batches can be
    split; those raise :class:`BaselineInfeasible`.
    """
    par, cap, dp = ctx.parallel, ctx.cap, ctx.parallel.dp
    if lengths.size % dp:
        raise BaselineInfeasible(f"ROLL: {lengths.size} samples do not split into {dp} equal shards")
    order = np.lexsort((np.arange(lengths.size), lengths))
    shards = [order[r::dp] for r in range(dp)]
    rows = shards[0].size
    row_len = np.maximum(-(-np.max([lengths[sh] for sh in shards], axis=0) // sequence_round) * sequence_round,
                         sequence_round)
    if int(row_len.max()) > cap:
        raise BaselineInfeasible(f"ROLL: a padded sequence of {int(row_len.max())} tokens exceeds {cap}")
    bounds = [0]
    longest = sequence_round
    for j in range(rows):
        longest_next = max(longest, int(row_len[j]))
        if (j - bounds[-1] + 1) * longest_next <= cap:
            longest = longest_next
        else:
            bounds.append(j)
            longest = int(row_len[j])
    bounds.append(rows)
    ranges = [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if par.pp > 1 and par.vpp > 1:
        target = -(-len(ranges) // par.pp) * par.pp
        if target > rows:
            raise BaselineInfeasible(f"ROLL: {target} micro-batches for shards of {rows} samples")
        # each of the largest splittable micro-batches (by padded tokens) is halved once
        split = sorted((k for k, (a, b) in enumerate(ranges) if b - a > 1),
                       key=lambda k: -(ranges[k][1] - ranges[k][0]) * int(row_len[ranges[k][1] - 1]))
        if len(split) < target - len(ranges):
            raise BaselineInfeasible("ROLL: not enough micro-batches to split")
        halves = []
        for k in split[:target - len(ranges)]:
            a, b = ranges[k]
            halves += [(a, a + (b - a) // 2), (a + (b - a) // 2, b)]
        gone = set(split[:target - len(ranges)])
        ranges = sorted([r for k, r in enumerate(ranges) if k not in gone] + halves)
    mbs = [[sh[a:b].tolist() for a, b in ranges] for sh in shards]
    return mbs, [int(row_len[b - 1]) for _, b in ranges]


def roll(lengths: np.ndarray, ctx: BaselineContext) -> MicroBatches:
    """ROLL ``use_dynamic_batching_in_train`` (see :func:`roll_layout`, which also returns the padded lengths
    its micro-batches are cut to)."""
    return roll_layout(lengths, ctx)[0]


# ============================================================================================ registry
@dataclass(frozen=True)
class Baseline:
    """One baseline: ``baseline(lengths, ctx)`` returns ``micro_batches[rank][j] -> sample indices``."""

    name: str
    fn: Callable[[np.ndarray, BaselineContext], MicroBatches]
    pad_to_longest: bool = False
    provenance: str = ""
    fixed_bins: bool = False  # every micro-batch is a full-width row of ``cap`` tokens, empty ones included

    @property
    def description(self) -> str:
        doc = (self.fn.__doc__ or "").strip()
        return doc.split("\n\n")[0].replace("\n", " ")

    def __call__(self, lengths: Union[Sequence[int], np.ndarray], ctx: BaselineContext) -> MicroBatches:
        lens = np.asarray(lengths, dtype=np.int64)
        if lens.ndim != 1 or lens.size == 0 or (lens < 0).any():
            raise DynBatchConfigError("lengths", f"array of shape {lens.shape}", "must be non-empty, 1-D, >= 0",
                                      "pass one token count per sample")
        if lens.size < ctx.parallel.dp:
            raise BaselineInfeasible(f"{lens.size} samples cannot fill dp={ctx.parallel.dp} ranks")
        return self.fn(lens, ctx)


BASELINES: Dict[str, Baseline] = {
    b.name: b for b in (
        Baseline("fixed_padded", fixed_padded, pad_to_longest=True,
                 provenance="Megatron-LM --micro-batch-size (fixed-shape micro-batches, no packing)"),
        Baseline("slime", slime,
                 provenance="slime --use-dynamic-batch-size --balance-data (slime/utils/dp_schedule.py behaviour)"),
        Baseline("slime_flops", slime_flops,
                 provenance="slime --use-dynamic-batch-size --balance-by-flops (help text: may exceed the budget)"),
        Baseline("slime_legacy", slime_legacy,
                 provenance="slime --balance-data + dynamic batch size before the rollout-side scheduler"),
        Baseline("verl", verl,
                 provenance="verl balance_batch + use_dynamic_bsz (rearrange_micro_batches, get_seqlen_balanced_"
                            "partitions)"),
        Baseline("nemo_rl", nemo_rl,
                 provenance="NeMo-RL sequence_packing, modified_first_fit_decreasing, round-robin bins to DP"),
        Baseline("megatron-dp-balanced", megatron_dp_balanced,
                 provenance="Megatron-Core DpBalancedScheduler (data_schedule.py wrap_data_iterator): next-fit in "
                            "loader order, count a multiple of dp (x N under VPP)"),
        Baseline("megatron-rl-packing", megatron_rl_packing, fixed_bins=True,
                 provenance="Megatron RL --rl-use-sequence-packing, fifo: longest-first next-fit bins of "
                            "--seq-length, padded bins and empty filler bins run"),
        Baseline("megatron-rl-packing-rr", megatron_rl_packing_rr, fixed_bins=True,
                 provenance="Megatron RL --rl-sequence-packing-algo round-robin: the same bins dealt cyclically"),
    )
}


#: Baselines outside the default benchmark table (compared in ``megatron-dynbatch bench --dropins``).
EXTRA_BASELINES: Dict[str, Baseline] = {
    "roll": Baseline("roll", roll, pad_to_longest=True,
                     provenance="ROLL use_dynamic_batching_in_train (roll/utils/dynamic_batching.py behaviour)"),
}


def get_baseline(name: str) -> Baseline:
    """The baseline called ``name`` (see ``BASELINES``)."""
    try:
        return BASELINES[name] if name in BASELINES else EXTRA_BASELINES[name]
    except KeyError:
        raise DynBatchConfigError("baseline", name, "unknown baseline", f"use one of {sorted(BASELINES)}") from None


@dataclass
class BaselineRun:
    """A baseline's scored plan, or why it could not run."""

    name: str
    plan: Any = None  # megatron_dynbatch.core.planner.Plan
    error: Optional[str] = None
    planning_time_s: float = 0.0
    notes: List[str] = field(default_factory=list)


def run_baseline(name: str, lengths: Union[Sequence[int], np.ndarray], ctx: BaselineContext,
                 cost_model: Optional[CostModel] = None) -> BaselineRun:
    """Run baseline ``name`` and score it with ``score_assignment`` (same cost model as the planner).

    A :class:`BaselineInfeasible` is returned as ``error`` (the modelled system would stop there), not raised.
    """
    from ..core.planner import score_assignment

    base = get_baseline(name)
    lens = np.asarray(lengths, dtype=np.int64)
    t0 = time.perf_counter()
    try:
        mbs = base(lens, ctx)
    except BaselineInfeasible as exc:
        return BaselineRun(name, error=str(exc), planning_time_s=time.perf_counter() - t0)
    elapsed = time.perf_counter() - t0
    plan = score_assignment(mbs, lens, model=ctx.model, parallel=ctx.parallel,
                            max_tokens_per_gpu=ctx.max_tokens_per_gpu, fp8_alignment=ctx.fp8_alignment,
                            cost_model=cost_model, pad_to_longest=base.pad_to_longest, algorithm=name,
                            fixed_microbatch_tokens=ctx.cap if base.fixed_bins else None)
    plan.planning_time_s = elapsed
    notes = structural_problems(plan, lens.size)
    if base.fixed_bins and "empty micro-batch" in notes:  # by design there: filler bins that run in full
        empty = sum(not mb for r in plan.micro_batches for mb in r)
        notes = [f"{empty} empty filler bin{'s' if empty > 1 else ''} (executed)" if n == "empty micro-batch" else n
                 for n in notes]
    return BaselineRun(name, plan=plan, planning_time_s=elapsed, notes=notes)


def structural_problems(plan: PlanKind, num_samples: int) -> List[str]:
    """What Megatron (or the training loop) would reject in a plan: ranks with different micro-batch counts,
    empty micro-batches, an interleaved-pipeline count Megatron refuses, or samples lost / duplicated."""
    from ..core.planner.vpp import is_valid_microbatch_count

    notes: List[str] = []
    counts = {len(r) for r in plan.micro_batches}
    if len(counts) > 1:
        notes.append(f"ragged micro-batch counts {min(counts)}..{max(counts)}")
    if any(not mb for r in plan.micro_batches for mb in r):
        notes.append("empty micro-batch")
    if plan.parallel.vpp > 1 and not all(is_valid_microbatch_count(c, plan.parallel) for c in counts):
        notes.append("micro-batch count rejected by Megatron's interleaved schedule")
    seen = sorted(i for r in plan.micro_batches for mb in r for i in mb)
    if seen != list(range(num_samples)):
        notes.append("samples lost or duplicated")
    return notes


__all__ = [
    "BASELINES", "Baseline", "BaselineContext", "EXTRA_BASELINES", "roll", "roll_layout", "BaselineInfeasible",
    "BaselineRun", "MicroBatches",
    "adjust_bin_count", "first_fit", "fixed_padded", "get_baseline", "karmarkar_karp",
    "megatron_dp_balanced", "megatron_rl_packing", "megatron_rl_packing_rr",
    "modified_first_fit_decreasing", "nemo_rl", "run_baseline", "slime", "slime_flops", "slime_legacy",
    "split_largest_bins", "structural_problems", "verl",
]
