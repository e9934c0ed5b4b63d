"""Input checks and derived per-sample arrays for the planner (pure NumPy).

Every check raises ``DynBatchConfigError`` naming the field or flag, the value and the fix.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Mapping, Optional, Tuple

import numpy as np

from ..alignment import Alignment
from ..checks import MAX_TOKENS, as_array, as_int, scalar, whole_number
from ..errors import DynBatchConfigError, OversizeSampleError, OversizeSampleWarning
from ..parallel import ParallelConfig

if TYPE_CHECKING:
    from ..flops import FlopsCoefficients
    from ..model_spec import ModelLike


def check_lengths(lengths, field: str = "lengths") -> np.ndarray:
    """Token counts as an int64 array, or a ``DynBatchConfigError`` naming the first bad entry (``field[i]``; a
    drop-in passes its trainer's name, e.g. ``total_lengths``).

    Accepted: a 1-D sequence, array or tensor (any device and dtype; duck-typed, see
    :func:`~megatron_dynbatch.core.checks.as_array`) of exact whole numbers in ``[0, MAX_TOKENS]`` -- integers of
    any dtype, whole floats (``np.loadtxt`` output, ``3636.0``), NumPy scalars and 0-d tensors inside a list.
    Refused: booleans (also inside a list: ``[True, 2]`` is not two token counts), fractions, NaN, strings, nested
    or ragged sequences, scalars and 0-d arrays / tensors, mappings, values beyond ``MAX_TOKENS`` (reported
    with their true value, also for unsigned 64-bit input)."""
    fix = "pass a list or 1-D array of non-negative integers (one token count per sample)"
    lengths = as_array(lengths)
    if lengths is None or isinstance(lengths, (str, bytes, Mapping, set, frozenset)) or _ndim(lengths) == 0 \
            and not isinstance(lengths, (list, tuple)):
        raise DynBatchConfigError(field, _short(lengths), "must be a sequence of token counts", fix)
    if isinstance(lengths, np.ndarray) and lengths.dtype.kind in "iuf":
        arr = lengths
    elif isinstance(lengths, np.ndarray) and lengths.ndim != 1:
        arr = lengths  # refused below, by shape
    else:
        arr = _whole_items(list(lengths), field)
    if arr.ndim != 1:
        raise DynBatchConfigError(field, f"array of shape {arr.shape}", "must be one-dimensional",
                                  "pass one token count per sample")
    if arr.size == 0:
        raise DynBatchConfigError(field, [], "the global batch is empty", "pass at least dp samples")
    if arr.dtype.kind == "f":  # whole numbers in a float dtype are token counts; blame the first fraction
        bad_mask = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad_mask.any():
            i = int(np.flatnonzero(bad_mask)[0])
            raise DynBatchConfigError(f"{field}[{i}]", arr[i].item(), "token counts must be integers",
                                      "pass whole token counts (e.g. len(token_ids)), not fractions or strings")
    if arr.dtype == object:  # Python ints beyond int64
        values = arr.tolist()
        bad = next((i for i, v in enumerate(values) if not 0 <= v <= MAX_TOKENS), None)
        if bad is not None:
            _raise_range(bad, values[bad], field)
        return np.asarray(values, dtype=np.int64)
    out = (arr < 0) | (arr > MAX_TOKENS)
    if out.any():
        bad = int(np.flatnonzero(out)[0])
        _raise_range(bad, int(arr[bad]), field)
    return arr.astype(np.int64)


def attention_mask_lengths(mask: Any) -> Tuple[np.ndarray, int]:
    """Each sample's real length (a ``[batch, seq_len]`` attention mask's row sums; duck-typed, tensors of any
    device) and the padded width ``seq_len``, as the RL trainers' drop-ins read them. A mask that is not at least
    2-D, or whose rows are not whole token counts (NaN), is a ``DynBatchConfigError`` naming it; an empty batch
    gives no lengths (the caller decides whether that is allowed)."""
    shape = tuple(int(d) for d in getattr(mask, "shape", ()))
    if len(shape) < 2:
        raise DynBatchConfigError("attention_mask", f"shape {shape}", "must be [batch, seq_len]",
                                  "pass the padded batch's attention mask (1 for real tokens, 0 for padding)")
    if shape[0] == 0:
        return np.zeros(0, np.int64), shape[-1]
    return check_lengths(mask.reshape(shape[0], -1).sum(-1), field="attention_mask.sum(-1)"), shape[-1]


def _whole_items(items: list, field: str) -> np.ndarray:
    """A list's entries (NumPy scalars and 0-d tensors read as Python scalars) as an int64 array, or an object
    array when one is beyond int64; an error naming the first entry that is not a whole token count."""
    for i, v in enumerate(items):
        v = scalar(v)
        if isinstance(v, (bool, np.bool_)) or not _is_scalar(v):
            raise DynBatchConfigError(f"{field}[{i}]", _short(v), "must be a whole token count",
                                      "pass one integer per sample (e.g. len(token_ids)); lengths must be "
                                      "one-dimensional")
        w = whole_number(v)
        if w is None:
            raise DynBatchConfigError(f"{field}[{i}]", v, "token counts must be integers",
                                      "pass whole token counts (e.g. len(token_ids)), not fractions or strings")
        items[i] = w
    if not items:
        raise DynBatchConfigError(field, [], "the global batch is empty", "pass at least dp samples")
    big = any(abs(v) > MAX_TOKENS for v in items)
    return np.asarray(items, dtype=object if big else np.int64)


def _raise_range(i: int, v: int, field: str = "lengths") -> None:
    if v < 0:
        raise DynBatchConfigError(f"{field}[{i}]", v, "token counts cannot be negative",
                                  "pass the number of tokens of each sample (>= 0)")
    raise DynBatchConfigError(f"{field}[{i}]", v, f"is larger than any sequence this planner accepts ({MAX_TOKENS})",
                              "pass token counts, not token ids or byte sizes")


def _ndim(v: Any) -> int:
    """``np.ndim`` that answers -1 for ragged nesting instead of raising."""
    try:
        return int(np.ndim(v))
    except ValueError:
        return -1


def _is_scalar(v: Any) -> bool:
    return _ndim(v) == 0 and not isinstance(v, (Mapping, str, bytes))


def _short(v: Any) -> Any:
    """A value for an error message: long sequences are summarised."""
    if isinstance(v, (list, tuple)) and len(v) > 8:
        return f"{type(v).__name__} of {len(v)} items"
    if isinstance(v, np.ndarray):
        return f"array of shape {v.shape}"
    return v


def check_budget(max_tokens_per_gpu, par: ParallelConfig, fp8_alignment, sequence_pad_multiple=None,
                 microbatch_pad_multiple=None, field: str = "max_tokens_per_gpu"):
    """``(cap, alignment, effective cap)`` for a budget and layout (padding conventions included), or a
    ``DynBatchConfigError`` naming ``field`` when the budget cannot hold one aligned sequence -- the one budget
    check (:class:`~.options.PlanOptions`, the start-up check)."""
    budget = as_int(max_tokens_per_gpu, field, minimum=1, maximum=MAX_TOKENS,
                    fix=f"pass the per-GPU token budget, e.g. {field}=16384")
    align = Alignment.for_layout(par, fp8_alignment, sequence_pad_multiple, microbatch_pad_multiple)
    cap = budget * par.cp
    cap_eff = align.effective_cap(cap)
    if cap_eff < align.seq_multiple:
        raise DynBatchConfigError(
            field, budget,
            f"the budget ({cap} tokens per micro-batch) is smaller than one aligned sequence (per-sequence "
            f"multiple {align.seq_multiple}, micro-batch multiple {align.total_multiple})",
            f"use {field} >= {align.budget_for(align.seq_multiple, par.cp)}",
        )
    return cap, align, cap_eff


def check_group_ids(group_ids: Any, n: int, field: str = "group_ids") -> list:
    """One hashable, non-``None`` id per sample -- a scalar (int, str, ...) or a tuple of them; NumPy scalars and
    0-d tensors become Python scalars, so ``np.int64(3)``, ``tensor(3)`` and ``3`` are one group (a tensor of
    ids is read by value, on any device). Anything else (``None``, NaN, lists,
    dicts, nested arrays) is a ``DynBatchConfigError`` naming the entry."""
    fix = "pass one id per sample (an int or str, e.g. the prompt index), as a list or 1-D array"
    group_ids = as_array(group_ids)  # a tensor groups by value, not by the identity of its 0-d elements
    if isinstance(group_ids, (str, bytes, Mapping, set, frozenset)) or _ndim(group_ids) == 0 \
            and not isinstance(group_ids, (list, tuple)):
        raise DynBatchConfigError(field, _short(group_ids), "must be a sequence of group ids", fix)
    if isinstance(group_ids, np.ndarray) and group_ids.ndim != 1:
        raise DynBatchConfigError(field, f"array of shape {group_ids.shape}", "must be one-dimensional", fix)
    gids = [scalar(g) for g in group_ids]
    if len(gids) != n:
        raise DynBatchConfigError(field, f"{len(gids)} ids", f"needs one id per sample ({n})",
                                  f"pass {field} with the same length as lengths")
    for i, g in enumerate(gids):
        if g is None or (isinstance(g, float) and g != g) or \
                (not isinstance(g, (str, bytes, tuple)) and not _is_scalar(g)):
            raise DynBatchConfigError(f"{field}[{i}]", _short(g), "is not a group id", fix)
        try:
            hash(g)
        except TypeError:
            raise DynBatchConfigError(f"{field}[{i}]", _short(g), "is not hashable", fix) from None
    return gids


def flops_coefficients_of(model: Optional[ModelLike]) -> Optional[FlopsCoefficients]:
    """The model's FLOPs coefficients (``linear * L + quadratic * L**2`` per sequence), ``None`` without a model."""
    if model is None:
        return None
    from ..flops import flops_coefficients
    from ..model_spec import ModelSpec

    return flops_coefficients(ModelSpec.from_any(model))


def sample_flops(coeffs: Any, aligned: np.ndarray, sq: np.ndarray) -> np.ndarray:
    """Forward FLOPs of each sample (zeros without a model)."""
    if coeffs is None:
        return np.zeros(aligned.size)
    return coeffs.linear * aligned + coeffs.quadratic * sq


def oversize_mask(lens: np.ndarray, aligned: np.ndarray, cap_eff: int, align: Alignment, par: ParallelConfig,
                  max_tokens_per_gpu: int, oversize: str, label=None, auto_fit=None) -> np.ndarray:
    """Items whose aligned slot exceeds the budget; raises (``"error"``) or warns (``"alone"``). ``label(i)``
    names item ``i`` in the message (default ``"sample i"``); ``auto_fit(slot, name) -> (problem, fix)``: for an
    automatic budget, what limits it and the ways out (``core/memory/auto_fit.py``) instead of "raise it"."""
    over = aligned > cap_eff
    if over.any():
        first = int(np.flatnonzero(over)[0])
        name = f"sample {first}" if label is None else label(first)
        padded = f" ({int(aligned[first])} padded to a multiple of {align.seq_multiple})" \
            if align.seq_multiple > 1 else ""
        rounding = f" rounded down to the micro-batch padding multiple {align.total_multiple}" \
            if align.total_multiple > 1 else ""
        where = (f"{name} has {int(lens[first])} tokens{padded} but a micro-batch may hold {cap_eff} "
                 f"(max_tokens_per_gpu={max_tokens_per_gpu} x cp={par.cp}{rounding}); {int(over.sum())} "
                 f"{'sample(s)' if label is None else 'micro-batch group(s)'} are over")
        if oversize == "error" and auto_fit is not None:
            problem, fix = auto_fit(int(aligned[over].max()), name)
            raise OversizeSampleError("max_tokens_per_gpu", "auto", f"{where}: {problem}", f"{fix}; or truncate "
                                      "the sample")
        if oversize == "error":
            need = align.budget_for(int(aligned[over].max()), par.cp)
            raise OversizeSampleError(
                "max_tokens_per_gpu", max_tokens_per_gpu, where,
                f"raise max_tokens_per_gpu to at least {need}, truncate the sample, or set oversize to 'alone' "
                f"(it then runs in a micro-batch of its own)",
            )
        warnings.warn(f"oversize='alone': {where}; each runs alone in its own micro-batch over the budget",
                      OversizeSampleWarning, stacklevel=4)  # the caller of plan_global_batch
    return over
