#!/usr/bin/env python
"""MODELLED vs MEASURED: this package's memory model, and Megatron-LM's own estimator, against the peaks Megatron-LM's
CI measured on DGX H100 for its functional test cases.

The measured numbers and the launch flags are in ``tests/data/megatron_ci_memory.json`` (copied from Megatron-LM's
``tests/functional_tests/test_cases/<family>/<case>/golden_values_dev_dgx_h100.json`` -- ``mem-allocated-bytes``
and ``mem-max-allocated-bytes``, written by the last rank, i.e. the last pipeline stage -- and the case's
``model_config.yaml``; commits in the file). For each case:

* the flags become a model, a layout and memory settings with the package's own readers
  (:func:`~megatron_dynbatch.core.memory.megatron_flags.model_from_megatron`, ``parallel_from_megatron``,
  ``settings_from_megatron``); the micro-batch is ``--micro-batch-size x --seq-length / cp`` tokens;
* **static** = predicted weights + gradients + optimizer state of the last stage against ``mem-allocated-bytes``
  (logged after the optimizer step, when no activation is alive); **dynamic** = predicted peak minus static
  against ``mem-max-allocated-bytes - mem-allocated-bytes`` at the run's highest logged peak;
* where the repository does not record the number of GPUs (release cases), the data-parallel size is the power of
  two whose static prediction is nearest the measured one -- that case's static check is then not independent;
* **Megatron-LM's estimator** (``megatron/training/theoretical_memory_usage.py``, ``report_theoretical_memory``)
  is re-derived here from its formulas, not imported: weights + optimizer of its "most loaded shard" (the first
  stage: embedding and ``1/pp`` of the layers) at ``18`` bytes per parameter, or ``6 + 12/dp`` with the
  distributed optimizer (the expert-data-parallel size for routed experts); activations with Korthikanti's
  ``sbh (18 + 4 ffn/h) / tp`` per layer (sequence parallel and selective recompute) or ``sbh (10 + 24/tp)``
  (otherwise, times 1.05), all ``L`` layers (its first-stage count), the interleaving factor, and the logits only
  when ``pp == 1``. It has no term for full recompute, MoE experts' activations, or the last stage's logits under
  PP, which is why it is far off on some cases.

``--json`` prints the rows as JSON. Exit status 0; the test ``tests/test_megatron_ci_memory.py`` holds the
tolerances::

    python benchmarks/megatron_ci_memory.py
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dynbatch.core.memory import peak_memory  # noqa: E402
from megatron_dynbatch.core.memory.megatron_flags import (  # noqa: E402
    namespace_from_argv,
    model_from_megatron,
    parallel_from_megatron,
    settings_from_megatron,
)
from megatron_dynbatch.core.model_spec import ModelSpec  # noqa: E402
from megatron_dynbatch.core.parallel import ParallelConfig  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "megatron_ci_memory.json"
#: the one routing imbalance (busiest expert's tokens over the mean) tried on every MoE case (settings.moe_imbalance)
MOE_IMBALANCE = 1.1
#: world sizes tried where the repository does not record one (release cases)
WORLD_SIZES = tuple(2 ** i for i in range(3, 11))


def load(path: Path = DATA) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def case_inputs(case: Dict[str, Any], world_size: int) -> Dict[str, Any]:
    """Model, layout, settings and tokens per micro-batch per GPU of a case's flags on ``world_size`` GPUs."""
    argv = case["argv"]
    ns = namespace_from_argv(argv)
    model = model_from_megatron(argv, vocab_size=case["vocab_size"], name=case["case"])
    parallel = parallel_from_megatron(argv, world_size)
    # the case's flag list is complete: no --untie-embeddings-and-output-weights means tied
    settings = settings_from_megatron(argv, untie_embeddings="--untie-embeddings-and-output-weights" in argv)
    tokens = int(ns.micro_batch_size) * int(ns.seq_length) // parallel.cp
    return {"model": model, "parallel": parallel, "settings": settings, "tokens": tokens, "ns": ns}


def megatron_estimate(m: ModelSpec, p: ParallelConfig, ns: Any, world_size: int, etp: int,
                      num_microbatches: int) -> Dict[str, float]:
    """Megatron-LM's ``report_theoretical_memory`` for the case, re-derived (module docstring): bytes of weights +
    optimizer and of activations on its most loaded (first) stage."""
    h, L, nq = m.hidden_size, m.num_layers, m.num_attention_heads
    d, ng = int(m.kv_channels or 0), int(m.num_query_groups or nq)
    glu = 1.5 if m.swiglu else 1.0
    norm = 1 if getattr(ns, "normalization", "LayerNorm") == "RMSNorm" else 2
    attn = 2 * h * h * (1 + ng / nq) * (nq * d / h)
    dense_mlp = 2 * h * m.ffn_hidden_size * glu
    moe = sum(m.moe_layer_pattern())
    routed = 2 * h * int(m.moe_ffn_hidden_size or 0) * int(m.num_experts or 0) * glu
    router = h * int(m.num_experts or 0) if m.num_experts else 0
    emb = h * m.padded_vocab_size  # Megatron's args.padded_vocab_size: already padded for this tp
    tp_sharded = (attn + dense_mlp) * (L - moe) + attn * moe
    replicated = 2 * h * norm * L + router * moe + norm * h
    shard = (tp_sharded / p.pp + emb) / p.tp + replicated / p.pp
    expert = routed * moe / p.pp / (etp * p.ep)
    if getattr(ns, "untie_embeddings_and_output_weights", False) and p.pp == 1:
        shard += emb / p.tp
    dist = bool(getattr(ns, "use_distributed_optimizer", False))
    edp = world_size // (etp * p.ep * p.pp)

    def per_param(dp: int) -> float:
        return 6 + 12 / dp if dist else 18.0

    static = shard * per_param(p.dp * p.cp) + expert * per_param(edp)
    s, b = int(ns.seq_length), int(ns.micro_batch_size)
    sp_selective = p.sequence_parallel and getattr(ns, "recompute_granularity", None) == "selective"
    if sp_selective:
        act = s * b * h * (18 + 4 * m.ffn_hidden_size / h) * L + 8 * s * b * p.pp + s * b * h * p.pp
    else:
        act = s * b * h * (10 + 24 / p.tp) * L + 8 * s * b * p.pp + s * b * h * p.pp
    if p.vpp > 1:
        act *= 1 + (p.pp - 1) / (p.pp * p.vpp)
    elif p.pp > 1:
        act *= min(1.0, num_microbatches / p.pp)
    if p.pp == 1:
        if sp_selective:
            act += s * b * h * 4 * (1 + m.padded_vocab_size / h)
        else:
            act += (s * b * m.padded_vocab_size / p.tp + s * b * h) * 2
    act = act / p.tp if sp_selective else act * 1.05
    return {"static": static, "activations": act}


def evaluate(case: Dict[str, Any]) -> Dict[str, Any]:
    """One row: predicted and measured static and dynamic bytes of the last stage, their ratios, and Megatron-LM's
    estimator's."""
    measured_static = float(case["mem_allocated_bytes"])
    measured_dynamic = float(case["mem_max_allocated_bytes"]) - measured_static
    worlds = [case["world_size"]] if case.get("world_size") else list(WORLD_SIZES)
    best: Optional[Dict[str, Any]] = None
    for w in worlds:
        try:
            inp = case_inputs(case, w)
            b = peak_memory(inp["model"], inp["parallel"], inp["tokens"], settings=inp["settings"])
        except ValueError:
            continue  # a world size the layout cannot have
        last = b.stages[-1]
        err = abs(last.static_bytes / measured_static - 1.0)
        if best is None or err < best["err"]:
            best = {"err": err, "world": w, "inp": inp, "last": last}
    assert best is not None, case["case"]
    inp, last, w = best["inp"], best["last"], best["world"]
    m, p, st, ns = inp["model"], inp["parallel"], inp["settings"], inp["ns"]
    static, dynamic = last.static_bytes, last.allocated_bytes - last.static_bytes
    gbs = int(getattr(ns, "global_batch_size", 0) or 0)
    micro = max(1, gbs // (int(ns.micro_batch_size) * p.dp)) if gbs else p.pp
    meg = megatron_estimate(m, p, ns, w, st.expert_tensor_parallel_size or p.tp, micro)
    no_dropout = peak_memory(m.replace(hidden_dropout=0.0), p, inp["tokens"], settings=st).stages[-1]
    share = (st.expert_tensor_parallel_size or p.tp) / p.tp  # the routed copies one GPU holds (analytic.py)
    imb = peak_memory(m, p, inp["tokens"], settings=st.replace(moe_imbalance=MOE_IMBALANCE)).stages[-1]
    dynamic_imb = imb.allocated_bytes - imb.static_bytes
    bal = peak_memory(m, p, inp["tokens"], settings=st.replace(moe_imbalance=1.0)).stages[-1]  # perfectly balanced
    dynamic_bal = bal.allocated_bytes - bal.static_bytes
    return {
        "case": case["case"], "what": case["what"], "world_size": w, "world_size_inferred": not case.get("world_size"),
        "layout": f"tp{p.tp} pp{p.pp}" + (f" vpp{p.vpp}" if p.vpp > 1 else "") + (f" ep{p.ep}" if p.ep > 1 else "")
                  + (f" etp{st.expert_tensor_parallel_size}" if st.expert_tensor_parallel_size else "")
                  + (" sp" if p.sequence_parallel else "") + f" dp{p.dp}",
        "tokens": inp["tokens"], "measured_static": measured_static, "measured_dynamic": measured_dynamic,
        "static": static, "dynamic": dynamic, "static_ratio": static / measured_static,
        "dynamic_ratio": dynamic / measured_dynamic, "measured_dynamic_median": float(case["dynamic_median_bytes"]),
        "dynamic_median_ratio": dynamic / float(case["dynamic_median_bytes"]),
        "megatron_static": meg["static"], "megatron_activations": meg["activations"],
        "megatron_static_ratio": meg["static"] / measured_static,
        "megatron_dynamic_ratio": meg["activations"] / measured_dynamic,
        "dropout_bytes": last.dropout_bytes, "routed_bytes": last.routed_bytes,
        # what the ratio would be without the dropout masks / with every routed copy counted on every TP rank
        "ratio_without_dropout": (no_dropout.allocated_bytes - no_dropout.static_bytes) / measured_dynamic,
        "ratio_routed_on_every_tp_rank": (dynamic + last.routed_bytes * (1 / share - 1)) / measured_dynamic,
        "ratio_routed_on_every_tp_rank_balanced": (dynamic_bal + bal.routed_bytes * (1 / share - 1))
        / measured_dynamic,
        # MoE: the routing imbalance on the measured GPU's experts that would close the gap (peak / median; routed_bytes
        # is at the settings' moe_imbalance), and the ratios with --moe-imbalance MOE_IMBALANCE
        "imbalance_needed": st.moe_imbalance * (1 + (measured_dynamic - dynamic) / last.routed_bytes)
        if last.routed_bytes else None,
        "imbalance_needed_median": st.moe_imbalance * (1 + (float(case["dynamic_median_bytes"]) - dynamic)
                                                       / last.routed_bytes) if last.routed_bytes else None,
        "dynamic_ratio_imbalanced": dynamic_imb / measured_dynamic,
        "dynamic_median_ratio_imbalanced": dynamic_imb / float(case["dynamic_median_bytes"]),
        # and with perfectly balanced routing (moe_imbalance 1.0, the default before 1.1)
        "dynamic_ratio_balanced": dynamic_bal / measured_dynamic,
        "dynamic_median_ratio_balanced": dynamic_bal / float(case["dynamic_median_bytes"]),
    }


def rows(path: Path = DATA) -> List[Dict[str, Any]]:
    return [evaluate(c) for c in load(path)["cases"]]


def table(rs: List[Dict[str, Any]]) -> str:
    """The Markdown table docs/tuning.md shows (GB = 1e9 bytes, as the golden values count)."""
    g = 1e9
    out = ["| case | layout | tokens | static GB measured / ours / Megatron's | dynamic GB measured / ours / "
           "Megatron's | ours / measured: static, dynamic (median) | Megatron's / measured: static, dynamic |",
           "|---|---|---|---|---|---|---|"]
    for r in rs:
        world = " (dp inferred)" if r["world_size_inferred"] else ""
        out.append(f"| `{r['case']}` | {r['layout']}{world} | {r['tokens']} | {r['measured_static'] / g:.2f} / "
                   f"{r['static'] / g:.2f} / {r['megatron_static'] / g:.2f} | {r['measured_dynamic'] / g:.2f} / "
                   f"{r['dynamic'] / g:.2f} / {r['megatron_activations'] / g:.2f} | {r['static_ratio']:.3f}, "
                   f"{r['dynamic_ratio']:.3f} ({r['dynamic_median_ratio']:.3f}) | {r['megatron_static_ratio']:.3f}, "
                   f"{r['megatron_dynamic_ratio']:.3f} |")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    rs = rows()
    if args.json:
        print(json.dumps(rs, indent=1))
    else:
        print(table(rs))
        worst = max(rs, key=lambda r: abs(math.log(r["dynamic_ratio"])))
        print(f"\nworst dynamic ratio (ours / measured): {worst['dynamic_ratio']:.3f} ({worst['case']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
