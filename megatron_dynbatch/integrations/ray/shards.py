"""The data a Ray driver sends to its training actors and gets back: :class:`RankShard` (one DP rank's share of a
rollout batch), :class:`RolloutPlan` (all shards plus the two plans) and :class:`ShardResult` (one pass's outputs,
tagged with global sample indices). Plain dataclasses: no Ray, torch or Megatron needed to build or inspect them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence

import numpy as np

from ...core.checks import is_int
from ...core.errors import DynBatchConfigError
from ...core.planner import Plan

__all__ = ["RankShard", "RolloutPlan", "ShardResult"]


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

    def metrics(self, prefix: str = "dynbatch/") -> Dict[str, float]:
        """The training plan's figures as ``{"dynbatch/...": float}`` (:func:`megatron_dynbatch.core.metrics.
        step_metrics`: micro-batches, imbalance, padding, budget, predicted step time), and the log-prob plan's
        under ``dynbatch/log_probs/...``: what a driver logs per rollout batch."""
        from ...core.metrics import step_metrics

        out = step_metrics(self.plan, prefix=prefix)
        if self.log_probs_plan is not None:
            out.update(step_metrics(self.log_probs_plan, prefix=f"{prefix}log_probs/"))
        return out

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
    DP ranks, training passes, last pipeline stage), else ``None``. ``timings``: with ``train_on_shard(...,
    record_timings=True)``, this actor's micro-batch times ``{"slice": {...}, "records": [...]}`` for the driver's
    online calibration (:func:`~.driver.update_calibration`), else ``None``. ``memory``: with
    ``train_on_shard(..., record_memory=True)``, this actor's peak-memory reading vector
    (:func:`~megatron_dynbatch.core.memory.guard.reading_vector`) for the driver's memory guard
    (:func:`~.driver.update_memory_guard`), else ``None``. ``metrics``: the pass's ``dynbatch/...`` figures
    (:func:`~megatron_dynbatch.core.metrics.step_metrics`; measured time, and this actor's peak when read)."""

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
    timings: Optional[Dict[str, Any]] = None
    memory: Optional[List[float]] = None
    metrics: Dict[str, float] = field(default_factory=dict)


def _ray_initialized() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return bool(ray is not None and getattr(ray, "is_initialized", lambda: False)())


def _step_samples(plan: Plan, step: int) -> List[int]:
    steps = len(plan.microbatches_per_step)
    if not is_int(step) or not 0 <= step < steps:
        raise DynBatchConfigError("step", step, f"must be in [0, {steps})",
                                  "pass a training step of the plan")
    start = int(sum(plan.microbatches_per_step[:step]))
    stop = start + int(plan.microbatches_per_step[step])
    return sorted(i for rank in plan.micro_batches for mb in rank[start:stop] for i in mb)
