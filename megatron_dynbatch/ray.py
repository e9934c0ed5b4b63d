"""Ray trainers (slime / ROLL style): plan a rollout batch once on the driver, ship each DP rank only its samples.

Data flow (see ``docs/ray.md``)::

    rollout workers --samples or per-sample ObjectRefs--> driver
    driver:  plan_rollout(...)            lengths + loss-mask statistics + group ids -> training plan and a
                                          forward-only (log-prob) plan with the SAME rank assignment;
                                          ray.put(rank r's samples) once per DP rank (or pass per-sample refs on)
             -> RolloutPlan.shards[r]     a small RankShard: plans, global per-sample statistics, ObjectRef(s)
    actor (one Megatron rank, DP rank r):
             log_probs_on_shard(...)      fetch rank r's samples once, forward-only pass, per-sample log-probs
                                          (optionally stored into the local samples as ``old_log_probs``)
             train_on_shard(...)          one optimizer step's forward/backward with the exact global loss
             -> ShardResult               per-sample outputs tagged with their GLOBAL sample indices
    driver:  gather_in_order(results)     the outputs in the driver's original sample order

The driver never holds more than what it already had (the rollout samples, or only their refs and metadata); each
sample's bytes travel once, from the object store to the actors of the one DP rank that runs it. The loss stays
exact because every shard carries the WHOLE batch's per-sample loss-mask statistics and group ids (a few numbers
per sample), which is all the normaliser needs (:class:`megatron_dynbatch.loss.LossNormalizer`).

Ray is imported lazily: planning (``plan_rollout(..., put=False)``), the shards and the actor-side helpers work
without it (the samples then travel inside the shard).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Union

import numpy as np

from megatron_dynbatch.errors import DynBatchConfigError
from megatron_dynbatch.iterator import DynamicBatchIterator, _hashable
from megatron_dynbatch.loss import LOSS_MODES, loss_mask_stats
from megatron_dynbatch.parallel import ParallelConfig
from megatron_dynbatch.planner import Plan, plan_global_batch, score_assignment
from megatron_dynbatch.planner.vpp import is_valid_microbatch_count, next_valid_microbatch_count

__all__ = [
    "RankShard",
    "RolloutPlan",
    "ShardResult",
    "plan_rollout",
    "plan_log_probs",
    "dp_rank_of",
    "shard_iterator",
    "train_on_shard",
    "log_probs_on_shard",
    "gather_in_order",
    "step_loss",
    "DynBatchActorMixin",
]


# ============================================================================================== data types
@dataclass
class RankShard:
    """What one data-parallel rank needs for one rollout batch -- and nothing of the other ranks' samples.

    Every actor of DP rank ``dp_rank`` (all its TP / PP / CP ranks) gets the same shard. Fields:

    * ``sample_indices``: global indices (ascending) of the samples this rank runs, in both passes; the shipped
      sample list is in this order;
    * ``plan`` / ``log_probs_plan``: the training plan and the forward-only plan of the WHOLE batch (they give
      this rank the same samples; a plan is a few integers per sample);
    * ``lengths``, ``loss_mask_sums``, ``loss_token_counts``, ``group_ids``: per-sample metadata of the WHOLE
      batch -- what makes the loss exact without the other ranks' samples;
    * ``samples_ref`` (one ``ObjectRef`` to this rank's sample list), or ``sample_refs`` (one ref per sample,
      passed through from rollout workers), or ``samples`` (the list itself, when planned without Ray).
    """

    batch_id: str
    dp_rank: int
    sample_indices: List[int]
    plan: Plan = field(repr=False)
    log_probs_plan: Optional[Plan] = field(repr=False)
    lengths: np.ndarray = field(repr=False)
    loss_mask_sums: np.ndarray = field(repr=False)
    loss_token_counts: np.ndarray = field(repr=False)
    group_ids: Optional[List[Hashable]] = field(default=None, repr=False)
    loss_mode: str = "token_mean"
    group_reduce: str = "token"
    samples_ref: Any = field(default=None, repr=False)
    sample_refs: Optional[List[Any]] = field(default=None, repr=False)
    samples: Optional[List[Mapping[str, Any]]] = field(default=None, repr=False)

    # ------------------------------------------------------------------------------------------ views
    @property
    def num_samples(self) -> int:
        """Samples in the whole rollout batch (all ranks)."""
        return int(self.lengths.size)

    @property
    def num_local_samples(self) -> int:
        return len(self.sample_indices)

    @property
    def local_tokens(self) -> int:
        """Real tokens this rank runs per pass."""
        return int(self.lengths[self.sample_indices].sum())

    @property
    def num_steps(self) -> int:
        """Optimizer steps of the training plan (``samples_per_step`` splits the batch)."""
        return len(self.plan.microbatches_per_step)

    def step_samples(self, step: int) -> List[int]:
        """Global indices (all ranks, ascending) of the samples of training step ``step``."""
        return _step_samples(self.plan, step)

    # ------------------------------------------------------------------------------------- actor side
    def fetch_samples(self) -> List[Mapping[str, Any]]:
        """This rank's sample dicts, in ``sample_indices`` order: the inline list, or ``ray.get`` of the ref(s).
        Call it once per batch and reuse the list (:class:`DynBatchActorMixin` caches it)."""
        if self.samples is not None:
            return self.samples
        import ray

        if self.samples_ref is not None:
            got = ray.get(self.samples_ref)
        elif self.sample_refs is not None:
            got = ray.get(list(self.sample_refs))
        else:
            raise DynBatchConfigError("RankShard", "no samples", "the shard carries neither samples nor refs",
                                      "build shards with plan_rollout(samples=...) or plan_rollout(sample_refs=...)")
        got = list(got)
        if len(got) != len(self.sample_indices):
            raise DynBatchConfigError("RankShard samples", f"{len(got)} samples",
                                      f"the shard lists {len(self.sample_indices)} samples", "re-dispatch the batch")
        return got

    def iterator(self, samples: Optional[Sequence[Mapping[str, Any]]] = None, *, forward_only: bool = False,
                 **kwargs: Any) -> DynamicBatchIterator:
        """:func:`shard_iterator` of this shard."""
        return shard_iterator(self, samples, forward_only=forward_only, **kwargs)


@dataclass
class RolloutPlan:
    """What :func:`plan_rollout` returns: one :class:`RankShard` per DP rank plus the two plans.

    ``rp[r]`` / ``rp.shards[r]`` is DP rank ``r``'s shard; :meth:`for_actors` maps a list of actors (by their DP
    rank) to shards, putting each shard in the object store once when Ray is running."""

    batch_id: str
    shards: List[RankShard]
    plan: Plan = field(repr=False)
    log_probs_plan: Optional[Plan] = field(repr=False)
    planning_time_s: float = 0.0
    _shard_refs: Optional[List[Any]] = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, dp_rank: int) -> RankShard:
        return self.shards[dp_rank]

    def __iter__(self):
        return iter(self.shards)

    @property
    def num_samples(self) -> int:
        return self.shards[0].num_samples

    @property
    def num_steps(self) -> int:
        return self.shards[0].num_steps

    def step_samples(self, step: int) -> List[int]:
        return _step_samples(self.plan, step)

    def for_actors(self, actor_dp_ranks: Sequence[int], *, as_refs: Optional[bool] = None) -> List[Any]:
        """One entry per actor: the shard of that actor's DP rank (``actor_dp_ranks[k]``, e.g. from
        :func:`dp_rank_of`). With ``as_refs`` (default: when Ray is initialised) each shard is ``ray.put`` once
        and every actor of its DP rank gets the same ``ObjectRef`` -- passed as a top-level argument of
        ``actor.method.remote(...)``, Ray hands the actor the shard itself."""
        dp = len(self.shards)
        bad = [r for r in actor_dp_ranks if not isinstance(r, (int, np.integer)) or not 0 <= int(r) < dp]
        if bad:
            raise DynBatchConfigError("actor_dp_ranks", bad[:8], f"DP ranks must be in [0, {dp})",
                                      "pass each actor's data-parallel rank (dp_rank_of(global_rank, parallel))")
        if as_refs is None:
            as_refs = _ray_initialized()
        if not as_refs:
            return [self.shards[int(r)] for r in actor_dp_ranks]
        if self._shard_refs is None:
            import ray

            self._shard_refs = [ray.put(s) for s in self.shards]
        return [self._shard_refs[int(r)] for r in actor_dp_ranks]

    def summary(self) -> Dict[str, Any]:
        """JSON-friendly headline numbers of both plans and the per-rank shares."""
        out: Dict[str, Any] = {
            "batch_id": self.batch_id,
            "num_samples": self.num_samples,
            "dp": len(self.shards),
            "rank_samples": [s.num_local_samples for s in self.shards],
            "rank_tokens": [s.local_tokens for s in self.shards],
            "train": self.plan.summary(),
            "planning_time_s": self.planning_time_s,
        }
        if self.log_probs_plan is not None:
            out["log_probs"] = self.log_probs_plan.summary()
        return out


@dataclass
class ShardResult:
    """What an actor sends back for one pass over its shard.

    ``per_sample[k]`` belongs to GLOBAL sample ``sample_indices[k]`` (CPU tensors, detached); ``per_sample`` is
    ``None`` on actors that are not this DP rank's output rank (only the last pipeline stage has outputs; of its
    TP / CP ranks only rank 0 sends them, the others hold copies). ``loss``: the step's exact loss ``L`` (all
    DP ranks, training passes, last pipeline stage), else ``None``."""

    batch_id: str
    dp_rank: int
    kind: str
    step: Optional[int]
    sample_indices: List[int]
    per_sample: Optional[List[Any]]
    loss: Optional[float]
    local_loss_sum: Optional[float]
    num_microbatches: int
    is_output_rank: bool
    seconds: float
    local_tokens: int
    extra: Dict[str, Any] = field(default_factory=dict)


# ============================================================================================ driver side
def plan_rollout(
    samples: Optional[Sequence[Mapping[str, Any]]] = None,
    *,
    sample_refs: Optional[Sequence[Any]] = None,
    lengths: Optional[Sequence[int]] = None,
    loss_mask_sums: Optional[Sequence[float]] = None,
    loss_token_counts: Optional[Sequence[int]] = None,
    group_ids: Optional[Sequence[Hashable]] = None,
    run_config: Any = None,
    model: Any = None,
    parallel: Union[ParallelConfig, Mapping[str, Any], None] = None,
    max_tokens_per_gpu: Optional[int] = None,
    log_probs_max_tokens_per_gpu: Optional[int] = None,
    samples_per_step: Optional[int] = None,
    balance_by_flops: Optional[bool] = None,
    balance_by: Optional[str] = None,
    oversize: Optional[str] = None,
    fp8_alignment: Union[None, str, int] = None,
    cost_model: Any = None,
    loss_mode: Optional[str] = None,
    group_reduce: Optional[str] = None,
    group_key: str = "group_id",
    log_probs: bool = True,
    put: Optional[bool] = None,
    batch_id: Optional[str] = None,
) -> RolloutPlan:
    """Plan one rollout batch on the driver and cut it into one :class:`RankShard` per DP rank.

    Give the batch either as ``samples`` (sample dicts the driver already holds; lengths, loss-mask statistics and
    group ids are read from them) or as ``sample_refs`` (one ``ObjectRef`` per sample from rollout workers, plus
    ``lengths`` and ``loss_mask_sums`` -- the driver never fetches the data).

    Planning arguments come from ``run_config`` (a :class:`~megatron_dynbatch.run_config.RunConfig`, a preset
    name or a mapping: model, layout, budgets, balancing, loss mode, ``samples_per_step``, ``group_size``) and/or
    the keyword arguments, which override it (``model``, ``parallel``, ``max_tokens_per_gpu``, ...; same meaning
    as for :func:`megatron_dynbatch.plan_global_batch`). ``log_probs_max_tokens_per_gpu`` (default: the training
    budget) is the budget of the forward-only plan (:func:`plan_log_probs`); ``log_probs=False`` skips it.

    ``put``: ``True`` -- ``ray.put`` each rank's sample list once (needs ``ray.init``); ``False`` -- keep the
    samples inside the shards (no Ray); default: ``True`` when Ray is initialised. Per-sample refs are always
    passed through as they are.
    """
    t0 = time.perf_counter()
    if (samples is None) == (sample_refs is None):
        raise DynBatchConfigError("samples / sample_refs", "both" if samples is not None else "neither",
                                  "give the batch exactly one way",
                                  "pass samples=[dict, ...] or sample_refs=[ObjectRef, ...] with lengths= and "
                                  "loss_mask_sums=")
    # ------------------------------------------------------------------ planning arguments
    kw: Dict[str, Any] = {}
    rc = None
    if run_config is not None:
        from megatron_dynbatch.run_config import RunConfig

        rc = RunConfig.from_any(run_config)
        kw = rc.planner_kwargs()
    overrides = {"model": model, "parallel": parallel, "max_tokens_per_gpu": max_tokens_per_gpu,
                 "samples_per_step": samples_per_step, "balance_by": balance_by, "oversize": oversize,
                 "fp8_alignment": fp8_alignment, "cost_model": cost_model}
    for k, v in overrides.items():
        if v is not None:
            kw[k] = v
    if balance_by_flops is not None:
        kw["balance_by_flops"] = bool(balance_by_flops)
        if balance_by is None:
            kw.pop("balance_by", None)
    if kw.get("max_tokens_per_gpu") is None:
        raise DynBatchConfigError("max_tokens_per_gpu", None, "needed to plan the rollout batch",
                                  "pass max_tokens_per_gpu=<per-GPU token budget> or run_config=RunConfig/preset")
    lp_budget = (log_probs_max_tokens_per_gpu or (rc.log_probs_max_tokens_per_gpu if rc is not None else None)
                 or kw["max_tokens_per_gpu"])
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
            group_ids = [_hashable(s[group_key]) for s in samples]
    else:
        sample_refs = list(sample_refs)  # type: ignore[arg-type]
        n = len(sample_refs)
        if n == 0:
            raise DynBatchConfigError("sample_refs", [], "the rollout batch is empty", "pass at least dp refs")
        if lengths is None or loss_mask_sums is None:
            raise DynBatchConfigError(
                "lengths / loss_mask_sums", "missing", "with sample_refs the driver does not read the samples, so it "
                "needs their token counts and loss-mask sums to plan and normalise",
                "have the rollout workers return len(tokens) and loss_mask.sum() (megatron_dynbatch.loss."
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
    gids = list(group_ids) if group_ids is not None else None
    if gids is not None and len(gids) != n:
        raise DynBatchConfigError("group_ids", f"{len(gids)} ids", f"needs one id per sample ({n})",
                                  "pass one group id per sample")
    if loss_mode == "group_mean" and gids is None:
        raise DynBatchConfigError("loss_mode", loss_mode, "group_mean needs a group id per sample",
                                  f"pass group_ids=, a '{group_key}' field in every sample, or a run_config with "
                                  "group_size")

    # ------------------------------------------------------------------ the two plans
    train_plan = plan_global_batch(lens, group_ids=gids, **kw)
    lp_plan = None
    if log_probs:
        lp_plan = plan_log_probs(train_plan, lens, max_tokens_per_gpu=int(lp_budget), model=kw.get("model"),
                                 balance_by=kw.get("balance_by"), balance_by_flops=kw.get("balance_by_flops", True),
                                 oversize=kw.get("oversize", "error"), fp8_alignment=kw.get("fp8_alignment"),
                                 cost_model=kw.get("cost_model"))

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


def plan_log_probs(
    train_plan: Plan,
    lengths: Sequence[int],
    *,
    max_tokens_per_gpu: int,
    model: Any = None,
    balance_by: Optional[str] = None,
    balance_by_flops: bool = True,
    oversize: str = "error",
    fp8_alignment: Union[None, str, int] = None,
    cost_model: Any = None,
) -> Plan:
    """A forward-only plan (log-probs, reference model) with its own budget that keeps ``train_plan``'s
    assignment of samples to DP ranks, so one shard serves both passes and the log-probs computed on a rank are
    already where that rank trains on them.

    Each rank's samples are re-packed for the forward budget by the planner (``dp=1``, same TP / PP / CP / VPP);
    every rank then runs the same number of micro-batches: the largest count a rank's own plan chose, capped by
    the fewest samples a rank holds, moved to a count the interleaved schedule accepts. If some rank cannot be
    packed into that count, the training plan's own micro-batches are used (they fit whenever
    ``max_tokens_per_gpu`` is at least the training budget); otherwise a ``DynBatchConfigError`` names the fix."""
    if not isinstance(train_plan, Plan):
        raise DynBatchConfigError("train_plan", type(train_plan).__name__, "must be a megatron_dynbatch.Plan",
                                  "pass the plan made by plan_global_batch for the same batch")
    t0 = time.perf_counter()
    lens = np.asarray(lengths, dtype=np.int64)
    par = train_plan.parallel
    train_plan.validate(num_samples=int(lens.size))
    sub_par = dataclasses.replace(par, dp=1)
    common: Dict[str, Any] = dict(model=model, parallel=sub_par, max_tokens_per_gpu=int(max_tokens_per_gpu),
                                  balance_by_flops=balance_by_flops, balance_by=balance_by, oversize=oversize,
                                  fp8_alignment=fp8_alignment, cost_model=cost_model)
    ranks = [sorted(train_plan.rank_samples(r)) for r in range(par.dp)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        subs = [plan_global_batch(lens[idx], **common) for idx in ranks]
        m = _common_count([p.num_microbatches for p in subs], min(len(idx) for idx in ranks), par)
        try:
            subs = [p if p.num_microbatches == m else plan_global_batch(lens[idx], num_microbatches=m, **common)
                    for p, idx in zip(subs, ranks)]
            micro_batches = [[[idx[k] for k in mb] for mb in p.micro_batches[0]] for p, idx in zip(subs, ranks)]
            oversize_samples = sorted(idx[k] for p, idx in zip(subs, ranks) for k in p.oversize_samples)
        except DynBatchConfigError:
            micro_batches = None
    fallback = micro_batches is None
    for w in caught[:1]:  # one warning for the whole batch is enough
        warnings.warn(w.message, w.category, stacklevel=2)
    if micro_batches is None:  # a rank with too few samples for m: reuse the training micro-batches
        m = train_plan.num_microbatches
        cap = int(max_tokens_per_gpu) * par.cp
        over = [mb for rank, toks in zip(train_plan.micro_batches, train_plan.microbatch_tokens)
                for mb, t in zip(rank, toks) if t > cap and (len(mb) > 1 or oversize != "alone")]
        if over or not is_valid_microbatch_count(m, par):
            raise DynBatchConfigError(
                "log_probs_max_tokens_per_gpu", max_tokens_per_gpu,
                "the forward-only pass cannot keep the training plan's rank assignment: a rank has too few samples "
                "for the micro-batch count the others need, and the training micro-batches do not fit this budget",
                "use a log-prob budget >= the training budget (--log-probs-max-tokens-per-gpu)")
        micro_batches = [list(map(list, rank)) for rank in train_plan.micro_batches]
        oversize_samples = list(train_plan.oversize_samples)
    plan = score_assignment(micro_batches, lens, model=model, parallel=par, max_tokens_per_gpu=int(max_tokens_per_gpu),
                            fp8_alignment=fp8_alignment, cost_model=cost_model, microbatches_per_step=[m],
                            algorithm="dynbatch-log-probs" if not fallback else "dynbatch-log-probs/train-microbatches")
    plan.balance_by_flops = bool(balance_by_flops) if balance_by is None else balance_by != "tokens"
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
        for i, v in zip(res.sample_indices, res.per_sample):
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


def step_loss(results: Iterable[Optional[ShardResult]]) -> Optional[float]:
    """The exact loss of the step: the same on every training output rank; ``None`` if none reported it."""
    for res in results:
        if res is not None and res.loss is not None:
            return float(res.loss)
    return None


# ============================================================================================= actor side
def shard_iterator(
    shard: RankShard,
    samples: Optional[Sequence[Mapping[str, Any]]] = None,
    *,
    forward_only: bool = False,
    dp_rank: Optional[int] = None,
    cp_rank: Optional[int] = None,
    cp_size: Optional[int] = None,
    pad_token_id: int = 0,
    device: Any = None,
    uniform_length: Optional[bool] = None,
    check_stats: bool = True,
) -> DynamicBatchIterator:
    """The rank-local :class:`DynamicBatchIterator` of ``shard`` (training plan, or the log-prob plan with
    ``forward_only``), from ``samples`` (this rank's samples in ``shard.sample_indices`` order; default
    ``shard.fetch_samples()``). When Megatron's ``parallel_state`` is initialised, its data-parallel size and
    rank must be the shard's plan's and the shard's; pass ``dp_rank=`` to skip that check (e.g. building the
    iterator of another rank for inspection)."""
    if not isinstance(shard, RankShard):
        raise DynBatchConfigError("shard", type(shard).__name__, "must be a RankShard",
                                  "pass one of plan_rollout(...).shards (ObjectRefs are resolved by Ray when passed "
                                  "as a top-level argument of .remote())")
    if dp_rank is None:  # the running layout must be the planned one
        _check_running_layout(shard)
        dp_rank = shard.dp_rank
    plan = shard.log_probs_plan if (forward_only and shard.log_probs_plan is not None) else shard.plan
    if samples is None:
        samples = shard.fetch_samples()
    return DynamicBatchIterator.from_shard(
        samples, plan, sample_indices=shard.sample_indices, lengths=shard.lengths,
        loss_mask_sums=shard.loss_mask_sums, loss_token_counts=shard.loss_token_counts, group_ids=shard.group_ids,
        dp_rank=dp_rank, cp_rank=cp_rank, cp_size=cp_size,
        loss_mode=shard.loss_mode, group_reduce=shard.group_reduce, pad_token_id=pad_token_id, device=device,
        uniform_length=uniform_length, check_stats=check_stats)


def train_on_shard(
    model: Any,
    shard: RankShard,
    *,
    samples: Optional[Sequence[Mapping[str, Any]]] = None,
    step: Optional[int] = None,
    per_token_loss: Optional[Callable[[Any, Any], Any]] = None,
    collect: Optional[Callable[[Any, Any], Any]] = None,
    return_outputs: bool = True,
    iterator: Optional[DynamicBatchIterator] = None,
    pad_token_id: int = 0,
    device: Any = None,
    **kwargs: Any,
) -> ShardResult:
    """One optimizer step's forward/backward over this rank's share of ``shard`` (through
    :func:`megatron_dynbatch.schedule.dynamic_forward_backward`; zero the grads before and step the optimizer
    after, as usual). ``step``: the training step of the plan (required when ``samples_per_step`` split it).
    ``per_token_loss`` / ``collect``: as for ``dynamic_forward_backward``; collected per-sample outputs come back
    on the output rank. ``kwargs`` go to ``dynamic_forward_backward`` (``config``, ``forward_step_func``, ...)."""
    from megatron_dynbatch.schedule import dynamic_forward_backward

    t0 = time.perf_counter()
    it = iterator or shard_iterator(shard, samples, pad_token_id=pad_token_id, device=device)
    if step is None and it.num_steps == 1:
        step = 0
    res = dynamic_forward_backward(model, it, per_token_loss=per_token_loss, collect=collect, step=step, **kwargs)
    return _result(shard, "train", step, res, it, t0, return_outputs, loss=res.loss)


def log_probs_on_shard(
    model: Any,
    shard: RankShard,
    *,
    samples: Optional[Sequence[Mapping[str, Any]]] = None,
    store_as: Optional[str] = None,
    return_outputs: bool = True,
    iterator: Optional[DynamicBatchIterator] = None,
    pad_token_id: int = 0,
    device: Any = None,
    **kwargs: Any,
) -> ShardResult:
    """Forward-only per-token log-probs of this rank's samples with the shard's log-prob plan (its own budget).

    ``store_as="old_log_probs"`` also writes each sample's log-probs (``[L_i]``, float32, CPU) into the local
    sample dicts under that key, where the training pass packs them as a per-token extra
    (``packed.extras["old_log_probs"]``) -- no round trip through the driver. That needs the sample list that
    training will use: pass ``samples=`` (or use :class:`DynBatchActorMixin`, which caches it). Only the last
    pipeline stage computes log-probs, and only it needs them. ``kwargs`` go to
    :func:`megatron_dynbatch.schedule.forward_log_probs`."""
    from megatron_dynbatch.schedule import forward_log_probs

    if store_as is not None and samples is None and iterator is None:
        raise DynBatchConfigError("store_as", store_as, "needs the sample list that training will reuse",
                                  "pass samples=shard.fetch_samples() here and to train_on_shard, or use "
                                  "DynBatchActorMixin")
    t0 = time.perf_counter()
    it = iterator or shard_iterator(shard, samples, forward_only=True, pad_token_id=pad_token_id, device=device)
    res = forward_log_probs(model, it, **kwargs)
    if store_as is not None and res.per_sample is not None:
        for i, lp in zip(res.sample_indices, res.per_sample):
            it.samples[i][store_as] = lp.detach().to("cpu").float()  # type: ignore[index]
    return _result(shard, "log_probs", None, res, it, t0, return_outputs, loss=None)


class DynBatchActorMixin:
    """Add to a Ray actor class that owns one Megatron rank (slime's / ROLL's Megatron train actor)::

        @ray.remote(num_gpus=1)
        class TrainActor(DynBatchActorMixin, YourMegatronActor):
            def compute_log_probs(self, shard):
                return self.dynbatch_log_probs(shard, store_as="old_log_probs")
            def train(self, shard):
                self.zero_grad()                                  # your usual step around it
                res = self.dynbatch_train_step(shard, per_token_loss=my_policy_loss)
                self.optimizer_step()
                return res

    The model is ``model=`` or ``self.model`` (a module or the list of VPP chunks). This rank's samples are
    fetched from the object store once per rollout batch and kept until the next batch (or
    :meth:`dynbatch_release`), so a log-prob pass and the training steps of one batch share them."""

    _dynbatch_key: Any = None
    _dynbatch_cache: Optional[List[Mapping[str, Any]]] = None

    def dynbatch_samples(self, shard: RankShard) -> List[Mapping[str, Any]]:
        """This rank's samples of ``shard`` (fetched on first use for a batch, then cached)."""
        if not isinstance(shard, RankShard):
            raise DynBatchConfigError("shard", type(shard).__name__, "must be a RankShard",
                                      "pass one of plan_rollout(...).shards (or RolloutPlan.for_actors(...))")
        _check_running_layout(shard)
        key = (shard.batch_id, shard.dp_rank)
        if self._dynbatch_key != key or self._dynbatch_cache is None:
            self._dynbatch_cache = [dict(s) for s in shard.fetch_samples()]  # own, mutable copies of the dicts
            self._dynbatch_key = key
        return self._dynbatch_cache

    def dynbatch_release(self) -> None:
        """Drop the cached samples of the current batch."""
        self._dynbatch_cache = None
        self._dynbatch_key = None

    def _dynbatch_model(self, model: Any) -> Any:
        model = model if model is not None else getattr(self, "model", None)
        if model is None:
            raise DynBatchConfigError("model", None, "no model to run", "pass model= or set self.model on the actor")
        return model

    def dynbatch_log_probs(self, shard: RankShard, model: Any = None, *, store_as: Optional[str] = None,
                           **kwargs: Any) -> ShardResult:
        """:func:`log_probs_on_shard` on the cached samples."""
        return log_probs_on_shard(self._dynbatch_model(model), shard, samples=self.dynbatch_samples(shard),
                                  store_as=store_as, **kwargs)

    def dynbatch_train_step(self, shard: RankShard, model: Any = None, *, step: Optional[int] = None,
                            **kwargs: Any) -> ShardResult:
        """:func:`train_on_shard` on the cached samples."""
        return train_on_shard(self._dynbatch_model(model), shard, samples=self.dynbatch_samples(shard), step=step,
                              **kwargs)


# =============================================================================================== internal
def _ray_initialized() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return bool(ray is not None and getattr(ray, "is_initialized", lambda: False)())


def _parallel_state():
    import sys

    ps = sys.modules.get("megatron.core.parallel_state")
    return ps if ps is not None and ps.model_parallel_is_initialized() else None


def _check_running_layout(shard: RankShard) -> None:
    """With Megatron's ``parallel_state`` initialised: the shard's plan is for this DP size and the shard is this
    actor's DP rank (checked before anything is fetched or any collective starts)."""
    ps = _parallel_state()
    if ps is None:
        return
    world_dp, mine = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if world_dp != shard.plan.parallel.dp:
        raise DynBatchConfigError(
            "shard.plan.parallel.dp", shard.plan.parallel.dp,
            f"the batch was planned for dp={shard.plan.parallel.dp} but Megatron's data-parallel size is {world_dp}",
            "plan_rollout with the running layout (parallel= / run_config=)")
    if mine != shard.dp_rank:
        raise DynBatchConfigError(
            "shard.dp_rank", shard.dp_rank, f"this actor is data-parallel rank {mine}",
            "send each actor the shard of its own DP rank (RolloutPlan.for_actors(dp_ranks), dp_rank_of(...))")


def _is_output_rank() -> bool:
    ps = _parallel_state()
    if ps is None:
        return True
    return bool(ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_context_parallel_rank() == 0)


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


def _step_samples(plan: Plan, step: int) -> List[int]:
    steps = len(plan.microbatches_per_step)
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step < steps:
        raise DynBatchConfigError("step", step, f"must be in [0, {steps})",
                                  "pass a training step of the plan")
    start = int(sum(plan.microbatches_per_step[:step]))
    stop = start + int(plan.microbatches_per_step[step])
    return sorted(i for rank in plan.micro_batches for mb in rank[start:stop] for i in mb)


def _to_cpu(x: Any) -> Any:
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def _result(shard: RankShard, kind: str, step: Optional[int], res: Any, it: DynamicBatchIterator, t0: float,
            return_outputs: bool, loss: Optional[float]) -> ShardResult:
    out = _is_output_rank()
    per_sample = None
    if return_outputs and out and res.per_sample is not None:
        per_sample = [_to_cpu(v) for v in res.per_sample]
    return ShardResult(
        batch_id=shard.batch_id, dp_rank=shard.dp_rank, kind=kind, step=step,
        sample_indices=list(res.sample_indices), per_sample=per_sample, loss=loss,
        local_loss_sum=res.local_loss_sum, num_microbatches=int(res.num_microbatches), is_output_rank=out,
        seconds=time.perf_counter() - t0, local_tokens=int(it.lengths[it.sample_indices(step)].sum()))
