"""Plain-text tables and verdicts for a :class:`~megatron_dynbatch.bench.runner.BenchResult`.

With several seeds, a table row aggregates one (workload, algorithm) pair: ratios, imbalance, padding and
micro-batch counts are means over seeds, cap violations are summed, planning time is the median. The JSON
output (``BenchResult.to_json``) keeps every seed.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import numpy as np

from .runner import PRIMARY, BenchResult, Row
from .table import LEVEL, aligned, gap_text, standing

COLUMNS: Tuple[Tuple[str, str], ...] = (
    ("workload", "<"), ("algorithm", "<"), ("step s", ">"), ("x LB", ">"), ("x best base", ">"),
    ("imbal", ">"), ("mb/rank (LB)", ">"), ("cap viol", ">"), ("peak/cap", ">"), ("pad %", ">"),
    ("plan ms", ">"), ("notes", "<"),
)


def _fmt(x: float, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _aggregate(rows: Sequence[Row]) -> List[str]:
    ok = [r for r in rows if r.ok]
    first = rows[0]
    if not ok:
        return [first.workload, first.algorithm] + ["-"] * 9 + ["FAILED: " + (first.error or "")[:70]]
    mean = lambda attr: float(np.mean([getattr(r, attr) for r in ok]))  # noqa: E731
    if len(ok) == 1:
        r0 = ok[0]
        mb = (str(r0.microbatches) if r0.microbatches_min == r0.microbatches
              else f"{r0.microbatches_min}-{r0.microbatches}")
    else:
        mb = f"{mean('microbatches'):.3g}"
    lb_m = float(np.mean([r.lower_bound_microbatches for r in ok]))
    notes = sorted({n for r in ok for n in r.notes})
    if len(ok) < len(rows):
        notes.append(f"failed on {len(rows) - len(ok)} seed(s)")
    return [
        first.workload, first.algorithm, _fmt(mean("step_time_s"), ".3f"), _fmt(mean("vs_lower_bound"), ".4f"),
        _fmt(mean("vs_best_baseline"), ".4f"), _fmt(mean("imbalance"), ".4f"), f"{mb} ({lb_m:.4g})",
        str(sum(r.cap_violations for r in ok)), _fmt(max(r.peak_over_cap for r in ok), ".3f"),
        _fmt(100 * mean("padding_fraction"), ".1f"), _fmt(float(np.median([r.planning_ms for r in ok])), ".1f"),
        "; ".join(notes),
    ]


def table_rows(result: BenchResult) -> List[List[str]]:
    """One list of cells per (workload, algorithm), in run order."""
    groups: Dict[Tuple[str, str], List[Row]] = {}
    for r in result.rows:
        groups.setdefault((r.workload, r.algorithm), []).append(r)
    return [_aggregate(g) for g in groups.values()]


def format_table(result: BenchResult) -> str:
    """The aligned plain-text results table (a blank line between workloads)."""
    body = table_rows(result)
    lines = aligned([[c for c, _ in COLUMNS], *body], [a for _, a in COLUMNS], rule=True)
    out = lines[:2]
    prev = None
    for r, text in zip(body, lines[2:], strict=True):
        if prev is not None and r[0] != prev:
            out.append("")
        out.append(text)
        prev = r[0]
    return "\n".join(out)


def format_speed(result: BenchResult) -> str:
    """The planning-speed list: one aligned row per timed case (its input shape: :mod:`.adversarial`), what the
    timed plan was (micro-batches per rank, or refused) and whether it meets its target, then a legend."""
    if not result.speed:
        return ""
    load, cpus = result.meta.get("load_avg"), result.meta.get("cpus")
    busy = load is not None and cpus and load > 0.75 * cpus
    where = f"; load average {load:.1f} on {cpus} CPU(s) during the run" if load is not None and cpus else ""
    lines = [f"planning speed (plan_global_batch, median of runs, single process{where}):"]
    rows = []
    for s in result.speed:
        runs = ", ".join(f"{x:.1f}" for x in s.runs_ms)
        verdict = "meets" if s.meets_target else \
            "MISSES (the machine was busy, which slows even CPU time: rerun when idle)" if busy else "MISSES"
        m = s.microbatches
        plan = f"{m} micro-batch{'' if m == 1 else 'es'} per rank" if m else "refused (no valid plan)"
        rows.append([s.shape, str(s.samples), "samples /", str(s.dp), "DP ranks:", f"{s.median_ms:.1f}",
                     f"ms {s.clock}", f"(runs {runs}; {plan}; target < {s.target_ms:g} ms: {verdict})"])
    lines += ["  " + ln for ln in aligned(rows, "<><><><<", gap=" ")]
    lines.append("(ms cpu: CPU time of the planning process, ms wall: elapsed time; runs: each timed run; the shapes "
                 "other than GRPO are adversarial inputs: docs/benchmarks.md, \"Planning time on adversarial inputs\")")
    return "\n".join(lines)


def verdicts(result: BenchResult, variants: Sequence[str] = (PRIMARY,)) -> List[str]:
    """One line per workload and planner variant: is it ahead of every baseline on every seed (a baseline
    that beats it is named, with its cap violations), and how far from the lower bound; plus a global line on
    the planner's cap violations."""
    lines = []
    workloads = list(dict.fromkeys(r.workload for r in result.rows))
    for w in workloads:
        rows = result.rows_for(w)
        for variant in variants:
            mine = {r.seed: r for r in rows if r.algorithm == variant}
            if not mine:
                continue
            failed = [r for r in mine.values() if not r.ok]
            if failed:
                lines.append(f"{w}: {variant} FAILED: {failed[0].error}")
                continue
            found: Dict[str, List[str]] = {"level": [], "behind": []}
            for r in rows:
                if r.family != "baseline" or not r.ok or r.seed not in mine:
                    continue
                ours = mine[r.seed].step_time_s
                where = standing(ours, r.step_time_s)
                if where != "ahead":
                    cap = (f"with {r.cap_violations} micro-batches over the cap" if r.cap_violations
                           else "within the cap")
                    found[where].append(f"{r.algorithm} on seed {r.seed} ({r.algorithm} {r.step_time_s:.4f} s {cap}, "
                                        f"{variant} {ours:.4f} s: {gap_text(ours, r.step_time_s)} slower)")
            worst = max(r.vs_best_baseline for r in mine.values())
            lb = max(r.vs_lower_bound for r in mine.values())
            parts = []
            if found["behind"]:
                parts.append("BEHIND " + "; ".join(found["behind"]))
            if found["level"]:
                parts.append(f"level (within {100 * LEVEL:g}%) with " + "; ".join(found["level"]))
            head = ", ".join(parts) + (", ahead of every other baseline" if parts else "ahead of every baseline")
            lines.append(f"{w}: {variant} {head} over {len(mine)} seed(s); worst x best baseline {worst:.4f}, "
                         f"worst x lower bound {lb:.4f}{' (> 1%)' if lb > 1.01 else ''}")
    v = result.dynbatch_cap_violations
    lines.append(f"planner cap violations: {v}" + ("  <-- BUG: the planner must never exceed the cap" if v else ""))
    return lines


def dyncp_verdicts(result: BenchResult, variant: str = "dynbatch-dyncp", fixed: str = PRIMARY,
                   upstream: Sequence[str] = ("megatron-hybrid-cp", "megatron-dynamic-cp")) -> List[str]:
    """One line per dynamic-CP workload: the dynamic-CP plan's speed-up over the fixed-CP plan of the same
    layout and over upstream's dynamic-CP schedulers (range over the seeds; those that ran), and whether it is
    ahead of every algorithm."""
    lines = []
    for w in dict.fromkeys(r.workload for r in result.rows if r.algorithm == variant):
        rows = result.rows_for(w)
        mine = {r.seed: r for r in rows if r.algorithm == variant and r.ok}
        if not mine:
            lines.append(f"{w}: {variant} FAILED")
            continue

        def speedup(name: str) -> str:
            other = {r.seed: r for r in rows if r.algorithm == name and r.ok}
            ratios = [other[s].step_time_s / mine[s].step_time_s for s in mine if s in other]
            if not ratios:
                return "n/a"
            return f"{min(ratios):.3f}x" if len(ratios) == 1 else f"{min(ratios):.3f}x-{max(ratios):.3f}x"

        found: Dict[str, Dict[str, int]] = {"level": {}, "behind": {}}
        for r in rows:
            if r.ok and r.algorithm != variant and r.seed in mine:
                where = standing(mine[r.seed].step_time_s, r.step_time_s)
                if where != "ahead":
                    found[where][r.algorithm] = found[where].get(r.algorithm, 0) + r.cap_violations
        viol = sum(r.cap_violations for r in mine.values())
        parts = [label + ", ".join(f"{a} ({v} micro-batches over the budget)" for a, v in sorted(found[key].items()))
                 for key, label in (("behind", "BEHIND "), ("level", f"level (within {100 * LEVEL:g}%) with "))
                 if found[key]]
        theirs = "".join(f", {speedup(name)} than {name}" for name in upstream
                         if any(r.algorithm == name for r in rows))
        lines.append(f"{w}: {variant} {speedup(fixed)} faster than fixed CP ({fixed}){theirs} "
                     f"(range over {len(mine)} seed(s)); "
                     + ("; ".join(parts) + ", ahead of every other algorithm" if parts else "ahead of every algorithm")
                     + f"; {viol} of its micro-batches over the budget")
    return lines


def format_report(result: BenchResult) -> str:
    """Headline, table, legend, verdicts, planning speed, the next command (what ``megatron-dynbatch bench`` prints)."""
    from .explain import headline, legend, next_steps

    parts = [*headline(result), "", format_table(result), "", *legend(result, [c for c, _ in COLUMNS]), "",
             *verdicts(result), *dyncp_verdicts(result)]
    speed = format_speed(result)
    if speed:
        parts += ["", speed]
    if result.meta.get("wall_s") is not None:
        parts += ["", f"(benchmark wall time {result.meta['wall_s']:.1f} s)"]
    parts += ["", *next_steps(result)]
    return "\n".join(parts)
