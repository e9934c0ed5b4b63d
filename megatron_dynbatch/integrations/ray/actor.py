"""Actor side of the Ray integration: each Megatron rank turns its :class:`~.shards.RankShard` into a
:class:`~megatron_dynbatch.megatron.iterator.DynamicBatchIterator` and runs a training step or a forward-only
log-prob pass on it. torch and megatron-core are imported only when a pass runs."""

from __future__ import annotations

import time
from typing import Any, Callable, List, Mapping, Optional, Sequence

from ...core.errors import DynBatchConfigError
from ...megatron.iterator import DynamicBatchIterator
from .shards import RankShard, ShardResult

__all__ = ["shard_iterator", "train_on_shard", "log_probs_on_shard", "DynBatchActorMixin"]


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
    record_timings: bool = False,
    record_memory: bool = False,
    memory_reader: Any = None,
    **kwargs: Any,
) -> ShardResult:
    """One optimizer step's forward/backward over this rank's share of ``shard`` (through
    :func:`megatron_dynbatch.megatron.schedule.dynamic_forward_backward`; zero the grads before and step the optimizer
    after, as usual). ``step``: the training step of the plan (required when ``samples_per_step`` split it).
    ``per_token_loss`` / ``collect``: as for ``dynamic_forward_backward``; collected per-sample outputs come back
    on the output rank. ``record_timings``: time each micro-batch (CUDA events read once after the step) and send
    the records back in ``ShardResult.timings`` for the driver's online calibration
    (:func:`~.driver.update_calibration`). ``record_memory``: read the step's peak memory (``memory_reader``,
    default the CUDA allocator's peak, reset for the step) and send it back in ``ShardResult.memory`` for the
    driver's memory guard (:func:`~.driver.update_memory_guard`). ``ShardResult.metrics`` holds the step's
    ``dynbatch/...`` figures. ``kwargs`` go to ``dynamic_forward_backward`` (``config``, ``forward_step_func``,
    ...)."""
    from megatron_dynbatch.megatron.schedule import dynamic_forward_backward

    t0 = time.perf_counter()
    it = iterator or shard_iterator(shard, samples, pad_token_id=pad_token_id, device=device)
    if step is None and it.num_steps == 1:
        step = 0
    recorder = None
    if record_timings:
        from megatron_dynbatch.megatron.online_calibration import TimingRecorder

        par = shard.plan.parallel
        recorder = TimingRecorder(pp=par.pp, tp=par.tp, device=device)
        kwargs["calibrator"] = recorder
    memory = None
    if record_memory:
        from megatron_dynbatch.megatron.memory_guard import MemoryRecorder

        memory = MemoryRecorder(pp=shard.plan.parallel.pp, reader=memory_reader, device=device)
        kwargs["memory_guard"] = memory
    res = dynamic_forward_backward(model, it, per_token_loss=per_token_loss, collect=collect, step=step, **kwargs)
    out = _result(shard, "train", step, res, it, t0, return_outputs, loss=res.loss)
    out.timings = recorder.payload() if recorder is not None else None
    out.memory = memory.vector.tolist() if memory is not None and memory.vector is not None else None
    return out


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
    :func:`megatron_dynbatch.megatron.schedule.forward_log_probs`."""
    from megatron_dynbatch.megatron.schedule import forward_log_probs

    if store_as is not None and samples is None and iterator is None:
        raise DynBatchConfigError("store_as", store_as, "needs the sample list that training will reuse",
                                  "pass samples=shard.fetch_samples() here and to train_on_shard, or use "
                                  "DynBatchActorMixin")
    t0 = time.perf_counter()
    it = iterator or shard_iterator(shard, samples, forward_only=True, pad_token_id=pad_token_id, device=device)
    res = forward_log_probs(model, it, **kwargs)
    if store_as is not None and res.per_sample is not None:
        for i, lp in zip(res.sample_indices, res.per_sample, strict=True):
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
    metrics = res.metrics() if callable(getattr(res, "metrics", None)) else {}
    return ShardResult(
        batch_id=shard.batch_id, dp_rank=shard.dp_rank, kind=kind, step=step,
        sample_indices=list(res.sample_indices), per_sample=per_sample, loss=loss,
        local_loss_sum=res.local_loss_sum, num_microbatches=int(res.num_microbatches), is_output_rank=out,
        seconds=time.perf_counter() - t0, local_tokens=int(it.lengths[it.sample_indices(step)].sum()),
        metrics=metrics)
