#!/usr/bin/env python
"""MODELLED vs MEASURED: the dynamic-CP / fixed-CP step-time ratio of every measured batch (H100, 2026-11-25).

For each batch of the shared GPU data (``results/``, method in the shared ``README.md``) this

1. takes the batch exactly as it was measured: its lengths are bundled in ``results/h100_2026-11-25_batches.json``
   (drawn by ``bench/workloads.py`` from the REAL document file, so a clone needs nothing else);
   ``--documents PATH`` draws them again from that file (``../shared/data/document_lengths_wlbllm.json``) and
   stops, naming the batch, where they differ from the bundle;
2. rebuilds the two measured plans -- the fixed-CP plan and the dynamic-CP plan of project commit e7fb6ba, i.e.
   the planner with ``cost_model="analytic", decision_margin=0`` and without the portfolio it gained later
   (``portfolio.disabled()``) -- and checks them against the timing records (every micro-batch share of both
   plans must be there; batches without records are marked);
3. composes the measured micro-batch times with the pool simulator (as the measurement did) where records exist;
4. scores both measured plans with the ``analytic`` model (what the bench reported then) and the ``fitted``
   default, with and without the CP communication term (the timings were compute only, so ``compute`` is the
   like-for-like column; ``+comm`` adds the ring transfers at the default topology: 8 GPUs per node);
5. plans the batch again with the fitted default (its decision margin included) and reports what it picks.

    python benchmarks/gpu/compare.py [--documents PATH] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_data import measured_lookup, measured_ratios  # noqa: E402

from megatron_dynbatch.bench.workloads import WORKLOADS, load_document_lengths  # noqa: E402
from megatron_dynbatch.core.cost_model import CostModel  # noqa: E402
from megatron_dynbatch.core.planner import build_dynamic_cp_plan, plan_global_batch, portfolio  # noqa: E402
from megatron_dynbatch.core.planner.dyncp.pool_sim import simulate_pool  # noqa: E402

#: the lengths of every measured batch (step 1 of the module docstring)
BATCHES = Path(__file__).resolve().parent / "results" / "h100_2026-11-25_batches.json"


def fixed_slots(plan: Any) -> List[list]:
    """A fixed-layout plan's micro-batches as pool slots (each DP rank's ``cp`` GPUs one group)."""
    cp = plan.parallel.cp
    return [[(r * cp, cp, list(plan.micro_batches[r][j])) for r in range(plan.parallel.dp)]
            for j in range(plan.num_microbatches)]


def dyn_slots(plan: Any) -> List[list]:
    return [plan.slot_groups(j) for j in range(plan.num_microbatches)]


def composed(slots: List[list], lengths: np.ndarray, key: str, table: Dict, cm: CostModel) -> Optional[float]:
    """The measured step of ``slots``: every group's measured seconds composed by the pool simulation (``None``
    when a share was not measured)."""
    pool = max(s + g for slot in slots for s, g, _ in slot)
    times = np.zeros((len(slots), pool))
    for j, slot in enumerate(slots):
        for start, size, samples in slot:
            t = table.get((key, size, tuple(sorted(int(x) for x in lengths[samples]))))
            if t is None:
                return None
            times[j, start:start + size] = t
    return float(simulate_pool(times, [np.array(sorted(s for s, _, _ in slot)) for slot in slots], cm).max())


def scored(slots: List[list], lengths: np.ndarray, w: Any, cm: CostModel, per_step: List[int]) -> float:
    return float(build_dynamic_cp_plan(lengths, slots, parallel=w.parallel, max_tokens_per_gpu=w.max_tokens_per_gpu,
                                       model=w.model, cost_model=cm,
                                       microbatches_per_step=per_step).predicted_step_time)


def measured_batches(documents: Optional[str]) -> Dict[str, np.ndarray]:
    """``workload/seed -> lengths`` of every measured batch: the bundle, checked against a fresh draw from the real
    document file when one is given (module docstring)."""
    if not BATCHES.is_file():
        raise SystemExit(f"compare.py: {BATCHES} is missing -- it holds the lengths of the measured batches; "
                         "restore it from the repository (git checkout -- benchmarks/gpu/results)")
    bundle = {k: np.asarray(v, dtype=np.int64) for k, v in json.loads(BATCHES.read_text())["batches"].items()}
    if documents is not None:
        if not Path(documents).is_file():
            raise SystemExit(f"compare.py: --documents {documents}: no such file (the real document-length file, "
                             "../shared/data/document_lengths_wlbllm.json); or drop --documents to use the bundle")
        docs = load_document_lengths(documents)
        for key, lengths in bundle.items():
            name, seed = key.split("/s")
            drawn = WORKLOADS[name].generate(int(seed), documents=docs).lengths
            if not np.array_equal(np.asarray(drawn), lengths):
                raise SystemExit(f"compare.py: batch {key} drawn from {documents} differs from {BATCHES.name}: "
                                 "the workload or the file changed since the measurement")
    return bundle


def evaluate(key: str, measured: List[float], lengths: np.ndarray, table: Dict) -> Dict[str, Any]:
    name, _ = key.split("/s")
    w = WORKLOADS[name]
    kw = dict(model=w.model, parallel=w.parallel, max_tokens_per_gpu=w.max_tokens_per_gpu)
    with portfolio.disabled():  # commit e7fb6ba planned with the count search alone (no portfolio: issue 33)
        old_fixed = plan_global_batch(lengths, cost_model="analytic", decision_margin=0, **kw)
        old_dyn = plan_global_batch(lengths, cost_model="analytic", decision_margin=0, dynamic_cp=True, **kw)
    fs, ds = fixed_slots(old_fixed), dyn_slots(old_dyn)
    steps_f, steps_d = old_fixed.microbatches_per_step, old_dyn.microbatches_per_step
    row: Dict[str, Any] = {"batch": key, "measured": float(np.mean(measured)), "measured_runs": measured,
                           "old_candidate": old_dyn.candidate, "old_groups": old_dyn.group_sizes()}
    plain = CostModel.from_model(w.model, w.parallel, profile="analytic")
    a, b = composed(fs, lengths, key, table, plain), composed(ds, lengths, key, table, plain)
    row["composed"] = a / b if a and b else None
    for prof in ("analytic", "fitted"):
        cm = CostModel.from_model(w.model, w.parallel, profile=prof)
        quiet = cm.with_cp_comm(0.0, 0.0, 0.0)
        row[f"{prof}"] = scored(fs, lengths, w, cm, steps_f) / scored(ds, lengths, w, cm, steps_d)
        row[f"{prof}_compute"] = scored(fs, lengths, w, quiet, steps_f) / scored(ds, lengths, w, quiet, steps_d)
    new = plan_global_batch(lengths, dynamic_cp=True, **kw)
    new_fixed = plan_global_batch(lengths, **kw)
    row.update(new_ratio=new.speedup_vs_fixed_cp, new_candidate=new.candidate, new_groups=new.group_sizes(),
               new_fixed_microbatches=new_fixed.num_microbatches, old_fixed_microbatches=old_fixed.num_microbatches)
    nf, nd = composed(fixed_slots(new_fixed), lengths, key, table, plain), composed(dyn_slots(new), lengths, key,
                                                                                    table, plain)
    row["new_measured"] = nf / nd if nf and nd else None
    return row


def markdown(rows: List[Dict[str, Any]]) -> str:
    def f(v: Optional[float]) -> str:
        return "--" if v is None else f"{v:.3f}"

    out = ["| batch | measured | composed from records | old model (analytic) | fitted, compute | fitted, +comm "
           "| error (compute vs measured) | new plan: candidate, groups | new plan modelled |",
           "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        err = 100 * (r["fitted_compute"] / r["measured"] - 1)
        groups = ", ".join(f"{g}: {n}" for g, n in sorted(r["new_groups"].items()))
        out.append(f"| {r['batch']} | {f(r['measured'])} | {f(r['composed'])} | {f(r['analytic'])} | "
                   f"{f(r['fitted_compute'])} | {f(r['fitted'])} | {err:+.1f}% | {r['new_candidate']} ({groups}) | "
                   f"{f(r['new_ratio'])} |")
    errs = np.array([100 * (r["fitted_compute"] / r["measured"] - 1) for r in rows])
    old = np.array([100 * (r["analytic"] / r["measured"] - 1) for r in rows])
    out.append(f"\nRMS error vs measured: fitted (compute) {np.sqrt(np.mean(errs ** 2)):.1f}%, old model "
               f"{np.sqrt(np.mean(old ** 2)):.1f}%; within 3%: {int((np.abs(errs) <= 3).sum())} of {len(rows)} "
               f"(fitted), {int((np.abs(old) <= 3).sum())} of {len(rows)} (old)")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--documents", default=None, metavar="PATH",
                    help="draw the batches again from the real document-length file and check them against the bundle")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args()
    batches = measured_batches(args.documents)
    table = measured_lookup()
    missing = sorted(k for k in measured_ratios() if k not in batches)
    if missing:
        raise SystemExit(f"compare.py: {BATCHES.name} has no lengths for {missing}; redraw them with --documents")
    rows = [evaluate(k, v, batches[k], table) for k, v in sorted(measured_ratios().items())]
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
