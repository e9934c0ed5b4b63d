"""``plan_global_batch``: lengths in, :class:`Plan` out.

Strategy
--------
For each optimizer step (the whole batch, or consecutive slices of ``samples_per_step`` samples):

1. Pad each sample to its alignment slot (``2*cp`` multiples) and count that padding against the budget
   ``cap = max_tokens_per_gpu * cp`` (less the micro-batch tail padding: ``Alignment.effective_cap``).
2. Start at the fewest micro-batches per rank the budget allows, ``M0 = ceil(slot tokens / (dp * cap))``,
   moved up to the next count Megatron's interleaved schedule accepts, and pack for that ``M``
   (:mod:`.packer`); if the packing is infeasible, try the next valid ``M``.
3. Score a few more counts with the cost model: with ``pp > 1`` counts up to the one that minimises the
   modelled 1F1B bubble + per-micro-batch overhead (never below the cost model's per-micro-batch floor), with
   ``pp == 1`` one more count when the first leaves the ranks unbalanced (an extra micro-batch can unlock a
   better packing). A larger count wins only by more than the **decision margin** (``decision_margin``, default
   the cost model's ``uncertainty``) charged to the part of the step the count changes (per-micro-batch fixed
   costs and the pipeline bubble); within it, the fewest micro-batches win.
4. Keep the fastest of that and the peers' cap-safe heuristics made into valid plans under the same rules
   (:mod:`.portfolio`: verl's Karmarkar-Karp, slime's first fit, NeMo-RL's modified first-fit decreasing,
   Megatron-Core's next fit), scored by the same cost model.
5. Order each rank's micro-batches: with ``pp == 1`` (order leaves the time alone) most padded tokens first, the
   largest predicted peak (an out-of-memory shows on the first micro-batch); with ``pp > 1`` the arrangement
   (decreasing, increasing, small-at-both-ends) with the shortest simulated 1F1B makespan. The arrangement is a
   pattern over the weight ranks, the same on every DP rank, so expert-parallel ranks that advance in lockstep
   meet micro-batches of similar size.

Invariants (asserted by ``tests/test_planner_properties.py`` over thousands of random workloads)
----------------------------------------------------------------------------------------------
* every sample is placed exactly once; no micro-batch is empty;
* every DP rank runs the same number of micro-batches, and the same number in every optimizer step;
* a micro-batch's padded token count never exceeds ``cap`` — the only exception is a sample that is alone
  over budget under ``oversize='alone'`` (it is listed in ``plan.oversize_samples`` and a warning is raised);
* with ``vpp > 1`` the count satisfies ``pp <= N <= M`` and ``M % N in {0} U [pp, N)``;
* the samples of one group (``group_ids``) share a DP rank; each optimizer step holds exactly
  ``samples_per_step`` samples (or ``rollouts_per_step`` rollouts);
* the knobs the RL trainers' drop-ins need (``integrations/``), each off by default and then without effect:
  ``equal_samples_per_rank`` (every rank ``n / dp`` samples per step), ``microbatch_group_ids`` (a group in
  one micro-batch), ``min_num_microbatches`` / ``num_microbatches_multiple`` (on top of the VPP rule),
  ``rollout_ids`` + ``rollouts_per_step`` (steps counted in rollouts), ``sequence_pad_multiple`` /
  ``microbatch_pad_multiple`` (a trainer's padding counted against the cap);
* the result depends only on the arguments: every rank computes the same plan without communicating.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Any, List, Mapping, Optional, Sequence, Union

import numpy as np

from ..alignment import Alignment
from ..cost_model import CostModel
from ..errors import DynBatchConfigError
from ..model_spec import ModelLike
from ..parallel import ParallelConfig
from .dyncp import plan_dynamic_cp
from .fallback import SearchWork
from .inputs import check_lengths, flops_coefficients_of, sample_flops
from .options import BATCH_ARGUMENTS, BalanceBy, PlanOptions, ResolvedOptions, dynamic_cp_knob_error
from .ordering import mb_sums
from .plan import Plan
from .plan_kind import PlanKind
from .prepare import Prepared, prepare
from .search import plan_step
from .timing import step_times_of

__all__ = ["plan_global_batch", "plan_resolved", "options_of", "score_assignment"]


def plan_global_batch(
    lengths: Union[Sequence[int], np.ndarray],
    options: Optional[PlanOptions] = None,
    *,
    group_ids: Optional[Sequence[Any]] = None,
    microbatch_group_ids: Optional[Sequence[Any]] = None,
    rollout_ids: Optional[Sequence[Any]] = None,
    **option_kwargs: Any,
) -> Plan:
    """Split a global batch over DP ranks and into micro-batches (see the module docstring).

    Args:
        lengths: tokens per sample (non-negative integers; 0 is allowed and takes one padding slot).
        options: a :class:`~.options.PlanOptions`; keywords given too replace its fields.
        group_ids: one id per sample; samples sharing an id (a GRPO prompt group) stay on one DP rank.
        microbatch_group_ids: one id per sample; samples sharing an id run in ONE micro-batch (verl's
            ``force_group_size``, e.g. a reward model's chosen/rejected pair). The group counts against the cap
            as a whole (``oversize`` applies to it).
        rollout_ids: one id per sample, with ``rollouts_per_step``: each optimizer step holds exactly that many
            rollouts (first-occurrence order), however many samples each emitted (slime's
            ``--global-batch-size``).
        **option_kwargs: the fields of :class:`~.options.PlanOptions`, each documented there --
            ``max_tokens_per_gpu`` (required), ``model``, ``parallel``, ``balance_by`` (``"time"``, the default;
            ``"flops"``, ``"tokens"``), ``cost_model``, ``decision_margin``, ``oversize``, ``fp8_alignment``,
            ``samples_per_step``, ``rollouts_per_step``, ``dynamic_cp``, ``num_microbatches``, ``refine_rounds``
            and the drop-ins' knobs -- and ``balance_by_flops``, the switch Megatron's ``--balance-by-flops``
            names (``True``: ``time``, which then needs a model; ``False``: ``tokens``). An unknown keyword is an
            :class:`~megatron_dynbatch.core.errors.UnknownOptionError` naming the close matches.

    With ``dynamic_cp=True`` returns a :class:`~.dyncp.plan.DynamicCPPlan` (strategy in :mod:`.dyncp`,
    ``docs/dynamic_cp.md``); it balances the cost model's seconds and refuses ``group_ids``.
    """
    return plan_resolved(lengths, options_of(options, option_kwargs).resolve(), group_ids=group_ids,
                         microbatch_group_ids=microbatch_group_ids, rollout_ids=rollout_ids)


def plan_resolved(lengths: Union[Sequence[int], np.ndarray], options: ResolvedOptions, *,
                  group_ids: Optional[Sequence[Any]] = None, microbatch_group_ids: Optional[Sequence[Any]] = None,
                  rollout_ids: Optional[Sequence[Any]] = None) -> PlanKind:
    """:func:`plan_global_batch` below its door: the batch planned with options resolved once by the caller
    (:meth:`PlanOptions.resolve`), so a run that plans every step reads no preset or cost-model file again."""
    opts = options.options
    if opts.dynamic_cp:
        given = [k for k, v in (("microbatch_group_ids", microbatch_group_ids), ("rollout_ids", rollout_ids))
                 if v is not None]
        if given:
            raise dynamic_cp_knob_error(given)
        plan = plan_dynamic_cp(lengths, options, group_ids=group_ids)
        plan.budget_choice = options.budget_choice
        return plan
    t_start = time.perf_counter()
    prep = prepare(lengths, options, group_ids=group_ids, microbatch_group_ids=microbatch_group_ids,
                   rollout_ids=rollout_ids)
    par, cm = options.parallel, options.cost_model
    settings = prep.search_settings()
    micro_batches: List[List[List[int]]] = [[] for _ in range(par.dp)]
    per_step: List[int] = []
    lb_time = 0.0
    lb_count = 0
    search = SearchWork()  # one bin-search work allowance for the whole batch (see planner/fallback.py)
    for s, step in enumerate(prep.steps):
        forced = None if prep.forced_counts is None else prep.forced_counts[s]
        bins, lb_m = plan_step(step.inp, step.sq, settings, forced=forced, search=search)
        per_step.append(len(bins[0]))
        for r, rank in enumerate(prep.step_samples(step, bins)):
            micro_batches[r].extend(rank)
        lb_count += lb_m
        work = cm.work(step.inp.aligned, step.sq)
        lb_time += cm.lower_bound(float(work.sum()), float(work.max()), par.dp, lb_m, step.items.size // par.dp)
    plan = _assemble(prep, micro_batches, per_step, lb_count, lb_time)
    plan.planning_time_s = time.perf_counter() - t_start
    plan.budget_choice = options.budget_choice  # "auto": what chose the budget, and what limits it
    return plan


def options_of(options: Optional[PlanOptions], option_kwargs: Mapping[str, Any]) -> PlanOptions:
    """A door's one conversion: ``options`` with ``option_kwargs`` replacing fields, or the keywords alone
    (:meth:`PlanOptions.from_kwargs`). Only the public entry points that take options as keywords call it."""
    if options is None:
        return PlanOptions.from_kwargs(option_kwargs)
    if not isinstance(options, PlanOptions):
        raise DynBatchConfigError("options", type(options).__name__, "must be a PlanOptions",
                                  "pass options=PlanOptions(...), or the options as keywords")
    return PlanOptions.from_kwargs(option_kwargs, base=options) if option_kwargs else options


def _signature() -> inspect.Signature:
    """``plan_global_batch``'s signature with every option spelled out (``help()``, IDEs)."""
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("lengths", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("options", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
    params += [inspect.Parameter(name, kw, default=None) for name in BATCH_ARGUMENTS]
    for f in dataclasses.fields(PlanOptions):
        if f.init:
            default = inspect.Parameter.empty if f.name == "max_tokens_per_gpu" else (
                f.default if f.default is not dataclasses.MISSING else None)
            params.append(inspect.Parameter(f.name, kw, default=default))
    params.append(inspect.Parameter("balance_by_flops", kw, default=None))
    return inspect.Signature(params, return_annotation=Plan)


plan_global_batch.__signature__ = _signature()  # type: ignore[attr-defined]


def executed_shapes(micro_batches: Sequence[Sequence[Sequence[int]]], lengths: Any, align: Alignment,
                    pad_to_longest: bool = False, fixed_microbatch_tokens: Optional[int] = None):
    """``(tokens, sq_tokens)`` per rank and micro-batch as an assignment runs (see :func:`score_assignment`): the
    packed tokens after alignment and the sum of squared lengths attention runs over -- packed THD micro-batches
    (real lengths), fixed-shape ``[b, s]`` rows padded to the longest sample (``pad_to_longest``: attention over
    the padded square), or fixed-width buffers (``fixed_microbatch_tokens``: the unused tail runs as one more
    causal sequence, an empty buffer as one full-width sequence)."""
    lens = np.asarray(lengths, dtype=np.int64)
    aligned = align.seq_len(lens).astype(np.int64)
    sq = lens.astype(np.float64) ** 2
    mbs = micro_batches
    if pad_to_longest:
        tokens = [[len(mb) * int(aligned[mb].max()) if mb else 0 for mb in rank] for rank in mbs]
        sqs = [[len(mb) * float(aligned[mb].max()) ** 2 if mb else 0.0 for mb in rank] for rank in mbs]
    elif fixed_microbatch_tokens is not None:
        width = int(fixed_microbatch_tokens)
        tokens = [[width for _ in rank] for rank in mbs]
        sqs = [[float(sq[mb].sum()) + float(max(width - int(aligned[mb].sum()), 0)) ** 2 if mb else float(width) ** 2
                for mb in rank] for rank in mbs]
    else:
        tokens = [[align.padded_total(int(aligned[mb].sum())) if mb else 0 for mb in rank] for rank in mbs]
        sqs = [[float(sq[mb].sum()) for mb in rank] for rank in mbs]
    return tokens, sqs


def score_assignment(
    micro_batches: Sequence[Sequence[Sequence[int]]],
    lengths: Union[Sequence[int], np.ndarray],
    *,
    model: Optional[ModelLike] = None,
    parallel: Union[ParallelConfig, Mapping[str, Any], None] = None,
    max_tokens_per_gpu: int,
    fp8_alignment: Union[None, str, int] = None,
    cost_model: Optional[CostModel] = None,
    pad_to_longest: bool = False,
    microbatches_per_step: Optional[Sequence[int]] = None,
    algorithm: str = "external",
    sequence_pad_multiple: Optional[int] = None,
    microbatch_pad_multiple: Optional[int] = None,
    fixed_microbatch_tokens: Optional[int] = None,
) -> Plan:
    """Score any assignment (e.g. a baseline's) with the same cost model and statistics as the planner.

    No invariant is enforced here -- ranks may differ in micro-batch count and micro-batches may break the cap
    (``plan.cap_violations`` counts them) -- so baselines are measured honestly. ``pad_to_longest`` models
    fixed-shape ``[b, s]`` micro-batches: every sample is padded to the longest in its micro-batch and attention
    runs over the padded square. ``sequence_pad_multiple`` / ``microbatch_pad_multiple`` score under a trainer's
    own padding convention (as in :func:`plan_global_batch`). ``fixed_microbatch_tokens`` models fixed-width packed
    buffers (Megatron RL's bins): every micro-batch, an empty one too, runs that many tokens, and its unused tail
    runs as one more causal sequence.
    """
    opts = PlanOptions(model=model, parallel=parallel, max_tokens_per_gpu=max_tokens_per_gpu,
                       fp8_alignment=fp8_alignment, cost_model=cost_model,
                       sequence_pad_multiple=sequence_pad_multiple,
                       microbatch_pad_multiple=microbatch_pad_multiple).resolve()
    par, align, cap, cm = opts.parallel, opts.alignment, opts.cap, opts.cost_model
    lens = check_lengths(lengths)
    coeffs = flops_coefficients_of(opts.model)
    mbs = [[[int(i) for i in mb] for mb in rank] for rank in micro_batches]
    aligned = align.seq_len(lens).astype(np.int64)
    sq = lens.astype(np.float64) ** 2
    tokens, sqs = executed_shapes(mbs, lens, align, pad_to_longest, fixed_microbatch_tokens)
    per_step = list(microbatches_per_step) if microbatches_per_step else [max((len(r) for r in mbs), default=0)]
    plan = _build_plan(mbs, per_step, tokens, sqs, sample_flops(coeffs, aligned, sq), lens, par, align, cap, cm,
                       balance_by=BalanceBy.TOKENS, algorithm=algorithm)
    work = cm.work(aligned, sq)
    plan.lower_bound_microbatches = max(1, -(-int(aligned.sum()) // (par.dp * cap)))
    plan.lower_bound_step_time = cm.lower_bound(float(work.sum()), float(work.max()), par.dp,
                                                plan.lower_bound_microbatches, lens.size // par.dp)
    return plan


def _assemble(prep: Prepared, micro_batches, per_step, lb_count: int, lb_time: float) -> Plan:
    """The ``Plan`` of a planned batch: per-micro-batch padded tokens and squared lengths, then statistics."""
    t_mult = prep.alignment.total_multiple
    tokens = [(-(-mb_sums(rank, prep.aligned) // t_mult) * t_mult).astype(int).tolist() for rank in micro_batches]
    sqs = [mb_sums(rank, prep.squared) for rank in micro_batches]
    opts = prep.options
    plan = _build_plan(micro_batches, per_step, tokens, sqs, prep.flops, prep.lengths, opts.parallel, opts.alignment,
                       opts.cap, opts.cost_model, balance_by=prep.balance_by, algorithm="dynbatch")
    plan.lower_bound_microbatches = lb_count
    plan.lower_bound_step_time = lb_time
    plan.oversize_samples = prep.oversize_samples
    return plan


def _build_plan(micro_batches, per_step, tokens, sqs, flops, lens, par: ParallelConfig, align: Alignment, cap: int,
                cm: CostModel, *, balance_by: BalanceBy, algorithm: str) -> Plan:
    """A ``Plan`` with per-micro-batch times and per-rank statistics from per-micro-batch token counts and sums
    of squared lengths. Optimizer steps run one after another, so a rank's time is the sum over steps (EP groups
    in lockstep inside each step) and the plan's is the sum of each step's slowest rank (:mod:`.timing`); ranks
    with different micro-batch counts (possible for baselines) are timed each on its own."""
    mb_time = [cm.microbatch_time(np.asarray(t, dtype=np.float64), np.asarray(q, dtype=np.float64)).tolist()
               for t, q in zip(tokens, sqs, strict=True)]
    rank_time, step_time = step_times_of(mb_time, per_step, cm)
    return Plan(
        micro_batches=micro_batches,
        microbatches_per_step=per_step,
        parallel=par,
        alignment=align,
        cap=cap,
        balance_by=str(balance_by),
        microbatch_tokens=tokens,
        microbatch_time=mb_time,
        rank_tokens=np.array([sum(t) for t in tokens], dtype=np.int64),
        rank_flops=np.array([float(flops[[i for mb in rank for i in mb]].sum()) for rank in micro_batches]),
        rank_time=rank_time,
        step_time=step_time,
        padding_tokens=int(sum(sum(t) for t in tokens) - lens.sum()),
        real_tokens=int(lens.sum()),
        lower_bound_microbatches=0,
        lower_bound_step_time=0.0,
        algorithm=algorithm,
    )
