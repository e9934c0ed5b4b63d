"""THD attention as ONE fused varlen kernel call: the kernel seam, its pure-torch reference, and the layout.

**The seam.** A :class:`VarlenKernel` wraps one function with the signature of torch's
``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.11)::

    fn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size) -> out     # [T_q, heads, dim]

THD tensors ``[T, heads, dim]``; sequence ``b`` is rows ``cu_seq_q[b]:cu_seq_q[b+1]`` of ``q`` against rows
``cu_seq_k[b]:cu_seq_k[b+1]`` of ``k``/``v``; ``window_size=(-1, 0)`` is causal, ``(-1, -1)`` full attention.
:func:`default_varlen_kernel` resolves torch's function once, checking with ``inspect`` that it takes those
parameters (torch 2.11 has no ``is_causal`` and no ``enable_gqa``; where ``enable_gqa`` exists it is used, else
K/V are expanded to the query heads), and logs ONE line when it is missing. :data:`REFERENCE_KERNEL`
(:func:`reference_varlen_attn`) has the same signature and semantics in plain torch and runs on any device and
dtype, so CPU tests run the same dispatch and layout code (:func:`varlen_attention`) as the GPU.

**Causal alignment when keys outnumber queries.** Flash attention (and so torch's kernel and the reference)
aligns the causal mask to the BOTTOM-RIGHT corner: with ``n_q`` queries and ``n_k >= n_q`` keys, query ``i``
sees keys ``j <= i + (n_k - n_q)``. So a chunk of queries at positions ``[s, s + n)`` of a sequence, given the
keys ``[0, s + n)`` of that sequence, is exactly causal attention of those rows -- which is how context
parallelism runs here (:func:`cp_segments`): every local zig-zag chunk is its own query sequence against the
gathered keys up to its end (causal on itself, full on the keys before it).

**Layout** (:func:`varlen_attention`): segments ``(q_start, q_len, k_start, k_len)`` name the real query rows
and key rows of each sequence; the real query rows are gathered into one packed tensor (skipped when there is
no padding), the key rows likewise (a key row may be listed by several segments under CP: its gradients add
up), one kernel call runs, and the result is scattered back into zeros -- padding rows output exactly 0 and get
no gradient.

Torch only; no megatron-core (the plain-torch decoder slice of :mod:`megatron_dynbatch.measure` uses it too).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

log = logging.getLogger(__name__)

#: ``(q_start, q_len, k_start, k_len)``: rows of the query tensor against rows of the key/value tensors
Segment = Tuple[int, int, int, int]
CAUSAL = (-1, 0)
FULL = (-1, -1)
_HALF = (torch.float16, torch.bfloat16)
_REQUIRED = ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k")


@dataclass(frozen=True)
class VarlenKernel:
    """One varlen attention function (module docstring) and what it accepts.

    ``cuda_only``: flash's contract -- CUDA tensors in fp16/bf16 with a head dim that is a multiple of 8 and at
    most 256 (other inputs take the caller's fallback); ``gqa``: the function takes ``enable_gqa=True`` so K/V
    keep their query-group count."""

    fn: Callable[..., Tensor]
    name: str
    cuda_only: bool = True
    gqa: bool = False

    def accepts(self, query: Tensor) -> bool:
        if not self.cuda_only:
            return True
        d = query.shape[-1]
        return bool(query.is_cuda and query.dtype in _HALF and d % 8 == 0 and d <= 256)


def torch_varlen_kernel() -> Tuple[Optional[VarlenKernel], str]:
    """torch's ``varlen_attn`` as a :class:`VarlenKernel`, or ``None`` and why not."""
    try:
        varlen = importlib.import_module("torch.nn.attention.varlen")
    except ImportError as exc:
        return None, f"torch {torch.__version__} has no torch.nn.attention.varlen ({exc})"
    fn = getattr(varlen, "varlen_attn", None)
    if fn is None:
        return None, f"torch {torch.__version__}'s torch.nn.attention.varlen has no varlen_attn"
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as exc:  # pragma: no cover - a builtin without a signature
        return None, f"cannot inspect varlen_attn ({exc})"
    names = list(params)
    missing = [p for p in ("scale", "window_size") if p not in params]
    if len(names) < len(_REQUIRED) or missing:
        return None, (f"torch {torch.__version__}'s varlen_attn{inspect.signature(fn)} lacks "
                      f"{missing or 'the 7 positional parameters'}")
    return VarlenKernel(fn, "torch.nn.attention.varlen.varlen_attn", gqa="enable_gqa" in params), ""


_DEFAULT: List[Optional[VarlenKernel]] = []


def default_varlen_kernel() -> Optional[VarlenKernel]:
    """torch's kernel when this torch has it (resolved once); else ``None``, with ONE log line saying why and
    that THD attention falls back to the per-sequence pure-torch path."""
    if not _DEFAULT:
        kernel, why = torch_varlen_kernel()
        if kernel is None:
            log.warning("megatron_dynbatch: no fused varlen attention kernel (%s); THD attention runs the "
                        "per-sequence pure-torch path (correct, slow on GPU)", why)
        _DEFAULT.append(kernel)
    return _DEFAULT[0]


_NOTED: set = set()


def note_fallback(reason: str) -> None:
    """Log once per process and ``reason`` that an input the fused kernel could have served takes the
    per-sequence path instead (e.g. fp32 on CUDA, attention dropout while training)."""
    if reason not in _NOTED:
        _NOTED.add(reason)
        log.warning("megatron_dynbatch: %s; THD attention runs the per-sequence pure-torch path there", reason)


# ----------------------------------------------------------------------------------------- reference
def reference_varlen_attn(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor,
                          max_q: int, max_k: int, *, scale: Optional[float] = None,
                          window_size: Tuple[int, int] = FULL, enable_gqa: bool = False) -> Tensor:
    """``varlen_attn``'s semantics in plain torch, one sequence at a time (softmax in fp32, output in the
    input dtype): bottom-right aligned window (module docstring; ``window_size=(left, right)``, -1 = unbounded),
    rows that see no key output 0. ``max_q``/``max_k`` are accepted for the signature and not needed."""
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[2]
    if kv_heads != heads and not (enable_gqa and heads % kv_heads == 0):
        raise ValueError(f"query has {heads} heads, key/value {kv_heads}: pass enable_gqa=True (divisible counts)")
    rep = heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    left, right = (int(w) for w in window_size)
    cq, ck = cu_seq_q.tolist(), cu_seq_k.tolist()
    pieces = []
    for b in range(len(cq) - 1):
        nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        q = query[cq[b]:cq[b + 1]].transpose(0, 1).float()  # [heads, nq, d]
        k = key[ck[b]:ck[b + 1]].transpose(0, 1).float()
        v = value[ck[b]:ck[b + 1]].transpose(0, 1).float()
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        i = torch.arange(nq, device=query.device).unsqueeze(1) + (nk - nq)  # bottom-right: row i's diagonal key
        j = torch.arange(nk, device=query.device).unsqueeze(0)
        hidden = torch.zeros(nq, nk, dtype=torch.bool, device=query.device)
        if right >= 0:
            hidden |= j > i + right
        if left >= 0:
            hidden |= j < i - left
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        probs = probs.masked_fill(hidden.all(dim=-1, keepdim=True), 0.0)  # no visible key: 0, not NaN
        pieces.append(torch.matmul(probs, v).transpose(0, 1).to(query.dtype))
    if not pieces:
        return query.new_zeros(0, heads, value.shape[-1])
    return torch.cat(pieces, dim=0)


#: the reference as a kernel that accepts every input: what CPU tests inject to run the kernel dispatch
REFERENCE_KERNEL = VarlenKernel(reference_varlen_attn, "reference_varlen_attn (pure torch)", cuda_only=False,
                                gqa=True)


# ----------------------------------------------------------------------------------------- layout
def thd_segments(cu_q: Sequence[int], cu_kv: Sequence[int], pad_q: Sequence[int],
                 pad_kv: Sequence[int]) -> List[Segment]:
    """Segments of a whole THD micro-batch: sequence ``i``'s real rows ``pad_q[i] + [0, L_i)`` against its real
    key rows ``pad_kv[i] + [0, Lk_i)`` (real lengths from ``cu_q``/``cu_kv``); empty sequences are skipped."""
    out = []
    for i in range(len(cu_q) - 1):
        n, nk = cu_q[i + 1] - cu_q[i], cu_kv[i + 1] - cu_kv[i]
        if n > 0:
            out.append((pad_q[i], n, pad_kv[i], nk))
    return out


def cp_segments(pad: Sequence[int], cu: Sequence[int], cp: int, cp_rank: int, causal: bool) -> List[Segment]:
    """Segments of CP rank ``cp_rank``'s zig-zag share against the full (gathered, packed-order) keys.

    Sequence ``i`` (slot ``pad[i]:pad[i+1]``, ``L_i`` real tokens) is cut into ``2*cp`` chunks of ``C`` rows;
    this rank holds chunks ``cp_rank`` then ``2cp-1-cp_rank`` (local rows in that order, sequence after
    sequence). Chunk ``c``'s real rows (positions ``cC .. min((c+1)C, L_i) - 1``) are one query sequence against
    keys ``pad[i] + [0, cC + n)`` when causal (bottom-right alignment makes that causal) or all ``L_i`` real keys
    when not."""
    out = []
    local = 0
    for i in range(len(pad) - 1):
        chunk = (pad[i + 1] - pad[i]) // (2 * cp)
        length = cu[i + 1] - cu[i]
        for k, c in enumerate((cp_rank, 2 * cp - 1 - cp_rank)):
            n = min(max(length - c * chunk, 0), chunk)
            if n > 0:
                out.append((local + k * chunk, n, pad[i], c * chunk + n if causal else length))
        local += 2 * chunk
    return out


def _rows(starts: Tensor, lens: Tensor) -> Tensor:
    """``cat(arange(s, s + n) for s, n)`` without a Python loop."""
    offsets = torch.cumsum(lens, 0) - lens
    return torch.repeat_interleave(starts - offsets, lens) + torch.arange(int(lens.sum()), device=lens.device)


def varlen_attention(query: Tensor, key: Tensor, value: Tensor, segments: Sequence[Segment], *,
                     kernel: VarlenKernel, scale: float, causal: bool) -> Tensor:
    """Attention of ``segments`` (module docstring) through ONE ``kernel`` call: query ``[t, heads, d]``,
    key/value ``[tk, groups, d]`` (GQA: head ``h`` uses group ``h // (heads/groups)``); returns
    ``[t, heads * d_v]`` with 0 on every row no segment names. ``segments`` must not be empty."""
    t, heads, _ = query.shape
    groups, dv = key.shape[1], value.shape[-1]
    seg = torch.as_tensor(segments, dtype=torch.int64).reshape(-1, 4)
    q_idx, k_idx = _rows(seg[:, 0], seg[:, 1]), _rows(seg[:, 2], seg[:, 3])
    zero = torch.zeros(1, dtype=torch.int64)
    cu_q = torch.cat([zero, torch.cumsum(seg[:, 1], 0)]).to(torch.int32).to(query.device)
    cu_k = torch.cat([zero, torch.cumsum(seg[:, 3], 0)]).to(torch.int32).to(query.device)
    whole_q = q_idx.numel() == t and bool((q_idx == torch.arange(t)).all())
    whole_k = k_idx.numel() == key.shape[0] and bool((k_idx == torch.arange(key.shape[0])).all())
    q = query if whole_q else query.index_select(0, q_idx.to(query.device))
    k = key if whole_k else key.index_select(0, k_idx.to(key.device))
    v = value if whole_k else value.index_select(0, k_idx.to(value.device))
    extra = {}
    if groups != heads:
        if kernel.gqa:
            extra["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(heads // groups, dim=1), v.repeat_interleave(heads // groups, dim=1)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # dense rows: what the flash kernel reads
    out = kernel.fn(q, k, v, cu_q, cu_k, int(seg[:, 1].max()), int(seg[:, 3].max()), scale=scale,
                    window_size=CAUSAL if causal else FULL, **extra)
    if not whole_q:
        out = out.new_zeros(t, heads, dv).index_copy(0, q_idx.to(out.device), out)
    return out.reshape(t, heads * dv)


__all__ = ["VarlenKernel", "Segment", "REFERENCE_KERNEL", "default_varlen_kernel", "torch_varlen_kernel",
           "note_fallback", "reference_varlen_attn", "thd_segments", "cp_segments", "varlen_attention"]
