"""``dynamic_forward_backward``: Megatron's ``get_forward_backward_func()`` driven by a dynamic-batching plan.

A thin wrapper. For one optimizer step it

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
from dataclasses import dataclass, field
from typing import Any, Callable, List, Mapping, Optional, Sequence, Union

from ..core.errors import DynBatchConfigError
from .iterator import DynamicBatchIterator, split_per_sample
from .loss import RESULT_KEY, MicroBatchResult
from ..core.planner import Plan
from ..core.planner.api import options_of
from ..core.planner.options import PlanOptions

__all__ = [
    "DynamicStepResult",
    "dynamic_forward_backward",
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


def _options_for_model(plan_or_options: Union[PlanOptions, Mapping[str, Any]], config: Any) -> PlanOptions:
    """The options this call plans with. Given as keywords, when the model runs sequence-parallel and
    ``parallel`` is a dict that does not say ``sequence_parallel``, it is added (the packer must then pad
    micro-batches to a multiple of tp)."""
    if isinstance(plan_or_options, PlanOptions):
        return plan_or_options
    kw = dict(plan_or_options)
    sp, _ = _config_sp_tp(config)
    par = kw.get("parallel")
    if sp and isinstance(par, Mapping) and "sequence_parallel" not in par:
        kw["parallel"] = dict(par, sequence_parallel=True)
    return options_of(None, kw)


def check_sequence_parallel_alignment(plan: Plan, config: Any) -> None:
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
def dynamic_forward_backward(
    model: Any,
    samples: Union[Sequence[Mapping[str, Any]], DynamicBatchIterator],
    plan_or_options: Union[Plan, PlanOptions, Mapping[str, Any], None] = None,
    *,
    config: Any = None,
    loss_mode: str = "token_mean",
    group_reduce: str = "token",
    forward_step_func: Optional[Callable[[Any, Any], tuple]] = None,
    per_token_loss: Optional[Callable[[Any, Any], Any]] = None,
    collect: Optional[Callable[[Any, Any], Any]] = None,
    forward_only: bool = False,
    step: Optional[int] = None,
    tuple_size: int = 3,
    reduce_loss: bool = True,
    gather_outputs: bool = False,
    pad_token_id: int = 0,
    device: Any = None,
    forward_backward_func: Optional[Callable[..., Any]] = None,
    calibrator: Any = None,
    memory_guard: Any = None,
    memory_probe: Any = None,
    **fb_kwargs: Any,
) -> DynamicStepResult:
    """Run one optimizer step (or a forward-only pass) over a global batch with dynamic micro-batches.

    Args:
        model: the model, or the list of model chunks (VPP), usually wrapped in Megatron's DDP.
        samples: the global batch (identical on every rank), or a ready :class:`DynamicBatchIterator`.
        plan_or_options: a :class:`Plan`, the planner's
            :class:`~megatron_dynbatch.core.planner.options.PlanOptions`, or the options as a dict of
            :func:`plan_global_batch` keywords (``model`` spec, ``parallel``, ``max_tokens_per_gpu``, ...). For a
            forward-only log-prob pass give its own budget (``options.for_forward_only(log_probs_budget)``).
            Ignored when ``samples`` is an iterator.
        config: the model's ``TransformerConfig`` (default: read from the model).
        loss_mode, group_reduce: loss normalisation (:mod:`megatron_dynbatch.megatron.loss`).
        forward_step_func: a Megatron forward step of your own (``(data_iterator, model) -> (output, loss_fn)``;
            the iterator yields :class:`~megatron_dynbatch.megatron.packing.PackedMicroBatch`; build ``loss_fn`` with
            ``result.iterator.loss_func`` -- pass a ready iterator as ``samples`` to have it beforehand).
            Default: :func:`default_forward_step`. Under a dynamic-CP plan run the model call inside
            ``megatron_dynbatch.megatron.dynamic_cp.microbatch_cp_group(model, packed)`` (THD RoPE positions).
        per_token_loss, collect: see :func:`megatron_dynbatch.megatron.loss.make_loss_func`. ``collect`` defaults to
            per-token log-probs when ``forward_only``.
        forward_only: no backward (log-prob / reference passes). Runs every step of the plan in one call.
        step: optimizer step of the plan to run (required when the plan has several; default 0).
        reduce_loss: all-reduce the loss over the DP x CP group of the last pipeline stage (exact ``L``).
        gather_outputs: gather per-sample outputs of all DP ranks into global sample order.
        pad_token_id, device: packing options (``device`` default: the current CUDA device, else the CPU).
        calibrator: an :class:`~megatron_dynbatch.megatron.online_calibration.OnlineCalibrator` (online
            calibration): a training step's micro-batches are timed, every ``interval`` steps the cost model is
            refitted (one all-reduce: call this on every rank), and plans made here from ``plan_or_options`` use
            the refitted model (pass ``calibrator.cost_model`` yourself when you plan). Never changes the loss.
        memory_guard: a :class:`~megatron_dynbatch.megatron.memory_guard.StepMemoryGuard` (online memory guard): a
            training step planned here from ``plan_or_options`` uses the guard's budget; the step's peak memory is
            read (CUDA allocator peak, reset per step), merged over the ranks (one all-reduce: call this on every
            rank) and the guard chooses the next step's budget. With a ready ``Plan`` / iterator the step is only
            measured (plan later steps with ``memory_guard.options(options)``). Never changes the loss.
        memory_probe: the first step protected (:mod:`megatron_dynbatch.megatron.probe`): a
            :class:`~megatron_dynbatch.megatron.probe.FirstStepProbe`, ``False`` (off) or ``None`` (the options'
            ``memory_probe``: on where a CUDA device is present). On a pass's first call planned here from
            ``plan_or_options``, one synthetic micro-batch at the budget runs through this call's own step first
            (every rank), and the budget is lowered if its measured peak crosses the headroom; no trace is left.
        **fb_kwargs: passed on to ``forward_backward_func`` (e.g. ``first_val_step``).
    """
    import torch

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    chunks = model if isinstance(model, list) else [model]
    if config is None:
        config = get_model_config(chunks[0])
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()

    if device is None:  # pack where the model runs (the GPU when there is one)
        device = _comm_device()
    options: Optional[PlanOptions] = None  # the planner's options when this call plans (for the calibration log)
    if isinstance(samples, DynamicBatchIterator):
        it = samples
    elif isinstance(plan_or_options, Plan):
        it = DynamicBatchIterator(samples, plan_or_options, loss_mode=loss_mode, group_reduce=group_reduce,
                                  pad_token_id=pad_token_id, device=device)
    elif isinstance(plan_or_options, (PlanOptions, Mapping)):
        options = _options_for_model(plan_or_options, config)
        if calibrator is not None and calibrator.cost_model is not None:
            options = options.replace(cost_model=calibrator.cost_model)
        if memory_guard is not None and not forward_only:
            options = memory_guard.options(options)
        if memory_probe is not False:  # the first step protected (megatron/probe.py): the lower budget of the two
            from .probe import protect_first_step

            options = protect_first_step(memory_probe, options, model=model, forward_only=forward_only, device=device,
                                         run=lambda smp, plan: dynamic_forward_backward(
                model, smp, plan, config=config, loss_mode=loss_mode, group_reduce=group_reduce,
                forward_step_func=forward_step_func, per_token_loss=per_token_loss, collect=collect,
                forward_only=forward_only, tuple_size=tuple_size, reduce_loss=False, pad_token_id=pad_token_id,
                device=device, forward_backward_func=forward_backward_func, memory_probe=False, **fb_kwargs))
        it = DynamicBatchIterator(samples, None, loss_mode=loss_mode, group_reduce=group_reduce,
                                  pad_token_id=pad_token_id, device=device, options=options)
    else:
        raise DynBatchConfigError("plan_or_options", type(plan_or_options).__name__,
                                  "needs a Plan, a PlanOptions or a dict of plan_global_batch options",
                                  "pass e.g. {'model': spec, 'parallel': par, 'max_tokens_per_gpu': 8192}")

    prepare_config(config, pp_size, uniform_length=it.uniform_length)
    check_sequence_parallel_alignment(it.plan, config)
    if it.dynamic_cp:
        from .dynamic_cp import check_dynamic_cp_model

        check_dynamic_cp_model(config)
    if it.dynamic_cp and getattr(config, "hybrid_context_parallel", False):
        raise DynBatchConfigError("config.hybrid_context_parallel", True, "megatron-core would run its own hybrid-CP "
                                  "schedule instead of the dynamic-CP plan", "build the model with "
                                  "hybrid_context_parallel=False (drop --hybrid-context-parallel)")

    if forward_only:
        run_step = None if step is None else step
    else:
        if step is None:
            if it.num_steps > 1:
                raise DynBatchConfigError("step", None, f"the plan has {it.num_steps} optimizer steps",
                                          "call once per step with step=0, 1, ... and run the optimizer in between")
            step = 0
        run_step = step
    if run_step is None:
        num_mb = it.num_microbatches
    else:
        num_mb = len(it.step_range(run_step))
    if collect is None and forward_only:
        collect = log_probs_collector

    if forward_step_func is None:
        forward_step_func = default_forward_step(
            it, calculate_per_token_loss=bool(getattr(config, "calculate_per_token_loss", False)),
            per_token_loss=per_token_loss, collect=collect, forward_only=forward_only, tuple_size=tuple_size,
            num_microbatches=num_mb)
    fb = forward_backward_func or get_forward_backward_func()
    data_iterator = it.data_iterator(run_step, num_model_chunks=len(chunks))
    timing = calibrator.step(model, it, run_step) if calibrator is not None and not forward_only else nullcontext()
    guarded = memory_guard is not None and not forward_only
    predicted = memory_guard.predict_plan(it.plan, run_step) if guarded else None

    def schedule() -> Any:
        return fb(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=num_mb,
            seq_length=it.max_seq_length(run_step),
            micro_batch_size=1,
            forward_only=forward_only,
            **fb_kwargs,
        )

    t0 = time.perf_counter()
    with timing:
        store = memory_guard.run(schedule, model, it, run_step) if guarded else schedule()
    seconds = memory_guard.last_seconds if guarded else (time.perf_counter() - t0 if _synchronous() else None)

    results: List[MicroBatchResult] = [d[RESULT_KEY] for d in (store or [])
                                       if isinstance(d, Mapping) and isinstance(d.get(RESULT_KEY), MicroBatchResult)]
    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    loss = local = None
    per_sample = None
    if last_stage and results:
        local = float(sum(float(r.loss_sum) for r in results if r.loss_sum is not None))
        loss = local
        cp = it.cp_size
        if reduce_loss and not forward_only:
            t = torch.tensor([local], dtype=torch.float64, device=_comm_device())
            torch.distributed.all_reduce(t, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            loss = float(t.item())
        if any(r.outputs is not None for r in results):
            mbs = it.microbatches(run_step)
            if len(results) != len(mbs):
                raise RuntimeError(f"expected {len(mbs)} micro-batch results on the last stage, got {len(results)}")
            # match results to micro-batches by their samples (each sample is in exactly one micro-batch)
            position = {tuple(mb.sample_indices): k for k, mb in enumerate(mbs)}
            slots: List[Any] = [None] * len(mbs)
            for r in results:
                slots[position[tuple(r.sample_indices)]] = r
            per_mb = []
            for r, mb in zip(slots, mbs, strict=True):
                full = r.outputs
                if mb.dynamic_cp:  # this micro-batch's own group
                    full = _gather_cp(full, mb, mb.cp_size, mb.cp_group) if mb.cp_size > 1 else full
                elif cp > 1:
                    full = _gather_cp(full, mb, cp)
                per_mb.append(split_per_sample(full, mb))
            per_sample = it.restore_order(per_mb, run_step)
            if gather_outputs:
                per_sample = it.gather_across_dp(per_sample, run_step)
    if gather_outputs and per_sample is not None:
        sample_indices = it.step_samples(run_step) if run_step is not None else list(range(len(it.samples)))
    else:
        sample_indices = it.sample_indices(run_step)
    if calibrator is not None and not forward_only:
        calibrator.end_step(it.plan, it.lengths, options)
    if guarded:
        memory_guard.end_step(it.plan, run_step)
    return DynamicStepResult(loss=loss, local_loss_sum=local, per_sample=per_sample, sample_indices=sample_indices,
                             num_microbatches=num_mb, iterator=it, forward_data_store=store or [], step=run_step,
                             seconds=seconds, peak_bytes=memory_guard.peak_bytes if guarded else None,
                             predicted_peak_bytes=predicted)


def forward_log_probs(
    model: Any,
    samples: Union[Sequence[Mapping[str, Any]], DynamicBatchIterator],
    plan_or_options: Union[Plan, PlanOptions, Mapping[str, Any], None] = None,
    **kwargs: Any,
) -> DynamicStepResult:
    """Forward-only pass returning per-sample per-token log-probs in ORIGINAL order (``result.per_sample[k]``
    belongs to sample ``result.sample_indices[k]``; ``L_i`` entries aligned with its labels). Plan it with its
    own budget, e.g. ``plan_options_from_args(args, forward_only=True)``."""
    kwargs.setdefault("collect", log_probs_collector)
    return dynamic_forward_backward(model, samples, plan_or_options, forward_only=True, **kwargs)


# ------------------------------------------------------------------------------------------ internal
def _synchronous() -> bool:
    """Whether a wall clock around the schedule measures its work: no CUDA device, so no asynchronous stream."""
    import torch

    return not torch.cuda.is_available()


def _comm_device() -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _gather_cp(local: Any, packed: Any, cp: int, group: Any = None) -> Any:
    """All-gather a CP-local per-token tensor ``[1, T/cp, ...]`` over the CP group (default: Megatron's) and
    reassemble it."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from .context_parallel import gather_cp_outputs

    if group is None:
        group = parallel_state.get_context_parallel_group()
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return gather_cp_outputs(parts, packed.cu_seqlens_padded, cp)
