"""The words around the benchmark table: a headline that says what the numbers mean, and a legend.

``megatron-dynbatch bench`` is the first thing a new user runs, so its output opens with a few lines a reader
can act on -- what was compared, how much faster than Megatron's fixed micro-batches, how often each peer
breaks the token budget, whether times are modelled or measured -- before the table, and the table is followed
by a legend of its abbreviated columns and of the algorithms.

Everything is derived from the :class:`~.runner.BenchResult`: which workloads, seeds and algorithms ran, which
of them are planner variants (``family == "dynbatch"``) or baselines, their budget breaks. New algorithms and
workloads therefore appear without edits here; the only fixed names are the planner's primary variant
(:data:`~.runner.PRIMARY`) and the reference for "how much faster" (:data:`REFERENCE`, Megatron's default
batching), and each headline line is left out when the run does not include what it needs (e.g.
``--algorithms dynbatch,verl`` has no ``fixed_padded``).
"""

from __future__ import annotations

import math
import textwrap
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .baselines import BASELINES
from .hybrid_cp import NAME as HYBRID_CP, PROVENANCE as HYBRID_PROVENANCE
from .megatron_dynamic_cp import NAME as MEGATRON_DYNCP, PROVENANCE as MEGATRON_DYNCP_PROVENANCE
from .runner import DYNBATCH_VARIANTS, PRIMARY, BenchResult, Row
from .table import LEVEL, standing

#: The baseline "how much faster" is measured against: Megatron-LM's default fixed-size, padded micro-batches.
REFERENCE = "fixed_padded"
#: Megatron-LM's own packing paths (bench/megatron_upstream.py): the headline says where the planner stands on each.
UPSTREAM = ("megatron-dp-balanced", "megatron-rl-packing", "megatron-rl-packing-rr")
WIDTH = 116

#: One line per table column (keys: the column titles of :data:`.report.COLUMNS`).
COLUMN_HELP: Dict[str, str] = {
    "workload": "the global batch (bench --list describes each)",
    "algorithm": "who planned it (see below)",
    "step s": "modelled step time: the slowest DP rank, seconds",
    "x LB": "step s / the batch's lower bound (1.0: no plan can be faster under this model)",
    "x best base": "step s / the fastest baseline on the same batch, even one that broke the budget "
                   "(< 1: ahead of every baseline)",
    "imbal": "slowest rank's time / mean rank time (1.0: every rank finishes together)",
    "mb/rank (LB)": "micro-batches per rank (a range when ranks differ); in brackets the fewest the budget allows",
    "cap viol": "micro-batches over the token budget max_tokens_per_gpu x cp: each one an out-of-memory risk",
    "peak/cap": "largest micro-batch / the budget (> 1: over it)",
    "pad %": "padding tokens / all tokens",
    "plan ms": "time to compute the plan, measured on this machine (scoring excluded)",
    "notes": "what Megatron or the trainer would reject: ragged counts, empty micro-batches, lost samples",
}


def _wrap(text: str, indent: str = "  ", hang: str = "    ") -> List[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=hang, break_on_hyphens=False)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _geomean(xs: Sequence[float]) -> float:
    return float(math.exp(np.mean(np.log(xs)))) if xs else float("nan")


def _by_workload(rows: Sequence[Row]) -> Dict[str, Dict[int, Dict[str, Row]]]:
    """workload -> seed -> algorithm -> row, in run order."""
    out: Dict[str, Dict[int, Dict[str, Row]]] = {}
    for r in rows:
        out.setdefault(r.workload, {}).setdefault(r.seed, {})[r.algorithm] = r
    return out


def _seed_pairs(seeds: Dict[int, Dict[str, Row]], other: str) -> List[Tuple[Row, Row]]:
    """``(PRIMARY's row, other's row)`` of each seed, in run order, where both planned and PRIMARY's step time
    is positive."""
    return [(s[PRIMARY], s[other]) for s in seeds.values()
            if PRIMARY in s and other in s and s[PRIMARY].ok and s[other].ok and s[PRIMARY].step_time_s > 0]


def _speedup_vs_reference(data: Dict[str, Dict[int, Dict[str, Row]]]) -> Optional[str]:
    ratios: Dict[str, float] = {}
    for w, seeds in data.items():
        per_seed = [ref.step_time_s / mine.step_time_s for mine, ref in _seed_pairs(seeds, REFERENCE)]
        if per_seed:
            ratios[w] = float(np.mean(per_seed))
    if not ratios:
        return None
    lo, hi = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
    spread = "" if len(ratios) == 1 else f"; from {ratios[lo]:.2f}x on {lo} to {ratios[hi]:.2f}x on {hi}"
    return (f"vs Megatron's fixed micro-batches ({REFERENCE}): {PRIMARY} is {_geomean(list(ratios.values())):.2f}x "
            f"faster (geometric mean over {_n(len(ratios), 'workload')}{spread})")


def _versus_best_peer(data: Dict[str, Dict[int, Dict[str, Row]]]) -> Optional[str]:
    """Where the planner stands against the fastest baseline, per workload over every seed: ahead, level (within
    :data:`~.table.LEVEL`, the rule of the verdict lines) or behind."""
    counts = {"ahead": 0, "level": 0, "behind": 0}
    gains = []
    for seeds in data.values():
        runs = [(s[PRIMARY], [b for b in s.values() if b.family == "baseline" and b.ok]) for s in seeds.values()
                if PRIMARY in s and s[PRIMARY].ok]
        runs = [(mine, bases) for mine, bases in runs if bases]
        if not runs:
            continue
        found = {standing(mine.step_time_s, b.step_time_s) for mine, bases in runs for b in bases}
        counts["behind" if "behind" in found else "level" if "level" in found else "ahead"] += 1
        gains.append(100 * (1 - float(np.mean([mine.vs_best_baseline for mine, _ in runs]))))
    if not gains:
        return None
    lo, hi = min(gains), max(gains)
    if lo >= 0:
        by = f"its step time {lo:.2f}% to {hi:.1f}% below that peer's" if len(gains) > 1 else \
            f"its step time {lo:.2f}% below that peer's"
    else:
        by = f"its step time from {-lo:.2f}% above to {hi:.1f}% below that peer's"
    rest = "".join(f"; {label} on {counts[key]}" for key, label in
                   (("level", f"level (within {100 * LEVEL:g}%)"), ("behind", "behind")) if counts[key])
    return (f"vs the fastest baseline on each batch: ahead on {counts['ahead']} of {_n(len(gains), 'workload')}, every "
            f"seed ({by}){rest}")


def _versus_upstream(data: Dict[str, Dict[int, Dict[str, Row]]]) -> Optional[str]:
    parts = []
    for name in UPSTREAM:
        ratios, ahead = [], 0
        for seeds in data.values():
            pairs = _seed_pairs(seeds, name)
            if pairs:
                ahead += all(theirs.step_time_s > mine.step_time_s for mine, theirs in pairs)
                ratios.append(float(np.mean([theirs.step_time_s / mine.step_time_s for mine, theirs in pairs])))
        if ratios:
            parts.append(f"{name} on {ahead} of {_n(len(ratios), 'workload')} ({_geomean(ratios):.2f}x, "
                         f"{min(ratios):.2f}-{max(ratios):.2f}x)")
    if not parts:
        return None
    return f"vs Megatron-LM's own packing (step time theirs / {PRIMARY}'s, geometric mean): {PRIMARY} ahead of " + \
        ", of ".join(parts)


def _budget_breaks(rows: Sequence[Row]) -> Optional[str]:
    totals: Dict[str, int] = {}
    where: Dict[str, set] = {}
    for r in rows:
        if r.ok:
            totals[r.algorithm] = totals.get(r.algorithm, 0) + int(r.cap_violations)
            if r.cap_violations:
                where.setdefault(r.algorithm, set()).add(r.workload)
    if not totals:
        return None
    n_workloads = len({r.workload for r in rows})
    breakers = sorted((a for a in totals if totals[a]), key=lambda a: -totals[a])
    clean = [a for a in totals if not totals[a]]
    parts = [f"{a} {totals[a]} ({len(where[a])}" + (f" of {_n(n_workloads, 'workload')})" if i == 0 else ")")
             for i, a in enumerate(breakers)]
    text = "budget breaks (micro-batches over max_tokens_per_gpu x cp, each an OOM risk): "
    text += ", ".join(parts) if parts else "none"
    if clean and parts:
        text += "; none: " + ", ".join(clean)
    return text


def _lower_bound(data: Dict[str, Dict[int, Dict[str, Row]]]) -> Optional[str]:
    worst = {w: max(s[PRIMARY].vs_lower_bound for s in seeds.values() if PRIMARY in s and s[PRIMARY].ok)
             for w, seeds in data.items() if any(PRIMARY in s and s[PRIMARY].ok for s in seeds.values())}
    if not worst:
        return None
    close = sum(v <= 1.01 for v in worst.values())
    far = sorted((w for w in worst if worst[w] > 1.01), key=lambda w: -worst[w])
    text = f"lower bound: {PRIMARY} within 1% of it on {close} of {_n(len(worst), 'workload')}"
    if far:
        text += " (further: " + ", ".join(f"{w} x{worst[w]:.3f}" for w in far) + \
                "; where the bound is loose: docs/benchmarks.md)"
    return text


def _speed(result: BenchResult) -> Optional[str]:
    if not result.speed:
        return None
    first = result.speed[0]
    met = sum(s.meets_target for s in result.speed)
    return (f"planning speed: {first.median_ms:.1f} ms {first.clock.upper()} time for {first.samples:,} samples "
            f"over {first.dp} ranks (target < {first.target_ms:g} ms); {met} of {len(result.speed)} timed cases "
            f"meet their targets")


def headline(result: BenchResult) -> List[str]:
    """The opening lines of ``megatron-dynbatch bench``'s report."""
    data = _by_workload(result.rows)
    seeds = len({r.seed for r in result.rows})
    algos = list(dict.fromkeys(r.algorithm for r in result.rows))
    planners = [a for a in algos if any(r.family == "dynbatch" for r in result.rows if r.algorithm == a)]
    peers = [a for a in algos if a not in planners]
    intro = (f"megatron-dynbatch bench: {_n(len(data), 'workload')} x {_n(seeds, 'seed')}; the planner "
             f"({', '.join(planners) or 'not run'}) and {_n(len(peers), 're-implemented baseline')} "
             f"({', '.join(peers) or 'none'}) plan the same global batches and one step-time model scores them all. "
             f"Step times are MODELLED (FLOPs at efficiencies fitted to H100 timings: docs/cost_model.md), not "
             f"measured; plan times are measured on this machine.")
    lines = _wrap(intro, indent="", hang="")
    for line in (_speedup_vs_reference(data), _versus_best_peer(data), _versus_upstream(data),
                 _budget_breaks(result.rows),
                 _lower_bound(data), _speed(result)):
        if line:
            lines += _wrap(line)
    return lines


#: What ``bench`` suggests next: plan a batch of one's own (the example files are in the repository root).
NEXT_PLAN = ("megatron-dynbatch plan --lengths examples/grpo_lengths.txt --model qwen3-8b --dp 8 "
             "--max-tokens-per-gpu 16384 --compare")
NEXT_DYNCP = ("megatron-dynbatch plan --lengths examples/longdoc_lengths.txt --model llama-3.1-8b --dp 8 --tp 2 "
              "--max-tokens-per-gpu 32768 --dynamic-cp")


def next_steps(result: BenchResult) -> List[str]:
    """The report's closing lines: the command to try next (the planner on one batch, then on your own), and
    where to read on."""
    dyncp = any(r.algorithm == "dynbatch-dyncp" for r in result.rows)
    command = NEXT_DYNCP if dyncp else NEXT_PLAN
    what = "a long-document batch, dynamic vs fixed CP" if dyncp else "an example GRPO batch, baselines alongside"
    return [f"next: plan one batch ({what}), then a file of your own lengths (one per line):",
            f"  {command}",
            "  more: docs/quickstart.md (from Python, in a Megatron-LM launch), docs/benchmarks.md (these numbers)"]


def _algorithm_help(name: str) -> str:
    if name in DYNBATCH_VARIANTS:
        kwargs, needs_groups = DYNBATCH_VARIANTS[name]
        args = [f"{k}={v!r}" for k, v in kwargs.items()] + (["group_ids=<GRPO groups>"] if needs_groups else [])
        return f"this planner: plan_global_batch(lengths, ...{', ' + ', '.join(args) if args else ''})" + \
            ("" if args else ", its defaults")
    if name in BASELINES:
        return BASELINES[name].provenance or BASELINES[name].description
    if name == HYBRID_CP:
        return HYBRID_PROVENANCE
    if name == MEGATRON_DYNCP:
        return MEGATRON_DYNCP_PROVENANCE
    return ""


def legend(result: BenchResult, columns: Sequence[str]) -> List[str]:
    """The legend printed under the table: one line per column and per algorithm that ran."""
    seeds = len({r.seed for r in result.rows})
    head = "columns" + (f" (means over {seeds} seeds; cap viol summed, plan ms the median)" if seeds > 1 else "")
    lines = [head + "; details in docs/benchmarks.md:"]
    width = max(len(c) for c in columns)
    for c in columns:
        if c in COLUMN_HELP:
            lines += _wrap(f"{c:<{width}}  {COLUMN_HELP[c]}", hang=" " * (width + 4))
    algos = list(dict.fromkeys(r.algorithm for r in result.rows))
    width = max((len(a) for a in algos), default=0)
    lines.append("algorithms:")
    for a in algos:
        lines += _wrap(f"{a:<{width}}  {_algorithm_help(a)}", hang=" " * (width + 4))
    return lines


__all__ = ["COLUMN_HELP", "REFERENCE", "UPSTREAM", "headline", "legend", "next_steps"]
