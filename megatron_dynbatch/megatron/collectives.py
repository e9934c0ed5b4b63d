"""The two small collectives the edge needs besides Megatron's own: a float vector reduced over every rank
(online calibration sums its refit vector, the memory guard takes the MAX of its peak readings), and a line
printed once (rank 0). Without an initialised process group both are the single-process identity."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["all_reduce_vector", "rank0_print"]


def rank0_print(line: str) -> None:
    """Print ``line`` on global rank 0 only (every process without a process group)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


def all_reduce_vector(vector: Any, op: str = "sum") -> np.ndarray:
    """A small float64 vector reduced over every rank (``op``: ``"sum"`` or ``"max"``), on the GPU under NCCL;
    ``vector`` itself without a process group."""
    import torch
    import torch.distributed as dist

    vector = np.asarray(vector, dtype=np.float64)
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return vector
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(vector, dtype=torch.float64, device=device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.cpu().numpy()
