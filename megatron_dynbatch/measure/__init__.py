"""Measured micro-batch times: build a slice of a model and time packed micro-batches and CP shares on it.

The timing core shared by ``benchmarks/gpu/measure.py`` and cost-model calibration::

    from megatron_dynbatch.measure import SliceLayout, build_slice

    sl = build_slice("qwen3-8b", SliceLayout(num_layers=2, tp=2, dtype="bf16", device="cuda", kind="mcore"))
    sl.time_microbatch([8192, 4096, 1200])                   # seconds, whole micro-batch (no CP)
    sl.time_microbatch([65536], group_size=4)                # one CP member's share, slower of members 0 and 3
    sl.time_share(4, [65536], member=1)                      # one given member
    sl.time_records([(1, [4096] * 4), (2, [16384])])         # [[group_size, lengths, seconds], ...]
    sl.environment()                                         # device, kernel, torch, megatron_core, layout

Layers of the package used here: :mod:`megatron_dynbatch.megatron` (the THD attention, the varlen kernel seam,
zig-zag CP indices) and :mod:`megatron_dynbatch.core` (model specs, alignment). Torch is needed; megatron-core
only for ``kind="mcore"`` (imported when such a slice is built). Never imports :mod:`megatron_dynbatch.bench`.

Modules: :mod:`.layout` (what is timed: ``SliceLayout``, per-TP-rank ``SliceWidths``), :mod:`.share` (one CP
member's share emulated on one device), :mod:`.mcore_slice` / :mod:`.torch_decoder` (the two slices),
:mod:`.timer` (CUDA events / ``perf_counter``), :mod:`.slices` (``ModelSlice``, ``build_slice``, records),
:mod:`.calibrate` (offline calibration: time the grid, fit the cost model), :mod:`.memory` (the measured peaks
of ``calibrate``'s memory grid), :mod:`.whole_model` (a whole model trained one real step at a time, for
``benchmarks/gpu/memory.py``) and :mod:`.budget_search` (the largest budget that fits, by real attempts).
"""

from .layout import SliceLayout, SliceWidths
from .share import EmulatedCPGroup, share_geometry
from .slices import ModelSlice, Record, build_slice, record_key
from .timer import device_name, time_call

__all__ = ["SliceLayout", "SliceWidths", "ModelSlice", "Record", "build_slice", "record_key", "time_call",
           "device_name", "EmulatedCPGroup", "share_geometry"]
