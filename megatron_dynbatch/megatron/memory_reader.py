"""The memory-reader seam: the peak the CUDA allocator reached around a callable, or a deterministic stand-in.

:class:`CudaPeakReader` reads the CUDA caching allocator: it synchronises, notes ``memory_allocated`` (what is
resident before: weights, gradients, optimizer state), resets the peak statistics, runs the callable, synchronises
and reads ``max_memory_allocated``. :class:`FakeMemoryReader` runs the same callable (so the CPU tests run the same
code) and reports a deterministic peak computed from what ran (:class:`MemoryProbe`: decoder layers, LM head,
tokens), rounded up to the allocator's 512-byte granularity; with a ``capacity`` it raises
``torch.OutOfMemoryError`` where a card of that size would, before running.

Every reader of measured memory goes through this seam: ``calibrate``'s memory grid
(:mod:`megatron_dynbatch.measure.memory`), the step memory guard (:mod:`megatron_dynbatch.megatron.memory_guard`)
and the GPU memory bench (``benchmarks/gpu/memory.py``). It sits in the Megatron edge, below ``measure/``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..core.errors import DynBatchConfigError

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


def checked_reader(reader: Any, device: Any = None) -> Any:
    """The reader a step-time observer (the memory guard, the first-step probe) measures with: ``reader`` when
    it has a ``measure(fn, probe)`` method, a :class:`CudaPeakReader` on ``device`` when ``None``; anything else
    is a ``DynBatchConfigError``."""
    if reader is None:
        reader = CudaPeakReader(device)
    if not callable(getattr(reader, "measure", None)):
        raise DynBatchConfigError("reader", type(reader).__name__, "has no measure(fn, probe) method",
                                  "pass a CudaPeakReader or FakeMemoryReader "
                                  "(megatron_dynbatch.megatron.memory_reader)")
    return reader


__all__ = ["ALLOCATION_GRANULE", "MemoryProbe", "MemoryReading", "CudaPeakReader", "FakeMemoryReader",
           "default_reader", "checked_reader"]
