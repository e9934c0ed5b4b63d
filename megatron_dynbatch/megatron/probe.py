"""The first step protected: before a pass's first real step, ONE synthetic micro-batch at its budget is run
through the trainer's own step and measured; the budget is lowered if the measured peak crosses the headroom.

Why
---
The memory model (``core/memory``) chooses or checks the budget before anything runs, and the online guard
(:mod:`.memory_guard`) corrects it from measured steps -- after a step has run. A model wrong by one term (a loss
that keeps one more fp32 copy of the logits, an allocator that fragments more) would run out of memory on step
one, before the guard has seen anything. The probe measures that step's worst case first, at the cost of one
micro-batch per pass (``pp`` of them under pipeline parallelism: what the first stage holds at once).

What it runs
------------
For a pass (``"train"``: forward + backward; ``"log_prob"``: forward only) whose budget is ``B`` tokens per GPU,
the probe builds ``dp x M`` synthetic samples (:func:`synthetic_samples`: random token ids from a private
generator, loss mask 1; each as long as one micro-batch of ``B x cp`` may hold after padding), so the plan gives
every rank ``M`` micro-batches of the full budget (``M = 1`` without pipeline parallelism,
:func:`probe_microbatches` with it), and runs them through ``run(samples, plan)`` -- the call site's own
schedule call: :func:`~megatron_dynbatch.megatron.schedule.dynamic_forward_backward` with the caller's
``forward_step_func`` (or the packed-THD default), loss, ``forward_backward_func`` and config -- under the peak
reader (:mod:`.memory_reader`: the CUDA allocator's ``max_memory_allocated`` reset before,
a deterministic fake in CPU tests).

How it decides (every rank alike)
---------------------------------
The reading goes through :func:`~megatron_dynbatch.core.memory.guard.reading_vector` and ONE all-reduce (MAX)
over the world (:func:`~.collectives.all_reduce_vector`), so every rank holds the largest peak of every stage.
Then, with the guard's refit (:class:`~megatron_dynbatch.core.memory.guard.MemoryGuard` for the pass, the probe's
reading its only one, no prior: the slope is the measured one):

* the peak is at most ``usable = card x (1 - headroom) - reserve`` (allocator bytes: the reserve is outside the
  allocator, as for the guard) on every stage: the budget is **kept**;
* else the budget is **lowered** to the largest multiple of ``multiple`` whose peak, at the measured base and
  slope, fits ``usable`` -- never under ``floor`` (the longest sample must fit; at the floor the line says so).

One line per pass on global rank 0 (:meth:`ProbeResult.line`): measured vs predicted, budget kept or lowered.

No trace
--------
The probe takes nothing from the data iterator (its samples are synthetic), runs no optimizer step, and restores
what the step it ran could have changed: the gradients are zeroed afterwards (``zero_grad_buffer`` of Megatron's
DDP, else every ``.grad`` / ``.main_grad``; a training step's gradients are zero when it starts -- Megatron's
``train_step`` zeroes them before the schedule -- so nothing is lost) and every random number generator is put back
exactly (Python's, NumPy's, torch's CPU and CUDA generators, megatron-core's tensor-parallel RNG tracker), so
dropout in the real step draws what it would have drawn. Parameters and optimizer state are not written (no
optimizer step). Known traces outside those: Transformer Engine's FP8 amax history (delayed scaling) records the
probe's micro-batch, and the allocator's cache keeps the blocks the probe freed (what the real step reuses).

A probe runs only where the call plans from options (a ready ``Plan`` or iterator fixes the budget), and only
with the model's shape (``options.model``: the memory model the decision refits). The decision is the budget
the NEXT plans use (:meth:`FirstStepProbe.options`); the guard, when on, keeps watching every step after.
"""

from __future__ import annotations

import random
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ..core.errors import DynBatchConfigError
from ..core.memory.budget import DEFAULT_MULTIPLE
from ..core.memory.guard import MISSING, MemoryGuard, reading_vector, stage_tokens
from ..core.memory.settings import GiB
from ..core.planner.options import ResolvedOptions
from .collectives import all_reduce_vector, rank0_print

__all__ = ["FirstStepProbe", "ProbeResult", "RngSnapshot", "probe_microbatches", "synthetic_samples",
           "zero_gradients", "protect_first_step", "probe_enabled", "memory_probe_from_args"]

PASS_WORDS = {"train": "training pass", "log_prob": "log-prob pass"}


def _size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps a figure >= 1 (GiB on a GPU, MiB / KiB for tiny CPU models)."""
    for unit, scale in (("GiB", GiB), ("MiB", float(1 << 20)), ("KiB", 1024.0)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def probe_microbatches(pp: int, vpp: int = 1) -> int:
    """Micro-batches per rank the probe runs: 1 without pipeline parallelism; ``pp`` with 1F1B (the first stage
    holds ``pp`` at once); with interleaving enough for the first stage's warm-up (``2 (pp - 1) + (vpp - 1) pp + 1``
    model chunks), rounded up to a multiple of ``pp`` (Megatron's interleaved schedule needs one)."""
    pp, vpp = max(1, int(pp)), max(1, int(vpp))
    if pp == 1:
        return 1
    if vpp == 1:
        return pp
    chunks = 2 * (pp - 1) + (vpp - 1) * pp + 1
    need = -(-chunks // vpp)
    return pp * -(-need // pp)


def synthetic_samples(options: ResolvedOptions, count: int, *, seed: int = 0,
                      make_sample: Optional[Callable[[int, Any], Dict[str, Any]]] = None) -> List[Dict[str, Any]]:
    """``count`` samples, each the longest one micro-batch of ``options``' budget holds after padding: token ids
    drawn from a private ``torch.Generator(seed)`` (the global generators are not touched), loss mask all 1.
    ``make_sample(length, generator)``: a sample dict of your own (a forward step that needs more per-token
    fields than ``tokens`` / ``loss_mask``)."""
    import torch

    align = options.alignment
    cap = align.effective_cap(options.cap)
    length = (cap // align.seq_multiple) * align.seq_multiple
    if length < 1:
        raise DynBatchConfigError("max_tokens_per_gpu", options.max_tokens_per_gpu, "holds no padded sequence",
                                  "raise the budget")
    model = options.model
    vocab = int(getattr(model, "vocab_size", 0) or 0) or 2
    gen = torch.Generator().manual_seed(int(seed))
    out = []
    for _ in range(int(count)):
        if make_sample is not None:
            out.append(make_sample(length, gen))
        else:
            out.append({"tokens": torch.randint(1, max(2, vocab), (length,), generator=gen),
                        "loss_mask": torch.ones(length)})
    return out


class RngSnapshot:
    """Every random number generator a step may draw from, captured and put back exactly: Python's ``random``,
    NumPy's global generator, torch's CPU generator, every CUDA device's generator, and megatron-core's
    tensor-parallel RNG tracker (its named states, when it has been set up)."""

    def __init__(self) -> None:
        import torch

        self.python = random.getstate()
        self.numpy = np.random.get_state()
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.tracker = None
        tracker = _tracker()
        if tracker is not None:
            self.tracker = {k: v.clone() if hasattr(v, "clone") else v for k, v in tracker.get_states().items()}

    def restore(self) -> None:
        import torch

        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        tracker = _tracker()
        if tracker is not None and self.tracker is not None:
            tracker.set_states({k: v.clone() if hasattr(v, "clone") else v for k, v in self.tracker.items()})


def _tracker() -> Any:
    try:
        from megatron.core import tensor_parallel

        tracker = tensor_parallel.get_cuda_rng_tracker()
    except (ImportError, AttributeError, RuntimeError):  # pragma: no cover
        return None
    return tracker if callable(getattr(tracker, "get_states", None)) else None


def zero_gradients(model: Any) -> None:
    """Zero every gradient of ``model`` (one module or a list of chunks): Megatron DDP's ``zero_grad_buffer()``
    (its ``main_grad`` buffers), and any ``.grad`` / ``.main_grad`` left outside a buffer."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        zero = getattr(chunk, "zero_grad_buffer", None)
        if callable(zero):
            zero()
        params = chunk.parameters() if callable(getattr(chunk, "parameters", None)) else []
        for p in params:
            if getattr(p, "grad", None) is not None:
                p.grad = None
            main = getattr(p, "main_grad", None)
            if main is not None and hasattr(main, "zero_"):
                main.zero_()


@dataclass(frozen=True)
class ProbeResult:
    """One pass's probe. Bytes are allocator bytes (the reserve excluded); ``measured_peak_bytes`` is the largest
    over the ranks (``None``: no rank could read its peak); ``predicted_peak_bytes`` the memory model's for the
    probe's plan; ``reason``: ``"kept"``, ``"lowered"``, ``"floor"`` (lowered only to the floor: the longest
    sample must fit) or ``"unmeasured"``."""

    pass_: str
    old_budget: int
    new_budget: int
    reason: str
    usable_bytes: float
    predicted_peak_bytes: float
    measured_peak_bytes: Optional[float]
    measured_stage: Optional[int]
    tokens: int
    microbatches: int
    fit_budget: Optional[int] = None

    @property
    def lowered(self) -> bool:
        return self.new_budget < self.old_budget

    def line(self) -> str:
        """E.g. ``dynbatch memory probe | training pass | 1 micro-batch of 96 tokens per GPU | measured peak
        70.10 GiB on stage 0, predicted 66.00 GiB, 71.20 GiB usable | budget 96 kept``."""
        head = (f"dynbatch memory probe | {PASS_WORDS[self.pass_]} | {self.microbatches} micro-batch"
                f"{'es' if self.microbatches != 1 else ''} of {self.tokens} tokens per GPU")
        if self.measured_peak_bytes is None:
            return (f"{head} | no rank could read its peak (predicted {_size(self.predicted_peak_bytes)} of "
                    f"{_size(self.usable_bytes)} usable) | budget {self.old_budget} kept")
        meas = (f"measured peak {_size(self.measured_peak_bytes)} on stage {self.measured_stage}, predicted "
                f"{_size(self.predicted_peak_bytes)}, {_size(self.usable_bytes)} usable")
        if self.reason == "kept":
            what = f"budget {self.old_budget} kept"
        elif self.reason == "lowered":
            what = f"budget {self.old_budget} -> {self.new_budget} tokens per GPU (lowered: the measured peak " \
                   "crossed the headroom)"
        else:
            what = (f"budget {self.old_budget} -> {self.new_budget} tokens per GPU (at the floor, over the "
                    f"{self.fit_budget} that fit: the longest sample must fit; expect an out-of-memory error -- "
                    "see docs/troubleshooting.md)")
        return f"{head} | {meas} | {what}"

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


class FirstStepProbe:
    """The first-step probe of one rank (module docstring).

    ``card_bytes``: the GPU's memory in bytes (default: ``options.gpu_memory_gb``, else the CUDA device's);
    ``reader``: anything with ``measure(fn, probe) -> reading(base, peak)`` (default: the CUDA allocator's);
    ``merge``: the cross-rank MAX (default: one all-reduce over the world); ``log``: the line (default: printed
    on global rank 0); ``settings`` / ``profile``: the memory model (default: ``options.memory`` / the analytic
    model); ``floor``: the smallest budget it may lower to (the longest sample's need); ``multiple``: the lowered
    budget's granularity; ``stage``: this rank's pipeline stage (default ``parallel_state``'s); ``seed`` /
    ``make_sample``: the synthetic samples (:func:`synthetic_samples`)."""

    def __init__(self, card_bytes: Any = None, *, reader: Any = None,
                 merge: Optional[Callable[[np.ndarray], np.ndarray]] = None,
                 log: Optional[Callable[[str], None]] = rank0_print, settings: Any = None, profile: Any = None,
                 floor: Optional[int] = None, multiple: int = DEFAULT_MULTIPLE, stage: Optional[int] = None,
                 device: Any = None, seed: int = 0,
                 make_sample: Optional[Callable[[int, Any], Dict[str, Any]]] = None) -> None:
        from .memory_reader import checked_reader

        reader = checked_reader(reader, device)
        self.card_bytes, self.reader, self.log = card_bytes, reader, log
        self.merge = merge or (lambda v: all_reduce_vector(v, "max"))
        self.settings, self.profile, self.floor, self.multiple = settings, profile, floor, int(multiple)
        self.stage, self.device, self.seed, self.make_sample = stage, device, int(seed), make_sample
        self.results: Dict[str, ProbeResult] = {}

    # ------------------------------------------------------------------ what the planner uses
    def budget(self, pass_: str) -> Optional[int]:
        """The budget ``pass_`` plans with after its probe (``None``: not probed yet)."""
        r = self.results.get(pass_)
        return None if r is None else r.new_budget

    def options(self, options: ResolvedOptions, forward_only: bool = False) -> ResolvedOptions:
        """``options`` with the pass's budget lowered where its probe lowered it (the lower of the two)."""
        pass_ = "log_prob" if forward_only or options.options.forward_only else "train"
        r = self.results.get(pass_)
        if r is None or not r.lowered or options.max_tokens_per_gpu <= r.new_budget:
            return options
        return options.replace(max_tokens_per_gpu=r.new_budget)

    # ------------------------------------------------------------------ the probe
    def _card(self, options: ResolvedOptions) -> float:
        if self.card_bytes is not None:
            return float(self.card_bytes)
        if options.options.gpu_memory_gb:
            return float(options.options.gpu_memory_gb) * GiB
        from .memory_guard import card_bytes_of

        return float(card_bytes_of(self.device))

    def _multiple(self, budget: int) -> int:
        """The lowered budget's granularity: ``multiple``, or a sixteenth of a budget under four of them."""
        return self.multiple if budget >= 4 * self.multiple else max(1, budget // 16)

    def run(self, options: ResolvedOptions, run: Callable[[List[Dict[str, Any]], Any], Any], *, model: Any = None,
            forward_only: bool = False) -> ProbeResult:
        """Probe the pass of ``options`` (``forward_only``: the log-prob pass) once: plan the synthetic samples,
        run ``run(samples, plan)`` under the reader, leave no trace, merge over the ranks, decide and log. Call it
        on every rank (one all-reduce)."""
        from ..core.planner.api import plan_resolved
        from .memory_guard import measured_call, rank_stage

        pass_ = "log_prob" if forward_only or options.options.forward_only else "train"
        if options.model is None:
            raise DynBatchConfigError("model", None, "the first-step memory probe needs the model's shape (its "
                                      "memory model)", "plan with model=ModelSpec/dict/preset name, or turn the "
                                      "probe off (memory_probe=False, --no-dynbatch-memory-probe)")
        par = options.parallel
        budget = int(options.max_tokens_per_gpu)
        m = probe_microbatches(par.pp, par.vpp)
        opts = options.replace(max_tokens_per_gpu=budget, samples_per_step=None, rollouts_per_step=None,
                               num_microbatches=None, min_num_microbatches=None, num_microbatches_multiple=None,
                               equal_samples_per_rank=False, oversize="error")
        samples = synthetic_samples(opts, par.dp * m, seed=self.seed, make_sample=self.make_sample)
        plan = plan_resolved([len(s["tokens"]) for s in samples], opts)
        floor = None if self.floor is None else min(int(self.floor), budget)
        guard = MemoryGuard(budget, self._card(options), model=options.model, parallel=par,
                            settings=self.settings if self.settings is not None else options.options.memory,
                            profile=self.profile, floor=floor, multiple=self._multiple(budget), prior_steps=0,
                            min_fill=0.0, skip_steps=0, log=None, pass_=pass_)
        predicted = guard.predict_plan(plan)
        stage = rank_stage(0) if self.stage is None else int(self.stage)
        rng = RngSnapshot()
        try:
            reading, _, _ = measured_call(self.reader, lambda: run(samples, plan), model=model, plan=plan, step=None,
                                          stage=stage, pp=par.pp, num_layers=options.model.num_layers)
        except Exception as exc:
            if type(exc).__name__ != "OutOfMemoryError":
                raise
            raise DynBatchConfigError(
                "max_tokens_per_gpu", budget, f"the first-step memory probe ran out of memory on this rank with "
                f"{m} micro-batch(es) of {budget} tokens per GPU ({PASS_WORDS[pass_]}; the memory model predicted "
                f"{_size(predicted)} of {_size(guard.usable_bytes)} usable): the first real step would have too",
                "lower the budget (or use 'auto'), raise settings.headroom, turn on full recompute, or raise tp / "
                "cp (docs/troubleshooting.md, 'the first-step memory probe ran out of memory')") from exc
        finally:
            if not forward_only and not options.options.forward_only:
                zero_gradients(model)
            rng.restore()
        vec, _ = reading_vector(par.pp, stage, getattr(reading, "base", None), getattr(reading, "peak", None))
        merged = np.asarray(self.merge(vec), dtype=np.float64)
        peaks = merged[1::2]
        measured = [(s, float(p)) for s, p in enumerate(peaks) if p != MISSING]
        if not measured:
            result = ProbeResult(pass_, budget, budget, "unmeasured", guard.usable_bytes, predicted, None, None,
                                 int(max(stage_tokens(plan, options.model.num_layers))), m)
        else:
            s_max, p_max = max(measured, key=lambda x: x[1])
            guard.observe(merged, plan)
            fit, _ = guard.fit_budget()
            crossed = any(p > guard.usable_bytes for _, p in measured)
            new, reason = budget, "kept"
            if crossed:
                target = min(fit, budget - guard.multiple) if fit >= budget else fit
                new = max(guard.floor, max(target, 0))
                reason = "lowered" if new == target else "floor"
            result = ProbeResult(pass_, budget, int(new), reason, guard.usable_bytes, predicted, p_max, s_max,
                                 int(max(stage_tokens(plan, options.model.num_layers))), m, int(fit))
        self.results[pass_] = result
        if self.log is not None:
            self.log(result.line())
        return result

    def protect(self, options: ResolvedOptions, run: Callable[[List[Dict[str, Any]], Any], Any], *, model: Any = None,
                forward_only: bool = False) -> Any:
        """``options`` for the call about to plan: the pass is probed first if it has not been (every rank), then
        its budget is the probe's (:meth:`options`)."""
        pass_ = "log_prob" if forward_only or options.options.forward_only else "train"
        if pass_ not in self.results:
            self.run(options, run, model=model, forward_only=forward_only)
        return self.options(options, forward_only=forward_only)


# ------------------------------------------------------------------------------------------ call sites
_DEFAULT_PROBES: "weakref.WeakKeyDictionary[Any, FirstStepProbe]" = weakref.WeakKeyDictionary()


def probe_enabled(setting: Optional[bool]) -> bool:
    """``memory_probe``: ``None`` = on iff a CUDA device is present; else the switch."""
    if setting is not None:
        return bool(setting)
    import torch

    return bool(torch.cuda.is_available())


def protect_first_step(memory_probe: Any, options: ResolvedOptions, *, model: Any, forward_only: bool, device: Any,
                       run: Callable[[List[Dict[str, Any]], Any], Any]) -> ResolvedOptions:
    """The call site of :func:`~megatron_dynbatch.megatron.schedule.dynamic_forward_backward`: ``memory_probe``
    is a :class:`FirstStepProbe` (used), ``False`` (off) or ``None`` (``options.memory_probe``: on where CUDA is,
    with one probe kept per model and the options' card and memory settings); returns the options to plan with.
    Without the model's shape (``options.model``) a default probe stays off."""
    if memory_probe is False:
        return options
    probe = memory_probe
    if probe is None:
        if not probe_enabled(options.options.memory_probe) or options.model is None:
            return options
        key = model[0] if isinstance(model, (list, tuple)) else model
        try:
            probe = _DEFAULT_PROBES.get(key)
        except TypeError:  # not weak-referenceable: no default probe
            return options
        if probe is None:
            probe = FirstStepProbe(device=device)
            _DEFAULT_PROBES[key] = probe
    return probe.protect(options, run, model=model, forward_only=forward_only)


def memory_probe_from_args(args: Any, options: ResolvedOptions, *, device: Any = None,
                           **kwargs: Any) -> Optional[FirstStepProbe]:
    """The probe a Megatron launch runs (``None`` when off: ``--no-dynbatch-memory-probe``, or no CUDA device
    without ``--dynbatch-memory-probe``): the memory settings the launch implies
    (:func:`~megatron_dynbatch.core.memory.settings_from_megatron`), ``--dynbatch-cost-model``'s memory section,
    the floor the longest sample needs (``--dynbatch-max-seq-length``, else ``--seq-length``). ``kwargs``: as for
    :class:`FirstStepProbe`."""
    if not probe_enabled(options.options.memory_probe):
        return None
    from .args import memory_settings_from_args
    from .memory_guard import floor_for

    length = getattr(args, "dynbatch_max_seq_length", None) or getattr(args, "seq_length", None)
    kwargs.setdefault("floor", floor_for(options.options, length))
    memory = options.options.memory
    kwargs.setdefault("settings", memory if memory is not None else memory_settings_from_args(args))
    kwargs.setdefault("profile", getattr(args, "dynbatch_cost_model", None))
    return FirstStepProbe(device=device, **kwargs)
