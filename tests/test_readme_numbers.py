"""README's modelled numbers are what ``megatron-dynbatch bench`` prints on a clone, digit for digit.

Each claim of README's **Results** paragraph is computed here from a benchmark run (in-process, the same
functions the command line calls) and must appear in README.md exactly as worded below, with the digits the
command prints (2 decimals for the headline's speed-up, 3 for the dynamic-CP verdicts and the drop-in summary); the opening lines of
``bench`` that docs/benchmarks.md shows must equal the ones ``bench`` prints. The runs use only what a clone
has (the bundled document lengths), so a cost-model or planner change that moves a number fails here with the
new figure and the command that prints it -- update README.md (and docs/benchmarks.md) to it. Measured numbers
(planning milliseconds, the CPU runs) are not checked: they belong to the machine that measured them.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

from megatron_dynbatch.bench.dropins import run_dropins
from megatron_dynbatch.bench.explain import headline
from megatron_dynbatch.bench.runner import PRIMARY, BenchResult, run_bench
from megatron_dynbatch.bench.workloads import WORKLOADS, default_workloads

ROOT = Path(__file__).resolve().parents[1]
DYNCP = [n for n, w in WORKLOADS.items() if w.dynamic_cp]
DYNCP_COMMAND = f"megatron-dynbatch bench --workloads {','.join(DYNCP)} --seeds 5"
TOLERANCE = 1e-9  # "never slower" / "ahead": the comparisons bench's verdicts make


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("`", ""))


README = _normalise((ROOT / "README.md").read_text(encoding="utf-8"))


def _check(claim: str, pattern: str, command: str) -> None:
    """``claim`` (what ``command`` gives) is in README.md; else say what README has instead and how to fix it."""
    if _normalise(claim) in README:
        return
    found = re.findall(pattern, README)
    pytest.fail(f"README.md's Results paragraph is out of date: `{command}` gives\n    {claim!r}\nbut README.md has "
                f"{found or 'no such sentence'}.\nUpdate README.md (the **Results** paragraph; docs/benchmarks.md "
                f"quotes the same run) to the new figure, worded as above.", pytrace=False)


def _bench(workloads, seeds: int) -> BenchResult:
    return run_bench(workloads, seeds=seeds, speed=False, progress=False)


@pytest.fixture(scope="module")
def default_run() -> BenchResult:
    """``megatron-dynbatch bench`` (README's first command) without its planning-speed section (measured)."""
    return _bench(default_workloads(), 1)


def _headline_value(lines: List[str], pattern: str) -> re.Match:
    text = " ".join(line.strip() for line in lines)
    m = re.search(pattern, text)
    assert m, f"bench's headline no longer says {pattern!r}:\n" + "\n".join(lines)
    return m


def _budget_breaks(lines: List[str]) -> Dict[str, int]:
    text = _headline_value(lines, r"budget breaks \([^)]*\): ([^;]*)").group(1)
    return {name: int(n) for name, n in re.findall(r"([\w-]+) (\d+) \(", text)}


def test_readme_speedup_over_megatron_fixed_batching_is_what_bench_prints(default_run):
    lines = headline(default_run)
    m = _headline_value(lines, r"dynbatch is ([\d.]+)x faster \(geometric mean over (\d+) workloads")
    _check(f"on the {m.group(2)} built-in RL/SFT workloads of megatron-dynbatch bench the planner is "
           f"{m.group(1)}x faster than Megatron's fixed micro-batches (geometric mean)",
           r"planner is ([\d.]+x) faster than Megatron's fixed micro-batches", "megatron-dynbatch bench")


#: how close "level" is: a step time at most this far above the fastest baseline's (bench prints 2 decimals of %)
LEVEL = 1e-4


def _standing(lines: List[str]) -> str:
    """``ahead on A of N batches`` / ``... and level (within 0.01% of the fastest) on the rest`` from bench's
    "vs the fastest baseline" headline line, checking that "level" holds."""
    m = _headline_value(lines, r"ahead on (\d+) of (\d+) workloads, every seed \(its step time from ([\d.]+)% (above|below)")
    ahead, n = int(m.group(1)), int(m.group(2))
    if ahead == n:
        return f"ahead on all {n}"
    behind = float(m.group(3)) / 100 if m.group(4) == "above" else 0.0
    assert behind <= LEVEL, (f"bench: the planner is {100 * behind:.2f}% behind the fastest baseline somewhere; "
                             "README must say where")
    return f"ahead on {ahead} of {n}"


def test_readme_standing_against_the_baselines_and_budget_breaks_are_what_bench_prints(default_run):
    lines = headline(default_run)
    breaks = _budget_breaks(lines)
    assert all(breaks.get(a, 0) == 0 for a in ("dynbatch", "dynbatch-flops", "dynbatch-groups")), breaks
    standing = _standing(lines)
    rest = "" if standing.startswith("ahead on all") else " and level (within 0.01% of the fastest) on the rest"
    _check(f"against every re-implemented baseline (Megatron fixed, slime, verl, NeMo-RL, Megatron-LM's own packing) "
           f"it is {standing} batches{rest}, with zero micro-batches over the budget where verl and slime's "
           f"FLOPs-balanced mode put {breaks['verl']} and {breaks['slime_flops']} micro-batches over it",
           r"against every re-implemented baseline[^;]*", "megatron-dynbatch bench")
    up = _headline_value(lines, r"megatron-dp-balanced on \d+ of \d+ workloads \(([\d.]+)x.*?megatron-rl-packing on "
                                r"\d+ of \d+ workloads \(([\d.]+)x")
    _check(f"upstream's own DpBalancedScheduler and Megatron RL's sequence packing take {up.group(1)}x and "
           f"{up.group(2)}x its step time (geometric mean)", r"upstream's own DpBalancedScheduler[^;.]*",
           "megatron-dynbatch bench")


@pytest.mark.slow
def test_readme_five_seed_claim_is_what_bench_prints():
    result = _bench(default_workloads(), 5)
    lines = headline(result)
    standing = _standing(lines)
    batches = len({(r.workload, r.seed) for r in result.rows})
    m = _headline_value(lines, r"ahead on (\d+) of (\d+) workloads, every seed")
    claim = (f"on all {batches} batches of megatron-dynbatch bench --seeds 5 as well" if standing.startswith("ahead on all")
             else f"over the {batches} batches of megatron-dynbatch bench --seeds 5 it is ahead on every seed of "
                  f"{m.group(1)} of {m.group(2)} workloads and level (within 0.01%) elsewhere")
    _check(claim, r"(?:on all \d+ batches|over the \d+ batches) of megatron-dynbatch bench --seeds 5[^.;]*",
           "megatron-dynbatch bench --seeds 5")


@pytest.mark.slow
def test_readme_dynamic_cp_claims_are_what_bench_prints():
    result = _bench([WORKLOADS[n] for n in DYNCP], 5)
    by_batch: Dict[tuple, Dict[str, float]] = {}
    for r in result.rows:
        if r.ok:
            by_batch.setdefault((r.workload, r.seed), {})[r.algorithm] = r.step_time_s
    speedups = [b[PRIMARY] / b["dynbatch-dyncp"] for b in by_batch.values()]
    never_slower = all(s >= 1 - TOLERANCE for s in speedups)
    ahead_of_hybrid = all(b["dynbatch-dyncp"] <= b["megatron-hybrid-cp"] * (1 + TOLERANCE) for b in by_batch.values())
    assert never_slower and ahead_of_hybrid, "bench: dynamic CP lost somewhere; README must say where"
    _check(f"Dynamic CP is never slower than fixed CP on {len(by_batch)} long-tail batches, up to "
           f"{max(speedups):.3f}x faster where one document dominates a rank, and ahead of a re-implementation of "
           f"megatron-core 0.16's hybrid-CP scheduler on all of them",
           r"Dynamic CP is never slower[^.]*", DYNCP_COMMAND)


@pytest.mark.slow
def test_readme_dropin_claims_are_what_bench_prints():
    rows, _ = run_dropins(default_workloads(), seeds=3)
    assert not [r for r in rows if r.error], "bench --dropins: a trainer stopped; README must say so"

    def geomeans(algorithm: str) -> Dict[str, float]:
        per: Dict[str, List[float]] = {}
        for r in rows:
            if r.algorithm == algorithm:
                per.setdefault(r.trainer, []).append(r.vs_own)
        return {t: math.exp(float(np.mean(np.log(v)))) for t, v in per.items()}

    plain, model = geomeans("drop-in"), geomeans("drop-in+model")
    batches = len({(r.workload, r.seed) for r in rows})
    level = all(r.vs_own <= 1 + LEVEL for r in rows if r.algorithm == "drop-in+model")
    assert level, "bench --dropins: a drop-in with model= is more than 0.01% slower on some batch; README must say so"
    assert sum(r.cap_violations for r in rows if r.algorithm.startswith("drop-in")) == 0
    _check(f"Each trainer drop-in takes {min(plain.values()):.3f}-{max(plain.values()):.3f}x the step time of that "
           f"trainer's own batching (geometric mean over {batches} batches; with model= "
           f"{min(model.values()):.3f}-{max(model.values()):.3f}x, never more than 0.01% slower on any batch) with none of its "
           f"budget breaks", r"Each trainer drop-in takes[^.]*", "megatron-dynbatch bench --dropins --seeds 3")


def test_benchmarks_doc_shows_the_opening_lines_bench_prints(default_run):
    """docs/benchmarks.md shows what ``bench`` opens with: the same lines, except the measured planning speed."""
    doc = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    block = re.search(r"opens with:\n\n```\n(.*?)```", doc, flags=re.S)
    assert block, "docs/benchmarks.md lost its sample of bench's opening lines"

    def modelled(lines: List[str]) -> List[str]:
        out, skip = [], False
        for line in lines:
            if line.startswith("  ") and not line.startswith("    "):
                skip = line.strip().startswith("planning speed")  # measured: differs from machine to machine
            if not skip:
                out.append(line.rstrip())
        return out

    shown, printed = modelled(block.group(1).splitlines()), modelled(headline(default_run))
    assert shown == printed, ("docs/benchmarks.md's sample of `megatron-dynbatch bench`'s opening lines is out of "
                              "date; replace it with:\n" + "\n".join(headline(default_run)))
