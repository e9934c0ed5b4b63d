"""The GPU this process runs on, as the planner needs to know it: its memory (for ``max_tokens_per_gpu="auto"``
and the memory guard). torch is imported here, never in ``core/``."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["device_memory_gb"]


def device_memory_gb(device: Any = None) -> Optional[float]:
    """The card's memory in GiB as torch reports it (``torch.cuda.get_device_properties(d).total_memory / 2**30``)
    for ``device`` (default: the current CUDA device), or ``None`` without CUDA or on a non-CUDA device."""
    import torch

    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    return torch.cuda.get_device_properties(dev).total_memory / float(1 << 30)
