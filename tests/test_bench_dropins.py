"""``megatron-dynbatch bench --dropins``: every drop-in plans every workload with no micro-batch over the cap (the
trainer's own padding counted), equal micro-batch counts on every rank and no sample lost, and is scored against
the trainer's own algorithm with the same cost model."""

from __future__ import annotations

import json

import pytest

from megatron_dynbatch.bench.dropins import DROPIN_TRAINERS, format_dropins, run_dropins
from megatron_dynbatch.bench.workloads import WORKLOADS


@pytest.fixture(scope="module")
def rows():
    return run_dropins([WORKLOADS["smoke"], WORKLOADS["pp4-vpp2-qwen3-32b"], WORKLOADS["sft-mix-8b"]], seeds=2)[0]


def test_every_trainer_and_variant_ran(rows):
    for trainer in DROPIN_TRAINERS:
        algos = {r.algorithm for r in rows if r.trainer == trainer}
        assert {DROPIN_TRAINERS[trainer].own, "drop-in"} <= algos


def test_drop_ins_keep_our_guarantees(rows):
    for r in rows:
        if not r.algorithm.startswith("drop-in"):
            continue
        assert r.error is None, (r.workload, r.trainer, r.error)
        assert r.cap_violations == 0, (r.workload, r.trainer, r.algorithm)
        assert r.notes == [], (r.workload, r.trainer, r.notes)  # equal counts, valid VPP count, every sample once


def test_ratios_are_against_the_same_batch(rows):
    for r in rows:
        if r.algorithm == DROPIN_TRAINERS[r.trainer].own and r.error is None:
            assert r.vs_own == pytest.approx(1.0)


def test_table_and_cli(rows, capsys):
    text = format_dropins(rows)
    assert "MODELLED" in text and "vs own" in text
    from megatron_dynbatch.cli import main

    assert main(["bench", "--dropins", "--workloads", "smoke", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["meta"]["step_time"].startswith("modelled") and out["rows"]
    assert "--dropins" in out["meta"]["command"]
