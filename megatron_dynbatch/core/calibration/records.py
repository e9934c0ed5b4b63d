"""What online calibration records: a rank's micro-batch timings and the slice they cover.

A record is ``[group_size, lengths, seconds]`` (:mod:`..cost_fit`): what ONE rank spent on a micro-batch, forward +
backward. :class:`SliceInfo` says what that rank runs -- the decoder layers of its pipeline stage, the TP size of its
widths, the LM head on the last stage -- so the fit can be per layer. :func:`clean_records` keeps the well-formed
records (NumPy scalars and tensors accepted) and counts the rest: non-finite, non-positive or over
:data:`MAX_RECORD_S` timings, group sizes below 1 or booleans, empty or non-integer lengths. Pure Python + NumPy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Tuple

import numpy as np

from ..checks import as_array, as_bool, as_int, is_int, scalar, whole_number

#: a recorded micro-batch slower than this is a measurement error, not a micro-batch
MAX_RECORD_S = 3600.0


@dataclass(frozen=True)
class SliceInfo:
    """What one rank's recorded seconds cover: ``measured_layers`` decoder layers at the widths of ``tp``, with the
    LM head and loss (``lm_head``) on the last pipeline stage."""

    measured_layers: int
    tp: int = 1
    lm_head: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "measured_layers", as_int(self.measured_layers, "slice.measured_layers", minimum=1))
        object.__setattr__(self, "tp", as_int(self.tp, "slice.tp", minimum=1))
        object.__setattr__(self, "lm_head", as_bool(self.lm_head, "slice.lm_head"))


def clean_records(records: Any) -> Tuple[List[List[Any]], int]:
    """The well-formed records of ``records`` (as plain lists) and how many were dropped (module docstring)."""
    out: List[List[Any]] = []
    dropped = 0
    for rec in records if isinstance(records, (list, tuple)) else []:
        try:
            g, lengths, s = scalar(rec[0]), as_array(rec[1]), scalar(rec[2])
            lens = [whole_number(x) for x in lengths]
            ok = (is_int(g) and g >= 1 and bool(lens) and all(x is not None and x >= 1 for x in lens)
                  and isinstance(s, (int, float, np.integer, np.floating)) and not isinstance(s, (bool, np.bool_))
                  and math.isfinite(float(s)) and 0 < float(s) <= MAX_RECORD_S)
        except (TypeError, ValueError, IndexError, KeyError):
            ok = False
        if ok:
            out.append([int(g), lens, float(s)])
        else:
            dropped += 1
    if not isinstance(records, (list, tuple)):
        dropped += 1
    return out, dropped


__all__ = ["SliceInfo", "clean_records", "MAX_RECORD_S"]
