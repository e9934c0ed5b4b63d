"""Measured memory of ``calibrate``'s grid: the peak of one forward + backward on a model slice.

:func:`measure_memory` measures ``calibrate``'s memory grid (:func:`megatron_dynbatch.core.memory.fit.
memory_grid`: 1- and 2-layer slices without the LM head and a 1-layer slice with it, several token counts):
each slice is built once (:func:`~.slices.build_slice`, megatron-core, the layout's per-TP-rank widths), every
point runs once untimed (its gradients are allocated then, so they count as resident) and once read through the
memory-reader seam (:mod:`megatron_dynbatch.megatron.memory_reader`: the CUDA allocator on a GPU, a deterministic
fake in CPU tests). The records are what :func:`~megatron_dynbatch.core.memory.fit.fit_memory_records` fits.
Torch and megatron-core needed.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..core.errors import DynBatchConfigError
from ..core.memory.fit import memory_grid
from ..core.model_spec import ModelSpec
from ..megatron.memory_reader import (ALLOCATION_GRANULE, CudaPeakReader, FakeMemoryReader, MemoryProbe,
                                      MemoryReading, default_reader)
from .layout import SliceLayout
from .slices import build_slice

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
