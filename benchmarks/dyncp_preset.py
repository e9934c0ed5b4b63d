#!/usr/bin/env python
"""MODELLED: does dynamic context parallelism pay for a run preset? Its layout and budget, with and without
``dynamic_cp``, on batches shaped like the preset's workload (one optimizer step of ``samples_per_step``).

Both plans come from ``plan_global_batch`` with the preset's planner arguments (``RunConfig.plan_options``);
the fixed-CP plan is re-scored with the CP communication of its ``cp``-GPU groups
(``score_with_cp_comm``), so both use one cost model -- ``CostModel.from_model`` with the default (fitted)
profile, whose CP exchange runs at NVLink numbers inside a node and InfiniBand numbers across nodes
(``docs/cost_model.md``, topology); ``--cp-bandwidth`` sets one bandwidth for both networks (e.g. ``25e9``).
Nothing here is measured: the numbers are the cost model's.

Batch shapes (``megatron_dynbatch.bench.workloads`` generators, one batch per seed):

* ``longcot-<max>-med<m>``: GRPO rollouts, ``samples_per_step / 8`` prompts x 8 responses, lognormal responses
  around a median ``m``, clipped at ``max`` (the preset's micro-batch cap less a 2k prompt, or 64k), ~8% at
  the cap (truncated generations);
* ``docs-real``: documents of the real length distribution (the quantiles bundled with the package,
  ``megatron_dynbatch/bench/data/``), truncated to the micro-batch cap.

This is how ``configs/runs/llama-3.1-70b-longcot.yaml`` made its ``dynamic_cp`` choice (docs/dynamic_cp.md,
"Run presets")::

    python benchmarks/dyncp_preset.py --run llama-3.1-70b-longcot --seeds 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dynbatch import CostModel, RunConfig, plan_global_batch  # noqa: E402
from megatron_dynbatch.bench.workloads import document_sample, grpo_lengths  # noqa: E402
from megatron_dynbatch.core.planner.dyncp.assembly import score_with_cp_comm  # noqa: E402


def shapes(rc: RunConfig) -> Dict[str, Callable[[np.random.Generator], np.ndarray]]:
    """The batch generators of the module docstring for this preset's step size and cap."""
    n = rc.options.samples_per_step or 8 * rc.parallel().dp
    prompts = max(1, n // 8)
    cap = rc.budget() * rc.parallel().cp
    top = max(1024, cap - 2048)

    def longcot(max_response: int, median: int, sigma: float) -> Callable[[np.random.Generator], np.ndarray]:
        return lambda rng: grpo_lengths(rng, prompts=prompts, group=8, max_response=max_response,
                                        median_response=median, sigma=sigma).lengths

    return {
        f"longcot-{top // 1024}k-med20k": longcot(top, 20000, 0.6),
        f"longcot-{top // 1024}k-med8k": longcot(top, 8000, 0.8),
        "longcot-64k-med20k": longcot(min(top, 65536), 20000, 0.6),
        "docs-real": lambda rng: document_sample(rng, prompts * 8, max_len=cap).lengths,
    }


def evaluate(run: str, seeds: int, cp_bandwidth: Optional[float] = None) -> Dict[str, Any]:
    """Per batch shape and seed: the fixed-CP and dynamic-CP step times (modelled) and the planning time."""
    rc = RunConfig.from_any(run).replace(dynamic_cp=False)
    on = rc.replace(dynamic_cp=True)  # refused (a clear error) where the preset's layout cannot use it
    extra = {} if cp_bandwidth is None else {"cp_bandwidth_Bps": cp_bandwidth}
    cm = CostModel.from_model(rc.model_spec(), rc.parallel(), **extra)
    rows: List[Dict[str, Any]] = []
    for shape, gen in shapes(rc).items():
        for seed in range(seeds):
            lengths = gen(np.random.default_rng(seed))
            fixed = score_with_cp_comm(plan_global_batch(lengths, rc.plan_options(), cost_model=cm),
                                       model=rc.model_spec(), cost_model=cm, lengths=lengths)
            t0 = time.perf_counter()
            dyn = plan_global_batch(lengths, on.plan_options(), cost_model=cm)
            planning = time.perf_counter() - t0
            dyn.validate(len(lengths))
            rows.append({"shape": shape, "seed": seed, "samples": int(len(lengths)),
                         "longest": int(np.max(lengths)), "fixed_cp_s": fixed.predicted_step_time,
                         "dynamic_cp_s": dyn.predicted_step_time,
                         "speedup": fixed.predicted_step_time / dyn.predicted_step_time,
                         "candidate": dyn.candidate, "group_sizes": {str(k): v for k, v in dyn.group_sizes().items()},
                         "over_budget": int(dyn.cap_violations), "planning_ms": 1e3 * planning})
    return {"run": rc.name, "parallel": rc.parallel().to_dict(), "max_tokens_per_gpu": rc.budget(),
            "cp_bandwidth_Bps": cp_bandwidth, "modelled": True, "rows": rows}


def table(result: Dict[str, Any]) -> str:
    p = result["parallel"]
    bw = result["cp_bandwidth_Bps"]
    out = [f"{result['run']}: dp={p['dp']} tp={p['tp']} pp={p['pp']} cp={p['cp']}, "
           f"{result['max_tokens_per_gpu']} tokens per GPU; CP bandwidth "
           f"{'default (by topology)' if bw is None else f'{bw / 1e9:g} GB/s'}; MODELLED step times",
           f"{'batch shape':<22} {'fixed CP s':>10} {'dyn CP s':>9} {'speed-up min':>12} {'mean':>6} {'max':>6} "
           f"{'over budget':>11} {'planning ms':>11}"]
    by: Dict[str, List[Dict[str, Any]]] = {}
    for row in result["rows"]:
        by.setdefault(row["shape"], []).append(row)
    for shape, rows in by.items():
        s = [r["speedup"] for r in rows]
        out.append(f"{shape:<22} {np.mean([r['fixed_cp_s'] for r in rows]):>10.3f} "
                   f"{np.mean([r['dynamic_cp_s'] for r in rows]):>9.3f} {min(s):>11.3f}x {np.mean(s):>5.3f}x "
                   f"{max(s):>5.3f}x {sum(r['over_budget'] for r in rows):>11} "
                   f"{max(r['planning_ms'] for r in rows):>11.0f}")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="llama-3.1-70b-longcot", help="run preset name or YAML path")
    ap.add_argument("--seeds", type=int, default=5, help="batches per shape (default 5)")
    ap.add_argument("--cp-bandwidth", type=float, default=None, metavar="BYTES_PER_S",
                    help="CP communication bandwidth per GPU, both networks (default: the profile's, by topology)")
    ap.add_argument("--json", metavar="FILE", default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    result = evaluate(args.run, max(1, args.seeds), args.cp_bandwidth)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
