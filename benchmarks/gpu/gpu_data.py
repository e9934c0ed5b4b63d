"""The H100 measurements of 2026-11-25 (``results/``, copied unchanged from ``../shared/gpu``; method in the shared
``README.md``): loaders for the fit (``fit_profile.py``) and the modelled-vs-measured comparison (``compare.py``).

* ``*_cp_microbatches.json`` / ``*_pp_microbatches.json``: one CP member's share of every micro-batch of the
  measured plans (project commit e7fb6ba), timed on 2-layer slices at per-TP-rank widths; :func:`slices` gives,
  per measured batch, a ``ModelSpec`` of the full model (widths x ``tp``), ``tp`` and the records
  ``[group_size, lengths, seconds]``;
* ``*_dp_microbatches.json``: whole micro-batches of DP-only slices WITH the LM head (vocabulary scaled to the
  slice): :func:`dp_slices` gives ``(label, spec, layers, tokens, sum of squares, seconds)``;
* ``*_steps.json`` + the pp=4 table of the shared README (:data:`PP_MEASURED`): measured step ratios.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_dynbatch.core.model_spec import ModelSpec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STAMP = "h100_2026-11-25"
#: layers of every measured slice (the files' "layers")
SLICE_LAYERS = 2
#: dynbatch-dyncp vs fixed CP under pp=4, measured (each micro-batch's measured compute composed by the
#: project's pool simulation; shared/gpu/README.md section 1, second table) -- not in the steps file
PP_MEASURED = {"dyncp-longcot-64k-32b-pp4/s0": 1.116, "dyncp-longcot-64k-32b-pp4/s1": 1.061,
               "dyncp-longctx-70b-cp4-pp4/s0": 0.964, "dyncp-longctx-70b-cp4-pp4/s1": 1.963}
#: the DP slices' model widths (tp = 1; the file names them)
_DP_MODELS = {"qwen3-4b x4 layers": ("qwen3-4b", 4), "qwen3-8b x2 layers": ("qwen3-8b", 2)}


def load(kind: str) -> Dict[str, Any]:
    """``results/h100_2026-11-25_<kind>.json`` (``cp_microbatches``, ``pp_microbatches``, ``dp_microbatches``,
    ``steps``)."""
    with open(RESULTS / f"{STAMP}_{kind}.json", encoding="utf-8") as fh:
        return json.load(fh)


def spec_from_widths(w: Dict[str, int], tp: int, label: str) -> ModelSpec:
    """The full model of a slice: per-TP-rank widths times ``tp`` (hidden size is not split by TP)."""
    return ModelSpec.from_dict({
        "name": label, "num_layers": w["layers_real"], "hidden_size": w["hidden_size"],
        "num_attention_heads": w["heads"] * tp, "num_query_groups": w["groups"] * tp, "kv_channels": w["kv"],
        "ffn_hidden_size": w["ffn"] * tp, "vocab_size": w["vocab"] * tp, "swiglu": True})


def slices() -> Iterator[Tuple[str, ModelSpec, int, List[list]]]:
    """``(workload/seed, full-model spec, tp, records)`` for every measured batch (CP and pp=4 files)."""
    for kind in ("cp_microbatches", "pp_microbatches"):
        for key, w in load(kind)["workloads"].items():
            recs = [[it["group_size"], it["lengths"], it["seconds"]] if isinstance(it, dict) else list(it[:3])
                    for it in w["items"]]
            yield key, spec_from_widths(w["widths_per_tp_rank"], int(w["tp"]), key), int(w["tp"]), recs


def dp_slices() -> Iterator[Tuple[str, ModelSpec, int, np.ndarray, np.ndarray, np.ndarray]]:
    """``(workload, slice spec, layers, tokens, sum of squared lengths, seconds)`` of the DP measurements: the
    preset's widths with the slice's (scaled) vocabulary; the LM head ran."""
    vocab = {"qwen3-4b x4 layers": 16896, "qwen3-8b x2 layers": 8448}
    for key, w in load("dp_microbatches")["workloads"].items():
        preset, layers = _DP_MODELS[w["model"]]
        base = ModelSpec.from_yaml(preset).to_dict()
        base.update(vocab_size=vocab[w["model"]], padded_vocab_size=None, name=f"{preset} slice")
        mb = np.asarray(w["microbatches"], dtype=np.float64)
        yield key, ModelSpec.from_dict(base), layers, mb[:, 0], mb[:, 1], mb[:, 3]


def measured_ratios() -> Dict[str, List[float]]:
    """Measured dynbatch-dyncp / fixed-CP step ratios per ``workload/seed``: every run of the steps file, and the
    pp=4 compositions of :data:`PP_MEASURED`."""
    out: Dict[str, List[float]] = {}
    for key, w in load("steps")["workloads"].items():
        if w.get("kind") != "dynamic-cp":
            continue
        for run in w["runs"]:
            if "dynbatch-dyncp" in run:
                out.setdefault(key, []).append(float(run["dynbatch-dyncp"]["vs_fixed_cp"]))
    for key, v in PP_MEASURED.items():
        out.setdefault(key, []).append(v)
    return out


def measured_lookup() -> Dict[Tuple[str, int, Tuple[int, ...]], float]:
    """``(workload/seed, group size, sorted lengths) -> seconds`` of every measured share (min of duplicates)."""
    out: Dict[Tuple[str, int, Tuple[int, ...]], float] = {}
    for key, _, _, recs in slices():
        for g, lengths, s in recs:
            k = (key, int(g), tuple(sorted(int(x) for x in lengths)))
            out[k] = min(out.get(k, float("inf")), float(s))
    return out
