"""Driver side of the Ray integration: plan a rollout batch once, cut it into per-DP-rank shards, and put the
actors' results back in the driver's sample order (see the package docstring for the data flow)."""

from __future__ import annotations

import dataclasses
import time
import uuid
import warnings
from typing import Any, Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Union

import numpy as np

from ...core.checks import hashable_group_id
from ...core.errors import DynBatchConfigError, trainer_terms
from ...core.parallel import ParallelConfig
from ...core.planner import Plan, PlanKind, score_assignment
from ...core.planner.api import options_of, plan_resolved
from ...core.planner.options import PlanOptions
from ...core.planner.inputs import check_group_ids
from ...core.planner.vpp import is_valid_microbatch_count, next_valid_microbatch_count
from ...megatron.loss import LOSS_MODES, loss_mask_stats
from .shards import RankShard, RolloutPlan, ShardResult, _ray_initialized

__all__ = ["plan_rollout", "plan_log_probs", "dp_rank_of", "gather_in_order", "step_loss", "update_calibration",
           "update_memory_guard"]


def plan_rollout(
    samples: Optional[Sequence[Mapping[str, Any]]] = None,
    *,
    sample_refs: Optional[Sequence[Any]] = None,
    lengths: Optional[Sequence[int]] = None,
    loss_mask_sums: Optional[Sequence[float]] = None,
    loss_token_counts: Optional[Sequence[int]] = None,
    group_ids: Optional[Sequence[Hashable]] = None,
    run_config: Any = None,
    options: Optional[PlanOptions] = None,
    log_probs_max_tokens_per_gpu: Optional[int] = None,
    loss_mode: Optional[str] = None,
    group_reduce: Optional[str] = None,
    group_key: str = "group_id",
    log_probs: bool = True,
    put: Optional[bool] = None,
    batch_id: Optional[str] = None,
    calibration: Any = None,
    memory_guard: Any = None,
    **option_kwargs: Any,
) -> RolloutPlan:
    """Plan one rollout batch on the driver and cut it into one :class:`RankShard` per DP rank.

    Give the batch either as ``samples`` (sample dicts the driver already holds; lengths, loss-mask statistics and
    group ids are read from them) or as ``sample_refs`` (one ``ObjectRef`` per sample from rollout workers, plus
    ``lengths`` and ``loss_mask_sums`` -- the driver never fetches the data).

    The planner's options come from ``run_config`` (a :class:`~megatron_dynbatch.core.run_config.RunConfig`, a
    preset name or a mapping: model, layout, budgets, balancing, loss mode, ``samples_per_step``, ``group_size``)
    or ``options`` (a :class:`~megatron_dynbatch.core.planner.options.PlanOptions`), with option keywords
    replacing their fields (``model``, ``parallel``, ``max_tokens_per_gpu``, ...; any
    :func:`megatron_dynbatch.plan_global_batch` option). ``log_probs_max_tokens_per_gpu`` (default: the training
    budget) is the budget of the forward-only plan (:func:`plan_log_probs`); ``log_probs=False`` skips it.

    ``put``: ``True`` -- ``ray.put`` each rank's sample list once (needs ``ray.init``); ``False`` -- keep the
    samples inside the shards (no Ray); default: ``True`` when Ray is initialised. Per-sample refs are always
    passed through as they are.

    ``calibration``: an :class:`~megatron_dynbatch.core.calibration.online.OnlineCalibration` kept by the driver
    across batches (``OnlineCalibration.from_run_config(run_config)``): both plans use its current model (the
    latest refit) unless ``cost_model=`` is given; feed it the actors' timings with :func:`update_calibration`. A
    ``run_config`` with ``online_calibration: true`` needs it.

    ``memory_guard``: a :class:`~megatron_dynbatch.core.memory.guard.MemoryGuard` kept by the driver across
    batches: the training plan uses its budget (unless ``max_tokens_per_gpu=`` is given); feed it the actors'
    peak readings (``train_on_shard(..., record_memory=True)``) with :func:`update_memory_guard`.
    """
    t0 = time.perf_counter()
    if (samples is None) == (sample_refs is None):
        raise DynBatchConfigError("samples / sample_refs", "both" if samples is not None else "neither",
                                  "give the batch exactly one way",
                                  "pass samples=[dict, ...] or sample_refs=[ObjectRef, ...] with lengths= and "
                                  "loss_mask_sums=")
    # ------------------------------------------------------------------ planning options
    rc = None
    if run_config is not None:
        from megatron_dynbatch.core.run_config import RunConfig

        rc = RunConfig.from_any(run_config)
        if options is not None:
            raise DynBatchConfigError("options", "given with run_config", "both say how to plan",
                                      "pass run_config=... or options=..., with keywords for what differs")
        options = rc.plan_options()
    if memory_guard is not None and "max_tokens_per_gpu" not in option_kwargs:
        option_kwargs["max_tokens_per_gpu"] = memory_guard.budget
    if options is None and "max_tokens_per_gpu" not in option_kwargs:
        raise DynBatchConfigError("max_tokens_per_gpu", None, "needed to plan the rollout batch",
                                  "pass max_tokens_per_gpu=<per-GPU token budget> or run_config=RunConfig/preset")
    if calibration is not None and "cost_model" not in option_kwargs:
        option_kwargs["cost_model"] = calibration.current()
    elif calibration is None and rc is not None and rc.online_calibration:
        raise DynBatchConfigError("run_config.online_calibration", True, "the driver keeps the calibration state "
                                  "across rollout batches, so plan_rollout cannot make it per call",
                                  "create cal = OnlineCalibration.from_run_config(run_config) once, pass "
                                  "calibration=cal here and update_calibration(cal, results, rollout) after each step")
    opts = options_of(options, option_kwargs)
    lp_budget = log_probs_max_tokens_per_gpu or (rc.log_probs_max_tokens_per_gpu if rc is not None else None)
    loss_mode = loss_mode or (rc.loss_mode if rc is not None else "token_mean")
    group_reduce = group_reduce or (rc.group_reduce if rc is not None else "token")
    if loss_mode not in LOSS_MODES:
        raise DynBatchConfigError("loss_mode", loss_mode, "unknown loss normalisation", f"use one of {LOSS_MODES}")

    # ------------------------------------------------------------------ per-sample metadata
    if samples is not None:
        if isinstance(samples, (str, bytes, Mapping)) or not isinstance(samples, Sequence) or len(samples) == 0:
            raise DynBatchConfigError("samples", type(samples).__name__, "must be a non-empty list of sample dicts",
                                      "pass the rollout batch as [{'tokens': ..., 'loss_mask': ...}, ...]")
        for i, s in enumerate(samples):
            if not isinstance(s, Mapping) or "tokens" not in s:
                raise DynBatchConfigError(f"samples[{i}]", type(s).__name__, "must be a dict with a 'tokens' entry",
                                          "pass dicts like {'tokens': LongTensor[L], 'loss_mask': ...}")
        n = len(samples)
        lens = np.asarray([len(s["tokens"]) for s in samples], dtype=np.int64)
        if lengths is not None and not np.array_equal(np.asarray(lengths, dtype=np.int64), lens):
            raise DynBatchConfigError("lengths", "differ from the samples", "lengths must be len(sample['tokens'])",
                                      "leave lengths out when passing samples")
        sums, counts = loss_mask_stats(samples)
        if group_ids is None and all(group_key in s for s in samples):
            group_ids = [hashable_group_id(s[group_key]) for s in samples]
    else:
        sample_refs = list(sample_refs)  # type: ignore[arg-type]
        n = len(sample_refs)
        if n == 0:
            raise DynBatchConfigError("sample_refs", [], "the rollout batch is empty", "pass at least dp refs")
        if lengths is None or loss_mask_sums is None:
            raise DynBatchConfigError(
                "lengths / loss_mask_sums", "missing", "with sample_refs the driver does not read the samples, so it "
                "needs their token counts and loss-mask sums to plan and normalise",
                "have the rollout workers return len(tokens) and loss_mask.sum() (megatron_dynbatch.megatron.loss."
                "sample_loss_mask) with each ref")
        lens = np.asarray(lengths)
        if lens.shape != (n,) or not np.issubdtype(lens.dtype, np.integer):
            raise DynBatchConfigError("lengths", f"shape {lens.shape}, dtype {lens.dtype}",
                                      f"needs one integer token count per ref ({n})", "pass len(tokens) of each sample")
        lens = lens.astype(np.int64)
        sums = np.asarray(loss_mask_sums, dtype=np.float64).reshape(-1)
        counts = (np.rint(sums).astype(np.int64) if loss_token_counts is None
                  else np.asarray(loss_token_counts, dtype=np.int64).reshape(-1))
        for name, arr in (("loss_mask_sums", sums), ("loss_token_counts", counts)):
            if arr.size != n:
                raise DynBatchConfigError(name, f"{arr.size} entries", f"needs one entry per ref ({n})",
                                          "pass one value per sample")
    if group_ids is None and rc is not None and rc.group_size is not None:
        group_ids = rc.group_ids(n)
    gids = check_group_ids(group_ids, n) if group_ids is not None else None
    if loss_mode == "group_mean" and gids is None:
        raise DynBatchConfigError("loss_mode", loss_mode, "group_mean needs a group id per sample",
                                  f"pass group_ids=, a '{group_key}' field in every sample, or a run_config with "
                                  "group_size")

    # ------------------------------------------------------------------ the two plans
    train_plan = plan_resolved(lens, opts.resolve(), group_ids=gids)  # the training pass, resolved once
    _refuse_dynamic_cp(train_plan)
    lp_plan = None
    if log_probs:
        with trainer_terms({"max_tokens_per_gpu": "log_probs_max_tokens_per_gpu"}):
            lp_options = opts.for_forward_only(lp_budget)
        lp_plan = plan_log_probs(train_plan, lens, lp_options)

    # ------------------------------------------------------------------ the shards
    if put is None:
        put = samples is not None and _ray_initialized()
    if put and samples is not None and not _ray_initialized():
        raise DynBatchConfigError("put", True, "ray.put needs a running Ray (ray.init())",
                                  "call ray.init() first, or pass put=False to keep the samples inside the shards")
    batch_id = batch_id or uuid.uuid4().hex
    if put:
        import ray
    shards = []
    for r in range(train_plan.parallel.dp):
        idx = sorted(train_plan.rank_samples(r))
        shard = RankShard(batch_id=batch_id, dp_rank=r, sample_indices=idx, plan=train_plan, log_probs_plan=lp_plan,
                          lengths=lens, loss_mask_sums=sums, loss_token_counts=counts, group_ids=gids,
                          loss_mode=loss_mode, group_reduce=group_reduce)
        if sample_refs is not None:
            shard.sample_refs = [sample_refs[i] for i in idx]
        elif put:
            shard.samples_ref = ray.put([samples[i] for i in idx])  # type: ignore[index]
        else:
            shard.samples = [samples[i] for i in idx]  # type: ignore[index]
        shards.append(shard)
    return RolloutPlan(batch_id=batch_id, shards=shards, plan=train_plan, log_probs_plan=lp_plan,
                       planning_time_s=time.perf_counter() - t0)


def _refuse_dynamic_cp(plan: PlanKind) -> None:
    """The Ray driver ships one shard per DP rank; a dynamic-CP plan places samples on pool GPUs (a sample on
    a group spanning several DP ranks belongs to none of them), so it is refused with a clear message."""
    if plan.dynamic_cp:
        raise DynBatchConfigError("dynamic_cp", True, "the Ray driver ships one shard per data-parallel rank, and a "
                                  "dynamic-CP plan spreads samples over CP groups that span several DP ranks",
                                  "plan with dynamic_cp=False here, or run dynamic CP through DynamicBatchIterator / "
                                  "dynamic_forward_backward on every rank (docs/dynamic_cp.md)")


def plan_log_probs(train_plan: PlanKind, lengths: Sequence[int], options: Optional[PlanOptions] = None,
                   **option_kwargs: Any) -> Plan:
    """A forward-only plan (log-probs, reference model) with its own budget that keeps ``train_plan``'s
    assignment of samples to DP ranks, so one shard serves both passes and the log-probs computed on a rank are
    already where that rank trains on them. ``options`` / ``option_kwargs``: the forward pass's planner options
    (its budget ``max_tokens_per_gpu``; ``PlanOptions.for_forward_only`` of the training options), as for
    :func:`megatron_dynbatch.plan_global_batch`.

    Each rank's samples are re-packed for the forward budget by the planner (``dp=1``, same TP / PP / CP / VPP);
    every rank then runs the same number of micro-batches: the largest count a rank's own plan chose, capped by
    the fewest samples a rank holds, moved to a count the interleaved schedule accepts. If some rank cannot be
    packed into that count, the training plan's own micro-batches are used (they fit whenever
    ``max_tokens_per_gpu`` is at least the training budget); otherwise a ``DynBatchConfigError`` names the fix."""
    if not isinstance(train_plan, PlanKind):
        raise DynBatchConfigError("train_plan", type(train_plan).__name__, "must be a megatron_dynbatch.Plan",
                                  "pass the plan made by plan_global_batch for the same batch")
    _refuse_dynamic_cp(train_plan)
    t0 = time.perf_counter()
    lens = np.asarray(lengths, dtype=np.int64)
    par = train_plan.parallel
    train_plan.validate(num_samples=int(lens.size))
    if "parallel" not in option_kwargs and options is None:
        option_kwargs["parallel"] = par
    opts = options_of(options, option_kwargs).resolve()  # the door: keywords -> options, resolved once
    common = opts.replace(parallel=dataclasses.replace(opts.parallel, dp=1), samples_per_step=None)
    max_tokens_per_gpu, oversize = opts.max_tokens_per_gpu, opts.options.oversize
    ranks = [sorted(train_plan.rank_samples(r)) for r in range(par.dp)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        subs = [plan_resolved(lens[idx], common) for idx in ranks]
        m = _common_count([p.num_microbatches for p in subs], min(len(idx) for idx in ranks), par)
        try:
            forced = common.replace(num_microbatches=m)
            subs = [p if p.num_microbatches == m else plan_resolved(lens[idx], forced)
                    for p, idx in zip(subs, ranks, strict=True)]
            micro_batches = [[[idx[k] for k in mb] for mb in p.micro_batches[0]]
                             for p, idx in zip(subs, ranks, strict=True)]
            oversize_samples = sorted(idx[k] for p, idx in zip(subs, ranks, strict=True) for k in p.oversize_samples)
        except DynBatchConfigError:
            micro_batches = None
    fallback = micro_batches is None
    for w in caught[:1]:  # one warning for the whole batch is enough
        warnings.warn(w.message, w.category, stacklevel=2)
    if micro_batches is None:  # a rank with too few samples for m: reuse the training micro-batches
        m = train_plan.num_microbatches
        cap = int(max_tokens_per_gpu) * par.cp
        over = [mb for rank, toks in zip(train_plan.micro_batches, train_plan.microbatch_tokens, strict=True)
                for mb, t in zip(rank, toks, strict=True) if t > cap and (len(mb) > 1 or oversize != "alone")]
        if over or not is_valid_microbatch_count(m, par):
            raise DynBatchConfigError(
                "log_probs_max_tokens_per_gpu", max_tokens_per_gpu,
                "the forward-only pass cannot keep the training plan's rank assignment: a rank has too few samples "
                "for the micro-batch count the others need, and the training micro-batches do not fit this budget",
                "use a log-prob budget >= the training budget (--log-probs-max-tokens-per-gpu)")
        micro_batches = [list(map(list, rank)) for rank in train_plan.micro_batches]
        oversize_samples = list(train_plan.oversize_samples)
    plan = score_assignment(micro_batches, lens, model=opts.model, parallel=par, max_tokens_per_gpu=max_tokens_per_gpu,
                            fp8_alignment=opts.options.fp8_alignment, cost_model=opts.cost_model,
                            microbatches_per_step=[m],
                            algorithm="dynbatch-log-probs" if not fallback else "dynbatch-log-probs/train-microbatches")
    plan.balance_by = opts.balance_by
    plan.oversize_samples = oversize_samples
    plan.planning_time_s = time.perf_counter() - t0
    plan.validate(num_samples=int(lens.size))
    return plan


def dp_rank_of(global_rank: int, parallel: Union[ParallelConfig, Mapping[str, Any]],
               order: str = "tp-cp-ep-dp-pp") -> int:
    """The data-parallel rank of a global rank in Megatron's default rank order (``tp-cp-ep-dp-pp``: TP varies
    fastest, then CP, then DP, then PP), to pick each actor's shard on the driver. Other orders: read
    ``parallel_state.get_data_parallel_rank()`` on the actor instead."""
    par = ParallelConfig.from_any(parallel)
    if order != "tp-cp-ep-dp-pp":
        raise DynBatchConfigError("order", order, "only Megatron's default order is computed here",
                                  "ask the actor for parallel_state.get_data_parallel_rank()")
    if not 0 <= int(global_rank) < par.world_size:
        raise DynBatchConfigError("global_rank", global_rank, f"must be in [0, {par.world_size})",
                                  "pass the actor's rank in the training world")
    return (int(global_rank) // (par.tp * par.cp)) % par.dp


def gather_in_order(results: Iterable[Optional[ShardResult]], shards: Any = None, *,
                    step: Optional[int] = None) -> List[Any]:
    """Per-sample outputs of all DP ranks in the driver's ORIGINAL sample order.

    ``results``: the :class:`ShardResult` of every actor (or only of the output ranks); entries without
    outputs are skipped, and copies from several ranks of one DP rank are taken once. ``shards``: the
    :class:`RolloutPlan` (or its shards) -- then every expected sample must be present: all samples, or those of
    training step ``step`` (default: the step the results were computed for). Without ``shards`` the outputs of
    the samples found are returned in ascending sample order."""
    found: Dict[int, Any] = {}
    steps = set()
    batch_ids = set()
    for res in results:
        if res is None or res.per_sample is None:
            continue
        if len(res.per_sample) != len(res.sample_indices):
            raise DynBatchConfigError("results", f"{len(res.per_sample)} outputs / {len(res.sample_indices)} indices",
                                      "every output needs its sample index", "pass ShardResult objects unchanged")
        steps.add(res.step)
        batch_ids.add(res.batch_id)
        for i, v in zip(res.sample_indices, res.per_sample, strict=True):
            found.setdefault(int(i), v)
    if len(batch_ids) > 1:
        raise DynBatchConfigError("results", sorted(batch_ids), "come from different rollout batches",
                                  "gather the results of one batch at a time")
    if shards is None:
        return [found[i] for i in sorted(found)]
    first = shards.shards[0] if isinstance(shards, RolloutPlan) else list(shards)[0]
    if batch_ids and first.batch_id not in batch_ids:
        raise DynBatchConfigError("shards", first.batch_id, f"the results belong to batch {batch_ids.pop()}",
                                  "pass the RolloutPlan the results were computed from")
    if step is None and len(steps) == 1:
        step = next(iter(steps))
    expected = list(range(first.num_samples)) if step is None else first.step_samples(step)
    missing = [i for i in expected if i not in found]
    if missing:
        raise DynBatchConfigError(
            "results", f"{len(missing)} of {len(expected)} samples missing (e.g. {missing[:8]})",
            "no actor returned outputs for these samples",
            "collect the results of every DP rank's last pipeline stage (ShardResult.is_output_rank)")
    return [found[i] for i in expected]


def update_calibration(calibration: Any, results: Iterable[Optional[ShardResult]], rollout: Any = None) -> Any:
    """Online calibration on the driver: add every actor's ``ShardResult.timings`` (``train_on_shard(...,
    record_timings=True)``) of one training step to ``calibration`` and count the step -- every
    ``interval`` steps it refits, and the next :func:`plan_rollout` with ``calibration=`` plans with the refit.
    ``rollout``: the :class:`RolloutPlan` the step ran (for the refit log's step-time change). Returns the refit's
    :class:`~megatron_dynbatch.core.calibration.online.RefitLog`, or ``None``. The driver is the only planner, so
    the refitted model needs no communication."""
    for res in results:
        if res is not None:
            calibration.add_timings(res.timings)
    plan = rollout.plan if isinstance(rollout, RolloutPlan) else None
    lengths = rollout.shards[0].lengths if plan is not None else None
    return calibration.end_step(plan, lengths)


def update_memory_guard(guard: Any, results: Iterable[Optional[ShardResult]], rollout: RolloutPlan, *,
                        step: Optional[int] = None) -> Any:
    """The memory guard on the driver: merge every actor's peak reading of one training step
    (``ShardResult.memory`` of ``train_on_shard(..., record_memory=True)``; the maximum over the actors of each
    pipeline stage) and observe it with the step's plan -- the next :func:`plan_rollout` with ``memory_guard=``
    plans with the budget it chooses. ``step``: the training step of the plan (default: the results'). Returns the
    budget change (:class:`~megatron_dynbatch.core.memory.guard.GuardChange`) or ``None``. The driver is the only
    planner, so the decision needs no communication."""
    from ...core.memory.guard import merge_readings

    results = [r for r in results if r is not None]
    if not isinstance(rollout, RolloutPlan):
        raise DynBatchConfigError("rollout", type(rollout).__name__, "must be the RolloutPlan the step ran",
                                  "pass plan_rollout(...)'s result")
    vectors = [r.memory for r in results if r.memory is not None]
    if not vectors:
        raise DynBatchConfigError("results", f"{len(results)} results", "carry no memory reading",
                                  "run train_on_shard(..., record_memory=True) on the actors")
    if step is None:
        steps = {r.step for r in results if r.memory is not None}
        step = steps.pop() if len(steps) == 1 else None
    return guard.observe(merge_readings(vectors), rollout.plan, step=step)


def step_loss(results: Iterable[Optional[ShardResult]]) -> Optional[float]:
    """The exact loss of the step: the same on every training output rank; ``None`` if none reported it."""
    for res in results:
        if res is not None and res.loss is not None:
            return float(res.loss)
    return None


def _common_count(preferred: Sequence[int], most: int, par: ParallelConfig) -> int:
    """One micro-batch count for every rank: the largest any rank's own plan chose (a pipeline plan may choose
    more than the minimum to shrink the bubble), but no more than the rank with the fewest samples can fill,
    and one the interleaved schedule accepts."""
    m = min(max(preferred), most)
    if is_valid_microbatch_count(m, par):
        return m
    up = next_valid_microbatch_count(m, par)
    if up <= most:
        return up
    while m > 1 and not is_valid_microbatch_count(m, par):
        m -= 1
    return m if is_valid_microbatch_count(m, par) else up
