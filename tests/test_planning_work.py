"""The planner's work on issue 33's hostile inputs is bounded -- counted, not timed.

The seconds live in the bench (``megatron-dynbatch bench``'s planning-speed section, bench/adversarial.py) and in
docs/benchmarks.md; here the deterministic quantities those seconds follow: the unit search's work units and the
rank packings they buy (a tight grouped step once packed ~43,000 ranks in one search, 4-12 s of CPU), and the items
the heap packers go through on large steps (a fixed multiple of the step, however tight the budget).
"""

from __future__ import annotations

from typing import Dict

import numpy as np
import pytest

from megatron_dynbatch import DynBatchConfigError, plan_global_batch
from megatron_dynbatch.bench.adversarial import SHAPES, TIGHT_GROUPS
from megatron_dynbatch.core.planner import fallback, packer

from test_planner_properties import check_invariants


def _shape(name: str):
    return next(s for s in SHAPES if s.name == name)


def _count_search(monkeypatch) -> Dict[str, int]:
    """Counters of the unit search's spending: its work units and bin-search units (from the shared search work) and
    the ranks it hands to the packers."""
    seen = {"unit_work": 0, "bin_work": 0, "rank_packings": 0, "searches": 0}
    search, pack = fallback.units_search, packer.pack_rank

    def counted_search(inp, dp, m, work):
        units, bins = work.units_left, work.left
        try:
            return search(inp, dp, m, work)
        finally:
            seen["searches"] += 1
            seen["unit_work"] += units - work.units_left
            seen["bin_work"] += bins - work.left

    def counted_pack(members, inp, m):
        if inp.units is not None and len(members) < inp.aligned.size:  # one rank of a grouped step
            seen["rank_packings"] += 1
        return pack(members, inp, m)

    monkeypatch.setattr(fallback, "units_search", counted_search)
    monkeypatch.setattr(packer, "pack_rank", counted_pack)
    return seen


def _assert_search_bounded(seen: Dict[str, int]) -> None:
    assert seen["searches"] >= 1  # the hostile step does reach the unit search
    assert seen["unit_work"] <= fallback.PLAN_UNIT_SEARCH_WORK
    assert seen["bin_work"] <= fallback.PLAN_SEARCH_WORK
    # every rank it packs is charged at least PACK_UNITS: the search work bounds the packings too
    assert seen["rank_packings"] <= fallback.PLAN_UNIT_SEARCH_WORK // fallback.PACK_UNITS


def test_tight_grouped_step_plans_within_the_unit_search_work(monkeypatch):
    """Issue 33's 1,455 grouped samples (pp=8, vpp=4: only M=16 is valid): planned, within the search's work."""
    lengths, kwargs = _shape(TIGHT_GROUPS).build(0)
    seen = _count_search(monkeypatch)
    plan = plan_global_batch(lengths, **kwargs)
    check_invariants(plan, lengths, kwargs["parallel"], kwargs["group_ids"])
    assert plan.num_microbatches == 16
    _assert_search_bounded(seen)


def test_a_tighter_budget_is_refused_within_the_same_work(monkeypatch):
    """100 tokens less: no packing is found; the refusal spends the whole search work and no more (the old unit
    search packed ~43,000 ranks on this input: 9 s of CPU)."""
    lengths, kwargs = _shape(TIGHT_GROUPS).build(0)
    budget = kwargs["max_tokens_per_gpu"] - 100
    seen = _count_search(monkeypatch)
    with pytest.raises(DynBatchConfigError, match="no packing"):
        plan_global_batch(np.minimum(lengths, budget), **{**kwargs, "max_tokens_per_gpu": budget})
    _assert_search_bounded(seen)


def test_heap_packers_pass_over_each_sample_a_bounded_number_of_times(monkeypatch):
    """The MoE ep8 shape (issue 33: 65,536 samples over 1,024 ranks; here 4,096 and 16,384 samples, the same
    code paths): the micro-batch LPT and the rank assignment see each item at most a fixed number of times --
    two scored counts, each packed per rank and as global bins (a failing pass included)."""
    shape = _shape("GRPO MoE ep8 (FLOPs)")
    for n in (4096, 16_384):
        lengths, kwargs = shape.build(n)
        items = {"lpt": 0, "assign": 0}
        lpt, assign = packer._lpt_bins, packer.assign_ranks

        def counted_lpt(its, needs, weights, k, cap, _lpt=lpt):
            items["lpt"] += len(its)
            return _lpt(its, needs, weights, k, cap)

        def counted_assign(inp, dp, m, _assign=assign):
            items["assign"] += inp.unit_weight.size
            return _assign(inp, dp, m)

        monkeypatch.setattr(packer, "_lpt_bins", counted_lpt)
        monkeypatch.setattr(packer, "assign_ranks", counted_assign)
        plan_global_batch(lengths, **kwargs)
        monkeypatch.undo()
        assert 0 < items["lpt"] <= 6 * n and 0 < items["assign"] <= 3 * n, (n, items)
