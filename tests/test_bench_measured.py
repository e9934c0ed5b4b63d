"""Composition of measured micro-batch seconds into step times (bench/measured.py, torch-free).

The key check: fed the cost model's OWN micro-batch times, every schedule composes to exactly the step time the
benchmark modelled for that plan -- DP plans (every algorithm, padded or packed), dynamic-CP plans (the pool
simulation) and upstream's hybrid CP (rounds with barriers). So measured and modelled step times differ only by
the micro-batch times, never by how they are put together."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_dynbatch.bench.measured import (TINY_WORKLOADS, PoolSchedule, RankSchedule, RoundsSchedule,
                                              layout_cost_model, schedule_of)
from megatron_dynbatch.bench.baselines import BASELINES
from megatron_dynbatch.bench.runner import run_workload
from megatron_dynbatch.bench.workloads import WORKLOADS
from megatron_dynbatch.core.planner.dyncp.pool import group_alignment


def _modelled_seconds(workload):
    cm = layout_cost_model(workload)

    def seconds_of(g, lengths):
        align = group_alignment(workload.parallel, g, 1)
        tokens = align.padded_total(int(align.seq_len(np.asarray(lengths)).sum()))
        return float(cm.group_microbatch_time(g, tokens, float(np.sum(np.asarray(lengths, dtype=np.float64) ** 2))))

    return cm, seconds_of


@pytest.mark.parametrize("name", ["tiny-rl-dp2", "tiny-dyncp-dp2-cp2", "dyncp-longdoc-8b-1mb",
                                  "dyncp-longcot-64k-32b-pp4"])
@pytest.mark.parametrize("seed", [0, 1])
def test_composing_modelled_seconds_gives_the_modelled_step(name, seed):
    w = TINY_WORKLOADS.get(name) or WORKLOADS[name]
    rows, plans = run_workload(w, seed, keep_plans=True)
    lengths = w.generate(seed).lengths
    cm, seconds_of = _modelled_seconds(w)
    checked = set()
    for row in rows:
        if not row.ok:
            continue
        sched = schedule_of(row.algorithm, plans[(w.name, seed, row.algorithm)], lengths, w)
        step = sched.compose(seconds_of, cm)
        assert step.step_s == pytest.approx(row.step_time_s, rel=1e-9), row.algorithm
        assert step.imbalance >= 1.0 and step.microbatches == len(sched.items())
        checked.add(type(sched))
    want = {RankSchedule, PoolSchedule, RoundsSchedule} if w.dynamic_cp else {RankSchedule}
    assert checked == want


def test_items_name_every_microbatch_once_per_group():
    w = TINY_WORKLOADS["tiny-dyncp-dp2-cp2"]
    rows, plans = run_workload(w, 0, keep_plans=True)
    lengths = w.generate(0).lengths
    for row in rows:
        sched = schedule_of(row.algorithm, plans[(w.name, 0, row.algorithm)], lengths, w)
        # every sample is timed exactly once (a group's micro-batch is one item, not one per member)
        timed = sorted(L for _, lens in sched.items() for L in lens)
        if row.algorithm == "fixed_padded":  # rows padded to the micro-batch's longest sample
            assert len(timed) == lengths.size
            continue
        if BASELINES.get(row.algorithm) and BASELINES[row.algorithm].fixed_bins:
            # full-width rows: every sample once, plus each bin's unused tail (an empty bin: one full row)
            width = w.max_tokens_per_gpu * w.parallel.cp
            assert all(sum(lens) <= width for _, lens in sched.items())
            rest = list(timed)
            for L in lengths.tolist():
                rest.remove(L)
            assert len(rest) <= len(sched.items()), row.algorithm
            continue
        assert timed == sorted(lengths.tolist()), row.algorithm


def test_padded_baseline_runs_rows_of_the_longest_sample():
    w = TINY_WORKLOADS["tiny-rl-dp2"]
    rows, plans = run_workload(w, 0, algorithms=["fixed_padded"], keep_plans=True)
    lengths = w.generate(0).lengths
    sched = schedule_of("fixed_padded", plans[(w.name, 0, "fixed_padded")], lengths, w)
    for _, lens in sched.items():
        assert len(set(lens)) == 1
    assert sum(map(len, (lens for _, lens in sched.items()))) == lengths.size


def test_slower_microbatches_make_a_slower_step():
    w = TINY_WORKLOADS["tiny-dyncp-dp2-cp2"]
    rows, plans = run_workload(w, 0, keep_plans=True)
    lengths = w.generate(0).lengths
    cm, seconds_of = _modelled_seconds(w)
    for row in rows:
        sched = schedule_of(row.algorithm, plans[(w.name, 0, row.algorithm)], lengths, w)
        base = sched.compose(seconds_of, cm).step_s
        assert sched.compose(lambda g, ls: 2 * seconds_of(g, ls), cm).step_s == pytest.approx(2 * base)
