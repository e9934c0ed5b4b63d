#!/usr/bin/env python
"""MEASURED (CPU time of this process): how long the memory model's answers take -- the budget a launch chooses
(``choose_budget``), the check a trainer runs once at start-up (``check_configured_budget``) and the memory
guard's per-step decision (``MemoryGuard.observe``) -- against their targets.

The tests check the work behind each deterministically (one or two evaluations of the memory model, a guard's
state bounded by its window: ``tests/test_memory_budget.py``, ``tests/test_budget_startup.py``,
``tests/test_memory_guard.py``); the seconds live here, where a busy machine makes a slow run, not a failed
test. Each case is the median of ``--repeats`` timed calls after one warm-up::

    python benchmarks/memory_speed.py --repeats 20

Exit status 1 when a case misses its target (a ratio in one run: measured / target).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dynbatch.core.memory import choose_budget  # noqa: E402
from megatron_dynbatch.core.memory.check import check_configured_budget  # noqa: E402
from megatron_dynbatch.core.memory.guard import MemoryGuard, merge_readings, reading_vector  # noqa: E402

CARD_GB = 79.1


def _budget() -> Any:
    return choose_budget("llama-3.1-70b", {"dp": 8, "pp": 16, "vpp": 2, "ep": 64}, 141, settings={"recompute": "full"})


def _start_up() -> Any:
    return check_configured_budget("train_mb_tokens", 65536, "deepseek-v3", {"dp": 32, "tp": 8, "pp": 8, "ep": 32},
                                   CARD_GB, trainer="nemo-rl")


def _observer() -> Callable[[], Any]:
    guard = MemoryGuard(8192, CARD_GB * 2 ** 30, model="qwen3-8b", parallel={"dp": 8, "pp": 4}, skip_steps=0)
    readings = []
    for s, t in enumerate(guard.terms):
        base = t.static
        readings.append(reading_vector(4, s, base, base + t.workspace + 4096 * t.per_token)[0])
    merged = merge_readings(readings)
    return lambda: guard.observe(merged, tokens=4096)


#: (name, what it times, target seconds, the call)
CASES: List[tuple] = [
    ("choose_budget", "llama-3.1-70b, pp=16 vpp=2 ep=64, 141 GiB", 0.05, lambda: _budget),
    ("start-up check", "deepseek-v3, dp=32 tp=8 pp=8 ep=32, NeMo-RL's setting", 2.0, lambda: _start_up),
    ("guard observe", "qwen3-8b, pp=4, one step's merged readings", 0.01, _observer),
]


def measure(repeats: int) -> List[Dict[str, Any]]:
    rows = []
    for name, what, target, make in CASES:
        call = make()
        call()  # warm-up: imports, presets, caches
        times = []
        for _ in range(repeats):
            t0 = time.process_time()
            call()
            times.append(time.process_time() - t0)
        median = statistics.median(times)
        rows.append({"case": name, "what": what, "median_s": median, "target_s": target,
                     "ratio": median / target, "meets": median < target})
    return rows


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per case (median reported)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    rows = measure(max(1, args.repeats))
    for r in rows:
        print(f"{r['case']:<15} {r['median_s'] * 1e3:9.3f} ms CPU  (target < {r['target_s'] * 1e3:g} ms: "
              f"{'meets' if r['meets'] else 'MISSES'}, {r['ratio']:.3f} of it)  {r['what']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["meets"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
