"""The online memory guard on a Megatron rank: read each training step's peak, merge it over the ranks, and plan the
next step with the budget every rank agrees on.

:class:`StepMemoryGuard` joins a peak reader -- the seam of :mod:`megatron_dynbatch.megatron.memory_reader`:
:class:`~.memory_reader.CudaPeakReader` on a GPU (synchronise, note ``memory_allocated``, reset
the peak statistics, run, synchronise, read ``max_memory_allocated``: reset per step),
:class:`~.memory_reader.FakeMemoryReader` in CPU tests, which runs the same code -- with the
torch-free :class:`~megatron_dynbatch.core.memory.guard.MemoryGuard` (refit, budget, log):

* :meth:`StepMemoryGuard.run` runs one training schedule call under the reader and keeps this rank's reading
  (allocated bytes before the step, the peak during it) and the call's wall time (synchronised by the reader);
* :meth:`StepMemoryGuard.end_step` is the collective: ONE all-reduce (MAX, float64, every rank of the world) of
  the ``2 x pp`` vector :func:`~megatron_dynbatch.core.memory.guard.reading_vector` -- this rank's base and peak in
  its pipeline stage's slots -- so every rank holds the largest reading of every stage, observes the same vector
  and chooses the same budget for the next step. A reading this rank cannot trust (a reader returning NaN, a
  negative or absurd number) is sent as "not measured", never raised: raising here would leave the other ranks
  waiting in the all-reduce. Call it on every rank after every training step (``dynamic_forward_backward`` does);
* :meth:`StepMemoryGuard.options` hands the budget to the planner: ``options.replace(max_tokens_per_gpu=budget)``.

The change lines (``dynbatch memory guard | step N | budget A -> B tokens per GPU ...``) are printed on global rank
0. Losses and gradients are untouched: the reader only brackets megatron-core's own call, and a new budget only
regroups later batches under the planner's hard limit. Forward-only passes are not guarded (their budget is the
log-prob budget's, and they keep no activations for backward).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..core.errors import DynBatchConfigError
from ..core.memory.guard import GuardChange, MemoryGuard, largest_peak, reading_vector, stage_tokens
from ..core.planner.options import PlanOptions, ResolvedOptions
from .collectives import all_reduce_vector, rank0_print
from .model_layers import rank_layers

__all__ = ["StepMemoryGuard", "MemoryRecorder", "memory_guard_from_args", "floor_for", "card_bytes_of",
           "rank_stage"]


def card_bytes_of(device: Any = None) -> int:
    """The GPU's memory in bytes (``torch.cuda.get_device_properties(device).total_memory``), or a
    ``DynBatchConfigError`` when this rank has no CUDA device (pass ``card_bytes=`` yourself there)."""
    import torch

    if not torch.cuda.is_available():
        raise DynBatchConfigError("card_bytes", None, "no card size is known: the memory guard reads it from the "
                                  "CUDA device, and this process has none",
                                  "run on GPUs, pass card_bytes= (bytes) yourself, or turn the memory guard off "
                                  "(drop --dynbatch-memory-guard)")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    return int(torch.cuda.get_device_properties(dev).total_memory)


def rank_stage(default: int = 0) -> int:
    """This rank's pipeline stage (``parallel_state``), or ``default`` when it is not initialised."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return int(ps.get_pipeline_model_parallel_rank())
    except ImportError:  # pragma: no cover
        pass
    return int(default)


def measured_call(reader: Any, fn: Callable[[], Any], *, model: Any, plan: Any, step: Optional[int], stage: int,
                  pp: int, num_layers: int) -> Tuple[Any, float, Any]:
    """Run ``fn`` under ``reader`` (its probe: this rank's decoder layers, the LM head on the last stage, the
    stage's tokens in flight); returns ``(reading, seconds, fn())`` -- seconds from ``fn``'s start to the
    reader's synchronisation after it."""
    from .memory_reader import MemoryProbe

    tokens = stage_tokens(plan, max(num_layers, pp), step)[stage] if plan is not None else 0
    probe = MemoryProbe(rank_layers(model) or max(1, num_layers // pp), stage == pp - 1, int(tokens))
    box: Dict[str, Any] = {}

    def timed() -> None:
        box["t0"] = time.perf_counter()
        box["out"] = fn()

    reading = reader.measure(timed, probe)
    return reading, time.perf_counter() - box["t0"], box["out"]


class StepMemoryGuard:
    """The memory guard of one Megatron rank (module docstring).

    ``start_budget``: the budget the options hold; ``card_bytes``: the GPU's memory in bytes (default: read from
    the CUDA device, :func:`card_bytes_of`); ``model`` / ``parallel`` / ``settings`` / ``profile`` and the
    ``guard_kwargs`` (``floor``, ``ceiling``, ``window``, ``prior_steps``, ``max_raise``, ``min_fill``,
    ``skip_steps``, ``multiple``): as for :class:`~megatron_dynbatch.core.memory.guard.MemoryGuard`. ``reader``:
    anything with ``measure(fn, probe) -> reading(base, peak)`` (default: the CUDA allocator's); ``merge``: the
    cross-rank MAX (default: an all-reduce over the world); ``log``: change lines (default: printed on global
    rank 0); ``stage``: this rank's pipeline stage (default: ``parallel_state``'s)."""

    def __init__(self, start_budget: Any, card_bytes: Any = None, *, model: Any, parallel: Any = None,
                 settings: Any = None, profile: Any = None, reader: Any = None,
                 merge: Optional[Callable[[np.ndarray], np.ndarray]] = None,
                 log: Optional[Callable[[str], None]] = rank0_print, stage: Optional[int] = None,
                 device: Any = None, **guard_kwargs: Any) -> None:
        if card_bytes is None:
            card_bytes = card_bytes_of(device)
        self.state = MemoryGuard(start_budget, card_bytes, model=model, parallel=parallel, settings=settings,
                                 profile=profile, log=log, **guard_kwargs)
        from .memory_reader import checked_reader

        reader = checked_reader(reader, device)
        self.reader = reader
        self.merge = merge or (lambda v: all_reduce_vector(v, "max"))
        self.stage = stage
        self.last_reading: Any = None
        self.last_seconds: Optional[float] = None
        self.last_merged: Optional[np.ndarray] = None

    @classmethod
    def for_options(cls, options: ResolvedOptions, card_bytes: Any = None, **kwargs: Any) -> "StepMemoryGuard":
        """A guard starting from resolved options' budget, model and layout
        (:class:`~megatron_dynbatch.core.planner.options.ResolvedOptions`)."""
        if options.model is None:
            raise DynBatchConfigError("model", None, "the memory guard needs the model's shape (its memory model)",
                                      "plan with model=ModelSpec/dict/preset name")
        return cls(options.max_tokens_per_gpu, card_bytes, model=options.model, parallel=options.parallel, **kwargs)

    # ------------------------------------------------------------------ what the planner uses
    @property
    def budget(self) -> int:
        """The budget the next training step plans with."""
        return self.state.budget

    @property
    def history(self) -> List[GuardChange]:
        return self.state.history

    @property
    def peak_bytes(self) -> Optional[float]:
        """The last step's measured peak, the largest over the ranks (allocator bytes), or ``None``."""
        return largest_peak(self.last_merged)

    def options(self, options: Any) -> Any:
        """``options`` with the guard's budget."""
        return self.state.options(options)

    def predict_plan(self, plan: Any, step: Optional[int] = None) -> float:
        """The predicted peak of (step ``step`` of) ``plan`` (allocator bytes, the highest stage)."""
        return self.state.predict_plan(plan, step)

    # ------------------------------------------------------------------ one step
    def _stage(self) -> int:
        return rank_stage(0) if self.stage is None else int(self.stage)

    def run(self, fn: Callable[[], Any], model: Any = None, iterator: Any = None, step: Optional[int] = None) -> Any:
        """Run one training schedule call ``fn`` under the reader; keep the reading and the wall seconds (from
        the start of ``fn`` to the reader's synchronisation after it). Returns ``fn()``'s result."""
        par = self.state.parallel
        self.last_reading, self.last_seconds, out = measured_call(
            self.reader, fn, model=model, plan=getattr(iterator, "plan", None), step=step, stage=self._stage(),
            pp=par.pp, num_layers=self.state.model.num_layers)
        return out

    def end_step(self, plan: Any, step: Optional[int] = None) -> Optional[GuardChange]:
        """The collective after every training step (module docstring): merge the readings (MAX over the world),
        observe them with ``plan``'s tokens, and return the budget change or ``None``. A rank that measured
        nothing this step (no :meth:`run`) sends "not measured"."""
        reading = self.last_reading
        base = getattr(reading, "base", None)
        peak = getattr(reading, "peak", None)
        vec, _ = reading_vector(self.state.parallel.pp, self._stage(), base, peak)
        self.last_reading = None
        merged = np.asarray(self.merge(vec), dtype=np.float64)
        self.last_merged = merged
        return self.state.observe(merged, plan, step=step)


class MemoryRecorder:
    """Reads one training step's peak without deciding anything: what a Ray actor sends its driver
    (:func:`megatron_dynbatch.integrations.ray.train_on_shard` with ``record_memory=True``), whose
    :class:`~megatron_dynbatch.core.memory.guard.MemoryGuard` merges the actors' vectors
    (:func:`~megatron_dynbatch.core.memory.guard.merge_readings`) and plans the next batch -- the driver is the only
    planner, so no all-reduce. Pass it as ``memory_guard=`` to ``dynamic_forward_backward``; ``vector`` is this
    rank's :func:`~megatron_dynbatch.core.memory.guard.reading_vector` after the step."""

    def __init__(self, *, pp: int = 1, reader: Any = None, stage: Optional[int] = None,
                 num_layers: Optional[int] = None, device: Any = None) -> None:
        from .memory_reader import checked_reader

        reader = checked_reader(reader, device)
        self.reader, self.pp, self.stage, self.num_layers = reader, int(pp), stage, num_layers
        self.vector: Optional[np.ndarray] = None
        self.last_reading: Any = None
        self.last_seconds: Optional[float] = None

    def options(self, options: Any) -> Any:
        return options

    def predict_plan(self, plan: Any, step: Optional[int] = None) -> None:
        return None

    @property
    def peak_bytes(self) -> Optional[float]:
        """This rank's peak of the last step (allocator bytes), or ``None``."""
        return largest_peak(self.vector)

    def run(self, fn: Callable[[], Any], model: Any = None, iterator: Any = None, step: Optional[int] = None) -> Any:
        stage = rank_stage(0) if self.stage is None else int(self.stage)
        self.last_reading, self.last_seconds, out = measured_call(
            self.reader, fn, model=model, plan=getattr(iterator, "plan", None), step=step, stage=stage, pp=self.pp,
            num_layers=self.num_layers or max(1, rank_layers(model) * self.pp))
        return out

    def end_step(self, plan: Any = None, step: Optional[int] = None) -> None:
        s = rank_stage(0) if self.stage is None else int(self.stage)
        r = self.last_reading
        self.vector, _ = reading_vector(self.pp, s, getattr(r, "base", None), getattr(r, "peak", None))
        return None


def floor_for(options: PlanOptions, max_seq_len: Any) -> Optional[int]:
    """The smallest budget a sample of ``max_seq_len`` tokens fits under ``options``' padding (``None`` without a
    length, or when over-budget samples run alone: ``oversize="alone"``) -- the guard's floor."""
    if not max_seq_len or options.oversize == "alone":
        return None
    import dataclasses

    from ..core.alignment import Alignment

    par = options.parallel
    if options.dynamic_cp:  # a sample may spread over the whole pool (core/startup.py)
        par = dataclasses.replace(par, dp=1, cp=par.dp * par.cp)
    align = Alignment.for_layout(par, options.fp8_alignment, options.sequence_pad_multiple,
                                 options.microbatch_pad_multiple)
    return int(align.budget_for(int(align.seq_len(int(max_seq_len))), par.cp))


def memory_guard_from_args(args: Any, options: ResolvedOptions, *, card_bytes: Any = None,
                           **kwargs: Any) -> StepMemoryGuard:
    """The guard ``--dynbatch-memory-guard`` runs: it starts from ``options``' budget (the training options of the
    launch, :func:`~megatron_dynbatch.megatron.args.plan_options_from_args`), with the memory settings the launch
    implies (:func:`~megatron_dynbatch.core.memory.settings_from_megatron`: recompute, optimizer, dtypes), the
    memory section of ``--dynbatch-cost-model`` when it has one (else the analytic model), and the floor the
    longest sample needs (``--dynbatch-max-seq-length``, else ``--seq-length``). ``card_bytes``: default
    ``options.gpu_memory_gb`` when the options carry it, else the CUDA device's. ``kwargs``: as for
    :class:`StepMemoryGuard`."""
    from ..core.memory.megatron_flags import settings_from_megatron
    from ..core.memory.settings import GiB

    if card_bytes is None and options.options.gpu_memory_gb:
        card_bytes = float(options.options.gpu_memory_gb) * GiB
    length = getattr(args, "dynbatch_max_seq_length", None) or getattr(args, "seq_length", None)
    floor = floor_for(options.options, length)
    if floor is not None:
        kwargs.setdefault("floor", min(floor, int(options.max_tokens_per_gpu)))
    kwargs.setdefault("settings", settings_from_megatron(args))
    kwargs.setdefault("profile", getattr(args, "dynbatch_cost_model", None))
    return StepMemoryGuard.for_options(options, card_bytes, **kwargs)
