"""Token alignment rules shared by the planner (which must count padding against the budget) and the THD
packer (which must produce exactly that padding).

Two kinds of padding exist:

* **per sequence** -- with context parallelism every sequence must split into ``2*cp`` equal chunks for the
  zig-zag layout, so each sequence is padded to a multiple of ``2*cp`` (``seq_multiple``);
* **per micro-batch** -- the tokens each GPU holds must divide by ``tp`` under sequence parallelism and by the
  FP8 GEMM tile (16 for FP8, 32 for MXFP8, 128 for NVFP4/blockwise). Each CP rank holds ``total/cp`` tokens,
  so the micro-batch total is padded to a multiple of ``total_multiple = lcm(m*cp, seq_multiple)``. Without
  sequence parallelism ``m`` is the FP8 tile; with it, ``m = tp * tile``: Transformer Engine checks the FP8
  shape rule (``assert_dim_for_fp8_exec``, and for block-scaled recipes ``assert_dim_for_all_gather``) on each
  TP rank's *local* shard of ``total/(cp*tp)`` tokens, before the sequence-parallel all-gather, so that share
  -- not only the gathered total -- must be a multiple of the tile. The packer adds that tail padding to the
  last sequence's padded slot, which keeps every padded slot a multiple of ``seq_multiple``.

The budget check is therefore ``padded_total(sum(seq_len(lengths))) <= cap``, which is the same as
``sum(seq_len(lengths)) <= effective_cap(cap)`` with ``effective_cap = floor(cap / total_multiple) * total_multiple``.

Trainers pad by conventions of their own, and a cap is only hard if *their* padding counts against it:
``for_layout(..., sequence_multiple=k)`` also pads every sequence to a multiple of ``k`` (verl's Megatron
engine pads each sequence to ``tp*cp*2``, or ``tp`` without CP), ``microbatch_multiple=k`` also pads each GPU's
share of a micro-batch (the ``total/cp`` tokens of one CP rank) to a multiple of ``k`` (slime pads it to
``tp * data_pad_size_multiplier``). Both combine with the layout's own rules by least common multiple, so a
plan meets all of them at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from .checks import as_int, is_int
from .errors import DynBatchConfigError
from .parallel import ParallelConfig

#: Largest explicit FP8 token multiple accepted (a tile, not a budget).
MAX_FP8_MULTIPLE = 4096
#: Largest explicit padding multiple accepted (``sequence_multiple`` / ``microbatch_multiple``).
MAX_PAD_MULTIPLE = 2 ** 20

FP8_TILES = {"none": 1, "fp8": 16, "e4m3": 16, "hybrid": 16, "mxfp8": 32, "nvfp4": 128, "blockwise": 128}


def fp8_multiple(fp8: Union[None, str, int]) -> int:
    """Token multiple that FP8 GEMMs need: ``None``/"none" -> 1, "fp8" -> 16, "mxfp8" -> 32,
    "nvfp4"/"blockwise" -> 128, or an explicit positive integer."""
    if fp8 is None:
        return 1
    if is_int(fp8):
        return as_int(fp8, "fp8_alignment", minimum=1, maximum=MAX_FP8_MULTIPLE,
                      fix="use 16 (FP8), 32 (MXFP8) or 128 (NVFP4)")
    if not isinstance(fp8, str):
        raise DynBatchConfigError("fp8_alignment", fp8, "must be a recipe name or a positive integer",
                                  f"use one of {sorted(FP8_TILES)} or an integer such as 16")
    key = fp8.lower()
    if key not in FP8_TILES:
        raise DynBatchConfigError("fp8_alignment", fp8, "unknown FP8 recipe",
                                  f"use one of {sorted(FP8_TILES)} or an integer such as 16")
    return FP8_TILES[key]


def pad_multiple(value: Optional[int], field: str) -> int:
    """A padding multiple (``None`` -> 1), or a ``DynBatchConfigError`` naming ``field``."""
    if value is None:
        return 1
    return as_int(value, field, minimum=1, maximum=MAX_PAD_MULTIPLE,
                  fix="pass the token multiple your trainer pads to (e.g. tp*cp*2), or None for none")


@dataclass(frozen=True)
class Alignment:
    """Padding rules for one parallel layout. Build it with :meth:`for_layout`."""

    seq_multiple: int = 1
    total_multiple: int = 1

    def __post_init__(self) -> None:
        for name in ("seq_multiple", "total_multiple"):
            object.__setattr__(self, name, as_int(getattr(self, name), f"alignment.{name}", minimum=1,
                                                  fix="use 1 for no padding"))

    @classmethod
    def for_layout(cls, parallel: Optional[ParallelConfig] = None, fp8: Union[None, str, int] = None,
                   sequence_multiple: Optional[int] = None, microbatch_multiple: Optional[int] = None) -> "Alignment":
        """The padding of ``parallel`` (CP zig-zag, TP sequence parallel, FP8 tile), combined with a trainer's own
        per-sequence multiple and per-GPU micro-batch multiple (see the module docstring); ``None`` = 1."""
        p = parallel or ParallelConfig()
        seq = math.lcm(2 * p.cp if p.cp > 1 else 1, pad_multiple(sequence_multiple, "sequence_pad_multiple"))
        m = math.lcm((p.tp if p.sequence_parallel else 1) * fp8_multiple(fp8),
                     pad_multiple(microbatch_multiple, "microbatch_pad_multiple"))
        total = math.lcm(m * p.cp, seq)
        return cls(seq_multiple=seq, total_multiple=total)

    def seq_len(self, lengths):
        """Per-sequence padded slot lengths (numpy array or int in, same kind out).

        A zero-length sample still takes one slot of ``seq_multiple`` padding tokens, so that no micro-batch
        is ever zero tokens long (Megatron cannot run a forward on an empty tensor); its loss mask is all 0.
        """
        s = self.seq_multiple
        if isinstance(lengths, (int, np.integer)):
            return max(-(-int(lengths) // s) * s, s)
        arr = np.asarray(lengths, dtype=np.int64)
        return np.maximum(-(-arr // s) * s, s)

    def padded_total(self, aligned_tokens: int) -> int:
        """Micro-batch token count after tail padding, given the sum of per-sequence padded lengths."""
        t = self.total_multiple
        return -(-int(aligned_tokens) // t) * t

    def effective_cap(self, cap: int) -> int:
        """Largest sum of per-sequence padded lengths whose padded total still fits ``cap``."""
        return (int(cap) // self.total_multiple) * self.total_multiple

    def budget_for(self, slot_tokens: int, cp: int) -> int:
        """Smallest ``max_tokens_per_gpu`` whose micro-batch (``budget * cp`` tokens, after tail padding) holds
        ``slot_tokens`` of per-sequence padded slots -- the number an error message should suggest."""
        need = self.padded_total(max(int(slot_tokens), self.seq_multiple))
        return -(-need // int(cp))
