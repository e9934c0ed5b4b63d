"""Tables line up and words mean what a newcomer reads (issue 28 item 16).

* ``plan --compare``, ``bench --dropins`` and the planning-speed list: every column as wide as its widest cell, so
  ``megatron-rl-packing-rr`` or ``dyncp 128k doc + short, dp16xcp2 pp4`` no longer push their rows out of line;
* a step time 0.001% above verl's is "level (within 0.01%)" in the verdicts, as in the headline and README, not
  "BEHIND" in capitals; one rule (:func:`megatron_dynbatch.bench.table.standing`) for all of them;
* no undefined shorthand: ``M=`` became "micro-batches per rank" (or "refused"), ``half+1 spike`` / ``third+1``
  became "just over budget/2" / "just over budget/3", and the speed list ends with a legend."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_dynbatch.bench import format_speed
from megatron_dynbatch.bench.adversarial import SHAPES
from megatron_dynbatch.bench.dropins import DropinRow, format_dropins
from megatron_dynbatch.bench.explain import headline
from megatron_dynbatch.bench.report import dyncp_verdicts, verdicts
from megatron_dynbatch.bench.runner import BenchResult, Row, SpeedResult
from megatron_dynbatch.bench.table import LEVEL, aligned, standing
from megatron_dynbatch.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "grpo_lengths.txt")


def _ends(lines, pattern):
    """The end offset of the first match of ``pattern`` in each line."""
    return {m.end() for m in (re.search(pattern, ln) for ln in lines) if m}


def test_aligned_sizes_columns_to_their_widest_cell():
    out = aligned([["name", "n", "notes"], ["a-very-long-name", "12345", "x"], ["b", "1", ""]], "<><", rule=True)
    assert out == ["name                  n  notes", "----------------  -----  -----",
                   "a-very-long-name  12345  x", "b                     1"]
    with pytest.raises(ValueError):
        aligned([["a", "b"], ["c"]], "<>")


def test_plan_compare_columns_line_up(capsys):
    assert main(["plan", "--lengths", EXAMPLE, "--model", "qwen3-8b", "--dp", "8", "--max-tokens-per-gpu", "16384",
                 "--compare"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("algorithm "):].splitlines()
    rows = [ln for ln in table if re.match(r"^[a-z_-]+\s+\d", ln)]
    assert any(ln.startswith("megatron-rl-packing-rr ") for ln in rows) and len(rows) >= 10
    for column in (r"^\S+\s+[\d.]+", r"^\S+\s+[\d.]+\s+[\d.]+", r"\s(\d+|\d+-\d+)\s+\d+$"):
        assert len(_ends(rows, column)) == 1, (column, rows)
    header = table[0]
    assert header.index("step s") + len("step s") == rows[0].index(".") + 5  # the header sits over its numbers


def test_dropin_table_and_summary_line_up():
    rows = [DropinRow("grpo-longcot-8b", 0, "slime", "slime", 10.758, 1.0, 0, 6, 1.007),
            DropinRow("grpo-longcot-8b", 0, "megatron_rl", "megatron-rl-packing", 17.198, 1.0, 0, 8, 1.150,
                      notes=["empty micro-batch"]),
            DropinRow("grpo-longcot-8b", 0, "megatron_rl", "drop-in", 10.843, 0.630, 0, 6, 1.0)]
    text = format_dropins(rows)
    lines = text.splitlines()
    body = [ln for ln in lines if ln.startswith("grpo-longcot-8b")]
    assert len(body) == 3
    for column in range(3, 8):  # step s, vs own, over cap, mbs, imbal: right-aligned, so they end together
        assert len(_ends(body, r"^(\S+\s+){%d}[\d.]+" % column)) == 1, (column, body)
    head = next(ln for ln in lines if ln.startswith("workload"))
    assert "vs own  over cap" in head  # two blanks between columns, never "vs own over cap"
    assert all(not ln.endswith(" ") for ln in lines)
    summary = [ln for ln in lines if ln.startswith("  ") and "vs own" in ln]
    assert len(summary) == 3 and len({ln.index("vs own") for ln in summary}) == 1


def _speed(shape, samples, dp, ms, m, target=2000.0):
    return SpeedResult(samples, dp, [ms], target, m, shape=shape, clock="cpu")


def test_speed_list_lines_up_and_says_what_it_counts():
    speed = [_speed("GRPO", 4096, 64, 16.8, 12, 20.0),
             _speed("dyncp 128k doc + short, dp16xcp2 pp4", 10000, 32, 736.1, 16),
             _speed("one giant group (refused)", 4096, 2, 10.5, 0), _speed("1% at cap", 4096, 64, 23.0, 1)]
    text = format_speed(BenchResult(rows=[], speed=speed, meta={"load_avg": 0.5, "cpus": 2}))
    rows = [ln for ln in text.splitlines() if "samples /" in ln]
    assert len(rows) == 4
    for column in (r"\d+ samples", r"\d+ DP ranks", r"[\d.]+ ms"):
        assert len(_ends(rows, column)) == 1, (column, text)
    assert "M=" not in text
    assert "12 micro-batches per rank" in text and "1 micro-batch per rank" in text and "refused" in rows[2]
    assert text.splitlines()[-1].startswith("(ms cpu: CPU time")
    names = [s.name for s in SHAPES]
    assert not [n for n in names if re.search(r"half\+1|third\+1|spike", n)], names
    assert {"just over budget/2", "just over budget/3"} <= set(names)


def _row(workload, seed, algorithm, family, t, cap=0):
    return Row(workload, seed, algorithm, family, step_time_s=t, lower_bound_s=t, vs_lower_bound=1.0,
               vs_best_baseline=1.0, imbalance=1.0, microbatches=4, microbatches_min=4, lower_bound_microbatches=4,
               cap_violations=cap)


def test_a_gap_within_a_hundredth_of_a_percent_is_level_everywhere():
    assert LEVEL == 1e-4
    assert standing(1.0, 1.0) == "ahead" and standing(1.000009, 1.0) == "level" and standing(1.0002, 1.0) == "behind"
    rows = [_row("w1", 0, "dynbatch", "dynbatch", 30.8622), _row("w1", 0, "verl", "baseline", 30.8618, cap=61),
            _row("w1", 0, "slime", "baseline", 31.5),
            _row("w2", 0, "dynbatch", "dynbatch", 10.0), _row("w2", 0, "verl", "baseline", 10.5),
            _row("w3", 0, "dynbatch", "dynbatch", 5.1), _row("w3", 0, "slime", "baseline", 5.0)]
    lines = verdicts(BenchResult(rows=rows))
    w1 = next(ln for ln in lines if ln.startswith("w1:"))
    assert "BEHIND" not in w1 and "level (within 0.01%) with verl on seed 0" in w1 and "0.001% slower" in w1
    assert "verl 30.8618 s with 61 micro-batches over the cap" in w1 and "ahead of every other baseline" in w1
    assert next(ln for ln in lines if ln.startswith("w2:")).startswith("w2: dynbatch ahead of every baseline")
    w3 = next(ln for ln in lines if ln.startswith("w3:"))
    assert "BEHIND slime on seed 0" in w3 and "2.00% slower" in w3
    head = " ".join(headline(BenchResult(rows=rows)))
    assert "ahead on 1 of 3 workloads" in head and "level (within 0.01%) on 1" in head and "behind on 1" in head
    dyn = [_row("d", 0, "dynbatch-dyncp", "dynbatch", 2.00001), _row("d", 0, "dynbatch", "dynbatch", 2.0),
           _row("d", 0, "megatron-hybrid-cp", "baseline", 2.5)]
    line = dyncp_verdicts(BenchResult(rows=dyn))[0]
    assert "BEHIND" not in line and "level (within 0.01%) with dynbatch" in line
