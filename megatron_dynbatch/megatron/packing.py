"""Pack the samples of one micro-batch into Megatron's THD layout (``[1, T]`` + ``PackedSeqParams``).

Layout. Sample ``i`` (``L_i`` real tokens) occupies a *padded slot* of ``P_i = alignment.seq_len(L_i)`` tokens
(a multiple of ``alignment.seq_multiple = 2*cp``) starting at ``cu_seqlens_padded[i]``; its real tokens come
first, padding after. Tail padding that brings the total to a multiple of ``alignment.total_multiple`` is
added to the LAST slot, so every slot stays a multiple of ``seq_multiple`` (what context parallelism needs)
and the padded total is exactly ``alignment.padded_total(sum(P_i))`` -- the count the planner budgeted.

Per-token fields and their padding:

* ``tokens``: ``pad_token_id`` on padding;
* ``position_ids``: restart at 0 at every slot start and keep counting through the slot's padding
  (``0..P_i-1``). Megatron's THD RoPE ignores ``position_ids`` and derives positions from
  ``cu_seqlens_q_padded`` in exactly this way, so the two agree;
* ``labels``: given per sample, or (default) the next token *within the sample* -- the last real position of
  each sample has no next token and gets ``pad_token_id`` with ``loss_mask`` 0; ``pad_token_id`` on padding;
* ``loss_mask`` (float32): the sample's ``loss_mask`` (default all ones) on real positions, 0 on every
  padding position, so padding is never trained on. All per-token fields are aligned with the *label*
  positions, Megatron's convention: position ``j`` predicts ``labels[j]``, and ``loss_mask[j]`` says whether
  that prediction counts. A mask that marks target tokens must be shifted left by one before packing;
* any other per-token field (a tensor/array whose first dimension is ``L_i``, or a list of ``L_i`` numbers:
  advantages, old_log_probs, ...): packed the same way, 0 on padding, dtype kept;
* anything else (rewards, ids, strings, 0-d tensors) is per-sample and kept as a list in ``sample_fields``.

Zero-length samples (e.g. an empty RL response) get the slot ``alignment.seq_len(0)`` prescribes -- one
``seq_multiple`` of pure padding, exactly what the planner counted -- with ``cu_seqlens`` repeating (real
length 0) and loss mask 0. So no sequence is an empty segment and no micro-batch is empty, which keeps every
attention backend (TE fused / flash varlen, the CPU reference) and Megatron's forward happy. (Should the
padded total ever be 0, the packer still emits one ``total_multiple`` of padding.)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from ..core.alignment import Alignment
from ..core.errors import DynBatchConfigError

Device = Union[str, torch.device, None]
_RESERVED = ("tokens", "labels", "loss_mask")


def _make_packed_seq_params(cu: torch.Tensor, cu_padded: torch.Tensor, max_seqlen: int, **cp: Any) -> Any:
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError as exc:  # pragma: no cover - exercised only without megatron-core
        raise ImportError(
            "PackedMicroBatch.packed_seq_params needs megatron-core (pip install 'megatron-dynbatch[megatron]')"
        ) from exc
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        **cp,
    )


@dataclass
class PackedMicroBatch:
    """One THD micro-batch. All per-token tensors are ``[1, T]`` (extras ``[1, T, ...]``), or ``[1, T/cp]``
    after :func:`megatron_dynbatch.megatron.context_parallel.slice_packed_for_cp` (``cp_size``/``cp_rank`` say which).

    ``cu_seqlens`` (cumulative real lengths) and ``cu_seqlens_padded`` (cumulative slot lengths) are int32
    ``[n+1]``. ``packed_seq_params`` (built lazily, needs megatron-core) carries both, ``qkv_format="thd"`` and
    ``max_seqlen_q/kv = max(seqlens_padded)`` as a python int (TE would otherwise sync to compute it).
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    extras: Dict[str, torch.Tensor]
    sample_fields: Dict[str, List[Any]]
    seqlens: List[int]
    seqlens_padded: List[int]
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    sample_indices: List[int]
    cp_size: int = 1
    cp_rank: int = 0
    #: dynamic CP (a ``DynamicCPPlan``): ``cp_size``/``cp_rank`` are this micro-batch's group and rank in it,
    #: ``cp_group`` its process group (a single-GPU group when ``cp_size == 1``); see ``megatron/dynamic_cp.py``
    dynamic_cp: bool = False
    cp_group: Any = field(default=None, repr=False, compare=False)
    _packed_seq_params: Any = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ sizes
    @property
    def num_sequences(self) -> int:
        return len(self.seqlens)

    @property
    def num_tokens(self) -> int:
        """Full packed length ``T`` (real + padding) -- also on a CP slice, which holds ``T/cp`` of them."""
        return int(self.cu_seqlens_padded[-1].item())

    @property
    def num_local_tokens(self) -> int:
        """Tokens this rank's tensors hold (``T``, or ``T/cp`` on a CP slice)."""
        return int(self.tokens.shape[-1])

    @property
    def num_real_tokens(self) -> int:
        return int(sum(self.seqlens))

    @property
    def num_padding_tokens(self) -> int:
        return self.num_tokens - self.num_real_tokens

    @property
    def num_loss_tokens(self) -> int:
        """Positions whose loss counts (``loss_mask.sum()`` of the tensors held here)."""
        return int(self.loss_mask.sum().item())

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens_padded) if self.seqlens_padded else 0

    # ------------------------------------------------------------- megatron
    @property
    def packed_seq_params(self) -> Any:
        """``megatron.core.packed_seq_params.PackedSeqParams`` for this micro-batch (full, un-sliced cu_seqlens).
        Under dynamic CP it also carries ``local_cp_size`` and (for a group of several GPUs) ``cp_group``, the
        per-micro-batch fields Transformer Engine's attention reads."""
        if self._packed_seq_params is None:
            cp = {}
            if self.dynamic_cp:
                cp = {"local_cp_size": self.cp_size, "cp_group": self.cp_group if self.cp_size > 1 else None}
            self._packed_seq_params = _make_packed_seq_params(self.cu_seqlens, self.cu_seqlens_padded, self.max_seqlen,
                                                              **cp)
        return self._packed_seq_params

    # ---------------------------------------------------------------- utils
    def unpack(self, per_token: torch.Tensor) -> List[torch.Tensor]:
        """Split a per-token result (``[1, T, ...]`` or ``[T, ...]``) into each sample's real-token slice
        (``[L_i, ...]``), in packing order. Padding positions are dropped."""
        if self.cp_size != 1:
            raise DynBatchConfigError(
                "packed.cp_size", self.cp_size, "unpack needs full-sequence outputs, this is a CP slice",
                "reassemble the CP ranks' outputs with context_parallel.gather_cp_outputs and unpack them "
                "with the un-sliced micro-batch",
            )
        x = per_token
        if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == self.num_tokens:
            x = x[0]
        if x.dim() < 1 or x.shape[0] != self.num_tokens:
            raise DynBatchConfigError(
                "per_token.shape", tuple(per_token.shape),
                f"expected [1, {self.num_tokens}, ...] or [{self.num_tokens}, ...] (the packed length)",
                "pass the un-sliced output of this micro-batch (gather context-parallel outputs first)",
            )
        starts = self.cu_seqlens_padded[:-1].tolist()
        return [x[s:s + n] for s, n in zip(starts, self.seqlens, strict=True)]

    def to(self, device: Device) -> "PackedMicroBatch":
        """A copy with every tensor (including the PackedSeqParams cu_seqlens) on ``device``."""
        return replace(
            self,
            tokens=self.tokens.to(device),
            position_ids=self.position_ids.to(device),
            labels=self.labels.to(device),
            loss_mask=self.loss_mask.to(device),
            extras={k: v.to(device) for k, v in self.extras.items()},
            cu_seqlens=self.cu_seqlens.to(device),
            cu_seqlens_padded=self.cu_seqlens_padded.to(device),
            _packed_seq_params=None,
        )


# ------------------------------------------------------------------------------------------- helpers
def _as_1d(value: Any, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value
    elif isinstance(value, np.ndarray):
        t = torch.from_numpy(value)
    else:
        t = torch.as_tensor(list(value), dtype=dtype)
    if dtype is not None:
        t = t.to(dtype)
    return t


def _is_per_token(value: Any, length: int) -> bool:
    """Per-token iff an array with ndim >= 1 or a list/tuple of numbers, with first dimension == length."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim >= 1
    if isinstance(value, (list, tuple)):
        return len(value) == length and all(
            isinstance(v, (int, float, bool, np.number)) for v in value
        )
    return False


def _check_sample(i: int, sample: Any) -> int:
    if not isinstance(sample, Mapping) or "tokens" not in sample:
        raise DynBatchConfigError(
            f"samples[{i}]", type(sample).__name__, "each sample must be a dict with a 'tokens' entry",
            "pass dicts like {'tokens': LongTensor[L], 'loss_mask': ..., 'advantages': ...}",
        )
    tokens = sample["tokens"]
    ndim = tokens.ndim if isinstance(tokens, (torch.Tensor, np.ndarray)) else np.ndim(tokens)
    if ndim != 1:
        raise DynBatchConfigError(
            f"samples[{i}]['tokens'].ndim", ndim, "tokens must be 1-D (one sequence, no batch dimension)",
            "pass each sequence separately; pack_microbatch builds the [1, T] batch",
        )
    return len(tokens)


# ------------------------------------------------------------------------------------------ main API
def pack_microbatch(
    samples: Sequence[Mapping[str, Any]],
    alignment: Optional[Alignment] = None,
    *,
    pad_token_id: int = 0,
    sample_indices: Optional[Sequence[int]] = None,
    device: Device = None,
) -> PackedMicroBatch:
    """Pack ``samples`` (dicts with ``tokens`` and optional ``labels``, ``loss_mask`` and other fields) into one
    THD micro-batch with the padding ``alignment`` prescribes. See the module docstring for every field's
    layout. ``sample_indices`` (default ``0..n-1``) are carried through for restoring sample order;
    ``device`` defaults to the device of the first sample's tokens (CPU for lists)."""
    alignment = alignment or Alignment()
    if len(samples) == 0:
        raise DynBatchConfigError("samples", [], "a micro-batch needs at least one sample",
                                  "drop empty micro-batches in the plan, or pass at least one sample")
    if sample_indices is None:
        sample_indices = list(range(len(samples)))
    elif len(sample_indices) != len(samples):
        raise DynBatchConfigError("sample_indices", list(sample_indices),
                                  f"has {len(sample_indices)} entries for {len(samples)} samples",
                                  "pass one index per sample")
    if device is None:
        first = samples[0].get("tokens") if isinstance(samples[0], Mapping) else None
        device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")

    seqlens = [_check_sample(i, s) for i, s in enumerate(samples)]
    padded = [int(alignment.seq_len(n)) for n in seqlens]
    aligned_total = sum(padded)
    total = alignment.padded_total(aligned_total)
    if total == 0:  # every sample empty: keep one slot of pure padding so the step still runs
        total = alignment.total_multiple
    padded[-1] += total - aligned_total

    keys = _classify_fields(samples, seqlens)
    tokens = torch.full((total,), int(pad_token_id), dtype=torch.long)
    labels = torch.full((total,), int(pad_token_id), dtype=torch.long)
    loss_mask = torch.zeros(total, dtype=torch.float32)
    position_ids = torch.cat([torch.arange(p, dtype=torch.long) for p in padded])
    extras: Dict[str, torch.Tensor] = {}
    sample_fields: Dict[str, List[Any]] = {k: [] for k in keys["per_sample"]}

    start = 0
    for i, (sample, n, p) in enumerate(zip(samples, seqlens, padded, strict=True)):
        tok = _as_1d(sample["tokens"], torch.long)
        tokens[start:start + n] = tok
        if "labels" in sample:
            lab = _as_1d(sample["labels"], torch.long)
            _check_len(i, "labels", lab, n)
            labels[start:start + n] = lab
        elif n > 0:
            labels[start:start + n - 1] = tok[1:]
        if "loss_mask" in sample:
            mask = _as_1d(sample["loss_mask"], torch.float32)
            _check_len(i, "loss_mask", mask, n)
            loss_mask[start:start + n] = mask
        else:
            loss_mask[start:start + n] = 1.0
        if "labels" not in sample and n > 0:
            loss_mask[start + n - 1] = 0.0  # no next token inside this sample
        for k in keys["per_token"]:
            val = _as_1d(sample[k])
            _check_len(i, k, val, n)
            if k not in extras:
                extras[k] = torch.zeros((total,) + tuple(val.shape[1:]), dtype=val.dtype)
            extras[k][start:start + n] = val
        for k in keys["per_sample"]:
            sample_fields[k].append(sample[k])
        start += p

    cu = torch.tensor(np.concatenate([[0], np.cumsum(seqlens)]), dtype=torch.int32)
    cu_padded = torch.tensor(np.concatenate([[0], np.cumsum(padded)]), dtype=torch.int32)
    return PackedMicroBatch(
        tokens=tokens.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        labels=labels.unsqueeze(0),
        loss_mask=loss_mask.unsqueeze(0),
        extras={k: v.unsqueeze(0) for k, v in extras.items()},
        sample_fields=sample_fields,
        seqlens=seqlens,
        seqlens_padded=padded,
        cu_seqlens=cu,
        cu_seqlens_padded=cu_padded,
        sample_indices=[int(x) for x in sample_indices],
    ).to(device)


def _check_len(i: int, name: str, value: torch.Tensor, n: int) -> None:
    if value.dim() < 1 or value.shape[0] != n:
        raise DynBatchConfigError(
            f"samples[{i}]['{name}'].shape", tuple(value.shape),
            f"a per-token field must have the sample's length {n} as first dimension",
            f"align '{name}' with 'tokens' (pad or trim it to {n} entries)",
        )


def _classify_fields(samples: Sequence[Mapping[str, Any]], seqlens: List[int]) -> Dict[str, List[str]]:
    """Split the non-reserved keys into per-token and per-sample fields; every sample must agree."""
    key_set = [k for k in samples[0].keys() if k not in _RESERVED]
    for i, s in enumerate(samples):
        extra = sorted(set(k for k in s.keys() if k not in _RESERVED) ^ set(key_set))
        if extra:
            raise DynBatchConfigError(
                f"samples[{i}] keys", extra, "every sample of a micro-batch must carry the same fields",
                "add the field to every sample (or drop it from all)",
            )
        for k in ("labels", "loss_mask"):
            if (k in s) != (k in samples[0]):
                raise DynBatchConfigError(
                    f"samples[{i}]['{k}']", "missing" if k not in s else "present",
                    f"'{k}' is given for some samples but not others",
                    f"pass '{k}' for every sample of the micro-batch or for none",
                )
    per_token, per_sample = [], []
    for k in key_set:
        kinds = {_is_per_token(s[k], n) for s, n in zip(samples, seqlens, strict=True)}
        if len(kinds) != 1:
            raise DynBatchConfigError(
                f"samples[*]['{k}']", "mixed", "is per-token in some samples and per-sample in others",
                "make it a length-L tensor in every sample, or a scalar in every sample",
            )
        (per_token if kinds.pop() else per_sample).append(k)
    return {"per_token": per_token, "per_sample": per_sample}
