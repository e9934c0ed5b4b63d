"""Wall time of a callable on a device: CUDA events on a GPU, ``time.perf_counter`` on the CPU.

:func:`time_call` runs ``warmup`` untimed calls, then ``repeats`` timed ones and returns every timed duration in
seconds. On CUDA each repetition is bracketed by two events on the current stream and read after the second
event completes (one synchronisation per repetition: right for offline timing, where the GPU must be idle
between repetitions; an online recorder reads its events once per step instead). The device is synchronised
before the first timed call so warm-up work is not counted.
"""

from __future__ import annotations

import time
from typing import Callable, List

import torch

from ..core.checks import is_int
from ..core.errors import DynBatchConfigError


def time_call(fn: Callable[[], None], device: torch.device, *, warmup: int = 1, repeats: int = 3) -> List[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (module docstring)."""
    if not is_int(warmup) or warmup < 0:
        raise DynBatchConfigError("warmup", warmup, "must be an integer >= 0", "pass e.g. warmup=1")
    if not is_int(repeats) or repeats < 1:
        raise DynBatchConfigError("repeats", repeats, "must be an integer >= 1", "pass e.g. repeats=3")
    for _ in range(warmup):
        fn()
    out: List[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        return out
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` on a GPU; the CPU's model name (or ``"cpu"``) elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"CPU {platform.processor() or platform.machine()}".strip()


__all__ = ["time_call", "device_name"]
