"""The hook: Megatron-LM's ``train()`` runs each global batch with a dynamic-batching plan.

How it hooks in (the least invasive place)
------------------------------------------
Megatron-LM's ``train()`` (``megatron/training/training.py``) obtains the schedule ONCE, through the name
``get_forward_backward_func`` that the module imported from ``megatron.core.pipeline_parallel``, and hands it
to every ``train_step``; ``train_step`` calls it with ``num_microbatches=get_num_microbatches()`` (the fixed
``global_batch_size / (micro_batch_size * dp)``). :func:`install` replaces that ONE module attribute,
``megatron.training.training.get_forward_backward_func``, by a function that validates the flags
(:func:`~.flags.validate_megatron_lm_args`) and returns Megatron's real schedule wrapped in
:class:`DynamicForwardBackward`. The wrapper ignores the fixed count: it takes one global batch from the data
iterator (:mod:`.sources`), plans it with the launch's options -- built from the flags
(:func:`megatron_dynbatch.megatron.args.plan_options_from_args`) and resolved once per run
(:meth:`DynamicForwardBackward.options`), not every step -- (identical plan on every rank, no communication) and
runs it through
:func:`megatron_dynbatch.megatron.schedule.dynamic_forward_backward` with the plan's micro-batch count, THD
packing and exact loss normalisation. One more attribute is replaced when present:
``num_floating_point_operations`` (the FLOPs behind Megatron's TFLOP/s and ``num_floating_point_operations_so_far``),
which assumes ``--seq-length`` tokens per sample; after a hooked step it returns the step's FLOPs from the real
lengths. Nothing else in Megatron is patched, so the optimizer step,
gradient finalisation, checkpointing and logging are Megatron's own. Besides ``lm loss`` the loss dicts carry
``dynbatch tokens`` / ``dynbatch padded tokens`` (:data:`STAT_KEYS`: real and padded tokens of the step), which
Megatron logs next to the loss. The ``forward_step`` given to ``pretrain()`` is not called (the packed-THD
forward step of :mod:`megatron_dynbatch.megatron.schedule` is).

With ``--dynbatch-online-calibration`` the wrapper keeps one
:class:`~megatron_dynbatch.megatron.online_calibration.OnlineCalibrator` per rank: every step's micro-batches are
timed (CUDA events, read once after the step's last backward), every ``--dynbatch-calibration-interval`` steps the
cost model is refitted and merged with one small all-reduce, and the following steps are planned with it on every
rank alike; the refit line (``dynbatch calibration | step N | ...``) is printed on global rank 0.

With ``--dynbatch-memory-guard`` it keeps one :class:`~megatron_dynbatch.megatron.memory_guard.StepMemoryGuard` per
rank (:func:`~megatron_dynbatch.megatron.memory_guard.memory_guard_from_args`): every step's peak memory is read
(the CUDA allocator's peak, reset per step), merged with one small all-reduce (MAX), and the next step is planned
with the budget the guard chooses, on every rank alike; each change is one line (``dynbatch memory guard | step N
| budget A -> B tokens per GPU ...``) on global rank 0.

The first step is protected (on where a CUDA device is present; ``--no-dynbatch-memory-probe`` turns it off):
before the first training step, :class:`~megatron_dynbatch.megatron.probe.FirstStepProbe` runs ``pp`` synthetic
micro-batches of the full budget through the same schedule and forward step, reads the peak (MAX over ranks) and
lowers the budget if it crosses the headroom -- one ``dynbatch memory probe | training pass | ...`` line; it leaves
no trace (gradients zeroed, RNG states restored, nothing taken from the data iterator, no optimizer step).

What the user sees per step: on the iterations Megatron writes its TensorBoard / W&B scalars
(``--tensorboard-log-interval``), the step's figures (:func:`megatron_dynbatch.core.metrics.step_metrics`:
``dynbatch/microbatches``, ``dynbatch/imbalance``, ``dynbatch/padding_tokens``, ``dynbatch/max_tokens_per_gpu``,
``dynbatch/predicted_step_time_s``, and with the guard the measured step time and peak memory) go to Megatron-LM's
own writers (``get_tensorboard_writer()`` / ``get_wandb_writer()``, fetched lazily and used only where they
exist: Megatron makes them on the last rank when logging is on); ``last_metrics`` holds them on every rank.

Caveats: Megatron's own ``get_num_microbatches()`` still drives bookkeeping that does not touch the data: with
``--micro-batch-size 1 --global-batch-size N`` its sample counter and learning-rate schedule count N samples
per step, which is exact; MoE auxiliary-loss *logging* divides by that count instead of the planned one.
Evaluation is not wired: pass ``--eval-iters 0``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from .flags import validate_megatron_lm_args
from .training import import_megatron_training, megatron_args

if TYPE_CHECKING:
    from ...core.planner.options import ResolvedOptions

__all__ = ["install", "DynamicForwardBackward", "megatron_loss_dicts", "plan_log_line", "STAT_KEYS"]

#: Extra per-step statistics the hook adds to Megatron's loss dicts (logged in its iteration line, TensorBoard
#: and W&B as the mean over the log interval): real tokens of the global batch, and tokens incl. padding.
STAT_KEYS = ("dynbatch tokens", "dynbatch padded tokens")

#: Megatron schedule keywords the wrapper sets itself (everything else is passed through).
_OWN_KWARGS = ("forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length", "micro_batch_size",
               "decoder_seq_length", "forward_only")


def install(training_module: Any = None, *, get_args: Optional[Callable[[], Any]] = None,
            validate: bool = True) -> Callable[[], None]:
    """Patch ``training_module.get_forward_backward_func`` (default ``megatron.training.training``, imported
    lazily; :class:`~.training.MegatronLMNotFoundError` if absent) so that the schedule Megatron's ``train()``
    obtains is wrapped in :class:`DynamicForwardBackward`, and (when the module has it)
    ``num_floating_point_operations`` so that FLOPs and TFLOP/s count the real lengths
    (:meth:`DynamicForwardBackward.step_flops`). Call it before ``pretrain()``. With ``validate`` the flags are
    checked (:func:`~.flags.validate_megatron_lm_args`) each time the schedule is fetched. Idempotent; returns a
    function that restores the original."""
    if training_module is None:
        training_module = import_megatron_training().training
    original = getattr(training_module, "get_forward_backward_func", None)
    if original is None:
        raise RuntimeError("megatron.training.training has no get_forward_backward_func: this Megatron-LM "
                           "version obtains its schedule differently; wrap the call site by hand "
                           "(see the docstring of megatron_dynbatch/integrations/megatron_lm/hook.py)")
    if getattr(original, "_dynbatch_original", None) is not None:
        original = original._dynbatch_original  # already installed: wrap the real one again
    read_args = get_args or megatron_args

    state: Dict[str, Any] = {}

    def get_forward_backward_func(*a: Any, **k: Any) -> DynamicForwardBackward:
        args = read_args()
        if validate:
            validate_megatron_lm_args(args)
        state["fb"] = DynamicForwardBackward(original(*a, **k), args, device=_current_device())
        return state["fb"]

    get_forward_backward_func._dynbatch_original = original  # type: ignore[attr-defined]
    training_module.get_forward_backward_func = get_forward_backward_func
    flops_original = getattr(training_module, "num_floating_point_operations", None)
    flops_original = getattr(flops_original, "_dynbatch_original", flops_original)
    if flops_original is not None:
        def num_floating_point_operations(args: Any, batch_size: Any, *a: Any, **k: Any) -> Any:
            fb = state.get("fb")
            real = fb.step_flops() if fb is not None else None
            return flops_original(args, batch_size, *a, **k) if real is None else real

        num_floating_point_operations._dynbatch_original = flops_original  # type: ignore[attr-defined]
        training_module.num_floating_point_operations = num_floating_point_operations

    def restore() -> None:
        training_module.get_forward_backward_func = original
        if flops_original is not None:
            training_module.num_floating_point_operations = flops_original

    return restore


def _current_device() -> Any:
    try:
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover
        return None


class DynamicForwardBackward:
    """A drop-in ``forward_backward_func`` (Megatron's keyword signature) that runs each global batch with a
    dynamic-batching plan. ``inner`` is Megatron's real schedule; ``args`` Megatron's parsed args."""

    def __init__(self, inner: Callable[..., Any], args: Any, *, run_step: Optional[Callable[..., Any]] = None,
                 plan_options: Optional[Callable[[Any], Any]] = None, device: Any = None,
                 memory_guard: Any = None, writers: Optional[Callable[[], Tuple[Any, Any]]] = None,
                 memory_probe: Any = None) -> None:
        self.inner = inner
        self.args = args
        self.run_step = run_step
        self.plan_options = plan_options  # args -> PlanOptions (or a dict of them); default: the launch flags
        self.device = device
        self.last_result: Any = None
        self.last_lengths: List[int] = []
        self.last_model: Any = None
        self.calibrator: Any = None  # online calibration (--dynbatch-online-calibration), made on the first step
        self.memory_guard = memory_guard  # --dynbatch-memory-guard: made on the first step unless given
        self.memory_probe = memory_probe  # the first-step probe (--[no-]dynbatch-memory-probe): made on the first
        # step unless given (False: off)
        self.writers = writers  # () -> (TensorBoard writer, W&B writer); default: Megatron-LM's own
        self.last_metrics: Dict[str, float] = {}
        self.resolved: Dict[bool, ResolvedOptions] = {}  # forward_only -> that pass, resolved on its first step

    def options(self, *, forward_only: bool = False) -> ResolvedOptions:
        """The pass's options (:class:`~megatron_dynbatch.core.planner.options.ResolvedOptions`), built from the
        launch (``plan_options(args)``, default :func:`~megatron_dynbatch.megatron.args.plan_options_from_args`)
        and resolved ONCE per run -- on the pass's first step -- not every step: the model preset, the cost-model
        file and an automatic budget are read and chosen once. What changes between steps (the memory guard's
        and the first-step probe's budget, the online calibrator's cost model) is applied on top by
        ``dynamic_forward_backward`` (:meth:`ResolvedOptions.replace`, which re-resolves nothing else)."""
        if forward_only not in self.resolved:
            from ...core.planner.api import options_of
            from ...megatron.args import plan_options_from_args, resolve_launch_options

            if self.plan_options is not None:
                given = self.plan_options(self.args)
            else:
                given = plan_options_from_args(self.args, forward_only=forward_only)
            opts = given if not isinstance(given, Mapping) else options_of(None, given)
            # one Megatron iteration = one optimizer step = this global batch
            self.resolved[forward_only] = resolve_launch_options(opts.replace(samples_per_step=None))
        return self.resolved[forward_only]

    def __call__(self, *, data_iterator: Any, model: Any, forward_only: bool = False,
                 **kwargs: Any) -> List[Dict[str, Any]]:
        from ...core.errors import DynBatchConfigError

        if forward_only:
            raise DynBatchConfigError("--eval-iters", getattr(self.args, "eval_iters", None),
                                      "evaluation is not wired in the Megatron-LM hook", "pass --eval-iters 0")
        source = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
        if source is None:
            raise DynBatchConfigError("data_iterator", None, "this rank has no training data iterator",
                                      "use global_batch_datasets_provider (is_distributed=True) with "
                                      "--dataloader-type external")
        samples = next(source)
        if not isinstance(samples, list) or not samples or not isinstance(samples[0], Mapping):
            raise DynBatchConfigError("data_iterator", type(samples).__name__,
                                      "must yield the whole global batch as a list of sample dicts",
                                      "yield [{'tokens': LongTensor, ...}, ...] (the same list on every rank)")
        run_step = self.run_step or _default_run_step
        opts = self.options(forward_only=False)
        passthrough = {k: v for k, v in kwargs.items() if k not in _OWN_KWARGS}
        if getattr(self.args, "dynbatch_online_calibration", False):
            passthrough["calibrator"] = self._calibrator(opts)
        if self.memory_guard is not None or getattr(self.args, "dynbatch_memory_guard", False):
            passthrough["memory_guard"] = self._memory_guard(opts)
        passthrough["memory_probe"] = self._memory_probe(opts)
        result = run_step(model, samples, opts, forward_backward_func=self.inner,
                          loss_mode=getattr(self.args, "dynbatch_loss_mode", "token_mean") or "token_mean",
                          group_reduce=getattr(self.args, "dynbatch_group_reduce", "token") or "token",
                          **passthrough)
        self.last_result = result
        self.last_lengths = [int(len(smp["tokens"])) for smp in samples]
        self.last_model = opts.model
        plan = getattr(getattr(result, "iterator", None), "plan", None)
        stats = {STAT_KEYS[0]: float(sum(self.last_lengths))}
        if plan is not None:
            stats[STAT_KEYS[1]] = float(sum(sum(r) for r in plan.microbatch_tokens))
            self._log_plan(plan)
        metrics = getattr(result, "metrics", None)
        self.last_metrics = metrics() if callable(metrics) and plan is not None else {}
        self._write_metrics(self.last_metrics)
        return megatron_loss_dicts(result.loss, result.num_microbatches, device=self.device, stats=stats)

    def _calibrator(self, options: Any) -> Any:
        """The rank's :class:`~megatron_dynbatch.megatron.online_calibration.OnlineCalibrator`: it plans with the
        refitted model once there is one (``dynamic_forward_backward`` swaps it in), the configured
        ``--dynbatch-cost-model`` before and as the prior's shape."""
        if self.calibrator is None:
            from ...core.calibration.online import DEFAULT_INTERVAL
            from ...megatron.online_calibration import OnlineCalibrator

            interval = getattr(self.args, "dynbatch_calibration_interval", None) or DEFAULT_INTERVAL
            self.calibrator = OnlineCalibrator(options.model, options.parallel, interval=interval,
                                               base=getattr(self.args, "dynbatch_cost_model", None),
                                               device=self.device)
        return self.calibrator

    def _memory_guard(self, options: Any) -> Any:
        """The rank's :class:`~megatron_dynbatch.megatron.memory_guard.StepMemoryGuard` (made from the launch's
        flags on the first step, :func:`~megatron_dynbatch.megatron.memory_guard.memory_guard_from_args`)."""
        if self.memory_guard is None:
            from ...megatron.memory_guard import memory_guard_from_args

            self.memory_guard = memory_guard_from_args(self.args, options, device=self.device)
        return self.memory_guard

    def _memory_probe(self, options: Any) -> Any:
        """The rank's :class:`~megatron_dynbatch.megatron.probe.FirstStepProbe` (made from the launch's flags on
        the first step, :func:`~megatron_dynbatch.megatron.probe.memory_probe_from_args`), or ``False`` when off
        (``--no-dynbatch-memory-probe``, or no CUDA device)."""
        if self.memory_probe is None:
            from ...megatron.probe import memory_probe_from_args

            self.memory_probe = memory_probe_from_args(self.args, options, device=self.device) or False
        return self.memory_probe

    def _write_metrics(self, metrics: Mapping[str, float]) -> None:
        """``metrics`` to Megatron-LM's TensorBoard (``add_scalar``) and W&B (``log``) writers, on the iterations
        Megatron writes its own scalars (``--tensorboard-log-interval``), where the writers exist."""
        if not metrics:
            return
        iteration = int(getattr(self.args, "curr_iteration", 0) or 0) + 1
        interval = int(getattr(self.args, "tensorboard_log_interval", None) or 1)
        if iteration % interval:
            return
        from .training import megatron_writers

        tensorboard, wandb = (self.writers or megatron_writers)()
        if tensorboard is not None:
            for name, value in metrics.items():
                tensorboard.add_scalar(name, value, iteration)
        if wandb is not None:
            wandb.log(dict(metrics), iteration)

    def _log_plan(self, plan: Any) -> None:
        """One ``dynbatch plan | iteration N | ...`` line (:func:`plan_log_line`) on global rank 0, on the
        iterations Megatron logs (``--log-interval``)."""
        iteration = int(getattr(self.args, "curr_iteration", 0) or 0) + 1
        interval = int(getattr(self.args, "log_interval", 1) or 1)
        if iteration % interval:
            return
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
                return
        except ImportError:  # pragma: no cover
            pass
        print(f"dynbatch plan | iteration {iteration:8d} | {plan_log_line(plan)}", flush=True)

    def step_flops(self) -> Optional[float]:
        """Training (forward + backward) FLOPs of the last global batch from its REAL sample lengths
        (:func:`megatron_dynbatch.core.flops.calculate_fwd_flops` x 3), or None before the first step."""
        if not getattr(self, "last_lengths", None) or self.last_model is None:
            return None
        from ...core.flops import FWD_BWD_FACTOR, calculate_fwd_flops

        return float(calculate_fwd_flops(self.last_lengths, self.last_model) * FWD_BWD_FACTOR)


def _default_run_step(*a: Any, **k: Any) -> Any:
    from ...megatron.schedule import dynamic_forward_backward

    return dynamic_forward_backward(*a, **k)


def megatron_loss_dicts(loss: Optional[float], num_microbatches: int, device: Any = None,
                        stats: Optional[Mapping[str, float]] = None) -> List[Dict[str, Any]]:
    """What ``train_step`` reduces on the last pipeline stage: one ``{"lm loss": tensor([L]), **stats}`` per
    micro-batch. Megatron averages one-element entries over micro-batches, so it logs exactly the step's loss
    ``L`` (already reduced over DP x CP by the dynamic schedule) and each statistic; ``[]`` off the last stage."""
    if loss is None:
        return []
    import torch

    entries = {"lm loss": float(loss), **{k: float(v) for k, v in (stats or {}).items()}}
    return [{k: torch.tensor([v], dtype=torch.float32, device=device) for k, v in entries.items()}
            for _ in range(max(1, int(num_microbatches)))]


def plan_log_line(plan: Any) -> str:
    """What the hook logs about a step's plan: micro-batches per GPU (the count every GPU runs) and, for a
    dynamic-CP plan, how many micro-batches ran on CP groups of each size and the modelled speed-up over the
    fixed layout's plan, e.g. ``micro-batches per GPU: 3 | cp groups (size: count): 1: 6, 2: 1, 4: 1 |
    modelled speed-up vs fixed cp: 1.008``."""
    parts = [f"micro-batches per GPU: {plan.num_microbatches}",
             "cp groups (size: count): " + ", ".join(f"{g}: {n}" for g, n in sorted(plan.group_sizes().items()))]
    if plan.dynamic_cp:  # only a dynamic-CP plan has a fixed layout's plan to compare with
        speedup = float(plan.speedup_vs_fixed_cp)
        parts.append("modelled speed-up vs fixed cp: " + (f"{speedup:.3f}" if np.isfinite(speedup) else
                                                          "n/a (the fixed layout cannot hold this batch)"))
    return " | ".join(parts)
