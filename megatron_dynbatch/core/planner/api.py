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
4. Order each rank's micro-batches: largest first with ``pp == 1`` (an out-of-memory shows on the first
   micro-batch); with ``pp > 1`` the arrangement (decreasing, increasing, small-at-both-ends) with the shortest
   simulated 1F1B makespan. The arrangement is a pattern over the weight ranks, the same on every DP rank,
   so expert-parallel ranks that advance in lockstep meet micro-batches of similar size.

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

import time
from typing import Any, List, Mapping, Optional, Sequence, Union

import numpy as np

from ..alignment import Alignment
from ..cost_model import CostModel
from ..checks import as_bool
from ..errors import DynBatchConfigError
from ..parallel import ParallelConfig
from .dyncp import plan_dynamic_cp
from .fallback import SearchBudget
from .inputs import BALANCE_MODES, OVERSIZE_POLICIES, check_budget, check_lengths, resolve_costs, sample_flops
from .ordering import mb_sums
from .plan import Plan
from .prepare import Prepared, prepare
from .search import plan_step
from .timing import rank_times_of

__all__ = ["plan_global_batch", "score_assignment", "BALANCE_MODES", "OVERSIZE_POLICIES"]


def plan_global_batch(
    lengths: Union[Sequence[int], np.ndarray],
    *,
    model: Any = None,
    parallel: Union[ParallelConfig, Mapping[str, Any], None] = None,
    max_tokens_per_gpu: int,
    balance_by_flops: bool = True,
    balance_by: Optional[str] = None,
    group_ids: Optional[Sequence[Any]] = None,
    samples_per_step: Optional[int] = None,
    oversize: str = "error",
    fp8_alignment: Union[None, str, int] = None,
    cost_model: Optional[CostModel] = None,
    num_microbatches: Union[None, int, Sequence[int]] = None,
    refine_rounds: Optional[int] = None,
    equal_samples_per_rank: bool = False,
    microbatch_group_ids: Optional[Sequence[Any]] = None,
    min_num_microbatches: Optional[int] = None,
    num_microbatches_multiple: Optional[int] = None,
    rollout_ids: Optional[Sequence[Any]] = None,
    rollouts_per_step: Optional[int] = None,
    sequence_pad_multiple: Optional[int] = None,
    microbatch_pad_multiple: Optional[int] = None,
    dynamic_cp: bool = False,
    decision_margin: Optional[float] = None,
) -> Plan:
    """Split a global batch over DP ranks and into micro-batches (see the module docstring).

    Args:
        lengths: tokens per sample (non-negative integers; 0 is allowed and takes one padding slot).
        model: ``ModelSpec``, a dict of Megatron field names or a preset name; needed to balance by FLOPs.
        parallel: ``ParallelConfig`` or a mapping with ``dp, tp, pp, cp, ep, vpp`` (missing = 1) -- or anything a
            run preset's ``parallel:`` takes: ``world_size`` for ``dp``, Megatron's long names, ``etp``
            (``core.parallel.parallel_from_mapping``; the same checks and error messages as a preset).
        max_tokens_per_gpu: the per-GPU budget; a micro-batch holds at most ``max_tokens_per_gpu * cp``.
        balance_by_flops: balance compute (True) or tokens (False) across ranks and micro-batches. Compute is
            the model's FLOPs per sample, linear and attention terms each at their kernel efficiency (the
            cost model's seconds), since equal time -- not equal raw FLOPs -- is what makes ranks finish
            together.
        balance_by: explicit mode overriding ``balance_by_flops``: ``"time"`` (the default with a model; pass a
            calibrated ``cost_model`` to balance measured time), ``"flops"`` (raw FLOPs) or ``"tokens"``.
        group_ids: one id per sample; samples sharing an id (a GRPO prompt group) stay on one DP rank.
        samples_per_step: split the batch into optimizer steps of exactly this many consecutive samples.
        oversize: policy for a sample longer than the budget: ``"error"`` (default) or ``"alone"``.
        fp8_alignment: ``None``, ``"fp8"``, ``"mxfp8"``, ``"nvfp4"``/``"blockwise"`` or a token multiple.
        cost_model: step-time model used to choose counts and orders: a ``CostModel``, a profile name
            (``"fitted"`` -- the default with a model --, ``"analytic"``) or a cost-model JSON file
            (``docs/cost_model.md``).
        num_microbatches: force ``M`` per rank and optimizer step, or a list with one count per step (raises if
            the budget cannot hold it; a count above one that packs always works while every rank has enough
            samples: micro-batches are split).
        refine_rounds: cap on rank-refinement rounds (default ``4 * dp``).
        equal_samples_per_rank: every DP rank gets exactly ``n / dp`` samples of each step (verl's
            ``balance_batch`` / ``equal_size=True``; ROLL's equal shards); raises if a step's samples do not
            divide by ``dp``.
        microbatch_group_ids: one id per sample; samples sharing an id run in ONE micro-batch (verl's
            ``force_group_size``, e.g. a reward model's chosen/rejected pair). The group counts against the cap
            as a whole (``oversize`` applies to it).
        min_num_microbatches: at least this many micro-batches per rank and step (verl's
            ``min_num_micro_batch``; NeMo-RL's ``min_bin_count``).
        num_microbatches_multiple: the per-rank count of every step divides by this (verl's
            ``num_batches_divided_by``; NeMo-RL's ``bin_count_multiple``), on top of the exact VPP rule.
        rollout_ids, rollouts_per_step: count optimizer steps in rollouts: one id per sample, and each step
            holds exactly ``rollouts_per_step`` rollouts (first-occurrence order), however many samples each
            emitted (slime's ``--global-batch-size``). Exclusive with ``samples_per_step``.
        sequence_pad_multiple: a trainer's own per-sequence padding multiple (verl: ``tp*cp*2``), counted
            against the cap together with the layout's.
        microbatch_pad_multiple: a trainer's own padding multiple of each GPU's share of a micro-batch (slime:
            ``tp * data_pad_size_multiplier``), counted against the cap.
        dynamic_cp: treat the ``dp * cp`` GPUs as one pool and choose each micro-batch's CP group (size and
            GPUs) per slot: returns a :class:`~.dyncp.plan.DynamicCPPlan` (strategy in :mod:`.dyncp`,
            ``docs/dynamic_cp.md``). Balances the cost model's seconds (``balance_by`` is not used); refuses
            ``group_ids``.
        decision_margin: the planner leaves its default choice -- the fewest micro-batches that pack; under
            ``dynamic_cp`` the fixed-CP plan -- only for a modelled gain above this (relative; ``None``: the cost
            model's ``uncertainty``, 3.2% for the fitted profile, 0 for ``"analytic"``). For the count it is
            charged to the share of the step the count changes (per-micro-batch fixed costs, the pipeline
            bubble). Ties within it go to fewer micro-batches; under ``dynamic_cp`` to fixed CP, then smaller
            groups, then groups inside one node (``docs/cost_model.md``).
    """
    if as_bool(dynamic_cp, "dynamic_cp"):
        knobs = {"equal_samples_per_rank": equal_samples_per_rank or None,
                 "microbatch_group_ids": microbatch_group_ids, "min_num_microbatches": min_num_microbatches,
                 "num_microbatches_multiple": num_microbatches_multiple, "rollout_ids": rollout_ids,
                 "rollouts_per_step": rollouts_per_step, "sequence_pad_multiple": sequence_pad_multiple,
                 "microbatch_pad_multiple": microbatch_pad_multiple}
        given = [k for k, v in knobs.items() if v is not None]
        if given:
            raise DynBatchConfigError(
                given[0], "given with dynamic_cp=True", "the trainer drop-in knobs describe DP ranks and their "
                "micro-batches, and a dynamic-CP plan has neither (its micro-batches run on CP groups of the pool)",
                f"drop {', '.join(given)}, or plan with dynamic_cp=False")

        return plan_dynamic_cp(lengths, model=model, parallel=parallel, max_tokens_per_gpu=max_tokens_per_gpu,
                               group_ids=group_ids, samples_per_step=samples_per_step, oversize=oversize,
                               fp8_alignment=fp8_alignment, cost_model=cost_model,
                               num_microbatches=num_microbatches, refine_rounds=refine_rounds,
                               decision_margin=decision_margin)
    t_start = time.perf_counter()
    prep = prepare(lengths, model=model, parallel=parallel, max_tokens_per_gpu=max_tokens_per_gpu,
                   balance_by_flops=balance_by_flops, balance_by=balance_by, group_ids=group_ids,
                   samples_per_step=samples_per_step, oversize=oversize, fp8_alignment=fp8_alignment,
                   cost_model=cost_model, num_microbatches=num_microbatches, refine_rounds=refine_rounds,
                   equal_samples_per_rank=equal_samples_per_rank, microbatch_group_ids=microbatch_group_ids,
                   min_num_microbatches=min_num_microbatches, num_microbatches_multiple=num_microbatches_multiple,
                   rollout_ids=rollout_ids, rollouts_per_step=rollouts_per_step,
                   sequence_pad_multiple=sequence_pad_multiple, microbatch_pad_multiple=microbatch_pad_multiple,
                   decision_margin=decision_margin)
    par, cm, align = prep.par, prep.cm, prep.align
    micro_batches: List[List[List[int]]] = [[] for _ in range(par.dp)]
    per_step: List[int] = []
    lb_time = 0.0
    lb_count = 0
    search = SearchBudget()  # one bin-search budget for the whole batch (see planner/fallback.py)
    for s, step in enumerate(prep.steps):
        forced = None if prep.forced is None else prep.forced[s]
        bins, lb_m = plan_step(step.inp, par, cm, step.sq, forced, prep.rounds, align, prep.budget, prep.rule,
                               search, prep.margin)
        per_step.append(len(bins[0]))
        for r, rank in enumerate(prep.step_samples(step, bins)):
            micro_batches[r].extend(rank)
        lb_count += lb_m
        work = cm.work(step.inp.aligned, step.sq)
        lb_time += cm.lower_bound(float(work.sum()), float(work.max()), par.dp, lb_m, step.items.size // par.dp)
    plan = _assemble(prep, micro_batches, per_step, lb_count, lb_time)
    plan.planning_time_s = time.perf_counter() - t_start
    return plan


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
    model: Any = None,
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
    par = ParallelConfig.from_any(parallel)
    lens = check_lengths(lengths)
    cap, align, _ = check_budget(max_tokens_per_gpu, par, fp8_alignment, sequence_pad_multiple,
                                 microbatch_pad_multiple)
    coeffs, cm = resolve_costs(model, par, cost_model)
    mbs = [[[int(i) for i in mb] for mb in rank] for rank in micro_batches]
    aligned = align.seq_len(lens).astype(np.int64)
    sq = lens.astype(np.float64) ** 2
    tokens, sqs = executed_shapes(mbs, lens, align, pad_to_longest, fixed_microbatch_tokens)
    per_step = list(microbatches_per_step) if microbatches_per_step else [max((len(r) for r in mbs), default=0)]
    plan = _build_plan(mbs, per_step, tokens, sqs, sample_flops(coeffs, aligned, sq), lens, par, align, cap, cm,
                       balance_by_flops=False, algorithm=algorithm)
    work = cm.work(aligned, sq)
    plan.lower_bound_microbatches = max(1, -(-int(aligned.sum()) // (par.dp * cap)))
    plan.lower_bound_step_time = cm.lower_bound(float(work.sum()), float(work.max()), par.dp,
                                                plan.lower_bound_microbatches, lens.size // par.dp)
    return plan


def _assemble(prep: Prepared, micro_batches, per_step, lb_count: int, lb_time: float) -> Plan:
    """The ``Plan`` of a planned batch: per-micro-batch padded tokens and squared lengths, then statistics."""
    t_mult = prep.align.total_multiple
    tokens = [(-(-mb_sums(rank, prep.aligned) // t_mult) * t_mult).astype(int).tolist() for rank in micro_batches]
    sqs = [mb_sums(rank, prep.sq) for rank in micro_batches]
    plan = _build_plan(micro_batches, per_step, tokens, sqs, prep.flops, prep.lens, prep.par, prep.align, prep.cap,
                       prep.cm, balance_by_flops=(prep.mode != "tokens"), algorithm="dynbatch")
    plan.lower_bound_microbatches = lb_count
    plan.lower_bound_step_time = lb_time
    plan.oversize_samples = prep.oversize_samples
    return plan


def _build_plan(micro_batches, per_step, tokens, sqs, flops, lens, par: ParallelConfig, align: Alignment, cap: int,
                cm: CostModel, *, balance_by_flops: bool, algorithm: str) -> Plan:
    """A ``Plan`` with per-micro-batch times and per-rank statistics from per-micro-batch token counts and sums
    of squared lengths. Optimizer steps run one after another, so a rank's time is the sum over steps (EP groups
    in lockstep inside each step); ranks with different micro-batch counts (possible for baselines) are timed
    each on its own."""
    mb_time = [cm.microbatch_time(np.asarray(t, dtype=np.float64), np.asarray(q, dtype=np.float64)).tolist()
               for t, q in zip(tokens, sqs)]
    rank_time = rank_times_of(mb_time, per_step, cm)
    return Plan(
        micro_batches=micro_batches,
        microbatches_per_step=per_step,
        parallel=par,
        alignment=align,
        cap=cap,
        balance_by_flops=balance_by_flops,
        microbatch_tokens=tokens,
        microbatch_time=mb_time,
        rank_tokens=np.array([sum(t) for t in tokens], dtype=np.int64),
        rank_flops=np.array([float(flops[[i for mb in rank for i in mb]].sum()) for rank in micro_batches]),
        rank_time=rank_time,
        padding_tokens=int(sum(sum(t) for t in tokens) - lens.sum()),
        real_tokens=int(lens.sum()),
        lower_bound_microbatches=0,
        lower_bound_step_time=0.0,
        algorithm=algorithm,
    )
