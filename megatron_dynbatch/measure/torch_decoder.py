"""The plain-torch decoder slice: the same per-TP-rank shapes as megatron-core's GPT layer, no megatron-core.

Per layer (pre-norm): RMSNorm -> fused QKV projection ``hidden -> (heads + 2 groups) * kv`` -> rotary embedding
at each row's position in its sequence -> THD attention (:func:`megatron_dynbatch.megatron.varlen.
varlen_attention`: torch's fused varlen kernel where it accepts the input, the pure-torch reference kernel
elsewhere) -> output projection ``heads * kv -> hidden`` -> residual; RMSNorm -> MLP ``hidden -> 2 ffn`` (SwiGLU)
or ``hidden -> ffn`` (GELU) ``-> hidden`` -> residual. Optional embedding and LM head + cross-entropy
(``widths.vocab > 0``). No biases, no dropout. Under CP the member's share (:mod:`.share`) runs with the other
members' K/V emulated, each local chunk attending to the keys up to its end (bottom-right causal).

For timing only: weights are random, nothing is trained. Inputs are prepared once per share by :meth:`prepare`;
the returned callable runs forward + backward and is what gets timed.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn

from ..megatron.varlen import REFERENCE_KERNEL, VarlenKernel, cp_segments, default_varlen_kernel, thd_segments
from ..megatron.varlen import varlen_attention
from .layout import SliceWidths
from .share import ShareGeometry, emulated_gather

ROPE_BASE = 10000.0


class _Layer(nn.Module):
    def __init__(self, w: SliceWidths) -> None:
        super().__init__()
        self.w = w
        self.norm1 = nn.RMSNorm(w.hidden_size)
        self.qkv = nn.Linear(w.hidden_size, (w.heads + 2 * w.groups) * w.kv, bias=False)
        self.proj = nn.Linear(w.heads * w.kv, w.hidden_size, bias=False)
        self.norm2 = nn.RMSNorm(w.hidden_size)
        self.fc1 = nn.Linear(w.hidden_size, (2 if w.swiglu else 1) * w.ffn, bias=False)
        self.fc2 = nn.Linear(w.ffn, w.hidden_size, bias=False)

    def forward(self, x: Tensor, ctx: "_Context") -> Tensor:
        w = self.w
        q, k, v = self.qkv(self.norm1(x)).split([w.heads * w.kv, w.groups * w.kv, w.groups * w.kv], dim=-1)
        q = _rotate(q.view(-1, w.heads, w.kv), ctx.cos, ctx.sin)
        k = _rotate(k.view(-1, w.groups, w.kv), ctx.cos, ctx.sin)
        v = v.reshape(-1, w.groups, w.kv)
        x = x + self.proj(ctx.attention(q, k, v))
        h = self.fc1(self.norm2(x))
        if w.swiglu:
            a, b = h.chunk(2, dim=-1)
            h = nn.functional.silu(a) * b
        else:
            h = nn.functional.gelu(h)
        return x + self.fc2(h)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding (rotate-half form); ``cos``/``sin`` are ``[t, 1, kv]``."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


class _Context:
    """Everything a forward of one share needs besides the weights: RoPE tables and the attention call."""

    def __init__(self, geo: ShareGeometry, w: SliceWidths, kernel: VarlenKernel, device: torch.device,
                 dtype: torch.dtype) -> None:
        inv = 1.0 / ROPE_BASE ** (torch.arange(0, w.kv, 2, dtype=torch.float32) / w.kv)
        ang = geo.positions.to(torch.float32).unsqueeze(1) * inv.unsqueeze(0)
        ang = torch.cat([ang, ang], dim=-1).unsqueeze(1)
        self.cos, self.sin = ang.cos().to(device, dtype), ang.sin().to(device, dtype)
        self.geo, self.kernel, self.scale = geo, kernel, w.kv ** -0.5
        g = geo.group_size
        if g == 1:
            self.segments = thd_segments(geo.cu_seqlens, geo.cu_seqlens, geo.cu_seqlens_padded,
                                         geo.cu_seqlens_padded)
            self.inverse = None
        else:
            self.segments = cp_segments(geo.cu_seqlens_padded, geo.cu_seqlens, g, geo.member, causal=True)
            from ..megatron.context_parallel import zigzag_gather_order

            self.inverse = zigzag_gather_order(torch.tensor(geo.cu_seqlens_padded), g)[1].to(device)

    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.inverse is not None:  # the other members' K/V (emulated), back in packed order
            kv = emulated_gather(torch.cat([k, v], dim=-1), self.geo.group).index_select(0, self.inverse)
            k, v = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
        if not self.segments:  # a share of padding only
            return q.new_zeros(q.shape[0], q.shape[1] * v.shape[-1]) + 0.0 * (q.sum() + k.sum() + v.sum())
        return varlen_attention(q, k, v, self.segments, kernel=self.kernel, scale=self.scale, causal=True)


class TorchDecoderSlice(nn.Module):
    """``num_layers`` plain-torch decoder layers of ``widths`` (module docstring)."""

    def __init__(self, widths: SliceWidths, num_layers: int, *, device: torch.device, dtype: torch.dtype,
                 kernel: Optional[VarlenKernel] = None) -> None:
        super().__init__()
        self.widths = widths
        self.layers = nn.ModuleList([_Layer(widths) for _ in range(num_layers)])
        self.embed = nn.Embedding(widths.vocab, widths.hidden_size) if widths.vocab else None
        self.head = nn.Linear(widths.hidden_size, widths.vocab, bias=False) if widths.vocab else None
        self.final_norm = nn.RMSNorm(widths.hidden_size) if widths.vocab else None
        self.to(device=device, dtype=dtype)
        self.device, self.dtype = device, dtype
        kernel = kernel if kernel is not None else default_varlen_kernel()
        probe = torch.empty(1, widths.heads, widths.kv, device=device, dtype=dtype)
        self.kernel = kernel if kernel is not None and kernel.accepts(probe) else REFERENCE_KERNEL

    def prepare(self, geo: ShareGeometry, generator: torch.Generator) -> Callable[[], None]:
        """Inputs of one share built now; the returned callable runs one forward + backward."""
        ctx = _Context(geo, self.widths, self.kernel, self.device, self.dtype)
        t = geo.local_tokens
        if self.embed is not None:
            tokens = torch.randint(0, self.widths.vocab, (t,), generator=generator).to(self.device)
            labels = torch.randint(0, self.widths.vocab, (t,), generator=generator).to(self.device)

            def run() -> None:
                x = self.embed(tokens)
                for layer in self.layers:
                    x = layer(x, ctx)
                logits = self.head(self.final_norm(x))
                nn.functional.cross_entropy(logits.float(), labels, reduction="sum").backward()

            return run
        hidden = torch.randn(t, self.widths.hidden_size, generator=generator).to(self.device, self.dtype)
        hidden.requires_grad_(True)
        grad = torch.randn(t, self.widths.hidden_size, generator=generator).to(self.device, self.dtype)

        def run_layers() -> None:
            hidden.grad = None
            x = hidden
            for layer in self.layers:
                x = layer(x, ctx)
            x.backward(grad)

        return run_layers


__all__ = ["TorchDecoderSlice"]
