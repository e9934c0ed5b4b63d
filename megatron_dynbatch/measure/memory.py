"""Measured memory: the peak of one forward + backward on a model slice, behind a small reader seam.

:class:`CudaPeakReader` reads the CUDA caching allocator: it synchronises, notes ``memory_allocated`` (what is
resident before: the slice's weights and gradients), resets the peak statistics, runs the callable,
synchronises and reads ``max_memory_allocated``. :class:`FakeMemoryReader` runs the same callable (so the CPU
tests run the same code) and reports a deterministic peak computed from what ran (:class:`MemoryProbe`:
decoder layers, LM head, tokens), rounded up to the allocator's 512-byte granularity; with a ``capacity`` it
raises ``torch.OutOfMemoryError`` where a card of that size would, before running.

:func:`measure_memory` measures ``calibrate``'s memory grid (:func:`megatron_dynbatch.core.memory.fit.
memory_grid`: 1- and 2-layer slices without the LM head and a 1-layer slice with it, several token counts):
each slice is built once (:func:`~.slices.build_slice`, megatron-core, the layout's per-TP-rank widths), every
point runs once untimed (its gradients are allocated then, so they count as resident) and once read. The records
are what :func:`~megatron_dynbatch.core.memory.fit.fit_memory_records` fits. Torch and megatron-core needed.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..core.errors import DynBatchConfigError
from ..core.memory.fit import memory_grid
from ..core.model_spec import ModelSpec
from .layout import SliceLayout
from .slices import build_slice

#: the CUDA caching allocator rounds every block up to this many bytes
ALLOCATION_GRANULE = 512


@dataclass(frozen=True)
class MemoryProbe:
    """What a measured callable runs: ``layers`` decoder layers, the LM head and loss or not, ``tokens`` tokens
    (what a fake reader computes its peak from; a real reader ignores it)."""

    layers: int
    lm_head: bool
    tokens: int


@dataclass(frozen=True)
class MemoryReading:
    """Allocated bytes before the callable ran (``base``) and the allocator's peak while it ran (``peak``)."""

    base: int
    peak: int

    @property
    def increment(self) -> int:
        return max(0, self.peak - self.base)


class CudaPeakReader:
    """The CUDA allocator's peak around a callable (module docstring)."""

    def __init__(self, device: Any = None) -> None:
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise DynBatchConfigError("memory_reader", str(self.device), "the CUDA peak reader needs a CUDA device",
                                      "measure memory on a GPU, or pass a FakeMemoryReader in CPU tests")

    def measure(self, fn: Callable[[], Any], probe: Optional[MemoryProbe] = None) -> MemoryReading:
        torch.cuda.synchronize(self.device)
        base = int(torch.cuda.memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return MemoryReading(base, int(torch.cuda.max_memory_allocated(self.device)))


class FakeMemoryReader:
    """A deterministic stand-in for CPU tests (module docstring): ``peak_of(probe)`` bytes over ``base``
    (a number, or a callable read when measuring), OOM above ``capacity``."""

    def __init__(self, peak_of: Callable[[MemoryProbe], float], *, base: Any = 0,
                 capacity: Optional[float] = None) -> None:
        self.peak_of, self.base, self.capacity = peak_of, base, capacity
        self.calls = 0

    @classmethod
    def from_coefficients(cls, *, workspace: float, layer: float, backward_extra: float, head: float,
                          **kwargs: Any) -> "FakeMemoryReader":
        """Peaks of the memory fit's own form (:mod:`megatron_dynbatch.core.memory.fit`): what a fit of its
        records must recover."""
        def peak_of(p: MemoryProbe) -> float:
            return workspace + p.tokens * (p.layers * layer + (head if p.lm_head else backward_extra))

        return cls(peak_of, **kwargs)

    def measure(self, fn: Callable[[], Any], probe: Optional[MemoryProbe] = None) -> MemoryReading:
        if probe is None:
            raise DynBatchConfigError("probe", None, "a fake memory reader computes its peak from the probe",
                                      "pass MemoryProbe(layers, lm_head, tokens)")
        base = int(self.base() if callable(self.base) else self.base)
        extra = float(self.peak_of(probe))
        peak = base + int(math.ceil(extra / ALLOCATION_GRANULE)) * ALLOCATION_GRANULE
        self.calls += 1
        if self.capacity is not None and peak > self.capacity:
            raise torch.OutOfMemoryError(f"fake reader: {peak} bytes needed, capacity {int(self.capacity)}")
        fn()
        return MemoryReading(base, peak)


def default_reader(device: str) -> Optional[CudaPeakReader]:
    """The real reader on a CUDA device; ``None`` on a CPU (no allocator statistics there)."""
    return CudaPeakReader(device) if str(device).startswith("cuda") else None


def measure_memory(model: Any, *, tp: int, dtype: str, device: str, max_tokens_per_gpu: int, spec: str = "local",
                   seed: int = 1234, reader: Any = None,
                   progress: Optional[Callable[[int, int], None]] = None
                   ) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Memory records of the grid (module docstring) and what they were measured on."""
    reader = reader if reader is not None else default_reader(device)
    if reader is None:
        raise DynBatchConfigError("--device", device, "peak memory is read from the CUDA allocator, which a CPU has "
                                  "not", "measure memory on a GPU (calibrate --device cuda), or pass --no-memory")
    spec_m = ModelSpec.from_any(model)
    grid = memory_grid(max_tokens_per_gpu)
    records: List[Dict[str, Any]] = []
    env: Dict[str, Any] = {}
    slices: Dict[Tuple[int, bool], List[List[int]]] = {}
    for layers, head, lengths in grid:
        slices.setdefault((layers, head), []).append(lengths)
    done = 0
    for (layers, head), points in slices.items():
        layout = SliceLayout(num_layers=layers, tp=tp, dtype=dtype, device=device, kind="mcore", seed=seed,
                             vocab_size=spec_m.padded_vocab_size // tp if head else 0, spec=spec)
        sl = build_slice(spec_m, layout)
        env = env or {"device": sl.environment()["device"], "dtype": dtype, "spec": spec}
        for lengths in points:
            if progress is not None:
                progress(done, len(grid))
            run = sl.prepare(1, lengths)
            run()  # gradients are allocated now and stay: resident, like a training run's grad buffers
            reading = reader.measure(run, MemoryProbe(layers, head, int(sum(lengths))))
            records.append({"layers": layers, "lm_head": head, "tokens": int(sum(lengths)),
                            "peak_bytes": reading.increment, "base_bytes": reading.base})
            done += 1
        del sl, run
        gc.collect()
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()
    return records, env


__all__ = ["MemoryProbe", "MemoryReading", "CudaPeakReader", "FakeMemoryReader", "default_reader", "measure_memory",
           "ALLOCATION_GRANULE"]
