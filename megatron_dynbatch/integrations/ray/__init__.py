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
             update_calibration(cal, ...) online calibration: the actors' micro-batch times (train_on_shard(...,
                                          record_timings=True)) refit the model the next plan_rollout(...,
                                          calibration=cal) uses
             update_memory_guard(guard, ...)  the memory guard: the actors' peak readings (train_on_shard(...,
                                          record_memory=True)) choose the budget the next plan_rollout(...,
                                          memory_guard=guard) plans with

The driver never holds more than what it already had (the rollout samples, or only their refs and metadata); each
sample's bytes travel once, from the object store to the actors of the one DP rank that runs it. The loss stays
exact because every shard carries the WHOLE batch's per-sample loss-mask statistics and group ids (a few numbers
per sample), which is all the normaliser needs (:class:`megatron_dynbatch.megatron.loss.LossNormalizer`).

Ray is imported lazily: planning (``plan_rollout(..., put=False)``), the shards and the actor-side helpers work
without it (the samples then travel inside the shard).

Modules: :mod:`.shards` (the data types), :mod:`.driver` (planning, gathering), :mod:`.actor` (the passes).
"""

from .actor import DynBatchActorMixin, log_probs_on_shard, shard_iterator, train_on_shard
from .driver import (dp_rank_of, gather_in_order, plan_log_probs, plan_rollout, step_loss, update_calibration,
                     update_memory_guard)
from .shards import RankShard, RolloutPlan, ShardResult

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
    "update_calibration",
    "update_memory_guard",
    "DynBatchActorMixin",
]
