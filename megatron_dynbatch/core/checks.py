"""The scalar checks every config object and entry point shares, so each kind of value is accepted and refused
the same way everywhere.

* integers: Python ``int`` and every NumPy integer scalar (``np.int64(8)``, ``np.uint32(3)``) are accepted and
  returned as a Python ``int``; ``bool`` (a subclass of ``int``) and ``np.bool_`` are refused, and so are floats,
  even integral ones (a float token count or rank count is almost always a bug upstream);
* booleans: ``bool`` and ``np.bool_`` only -- never a string (``"no"`` is truthy) or ``0``/``1``;
* magnitudes: every integer :func:`as_int` accepts is at most :data:`MAX_TOKENS` unless the caller names a
  smaller maximum -- token counts, budgets, counts, multiples alike -- so no arithmetic downstream can overflow an
  int64 (a budget of ``2**62`` times ``cp=4`` would, and so would ``2**63`` in a NumPy array). A ceiling by
  default, not per call site: a new knob cannot forget it.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .errors import DynBatchConfigError

#: Largest token count (per sample, per budget) accepted: ~1.1e12, far above any sequence or GPU memory, and
#: small enough that sums over millions of samples stay exact in int64 and float64.
MAX_TOKENS = 2 ** 40


def is_int(value: Any) -> bool:
    """An integer that is not a boolean (Python or NumPy)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


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
    if not is_int(value):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise DynBatchConfigError(field, value, f"must be an integer{bound}",
                                  fix or f"pass a whole number{bound}")
    out = int(value)
    if minimum is not None and out < minimum:
        raise DynBatchConfigError(field, out, f"must be >= {minimum}", fix or f"pass a whole number >= {minimum}")
    if maximum is not None and out > maximum:
        raise DynBatchConfigError(field, out, f"is larger than the supported maximum {maximum}",
                                  fix or f"pass a value <= {maximum}")
    return out


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


def as_bool(value: Any, field: str) -> bool:
    if not is_bool(value):
        raise DynBatchConfigError(field, value, "must be True or False", f"pass {field}=True or {field}=False")
    return bool(value)
