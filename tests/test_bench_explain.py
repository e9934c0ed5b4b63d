"""The benchmark report's headline and legend: derived from the result (new algorithms and workloads flow in),
every column explained, modelled vs measured said, and a planning-speed miss on a busy machine says so."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_dynbatch.bench import WORKLOADS, format_report, format_speed, run_bench
from megatron_dynbatch.bench.explain import COLUMN_HELP, REFERENCE, headline, legend
from megatron_dynbatch.bench.report import COLUMNS
from megatron_dynbatch.bench.runner import PRIMARY, BenchResult, SpeedResult


@pytest.fixture(scope="module")
def smoke() -> BenchResult:
    return run_bench([WORKLOADS["smoke"]], seeds=2, speed=False, progress=False)


def test_every_column_has_a_legend_line():
    assert [c for c, _ in COLUMNS if c not in COLUMN_HELP] == []


def test_report_opens_with_the_headline_then_table_then_legend(smoke):
    text = format_report(smoke)
    first = text.splitlines()[0]
    assert first.startswith("megatron-dynbatch bench: 1 workload x 2 seeds")
    assert text.index("MODELLED") < text.index("workload  ") < text.index("columns (means over 2 seeds")
    assert text.index("algorithms:") < text.index("planner cap violations")
    assert "docs/benchmarks.md" in text


def test_headline_numbers_come_from_the_rows(smoke):
    lines = " ".join(headline(smoke))
    ratios = [next(r for r in smoke.rows_for("smoke", s) if r.algorithm == REFERENCE).step_time_s /
              next(r for r in smoke.rows_for("smoke", s) if r.algorithm == PRIMARY).step_time_s for s in (0, 1)]
    assert f"{sum(ratios) / 2:.2f}x faster" in lines
    assert "ahead on 1 of 1 workload" in lines or "ahead on 0 of 1 workload" in lines
    assert "budget breaks" in lines and "lower bound" in lines


def test_new_algorithms_and_workloads_flow_in_without_edits(smoke):
    """A planner variant or workload the explainer never heard of appears in the intro, the breaks and the legend."""
    extra = [dataclasses.replace(r, algorithm="dynbatch-new", cap_violations=0) for r in smoke.rows
             if r.algorithm == PRIMARY]
    extra += [dataclasses.replace(r, workload="brand-new", algorithm="peer-x", family="baseline", cap_violations=3)
              for r in smoke.rows if r.algorithm == REFERENCE]
    result = BenchResult(rows=smoke.rows + extra, meta=smoke.meta)
    head = " ".join(headline(result))
    assert "dynbatch-new" in head and "peer-x 6 (1 of 2 workloads)" in head and "2 workloads x 2 seeds" in head
    names = [ln.split()[0] for ln in legend(result, [c for c, _ in COLUMNS]) if ln.startswith("  ")]
    assert "dynbatch-new" in names and "peer-x" in names


def test_lines_that_need_missing_algorithms_are_left_out():
    result = run_bench([WORKLOADS["smoke"]], algorithms=["verl", "nemo_rl"], speed=False, progress=False)
    head = " ".join(headline(result))
    assert REFERENCE not in head and "faster" not in head and "budget breaks" in head
    assert "The planner (not run)" in head or "planner (not run)" in head


def test_a_speed_miss_on_a_busy_machine_says_so():
    slow = SpeedResult(4096, 64, [50.0, 51.0, 49.0], 20.0, 12, clock="cpu")
    busy = BenchResult(rows=[], speed=[slow], meta={"load_avg": 3.9, "cpus": 2})
    text = format_speed(busy)
    assert "load average 3.9 on 2 CPU(s)" in text and "MISSES (the machine was busy" in text
    idle = format_speed(BenchResult(rows=[], speed=[slow], meta={"load_avg": 0.1, "cpus": 2}))
    assert "MISSES" in idle and "busy" not in idle
    assert "MISSES" in format_speed(BenchResult(rows=[], speed=[slow]))  # older JSON without load


def test_run_records_the_machine_load(smoke):
    assert smoke.meta["cpus"] >= 1
    assert smoke.meta["load_avg"] is None or smoke.meta["load_avg"] >= 0


@pytest.mark.parametrize("dyncp", [False, True])
def test_the_report_ends_with_a_next_command_that_runs(smoke, dyncp, monkeypatch, capsys):
    """``bench`` closes with the command to try next, and that command works as printed from the repository
    root (where README's first command leaves the user)."""
    import shlex

    from megatron_dynbatch.bench.explain import next_steps
    from megatron_dynbatch.cli import main

    result = smoke
    if dyncp:
        rows = [dataclasses.replace(r, algorithm="dynbatch-dyncp") for r in smoke.rows[:1]] + list(smoke.rows)
        result = dataclasses.replace(smoke, rows=rows)
    tail = next_steps(result)
    assert format_report(result).splitlines()[-len(tail):] == tail and tail[0].startswith("next: ")
    command = shlex.split(tail[1])
    assert command[0] == "megatron-dynbatch" and ("--dynamic-cp" in command) == dyncp
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert main(command[1:]) == 0
    assert "predicted step time" in capsys.readouterr().out
