#!/usr/bin/env python
"""Derive the document-length distribution the benchmark ships (``megatron_dynbatch/bench/data/``) from the real file.

The long-document workloads of ``megatron-dynbatch bench`` draw document lengths from a real long-context
pretraining distribution: 99,519 document lengths (tokens) published with the DistCA simulator
(hao-ai-lab/DistCA, ``distca/simulator/data/dist_wlbllm.json``; this project keeps a copy as
``shared/data/document_lengths_wlbllm.json``, which a clone of the repository does not have). The package ships
a derived form instead, so that every workload reproduces from a clone:

* **what**: 8,192 quantiles of the real lengths, ``q[i] = round(Q((i + 0.5) / 8192))`` for ``i = 0..8191``, where
  ``Q`` is NumPy's default (``"linear"``) quantile of the sorted real lengths -- the midpoints of 8,192 slices of
  equal probability, so that drawing uniformly from the 8,192 values is drawing from the real distribution
  discretised to 1/8,192 of probability (about 12 documents per value);
* **why quantiles**: the benchmark only ever samples lengths with replacement (``pool[rng.integers(...)]``),
  so the distribution is what matters, not the documents' order; equally likely values keep that sampler
  unchanged (no weights), and 8,192 of them keep the tail that dominates attention cost -- 194 values above 8k
  tokens -- within a fraction of a percent of the real statistics (this script prints them; they are stored in
  the file and checked by ``tests/test_bench.py``) at 1/12 of the real file's size;
* **what it cannot keep**: the very longest documents -- the top value is 124,502 tokens, the 7th longest
  document (the longest has 124,913) -- and a batch drawn from it is a different batch than one drawn from the
  real file with the same seed (``Workload.generate(seed, documents=load_document_lengths(REAL_FILE))`` draws
  from the real file).

Run it from the repository root (it only reads the given file and writes the package's data file)::

    python benchmarks/derive_document_lengths.py ../shared/data/document_lengths_wlbllm.json
    python benchmarks/derive_document_lengths.py ../shared/data/document_lengths_wlbllm.json --check  # exit 1 if stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dynbatch.bench.documents import (  # noqa: E402
    BUNDLED_DOCUMENTS, BUNDLED_QUANTILES, document_statistics, load_document_lengths)

SOURCE = ("hao-ai-lab/DistCA, distca/simulator/data/dist_wlbllm.json: document lengths (tokens) of a public "
          "long-context pretraining length distribution, published with the DistCA simulator")


def derive(real: np.ndarray, quantiles: int = BUNDLED_QUANTILES) -> np.ndarray:
    """The module docstring's ``q[i] = round(Q((i + 0.5) / quantiles))``, ascending, as int64."""
    probs = (np.arange(quantiles) + 0.5) / quantiles
    return np.round(np.quantile(np.sort(real), probs)).astype(np.int64)


def bundle(real: np.ndarray, real_name: str) -> Dict[str, object]:
    """The JSON object written to the package (``load_document_lengths`` reads its ``lengths``)."""
    q = derive(real)
    return {
        "what": f"{q.size} quantiles of {real.size} real document lengths (tokens): q[i] = round(Q((i + 0.5) / "
                f"{q.size})), NumPy's linear quantile of the sorted lengths; draw uniformly from 'lengths'",
        "source": SOURCE,
        "source_file": real_name,
        "derived_by": "benchmarks/derive_document_lengths.py",
        "documents": int(real.size),
        "statistics": {"real": document_statistics(real), "bundled": document_statistics(q)},
        "lengths": q.tolist(),
    }


def _table(stats: Dict[str, Dict[str, float]]) -> str:
    real, ours = stats["real"], stats["bundled"]
    rows = [f"{'statistic':<34} {'real':>12} {'bundled':>12} {'difference':>11}"]
    for key, value in real.items():
        d = ours[key] / value - 1 if value else 0.0
        spec = ",.1f" if value >= 10 else ".5f"
        rows.append(f"{key:<34} {value:>12{spec}} {ours[key]:>12{spec}} {100 * d:>+10.2f}%")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("real", help="the real lengths: a JSON list (shared/data/document_lengths_wlbllm.json)")
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 when the package's file differs from what the real file gives")
    args = ap.parse_args()
    real = load_document_lengths(args.real)
    data = bundle(real, Path(args.real).name)
    text = json.dumps(data, indent=1)
    # one line for the 8,192 lengths keeps the file short and the metadata readable
    text = text[:text.index('"lengths": [')] + '"lengths": ' + json.dumps(data["lengths"]) + "\n}\n"
    print(_table(data["statistics"]))  # type: ignore[arg-type]
    if args.check:
        same = BUNDLED_DOCUMENTS.is_file() and BUNDLED_DOCUMENTS.read_text(encoding="utf-8") == text
        print(f"{BUNDLED_DOCUMENTS}: {'up to date' if same else 'STALE: rerun without --check'}")
        return 0 if same else 1
    BUNDLED_DOCUMENTS.parent.mkdir(parents=True, exist_ok=True)
    BUNDLED_DOCUMENTS.write_text(text, encoding="utf-8")
    print(f"wrote {BUNDLED_DOCUMENTS} ({len(text):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
