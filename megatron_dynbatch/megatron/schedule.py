"""``dynamic_forward_backward``: Megatron's ``get_forward_backward_func()`` driven by a dynamic-batching plan.

A thin wrapper. Its arguments are the model, the batch, the plan or its options and three typed objects
(:mod:`.step_config`: :class:`StepConfig`, :class:`MegatronSchedule`, :class:`StepHooks`); the keywords of before
are sorted into those once, and the plan's source converted once (:func:`batch_iterator`), at the boundary --
:func:`run_dynamic_step` below it takes only typed objects. For one optimizer step it

1. builds (or takes) a :class:`~megatron_dynbatch.megatron.iterator.DynamicBatchIterator` over the global batch;
2. sets ``config.variable_seq_lengths = True`` when ``pp > 1`` (micro-batches differ in length, so the p2p
   layer must send shapes first; Megatron-core 0.16 then ignores ``seq_length`` for the shapes but still needs
   a non-None ``tensor_shape``, so ``seq_length`` is the longest packed micro-batch and ``micro_batch_size=1``);
   refuses the MoE ``allgather`` token dispatcher, which cannot take variable lengths;
3. calls ``forward_backward_func(forward_step_func, data_iterator, model, num_microbatches=M_step, ...)`` with
   one iterator (or, for an interleaved/VPP model list, one independent iterator per model chunk);
4. returns the step's exact loss (partial sums all-reduced over the DP x CP group on the last pipeline stage)
   and, if asked, per-sample outputs in the ORIGINAL sample order (CP slices reassembled).

The default forward step runs ``GPTModel(tokens, position_ids, None, labels=labels, packed_seq_params=...)``,
which returns the per-token cross-entropy ``[1, T_local]``; the default loss is that cross-entropy normalised
by ``loss_mode``. ``forward_only=True`` (log-prob / reference passes) collects ``-cross_entropy`` = per-token
log-probs ``log p(labels[j] | tokens[:j+1])`` of each sample's real positions.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

from ..core.errors import DynBatchConfigError
from ..core.planner.api import options_of
from ..core.planner.options import PlanOptions, ResolvedOptions
from ..core.planner.plan_kind import PlanKind
from .gather import per_microbatch_outputs
from .iterator import DynamicBatchIterator
from .loss import RESULT_KEY, MicroBatchResult
from .step_config import MegatronSchedule, StepConfig, StepHooks, split_keywords

__all__ = [
    "DynamicStepResult",
    "MegatronSchedule",
    "StepConfig",
    "StepHooks",
    "dynamic_forward_backward",
    "run_dynamic_step",
    "batch_iterator",
    "check_model_for_plan",
    "forward_log_probs",
    "default_forward_step",
    "log_probs_from_logits",
    "log_probs_collector",
    "prepare_config",
    "check_sequence_parallel_alignment",
]


@dataclass
class DynamicStepResult:
    """What :func:`dynamic_forward_backward` returns.

    ``loss``: the step's loss ``L`` exactly as defined by the loss mode (float; on the last pipeline stage;
    ``None`` elsewhere, or the local partial sum when ``reduce_loss=False``). ``per_sample``: collected outputs
    of this rank's samples in ORIGINAL order (``sample_indices``), or of ALL samples in global order with
    ``gather_outputs=True``; ``None`` when nothing was collected or on a non-last pipeline stage.
    ``step``: the optimizer step of the plan that ran (``None``: a forward-only pass over all of them);
    ``seconds``: the schedule call's wall time when it was measured (synchronised: with a memory guard, or on a
    CPU), else ``None``; ``peak_bytes`` / ``predicted_peak_bytes``: with a memory guard, the step's measured
    allocator peak (the largest over the ranks) and the guard's prediction for the plan before it ran.
    :meth:`metrics` gives the step's ``dynbatch/...`` figures.
    """

    loss: Optional[float]
    local_loss_sum: Optional[float]
    per_sample: Optional[List[Any]]
    sample_indices: List[int]
    num_microbatches: int
    iterator: DynamicBatchIterator
    forward_data_store: List[Any] = field(default_factory=list, repr=False)
    step: Optional[int] = None
    seconds: Optional[float] = None
    peak_bytes: Optional[float] = None
    predicted_peak_bytes: Optional[float] = None

    def metrics(self, prefix: str = "dynbatch/") -> dict:
        """The step's figures as ``{"dynbatch/...": float}`` (:func:`megatron_dynbatch.core.metrics.step_metrics`:
        micro-batches, imbalance, padding, budget, predicted step time; measured time and peak when known)."""
        from ..core.metrics import step_metrics

        return step_metrics(self.iterator.plan, step=self.step, measured_step_s=self.seconds,
                            measured_peak_bytes=self.peak_bytes, predicted_peak_bytes=self.predicted_peak_bytes,
                            prefix=prefix)


# ----------------------------------------------------------------------------------- helpers for users
def log_probs_from_logits(logits: Any, labels: Any, *, temperature: float = 1.0, batch_first: bool = True) -> Any:
    """Per-token log-probs ``log softmax(logits / temperature)[labels]``.

    ``logits``: ``[b, s, V/tp]`` (``batch_first``, what ``GPTModel`` returns without labels) or ``[s, b, V/tp]``,
    vocabulary-parallel under tensor parallelism; ``labels``: ``[b, s]`` / ``[s, b]``. Uses Megatron's
    ``vocab_parallel_cross_entropy`` when ``parallel_state`` is initialised (exact under TP, on a copy: that
    kernel works in place), else a plain ``log_softmax``. Differentiable; returns the layout of ``labels``."""
    import torch

    if temperature <= 0:
        raise DynBatchConfigError("temperature", temperature, "must be > 0", "use the sampling temperature, e.g. 1.0")
    scaled = logits.float() / float(temperature)  # always a new tensor
    try:
        from megatron.core import parallel_state, tensor_parallel

        use_megatron = parallel_state.model_parallel_is_initialized()
    except ImportError:  # pragma: no cover
        use_megatron = False
    if use_megatron:
        if batch_first:
            ce = tensor_parallel.vocab_parallel_cross_entropy(scaled.transpose(0, 1).contiguous(),
                                                              labels.transpose(0, 1).contiguous())
            return -ce.transpose(0, 1)
        return -tensor_parallel.vocab_parallel_cross_entropy(scaled, labels)
    return torch.log_softmax(scaled, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def log_probs_collector(output_tensor: Any, packed: Any) -> Any:
    """``collect`` function for models run with labels: per-token log-probs are minus the cross-entropy."""
    return -output_tensor.detach().float()


def default_forward_step(
    batch_iterator: DynamicBatchIterator,
    *,
    calculate_per_token_loss: bool = False,
    per_token_loss: Optional[Callable[[Any, Any], Any]] = None,
    collect: Optional[Callable[[Any, Any], Any]] = None,
    forward_only: bool = False,
    tuple_size: int = 3,
    num_microbatches: Optional[int] = None,
) -> Callable[[Any, Any], tuple]:
    """A Megatron ``forward_step_func(data_iterator, model)`` for packed micro-batches: runs
    ``model(tokens, position_ids, None, labels=labels, packed_seq_params=...)`` (per-token cross-entropy out of
    the last stage, hidden states elsewhere) and returns ``batch_iterator.loss_func(...)`` for the micro-batch."""

    def forward_step(data_iterator: Any, model: Any) -> tuple:
        from .dynamic_cp import microbatch_cp_group

        packed = next(data_iterator)
        with microbatch_cp_group(model, packed):  # dynamic CP: THD RoPE must see the micro-batch's group
            output = model(packed.tokens, packed.position_ids, None, labels=packed.labels,
                           packed_seq_params=packed.packed_seq_params)
        return output, batch_iterator.loss_func(
            packed, calculate_per_token_loss=calculate_per_token_loss, per_token_loss=per_token_loss,
            collect=collect, tuple_size=tuple_size, forward_only=forward_only, num_microbatches=num_microbatches)

    return forward_step


def prepare_config(config: Any, pp_size: int, uniform_length: bool = False) -> None:
    """Make a (Transformer/ModelParallel) ``config`` ready for variable-length micro-batches: with ``pp > 1``
    set ``variable_seq_lengths=True`` (not needed when ``uniform_length``: every micro-batch of the step has the
    same length, passed as ``seq_length``); refuse the MoE ``allgather`` dispatcher (fixed shapes across ranks)."""
    moe = getattr(config, "num_moe_experts", None)
    dispatcher = getattr(config, "moe_token_dispatcher_type", None)
    ep = int(getattr(config, "expert_model_parallel_size", 1) or 1)
    if moe and dispatcher == "allgather" and (pp_size > 1 or ep > 1):
        raise DynBatchConfigError(
            "--moe-token-dispatcher-type", dispatcher,
            "the allgather dispatcher needs the same token count on every rank of its group, which dynamic "
            "batching (and variable_seq_lengths under pipeline parallelism) does not give",
            "use --moe-token-dispatcher-type alltoall")
    if pp_size > 1 and not uniform_length and not getattr(config, "variable_seq_lengths", False):
        config.variable_seq_lengths = True


def _config_sp_tp(config: Any) -> tuple:
    tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    return bool(getattr(config, "sequence_parallel", False)) and tp > 1, tp


def _options_for_model(plan_or_options: Union[ResolvedOptions, PlanOptions, Mapping[str, Any]],
                       config: Any) -> ResolvedOptions:
    """The door's one conversion: the options this call plans with, resolved (once: options resolved by the
    caller, as the Megatron-LM hook does once per run, are taken as they are). Given as keywords, when the model
    runs sequence-parallel and ``parallel`` is a dict that does not say ``sequence_parallel``, it is added (the
    packer must then pad micro-batches to a multiple of tp)."""
    if isinstance(plan_or_options, ResolvedOptions):
        return plan_or_options
    if isinstance(plan_or_options, PlanOptions):
        return plan_or_options.resolve()
    kw = dict(plan_or_options)
    sp, _ = _config_sp_tp(config)
    par = kw.get("parallel")
    if sp and isinstance(par, Mapping) and "sequence_parallel" not in par:
        kw["parallel"] = dict(par, sequence_parallel=True)
    return options_of(None, kw).resolve()


def check_sequence_parallel_alignment(plan: PlanKind, config: Any) -> None:
    """Under sequence parallelism Megatron scatters every micro-batch's (CP-local) tokens over TP, so their
    count must divide by ``tp``: refuse a plan whose alignment does not guarantee ``tp * cp`` | tokens."""
    sp, tp = _config_sp_tp(config)
    if not sp:
        return
    cp = int(getattr(config, "context_parallel_size", 1) or 1)
    if plan.alignment.total_multiple % (tp * cp) != 0:
        raise DynBatchConfigError(
            "plan.parallel.sequence_parallel", plan.parallel.sequence_parallel,
            f"the model runs with sequence_parallel and tp={tp} (cp={cp}), but the plan pads micro-batches to a "
            f"multiple of {plan.alignment.total_multiple}, not of tp*cp={tp * cp}",
            "plan with parallel={..., 'tp': tp, 'cp': cp, 'sequence_parallel': True} (parallel_from_args does)")


# --------------------------------------------------------------------------------------------- main
#: what ``dynamic_forward_backward`` plans from: a plan, the planner's options (resolved already, or to resolve
#: here), or those as a dict of ``plan_global_batch`` keywords -- converted once, at that boundary
#: (:func:`batch_iterator`)
PlanSource = Union[PlanKind, ResolvedOptions, PlanOptions, Mapping[str, Any], None]


def dynamic_forward_backward(
    model: Any,
    samples: Union[Sequence[Mapping[str, Any]], DynamicBatchIterator],
    plan_or_options: PlanSource = None,
    step_config: Optional[StepConfig] = None,
    schedule: Optional[MegatronSchedule] = None,
    hooks: Optional[StepHooks] = None,
    **keywords: Any,
) -> DynamicStepResult:
    """Run one optimizer step (or a forward-only pass) over a global batch with dynamic micro-batches.

    Args:
        model: the model, or the list of model chunks (VPP), usually wrapped in Megatron's DDP.
        samples: the global batch (identical on every rank), or a ready :class:`DynamicBatchIterator`.
        plan_or_options: a plan (:class:`Plan` / :class:`DynamicCPPlan`), the planner's
            :class:`~megatron_dynbatch.core.planner.options.PlanOptions`, or the options as a dict of
            :func:`plan_global_batch` keywords (``model`` spec, ``parallel``, ``max_tokens_per_gpu``, ...). For a
            forward-only log-prob pass give its own budget (``options.for_forward_only(log_probs_budget)``).
            Ignored when ``samples`` is an iterator.
        step_config: what to run (:class:`~megatron_dynbatch.megatron.step_config.StepConfig`: ``loss_mode``,
            ``group_reduce``, ``forward_only``, ``step``, ``reduce_loss``, ``gather_outputs``, ``per_token_loss``,
            ``collect``, ``forward_step_func``, ``tuple_size``, ``pad_token_id``, ``device``).
        schedule: Megatron's side (:class:`~megatron_dynbatch.megatron.step_config.MegatronSchedule`: ``config``,
            ``forward_backward_func``, ``extra`` keywords for it).
        hooks: observers (:class:`~megatron_dynbatch.megatron.step_config.StepHooks`: ``calibrator``,
            ``memory_guard``).
        **keywords: any field of those three by name, as before (``loss_mode="sample_mean"``, ``step=1``,
            ``memory_guard=guard``, ...); any other name is passed on to ``forward_backward_func`` (e.g.
            ``first_val_step``).

    The fields, in words:

    * ``forward_step_func``: a Megatron forward step of your own (``(data_iterator, model) -> (output,
      loss_fn)``; the iterator yields :class:`~megatron_dynbatch.megatron.packing.PackedMicroBatch`; build
      ``loss_fn`` with ``result.iterator.loss_func`` -- pass a ready iterator as ``samples`` to have it
      beforehand). Default: :func:`default_forward_step`. Under a dynamic-CP plan run the model call inside
      ``megatron_dynbatch.megatron.dynamic_cp.microbatch_cp_group(model, packed)`` (THD RoPE positions).
    * ``per_token_loss``, ``collect``: see :func:`megatron_dynbatch.megatron.loss.make_loss_func`. ``collect``
      defaults to per-token log-probs when ``forward_only``.
    * ``forward_only``: no backward (log-prob / reference passes). Runs every step of the plan in one call.
    * ``step``: optimizer step of the plan to run (required when the plan has several; default 0).
    * ``reduce_loss``: all-reduce the loss over the DP x CP group of the last pipeline stage (exact ``L``).
    * ``gather_outputs``: gather per-sample outputs of all DP ranks into global sample order.
    * ``pad_token_id``, ``device``: packing options (``device`` default: the current CUDA device, else the CPU).
    * ``calibrator``: an :class:`~megatron_dynbatch.megatron.online_calibration.OnlineCalibrator` (online
      calibration): a training step's micro-batches are timed, every ``interval`` steps the cost model is
      refitted (one all-reduce: call this on every rank), and plans made here from ``plan_or_options`` use the
      refitted model (pass ``calibrator.cost_model`` yourself when you plan). Never changes the loss.
    * ``memory_guard``: a :class:`~megatron_dynbatch.megatron.memory_guard.StepMemoryGuard` (online memory guard):
      a training step planned here from ``plan_or_options`` uses the guard's budget; the step's peak memory is
      read (CUDA allocator peak, reset per step), merged over the ranks (one all-reduce: call this on every rank)
      and the guard chooses the next step's budget. With a ready plan / iterator the step is only measured (plan
      later steps with ``memory_guard.options(options)``). Never changes the loss.
    """
    cfg, sched, obs = split_keywords(keywords, step_config, schedule, hooks)
    if sched.config is None:
        from megatron.core.utils import get_model_config

        sched = replace(sched, config=get_model_config(model[0] if isinstance(model, list) else model))
    if cfg.device is None:  # pack where the model runs (the GPU when there is one)
        cfg = replace(cfg, device=_comm_device())
    it, options = batch_iterator(samples, plan_or_options, cfg, obs, sched.config, model=model,
                                 probe_run=lambda smp, plan: run_dynamic_step(
                                     model, batch_iterator(smp, plan, cfg, obs, sched.config)[0],
                                     replace(cfg, reduce_loss=False), sched, replace(obs, memory_probe=False)))
    return run_dynamic_step(model, it, cfg, sched, obs, options)


def batch_iterator(samples: Union[Sequence[Mapping[str, Any]], DynamicBatchIterator], source: PlanSource,
                   cfg: StepConfig, hooks: StepHooks, config: Any, *, model: Any = None,
                   probe_run: Optional[Callable[[Any, Any], Any]] = None) -> Tuple[DynamicBatchIterator,
                                                                                   Optional[ResolvedOptions]]:
    """The boundary: the iterator of the step and, when it plans here, the resolved options it planned with
    (the model's sequence parallelism filled in, the calibrator's cost model, the memory guard's budget and the
    first-step probe's verdict applied; ``probe_run(samples, plan)`` runs the probe's synthetic micro-batches
    through this call's own step, :mod:`.probe`)."""
    if isinstance(samples, DynamicBatchIterator):
        return samples, None
    packing = dict(loss_mode=cfg.loss_mode, group_reduce=cfg.group_reduce, pad_token_id=cfg.pad_token_id,
                   device=cfg.device)
    if isinstance(source, PlanKind):
        return DynamicBatchIterator(samples, source, **packing), None
    if not isinstance(source, (ResolvedOptions, PlanOptions, Mapping)):
        raise DynBatchConfigError("plan_or_options", type(source).__name__,
                                  "needs a Plan, a PlanOptions or a dict of plan_global_batch options",
                                  "pass e.g. {'model': spec, 'parallel': par, 'max_tokens_per_gpu': 8192}")
    options = _options_for_model(source, config)
    if hooks.calibrator is not None and hooks.calibrator.cost_model is not None:
        options = options.replace(cost_model=hooks.calibrator.cost_model)
    if hooks.memory_guard is not None and not cfg.forward_only:
        options = hooks.memory_guard.options(options)
    if hooks.memory_probe is not False and probe_run is not None:  # the first step protected: the lower budget
        from .probe import protect_first_step

        options = protect_first_step(hooks.memory_probe, options, model=model, forward_only=cfg.forward_only,
                                     device=cfg.device, run=probe_run)
    return DynamicBatchIterator.planned(samples, options, **packing), options


def run_dynamic_step(model: Any, it: DynamicBatchIterator, cfg: StepConfig, sched: MegatronSchedule,
                     hooks: StepHooks, options: Optional[ResolvedOptions] = None) -> DynamicStepResult:
    """One step of ``it``'s plan through Megatron's schedule (below the boundary: every argument typed;
    ``options``: what the plan was made with here, for the calibration log). ``sched.config`` must be set."""
    from megatron.core import parallel_state

    chunks = model if isinstance(model, list) else [model]
    check_model_for_plan(sched.config, it, parallel_state.get_pipeline_model_parallel_world_size())
    run_step = _step_to_run(it, cfg)
    num_mb = it.num_microbatches if run_step is None else len(it.step_range(run_step))
    collect = cfg.collect if cfg.collect is not None or not cfg.forward_only else log_probs_collector
    forward_step_func = cfg.forward_step_func or default_forward_step(
        it, calculate_per_token_loss=bool(getattr(sched.config, "calculate_per_token_loss", False)),
        per_token_loss=cfg.per_token_loss, collect=collect, forward_only=cfg.forward_only,
        tuple_size=cfg.tuple_size, num_microbatches=num_mb)
    if sched.forward_backward_func is not None:
        fb = sched.forward_backward_func
    else:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fb = get_forward_backward_func()
    data_iterator = it.data_iterator(run_step, num_model_chunks=len(chunks))
    training = not cfg.forward_only
    calibrator = hooks.calibrator if training else None
    guard = hooks.memory_guard if training else None
    timing = calibrator.step(model, it, run_step) if calibrator is not None else nullcontext()
    predicted = guard.predict_plan(it.plan, run_step) if guard is not None else None

    def run_schedule() -> Any:
        return fb(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                  num_microbatches=num_mb, seq_length=it.max_seq_length(run_step), micro_batch_size=1,
                  forward_only=cfg.forward_only, **sched.extra)

    t0 = time.perf_counter()
    with timing:
        store = guard.run(run_schedule, model, it, run_step) if guard is not None else run_schedule()
    seconds = guard.last_seconds if guard is not None else (time.perf_counter() - t0 if _synchronous() else None)

    results: List[MicroBatchResult] = [d[RESULT_KEY] for d in (store or [])
                                       if isinstance(d, Mapping) and isinstance(d.get(RESULT_KEY), MicroBatchResult)]
    local, loss, per_sample = _step_outputs(results, it, run_step, cfg)
    if cfg.gather_outputs and per_sample is not None:
        sample_indices = it.step_samples(run_step) if run_step is not None else list(range(len(it.samples)))
    else:
        sample_indices = it.sample_indices(run_step)
    if calibrator is not None:
        calibrator.end_step(it.plan, it.lengths, options)
    if guard is not None:
        guard.end_step(it.plan, run_step)
    return DynamicStepResult(loss=loss, local_loss_sum=local, per_sample=per_sample, sample_indices=sample_indices,
                             num_microbatches=num_mb, iterator=it, forward_data_store=store or [], step=run_step,
                             seconds=seconds, peak_bytes=guard.peak_bytes if guard is not None else None,
                             predicted_peak_bytes=predicted)


def check_model_for_plan(config: Any, it: DynamicBatchIterator, pp_size: int) -> None:
    """Make ``config`` ready for the plan's variable lengths (:func:`prepare_config`) and refuse what cannot run
    it: a plan without the sequence-parallel padding the model needs, a dynamic-CP plan on a model that reads its
    fixed CP group (MTP) or runs megatron-core's own hybrid-CP schedule."""
    prepare_config(config, pp_size, uniform_length=it.uniform_length)
    check_sequence_parallel_alignment(it.plan, config)
    if not it.plan.dynamic_cp:
        return
    from .dynamic_cp import check_dynamic_cp_model

    check_dynamic_cp_model(config)
    if getattr(config, "hybrid_context_parallel", False):
        raise DynBatchConfigError("config.hybrid_context_parallel", True, "megatron-core would run its own hybrid-CP "
                                  "schedule instead of the dynamic-CP plan", "build the model with "
                                  "hybrid_context_parallel=False (drop --hybrid-context-parallel)")


def _step_to_run(it: DynamicBatchIterator, cfg: StepConfig) -> Optional[int]:
    """The plan's optimizer step this call runs (``None``: every step, a forward-only pass)."""
    if cfg.forward_only or cfg.step is not None:
        return cfg.step
    if it.num_steps > 1:
        raise DynBatchConfigError("step", None, f"the plan has {it.num_steps} optimizer steps",
                                  "call once per step with step=0, 1, ... and run the optimizer in between")
    return 0


def _step_outputs(results: List[MicroBatchResult], it: DynamicBatchIterator, run_step: Optional[int],
                  cfg: StepConfig) -> Tuple[Optional[float], Optional[float], Optional[List[Any]]]:
    """``(local loss sum, loss, per-sample outputs)`` of the step on the last pipeline stage (``None`` elsewhere):
    the loss all-reduced over the DP x CP group when asked, the outputs in sample order (:mod:`.gather`)."""
    import torch
    from megatron.core import parallel_state

    if not (parallel_state.is_pipeline_last_stage(ignore_virtual=True) and results):
        return None, None, None
    local = float(sum(float(r.loss_sum) for r in results if r.loss_sum is not None))
    loss = local
    if cfg.reduce_loss and not cfg.forward_only:
        t = torch.tensor([local], dtype=torch.float64, device=_comm_device())
        torch.distributed.all_reduce(t, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        loss = float(t.item())
    per_sample = None
    if any(r.outputs is not None for r in results):
        per_sample = it.restore_order(per_microbatch_outputs(results, it.microbatches(run_step), it.cp_size),
                                      run_step)
        if cfg.gather_outputs:
            per_sample = it.gather_across_dp(per_sample, run_step)
    return local, loss, per_sample


def forward_log_probs(
    model: Any,
    samples: Union[Sequence[Mapping[str, Any]], DynamicBatchIterator],
    plan_or_options: PlanSource = None,
    step_config: Optional[StepConfig] = None,
    schedule: Optional[MegatronSchedule] = None,
    hooks: Optional[StepHooks] = None,
    **keywords: Any,
) -> DynamicStepResult:
    """Forward-only pass returning per-sample per-token log-probs in ORIGINAL order (``result.per_sample[k]``
    belongs to sample ``result.sample_indices[k]``; ``L_i`` entries aligned with its labels). Plan it with its
    own budget, e.g. ``plan_options_from_args(args, forward_only=True)``. Arguments: as for
    :func:`dynamic_forward_backward` (``forward_only`` is set; ``collect`` defaults to per-token log-probs)."""
    cfg, sched, obs = split_keywords(keywords, step_config, schedule, hooks)
    cfg = replace(cfg, forward_only=True, collect=cfg.collect if cfg.collect is not None else log_probs_collector)
    return dynamic_forward_backward(model, samples, plan_or_options, cfg, sched, obs)


# ------------------------------------------------------------------------------------------ internal
def _synchronous() -> bool:
    """Whether a wall clock around the schedule measures its work: no CUDA device, so no asynchronous stream."""
    import torch

    return not torch.cuda.is_available()


def _comm_device() -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
