"""The real document-length distribution the long-document workloads draw from, shipped in the package.

Source: 99,519 document lengths (tokens) of a public long-context pretraining length distribution, published
with the DistCA simulator (hao-ai-lab/DistCA, ``distca/simulator/data/dist_wlbllm.json``; this project keeps a
copy as ``shared/data/document_lengths_wlbllm.json``, which a clone does not have). The package ships 8,192
quantiles of it (:data:`BUNDLED_DOCUMENTS`), derived by ``benchmarks/derive_document_lengths.py`` -- whose
docstring says how, why quantiles, and what they lose -- with the real and the bundled statistics stored next to
them (mean, median, p99, max, share over 8k tokens and their share of the sum of squares; within 0.7% of each
other, ``tests/test_bench.py`` checks them). The benchmark reads nothing outside the package.

:func:`load_document_lengths` reads the real file (or any JSON list of lengths) for
``Workload.generate(seed, documents=...)``, which then draws from it instead.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Dict, Sequence, Union

import numpy as np

from ..core.errors import DynBatchConfigError

#: The real file's name (``shared/data/`` in this project; hao-ai-lab/DistCA
#: ``distca/simulator/data/dist_wlbllm.json``).
DOCUMENT_LENGTHS_FILE = "document_lengths_wlbllm.json"
#: How many quantiles of the real lengths the package ships.
BUNDLED_QUANTILES = 8192
#: The package's derived distribution: a JSON object whose ``lengths`` are :data:`BUNDLED_QUANTILES` quantiles of
#: the real file (``q[i] = round(Q((i + 0.5) / 8192))``, ascending), with its provenance and statistics next to
#: them. Written by ``benchmarks/derive_document_lengths.py`` (its docstring says why quantiles and what they
#: lose); installed with the package (``[tool.setuptools.package-data]``), so the benchmark reads nothing outside it.
BUNDLED_DOCUMENTS = Path(__file__).resolve().parent / "data" / "document_lengths_wlbllm_q8192.json"


def load_document_lengths(path: Union[str, os.PathLike]) -> np.ndarray:
    """Document lengths (tokens) from a JSON file: a list of whole numbers >= 1 (the format of the real
    ``document_lengths_wlbllm.json``), or an object whose ``lengths`` is such a list (the bundled file)."""
    p = Path(path).expanduser()
    try:
        with open(p, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise DynBatchConfigError("documents", str(path), f"cannot be read as JSON ({exc})",
                                  "pass a JSON list of document lengths, e.g. shared/data/document_lengths_wlbllm.json"
                                  ) from None
    if isinstance(data, dict):
        data = data.get("lengths")
    return _as_documents(data, str(path))


@functools.lru_cache(maxsize=1)
def bundled_document_lengths() -> np.ndarray:
    """The distribution shipped in the package (:data:`BUNDLED_DOCUMENTS`), read once; read-only."""
    data = load_document_lengths(BUNDLED_DOCUMENTS)
    data.setflags(write=False)
    return data


def document_pool(documents: Any) -> np.ndarray:
    """The pool a generator draws from: ``documents`` checked, or the bundled distribution when ``None``."""
    return bundled_document_lengths() if documents is None else _as_documents(documents, "documents")


def _as_documents(documents: Any, where: str) -> np.ndarray:
    """``documents`` as a 1-D int64 array of lengths >= 1, else a :class:`DynBatchConfigError` naming ``where``."""
    fix = "pass a 1-D list/array of token counts (whole numbers >= 1), e.g. load_document_lengths(path)"
    try:
        arr = np.asarray(documents)
    except (TypeError, ValueError):
        arr = np.asarray(None)
    bools = isinstance(documents, (list, tuple)) and any(isinstance(v, (bool, np.bool_)) for v in documents)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iuf" or bools:
        shown = documents if arr.ndim != 1 or arr.size <= 6 else f"<{arr.size} values of {arr.dtype}>"
        raise DynBatchConfigError(where, shown, "is not a non-empty list of document lengths", fix)
    bad = ~np.isfinite(arr) | (arr != np.round(arr)) | (arr < 1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DynBatchConfigError(f"{where}[{i}]", arr[i].item(), "is not a document length (a whole number >= 1)",
                                  fix)
    return arr.astype(np.int64) if arr.dtype != np.int64 else arr


def pool_source(pool: np.ndarray) -> str:
    """What a batch's documents were drawn from (``Batch.source``)."""
    if pool is bundled_document_lengths():
        return f"bundled document lengths ({pool.size:,} quantiles of 99,519 real documents)"
    return f"given document lengths ({pool.size:,})"


def document_statistics(lengths: Sequence[int]) -> Dict[str, float]:
    """Mean, median, p99 (NumPy's linear percentile), max, share of documents over 8k tokens and their share of
    the sum of squared lengths (attention cost): how the bundled distribution is compared with the real one."""
    x = np.asarray(lengths, dtype=np.float64)
    sq = x * x
    return {"mean": round(float(x.mean()), 1), "median": round(float(np.median(x)), 1),
            "p99": round(float(np.percentile(x, 99)), 1), "max": float(x.max()),
            "share over 8k tokens": round(float((x > 8192).mean()), 5),
            "share of sum of squares over 8k": round(float(sq[x > 8192].sum() / sq.sum()), 5)}


__all__ = ["BUNDLED_DOCUMENTS", "BUNDLED_QUANTILES", "DOCUMENT_LENGTHS_FILE", "bundled_document_lengths",
           "document_pool", "document_statistics", "load_document_lengths", "pool_source"]
