"""Reading per-sample values (lengths, group ids) from the files the command line takes: ``.txt`` (one per line),
``.json`` (a list, or an object with a ``lengths`` / ``group_ids`` list) or ``.npy``. Shared by ``plan`` and
``calibrate``; every problem is a ``DynBatchConfigError`` naming the flag and the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List

import numpy as np

from .core.errors import DynBatchConfigError


def read_values(path: str, flag: str, *, integers: bool) -> List[Any]:
    """Values from ``.txt`` (one per line; blank lines and ``#`` comments skipped), ``.json`` (a list, or an
    object with a ``lengths``/``group_ids`` list) or ``.npy``."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DynBatchConfigError(flag, path, "file not found", "pass an existing .txt, .json or .npy file")
    suffix = p.suffix.lower()
    try:
        if suffix == ".npy":
            values = np.load(p, allow_pickle=False).tolist()
        elif suffix == ".json":
            with open(p, encoding="utf-8") as fh:
                values = json.load(fh)
            if isinstance(values, dict):
                key = next((k for k in ("lengths", "group_ids") if k in values), None)
                if key is None:
                    raise DynBatchConfigError(flag, path, "a JSON object needs a 'lengths' or 'group_ids' list",
                                              "write a JSON list, or {\"lengths\": [...]}")
                values = values[key]
        else:
            with open(p, encoding="utf-8") as fh:
                values = [ln.split("#", 1)[0].strip() for ln in fh]
            values = [v for v in values if v]
    except (ValueError, OSError) as exc:
        if isinstance(exc, DynBatchConfigError):
            raise
        raise DynBatchConfigError(flag, path, f"cannot be read ({exc})",
                                  "use .txt (one value per line), .json (a list) or .npy") from None
    if not isinstance(values, list):
        raise DynBatchConfigError(flag, path, "does not hold a list of values", "write one value per sample")
    if integers:
        out = []
        for i, v in enumerate(values):
            try:
                f = float(v)
                if isinstance(v, bool) or f != int(f):
                    raise ValueError
                out.append(int(f))
            except (TypeError, ValueError):
                raise DynBatchConfigError(f"{flag}[{i}]", v, "is not a whole token count",
                                          "write one integer per sample") from None
        return out
    return values


__all__ = ["read_values"]
