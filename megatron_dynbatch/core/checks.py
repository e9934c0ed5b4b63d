"""The scalar checks every config object and entry point shares, so each kind of value is accepted and refused
the same way everywhere.

* integers: every exact whole number is accepted and returned as a Python ``int`` -- Python ``int``, NumPy integer
  scalars (``np.int64(8)``, ``np.uint32(3)``), whole floats in any dtype (``12.0``, ``np.float32(4096)``: what
  ``np.loadtxt`` and config files produce) and 0-d arrays or tensors holding one (a CUDA ``tensor(8192)``, read
  through ``.item()``); ``bool`` (a subclass of ``int``) and ``np.bool_`` are refused, and so are fractions,
  NaN and infinities (with the message ``must be an integer``);
* tensors: never imported here -- duck-typed by ``.detach().cpu().numpy()`` (:func:`as_array`) and ``.item()``
  (:func:`scalar`), so ``core/`` stays torch-free and takes any device and dtype;
* booleans: ``bool`` and ``np.bool_`` only -- never a string (``"no"`` is truthy) or ``0``/``1``;
* magnitudes: every integer :func:`as_int` accepts is at most :data:`MAX_TOKENS` unless the caller names a
  smaller maximum -- token counts, budgets, counts, multiples alike -- so no arithmetic downstream can overflow an
  int64 (a budget of ``2**62`` times ``cp=4`` would, and so would ``2**63`` in a NumPy array). A ceiling by
  default, not per call site: a new knob cannot forget it.
"""

from __future__ import annotations

import difflib
import math
import os
from typing import Any, List, Optional, Sequence

import numpy as np

from .errors import DynBatchConfigError

#: Largest token count (per sample, per budget) accepted: ~1.1e12, far above any sequence or GPU memory, and
#: small enough that sums over millions of samples stay exact in int64 and float64.
MAX_TOKENS = 2 ** 40


def is_int(value: Any) -> bool:
    """An integer that is not a boolean (Python or NumPy)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def scalar(value: Any) -> Any:
    """The Python scalar held by a NumPy scalar or a 0-d array / tensor (any device); anything else unchanged."""
    if isinstance(value, np.generic):
        return value.item()
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            return value.item()
        except (TypeError, ValueError, RuntimeError):
            return value
    return value


def hashable_group_id(value: Any) -> Any:
    """One sample's group id (the value under a sample dict's ``group_key``) as a hashable key: a tensor
    (duck-typed by ``.numel()``, ``.item()`` and ``.tolist()``, any device) of one element as its Python scalar,
    of several as a tuple; a NumPy scalar as its Python scalar; anything else unchanged (the group-id check then
    names what is wrong). Used where samples are read, by the data iterator and the Ray driver alike."""
    if all(callable(getattr(value, a, None)) for a in ("numel", "item", "tolist")):
        return value.item() if value.numel() == 1 else tuple(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    return value


def whole_number(value: Any) -> Optional[int]:
    """``value`` as a Python int when it is an exact whole number of any numeric type (see the module docstring),
    else ``None`` (booleans, fractions, NaN, infinities, strings, containers)."""
    value = scalar(value)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def as_array(values: Any) -> Any:
    """A tensor (duck-typed: ``.detach().cpu().numpy()``, any device; dtypes NumPy lacks, like bfloat16, through
    ``.double()``) or another object with ``__array__`` as a NumPy array; lists, tuples, arrays and everything
    else unchanged (so the caller's own checks name what is wrong)."""
    if isinstance(values, (np.ndarray, list, tuple, range, str, bytes)) or values is None:
        return values
    if all(hasattr(values, a) for a in ("detach", "cpu", "numpy")):
        t = values.detach().cpu()
        try:
            return t.numpy()
        except (TypeError, RuntimeError):
            return t.double().numpy() if hasattr(t, "double") else values
    if hasattr(values, "__array__"):
        try:
            return np.asarray(values)
        except (TypeError, ValueError):
            return values
    return values


def get_arg(args: Any, name: str, default: Any = None) -> Any:
    """``args.name`` of a Megatron-style argument namespace, ``default`` when it is missing or ``None`` (unset)."""
    value = getattr(args, name, default)
    return default if value is None else value


def is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def as_int(value: Any, field: str, *, minimum: Optional[int] = None, maximum: Optional[int] = None,
           fix: str = "") -> int:
    """``value`` as a Python int, or a ``DynBatchConfigError`` naming ``field``, the value and ``fix``.
    ``maximum`` defaults to :data:`MAX_TOKENS` (see the module docstring)."""
    if maximum is None:
        maximum = MAX_TOKENS
    out = whole_number(value)
    if out is None:
        bound = f" >= {minimum}" if minimum is not None else ""
        raise DynBatchConfigError(field, value, f"must be an integer{bound}",
                                  fix or f"pass a whole number{bound}")
    if minimum is not None and out < minimum:
        raise DynBatchConfigError(field, out, f"must be >= {minimum}", fix or f"pass a whole number >= {minimum}")
    if maximum is not None and out > maximum:
        raise DynBatchConfigError(field, out, f"is larger than the supported maximum {maximum}",
                                  fix or f"pass a value <= {maximum}")
    return out


def as_budget(value: Any, field: str, *, trainer: str, fix: str = "") -> int:
    """A trainer's own token-budget setting (verl's ``max_token_len``, ROLL's ``max_tokens_per_microbatch``, ...):
    a whole number >= 1 (:func:`as_int`). ``"auto"`` is refused with the way to get the number: only this
    package's own options (``max_tokens_per_gpu="auto"``) choose a budget themselves; a trainer's setting is read
    by the trainer too."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        raise DynBatchConfigError(field, value, f"{trainer} takes its budget as a number of tokens; only this "
                                  "package's own options (max_tokens_per_gpu='auto') choose one themselves",
                                  f"run `megatron-dynbatch budget --model NAME --gpu-memory-gb G ...` and paste its "
                                  f"line for {trainer}")
    return as_int(value, field, minimum=1, fix=fix)


def as_float(value: Any, field: str, *, minimum: Optional[float] = None, maximum: Optional[float] = None,
             fix: str = "") -> float:
    """A finite real number (Python or NumPy; ``bool`` refused) as a Python float, within ``[minimum, maximum]``,
    or a ``DynBatchConfigError`` naming ``field``, the value and ``fix``."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    out = float(value) if ok else float("nan")
    within = (minimum is None or out >= minimum) and (maximum is None or out <= maximum)
    if not ok or not np.isfinite(out) or not within:
        lo = "-inf" if minimum is None else f"{minimum:g}"
        hi = "inf" if maximum is None else f"{maximum:g}"
        raise DynBatchConfigError(field, value, f"must be a finite number in [{lo}, {hi}]",
                                  fix or f"pass a number between {lo} and {hi}")
    return out


def close_matches(key: str, known: Sequence[str], *, n: int = 3, cutoff: float = 0.6) -> List[str]:
    """The names in ``known`` close to ``key``, best first: at most ``n``, each at least ``cutoff`` similar and
    about as close as the best one (within 0.1) -- the one "did you mean" rule of every error that names an
    unknown key, choice, flag or preset."""
    scored = sorted(((difflib.SequenceMatcher(None, str(key), str(k)).ratio(),
                      len(os.path.commonprefix([str(key), str(k)])), str(k)) for k in known),
                    reverse=True)  # ties: the longer shared start (--seedz: --seeds before --speed)
    if not scored or scored[0][0] < cutoff:
        return []
    return [k for r, _, k in scored[:n] if r >= cutoff and r >= scored[0][0] - 0.1]


def did_you_mean(key: Any, known: Sequence[str], *, n: int = 3, cutoff: float = 0.6) -> str:
    """``"did you mean 'a' or 'b'?"`` for the :func:`close_matches` of ``key``, or ``""`` when none is close."""
    close = close_matches(str(key), known, n=n, cutoff=cutoff)
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def read_json(path: Any, *, field: str, fix: str) -> Any:
    """The JSON value in the file ``path``, or a ``DynBatchConfigError`` naming ``field`` and the file when it
    cannot be read as JSON (missing, unreadable, not JSON) -- the one reader of the files users pass."""
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        raise DynBatchConfigError(field, str(path), f"cannot be read as JSON ({exc})", fix) from None


def as_bool(value: Any, field: str) -> bool:
    if not is_bool(value):
        raise DynBatchConfigError(field, value, "must be True or False", f"pass {field}=True or {field}=False")
    return bool(value)
