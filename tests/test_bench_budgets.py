"""``bench --budgets``: the auto budget against hand-set ones on the same batches -- modelled step time,
micro-batches, predicted peak -- with budgets that would run out of memory not scored, and a budget below the
longest sample reported as the planner stopping; docs/benchmarks.md quotes the command's table."""

from __future__ import annotations

import json
from pathlib import Path


from megatron_dynbatch.bench.budgets import BENCH_SETTINGS, format_budgets, hand_set_budgets, run_budgets
from megatron_dynbatch.bench.workloads import WORKLOADS
from megatron_dynbatch.cli import main
from megatron_dynbatch.core.memory import choose_budget

ROOT = Path(__file__).resolve().parents[1]


def test_rows_compare_auto_with_the_hand_set_budgets():
    rows, meta = run_budgets([WORKLOADS["sft-longctx-70b-cp8"], WORKLOADS["smoke"]], gpu_memory_gb=80)
    by = {(r.workload, r.label): r for r in rows}
    w = WORKLOADS["sft-longctx-70b-cp8"]
    auto = by[(w.name, "auto")]
    assert auto.tokens_per_gpu == choose_budget(w.model, w.parallel, 80, settings=BENCH_SETTINGS).tokens_per_gpu
    assert auto.fits and auto.vs_auto == 1.0 and auto.step_time_s > 0 and auto.predicted_peak_gb <= 72
    assert [label for label, _ in hand_set_budgets(w)] == ["workload", "verl default", "roll default"]
    hand = by[(w.name, "workload")]
    assert hand.tokens_per_gpu == w.max_tokens_per_gpu
    assert not hand.fits and hand.predicted_peak_gb > 72  # 16384 x cp 8 on 80 GiB: predicted out of memory
    assert hand.step_time_s != hand.step_time_s and hand.microbatches > 0  # planned, not scored
    roll = by[(w.name, "roll default")]
    assert roll.tokens_per_gpu == 8192 // w.parallel.cp and roll.error.startswith("planner stops")
    assert meta["step_time"].startswith("modelled")
    text = format_budgets(rows, meta)
    assert "MODELLED" in text and "out of memory (predicted)" in text


def test_cli_flag_prints_the_table_and_json(capsys, tmp_path):
    out = tmp_path / "b.json"
    assert main(["bench", "--budgets", "--workloads", "smoke", "--output", str(out)]) == 0
    assert "Auto budget vs hand-set budgets" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert {r["label"] for r in d["rows"]} == {"auto", "workload", "verl default", "roll default"}
    assert main(["bench", "--budgets", "--workloads", "smoke", "--gpu-memory-gb", "zero"]) == 2
    assert "--gpu-memory-gb" in capsys.readouterr().err

# docs/benchmarks.md quotes `bench --budgets`: its block and figures are checked by tests/test_doc_figures.py.
