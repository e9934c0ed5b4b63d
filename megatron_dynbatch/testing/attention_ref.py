"""The per-sample attention reference for tests (test support, never imported by the library): torch's own SDPA
on each packed sequence's real rows, computed in fp32, with 0 on every padding row -- what every THD attention
path (the per-sequence loop, the fused varlen kernel, CP shares) must equal."""

from __future__ import annotations

from itertools import accumulate
from typing import List, Sequence

import torch


def cumulative(lengths: Sequence[int]) -> List[int]:
    """``[0, l0, l0+l1, ...]``: cu_seqlens of ``lengths``."""
    return [0, *accumulate(int(n) for n in lengths)]


def per_sample_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: Sequence[int],
                         cu_padded: Sequence[int], causal: bool = True) -> torch.Tensor:
    """``[t, heads * d]`` fp32: sequence ``i``'s rows ``cu_padded[i] + [0, cu[i+1] - cu[i])`` attend to the same
    rows of ``k``/``v`` (GQA by head group), padding rows 0. Differentiable in ``q``, ``k``, ``v``."""
    t, h, d = q.shape
    out = torch.zeros(t, h * d, device=q.device, dtype=torch.float32)
    for i in range(len(cu) - 1):
        s, n = int(cu_padded[i]), int(cu[i + 1]) - int(cu[i])
        if n:
            o = torch.nn.functional.scaled_dot_product_attention(
                *(x[s:s + n].float().transpose(0, 1) for x in (q, k, v)), is_causal=causal, enable_gqa=True)
            out[s:s + n] = o.transpose(0, 1).reshape(n, h * d)
    return out


__all__ = ["cumulative", "per_sample_attention"]
