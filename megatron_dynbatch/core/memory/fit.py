"""Fitting a memory profile to measured peaks of model slices (the torch-free half of ``calibrate``'s memory).

A record is one forward + backward of a slice -- ``layers`` decoder layers at the layout's per-TP-rank widths,
with or without the embedding, LM head and loss (``lm_head``) -- on one micro-batch of ``tokens`` tokens:
``peak_bytes`` is the allocator's peak during it MINUS what was allocated before it started (the slice's
weights and gradients; :mod:`megatron_dynbatch.measure.memory` reads it). The model fitted::

    peak_bytes = workspace + tokens x (layers x layer + [no head] backward_extra + [head] head)

``layer``: what a layer keeps for backward per token; ``backward_extra``: the working set of the layer running
its backward, once per micro-batch; ``head``: what the head, loss and (at the same moment) the layers' kept
activations beyond them add -- the larger of the loss's working set and the backward extra, as the peak is one
moment; ``workspace``: per micro-batch. Four unknowns, so a slice must vary three things: the tokens (the
slope), the layers (which part of the slope is per layer), and the head (what the head adds): :func:`memory_grid`
measures 1- and 2-layer slices without the head and a 1-layer slice with it, each at several token counts;
:func:`check_memory_records` refuses records that cannot separate the terms.

The fit is a non-negative least squares of the relative error (:func:`~..cost_fit.nnls_relative`, exact over
every active set). :func:`fit_memory_records` returns the coefficients, the fit error and the
:class:`~.profile.MemoryProfile` they make for the model and layout. Pure Python + NumPy.
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..checks import as_bool, as_int, scalar
from ..cost_fit import nnls_relative
from ..errors import DynBatchConfigError
from ..model_spec import ModelLike, ModelSpec
from ..parallel import ParallelConfig
from .profile import MemoryProfile, model_key

if TYPE_CHECKING:
    from ..parallel import ParallelLike

#: the slices measured: (decoder layers, with the embedding / LM head / loss)
MEMORY_SLICES: Tuple[Tuple[int, bool], ...] = ((1, False), (2, False), (1, True))
#: token counts per slice: the budget and its halvings down to budget / 2**MEMORY_HALVINGS (at least 64)
MEMORY_HALVINGS = 3
#: the longest sequence of a memory point (longer micro-batches are split into equal sequences)
MEMORY_SEQ_TOKENS = 4096
COEFFICIENTS = ("workspace", "layer", "backward_extra", "head")


@dataclass(frozen=True)
class MemoryRecord:
    """One measured forward + backward of a slice (module docstring)."""

    layers: int
    lm_head: bool
    tokens: int
    peak_bytes: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", as_int(self.layers, "memory_record.layers", minimum=1, maximum=4096))
        object.__setattr__(self, "lm_head", as_bool(scalar(self.lm_head), "memory_record.lm_head"))
        object.__setattr__(self, "tokens", as_int(self.tokens, "memory_record.tokens", minimum=1))
        v = scalar(self.peak_bytes)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)) and float(v) > 0
        if not ok:
            raise DynBatchConfigError("memory_record.peak_bytes", v, "must be a positive, finite number of bytes",
                                      "drop failed measurements")
        object.__setattr__(self, "peak_bytes", float(v))

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_any(cls, value: Any) -> "MemoryRecord":
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls(value.get("layers"), value.get("lm_head"), value.get("tokens"), value.get("peak_bytes"))
        raise DynBatchConfigError("memory_record", value, "is not a memory record",
                                  "pass {'layers', 'lm_head', 'tokens', 'peak_bytes'} objects")


@dataclass(frozen=True)
class MemoryFit:
    """The fitted coefficients (bytes per token; ``workspace`` bytes per micro-batch), their fit error on the
    records (relative), and the profile they make."""

    coefficients: Dict[str, float]
    num_records: int
    rel_rms_error: float
    max_rel_error: float
    profile: MemoryProfile

    def to_dict(self) -> Dict[str, Any]:
        return {"coefficients": dict(self.coefficients), "num_records": self.num_records,
                "rel_rms_error": self.rel_rms_error, "max_rel_error": self.max_rel_error}


def memory_grid(max_tokens_per_gpu: Any) -> List[Tuple[int, bool, List[int]]]:
    """``(layers, lm_head, lengths)`` of every memory point: each of :data:`MEMORY_SLICES` at the budget and its
    halvings (never over the budget, at least 64 tokens), sequences of at most :data:`MEMORY_SEQ_TOKENS`."""
    budget = as_int(max_tokens_per_gpu, "--max-tokens-per-gpu", minimum=1,
                    fix="pass the per-GPU token budget of your training run")
    sizes = sorted({max(min(64, budget), budget >> k) for k in range(MEMORY_HALVINGS + 1)})
    out = []
    for layers, head in MEMORY_SLICES:
        for t in sizes:
            n = -(-t // MEMORY_SEQ_TOKENS)
            base, extra = divmod(t, n)
            out.append((layers, head, [base + (1 if i < extra else 0) for i in range(n)]))
    return out


def _design(recs: Sequence[MemoryRecord]) -> np.ndarray:
    t = np.array([r.tokens for r in recs], dtype=np.float64)
    n = np.array([r.layers for r in recs], dtype=np.float64)
    h = np.array([1.0 if r.lm_head else 0.0 for r in recs])
    return np.column_stack([np.ones_like(t), t * n, t * (1.0 - h), t * h])


def check_memory_records(records: Any) -> List[MemoryRecord]:
    """The records as :class:`MemoryRecord` s; refused when they cannot separate the four terms."""
    if isinstance(records, (str, bytes)) or not isinstance(records, Sequence):
        raise DynBatchConfigError("memory_records", type(records).__name__, "must be a list of memory records",
                                  "pass the records calibrate measured")
    recs = [MemoryRecord.from_any(r) for r in records]
    if len(recs) < 4:
        raise DynBatchConfigError("memory_records", len(recs), "a memory fit needs at least 4 records",
                                  "measure the memory grid (memory_grid)")
    x = _design(recs)
    x = x / np.maximum(x.max(axis=0), 1.0)
    if np.linalg.matrix_rank(x, tol=1e-9) < 4:
        raise DynBatchConfigError("memory_records", len(recs), "the records do not vary the tokens, the decoder "
                                  "layers and the LM head independently, so the per-layer, backward, head and "
                                  "workspace terms cannot be told apart",
                                  "measure 1- and 2-layer slices without the LM head and one with it, each at two "
                                  "or more token counts (memory_grid)")
    return recs


def fit_memory_records(records: Any, model: ModelLike, parallel: ParallelLike = None, *,
                       fitted_on: Optional[Mapping[str, Any]] = None) -> MemoryFit:
    """Fit the records (module docstring) and build the model's :class:`~.profile.MemoryProfile` on
    ``parallel``'s TP width (the width the slices were measured at). ``fitted_on``: what to record about the
    measurement (device, dtype, ...); model, tp, slice layers, date and fit error are added."""
    recs = check_memory_records(records)
    m = ModelSpec.from_any(model)
    p = ParallelConfig.from_any(parallel)
    x = _design(recs)
    y = np.array([r.peak_bytes for r in recs], dtype=np.float64)
    coef = nnls_relative(x, y, y)
    rel = (x @ coef - y) / y
    coefficients = {k: float(v) for k, v in zip(COEFFICIENTS, coef, strict=True)}
    rms, worst = float(np.sqrt(np.mean(rel ** 2))), float(np.max(np.abs(rel)))
    info: Dict[str, Any] = {"model": model_key(m), "tp": p.tp, "slice_layers": sorted({r.layers for r in recs}),
                            "records": len(recs), "rel_rms_error": rms, "max_rel_error": worst,
                            "date": _dt.date.today().isoformat()}
    info.update(dict(fitted_on or {}))
    return MemoryFit(coefficients, len(recs), rms, worst, MemoryProfile.fitted(m, p, coefficients, info))


__all__ = ["MemoryRecord", "MemoryFit", "memory_grid", "check_memory_records", "fit_memory_records",
           "MEMORY_SLICES", "MEMORY_SEQ_TOKENS", "COEFFICIENTS"]
