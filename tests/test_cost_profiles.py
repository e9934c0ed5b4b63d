"""The fitted cost model: profiles, the floor and CP-member terms, topology, the decision margin, the cost-model
file and the fit (docs/cost_model.md). Modelled numbers only; no timing asserts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_dynbatch import CostModel, DynBatchConfigError, ParallelConfig, plan_global_batch
from megatron_dynbatch.core.cost_fit import fit_records, predict_records
from megatron_dynbatch.core.cost_model import kv_bytes_per_token
from megatron_dynbatch.core.cost_files import load_cost_model, resolve_cost_model, save_cost_model
from megatron_dynbatch.core.cost_profiles import ANALYTIC, FITTED, CostProfile, resolve_profile
from megatron_dynbatch.core.topology import fixed_cp_spans_nodes, group_spans_nodes, spans_by_size

ROOT = Path(__file__).resolve().parents[1]
HOSTILE_NUMBERS = [True, "0.1", float("nan"), float("inf"), -0.1, [0.1]]


# ------------------------------------------------------------------------------------------ profiles
def test_the_default_is_the_fitted_profile_and_analytic_is_the_old_model():
    par = ParallelConfig(dp=4, tp=2, cp=4)
    fitted, default = CostModel.from_model("qwen3-8b", par, profile="fitted"), CostModel.from_model("qwen3-8b", par)
    assert fitted == default and fitted.uncertainty == FITTED.uncertainty > 0
    old = CostModel.from_model("qwen3-8b", par, profile="analytic")
    assert (old.overhead_s, old.min_microbatch_s, old.cp_linear_overhead, old.cp_chunk_tokens) == (2e-3, 0, 0, 0)
    assert old.cp_comm_s_per_token == old.cp_comm_inter_s_per_token == pytest.approx(
        3 * kv_bytes_per_token("qwen3-8b") / 2 / 100e9)
    assert old.uncertainty == 0.0
    # per-layer terms count the model's layers
    assert fitted.overhead_s == pytest.approx(36 * FITTED.overhead_per_layer_s)
    assert fitted.min_microbatch_s == pytest.approx(36 * FITTED.min_per_layer_s)


def test_a_micro_batch_never_costs_less_than_the_floor():
    cm = CostModel.from_model("llama-3.1-70b", ParallelConfig(tp=8, cp=4, pp=4))
    one, member = cm.group_microbatch_time(1, 64, 64.0 ** 2), cm.group_microbatch_time(4, 256, 256.0 ** 2, True)
    assert one == pytest.approx(cm.min_microbatch_s)
    att = cm.attention_s_per_sq_token * 256.0 ** 2
    assert member == pytest.approx(cm.min_microbatch_s + cm.cp_min_microbatch_s + cm.cp_comm_time(4, 256, att, True))
    # large micro-batches are compute-bound: the floor does not apply
    big = cm.group_microbatch_time(1, 16384, 16384.0 ** 2)
    assert big > cm.min_microbatch_s and cm.microbatch_time(16384, 16384.0 ** 2) >= cm.min_microbatch_s


def test_a_cp_members_share_costs_more_than_its_fraction_and_more_so_for_small_chunks():
    cm = CostModel.from_model("qwen3-8b", ParallelConfig(tp=2)).with_cp_comm(0.0, 0.0, 0.0)
    old = CostModel.from_model("qwen3-8b", ParallelConfig(tp=2), profile="analytic").with_cp_comm(0.0, 0.0, 0.0)
    for L in (16384, 65536):
        tok, sq = float(L), float(L) ** 2
        for g in (2, 4, 16):
            excess = ((cm.group_microbatch_time(g, tok, sq) - cm.overhead_s)
                      / ((cm.microbatch_time(tok, sq) - cm.overhead_s) / g))
            plain = ((old.group_microbatch_time(g, tok, sq) - old.overhead_s)
                     / ((old.microbatch_time(tok, sq) - old.overhead_s) / g))
            assert plain == pytest.approx(1.0) and excess > 1.02
    ratio = lambda L, g: cm.group_work(g, L, L ** 2) / (cm.group_work(1, L, L ** 2) / g)  # noqa: E731
    assert ratio(16384.0, 16) > ratio(65536.0, 16) > ratio(65536.0, 2) > 1.0  # smaller chunks, larger share


def test_profiles_are_validated():
    with pytest.raises(DynBatchConfigError, match="profile.linear_efficiency"):
        FITTED.replace(linear_efficiency=1.5)
    with pytest.raises(DynBatchConfigError, match="profile.inter_node_bandwidth_Bps"):
        FITTED.replace(inter_node_bandwidth_Bps=0.0)
    with pytest.raises(DynBatchConfigError, match="not a cost-profile field"):
        FITTED.replace(linear_eff=0.5)
    with pytest.raises(DynBatchConfigError, match="profile"):
        resolve_profile("fited")
    with pytest.raises(DynBatchConfigError, match="profile"):
        resolve_profile(3)
    assert resolve_profile(np.str_("analytic")) is ANALYTIC
    assert CostProfile.from_dict({"linear_efficiency": np.float32(0.5)}).linear_efficiency == 0.5


# ------------------------------------------------------------------------------------------ topology
def test_megatron_rank_order_decides_which_groups_cross_nodes():
    par = ParallelConfig(dp=4, tp=2, cp=4)  # tp fastest: a CP group of 4 at tp=2 fills one node of 8
    assert [group_spans_nodes(0, s, par) for s in (1, 2, 4, 8, 16)] == [False, False, False, True, True]
    assert not group_spans_nodes(4, 4, par) and not fixed_cp_spans_nodes(par)
    wide = ParallelConfig(dp=4, tp=2, cp=4, gpus_per_node=16)
    assert not group_spans_nodes(0, 8, wide) and group_spans_nodes(0, 16, wide)
    assert fixed_cp_spans_nodes(ParallelConfig(dp=4, tp=8, cp=4))  # TP fills the node: every CP ring crosses
    # pipeline stages shift the ranks: dp=3 x cp=2 x tp=2 = 12 ranks per stage, the second stage starts mid-node
    odd = ParallelConfig(dp=3, tp=2, cp=2, pp=2)
    assert spans_by_size(odd, [(0, 6), (0, 4), (4, 2), (0, 2), (2, 2)]) == {2: False, 4: True, 6: True}


def test_node_crossing_is_the_stage_by_stage_definition_for_any_number_of_stages():
    """Which groups cross nodes, by the closed form over the stages' offsets (issue 28: with pp and gpus_per_node
    both 2 ** 20 the stage-by-stage loop ran a million times per group), against that loop."""
    from megatron_dynbatch.core.topology import groups_span_nodes

    def by_stage(start, size, par):
        n, width = par.gpus_per_node, par.tp * par.cp * par.dp
        first, last = par.tp * start, par.tp * (start + size) - 1
        return any((first + s * width % n) // n != (last + s * width % n) // n for s in range(min(par.pp, n)))

    rng = np.random.default_rng(0)
    for _ in range(400):
        par = ParallelConfig(dp=int(rng.integers(1, 9)), tp=int(rng.choice([1, 2, 3, 4])),
                             cp=int(rng.choice([1, 2, 3, 4])), pp=int(rng.integers(1, 12)),
                             gpus_per_node=int(rng.choice([1, 2, 4, 6, 8, 16])))
        start = int(rng.integers(0, par.dp * par.cp))
        size = int(rng.integers(1, par.dp * par.cp - start + 1))
        assert group_spans_nodes(start, size, par) == by_stage(start, size, par)
    huge = ParallelConfig(dp=3, cp=2, pp=2 ** 20, gpus_per_node=2 ** 20)  # stages start at every even rank
    offsets = np.unique(np.arange(2 ** 20, dtype=np.int64) * 6 % 2 ** 20)
    for start, size in [(0, 1), (0, 2), (0, 3), (1, 2), (5, 1), (0, 6)]:
        want = bool((((start + offsets) // 2 ** 20) != ((start + size - 1 + offsets) // 2 ** 20)).any())
        assert group_spans_nodes(start, size, huge) == want
    assert groups_span_nodes(np.arange(6), np.ones(6, dtype=np.int64), huge).tolist() == [False] * 6


def test_crossing_nodes_prices_the_ring_at_the_inter_node_numbers():
    cm = CostModel.from_model("qwen3-8b", ParallelConfig(dp=4, tp=2, cp=4))
    tok = np.array([8192.0])
    intra, inter = cm.cp_comm_time(16, tok, 0.0, False), cm.cp_comm_time(16, tok, 0.0, True)
    assert inter > 3 * intra > 0
    assert cm.cp_comm_inter_s_per_token / cm.cp_comm_s_per_token == pytest.approx(
        FITTED.intra_node_bandwidth_Bps / FITTED.inter_node_bandwidth_Bps)


@pytest.mark.parametrize("bad", [0, -8, True, 2.5, "8", None, 2 ** 21])
def test_gpus_per_node_is_validated(bad):
    with pytest.raises(DynBatchConfigError, match="gpus_per_node"):
        ParallelConfig(dp=2, gpus_per_node=bad)


def test_gpus_per_node_flows_from_every_entry_point():
    assert ParallelConfig.from_any({"dp": 2, "gpus_per_node": np.int64(4)}).gpus_per_node == 4
    assert ParallelConfig.from_any({"dp": 2}).gpus_per_node == 8
    from megatron_dynbatch import RunConfig

    rc = RunConfig.from_dict({"name": "r", "model": "qwen3-8b", "parallel": {"dp": 4, "tp": 2, "cp": 4,
                                                                              "gpus_per_node": 4},
                              "max_tokens_per_gpu": 20480})
    assert rc.parallel().gpus_per_node == 4 and rc.plan_options().parallel.gpus_per_node == 4
    assert rc.to_megatron_args()[-2:] == ["--dynbatch-gpus-per-node", "4"]
    assert RunConfig.from_dict(rc.to_dict()) == rc
    plan = plan_global_batch([30000, 500, 400, 300] * 4, model="qwen3-8b", parallel=rc.parallel(),
                             max_tokens_per_gpu=20480, dynamic_cp=True)
    assert plan.parallel.gpus_per_node == 4


def test_megatron_flags_carry_gpus_per_node_margin_and_profile(monkeypatch):
    import argparse

    args_mod = pytest.importorskip("megatron_dynbatch.megatron.args")
    parser = args_mod.add_dynamic_batch_args(argparse.ArgumentParser())
    base = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"]

    def parse(*extra):
        ns = parser.parse_args(base + list(extra))
        ns.data_parallel_size, ns.tensor_model_parallel_size, ns.context_parallel_size = 2, 2, 2
        return ns

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert args_mod.parallel_from_args(parse()).gpus_per_node == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert args_mod.parallel_from_args(parse()).gpus_per_node == 4
    assert args_mod.parallel_from_args(parse("--dynbatch-gpus-per-node", "16")).gpus_per_node == 16
    for bad in (("--dynbatch-gpus-per-node", "0"), ("--dynbatch-decision-margin", "1.5"),
                ("--dynbatch-decision-margin", "nan"), ("--dynbatch-cost-model", "fited")):
        with pytest.raises(DynBatchConfigError, match=bad[0]):
            args_mod.validate_dynamic_batch_args(parse(*bad))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "lots")
    with pytest.raises(DynBatchConfigError, match="LOCAL_WORLD_SIZE"):
        args_mod.parallel_from_args(parse())
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    ns = args_mod.validate_dynamic_batch_args(parse("--dynbatch-cost-model", "analytic",
                                                    "--dynbatch-decision-margin", "0.05"))
    ns.num_layers, ns.hidden_size, ns.num_attention_heads, ns.ffn_hidden_size = 2, 64, 4, 128
    ns.padded_vocab_size = 256
    opts = args_mod.plan_options_from_args(ns)
    assert opts.decision_margin == 0.05 and opts.resolve().cost_model.min_microbatch_s == 0.0  # analytic: no floor


# ------------------------------------------------------------------------------------------ margin
@pytest.mark.parametrize("bad", HOSTILE_NUMBERS + [1.0])
def test_decision_margin_is_validated(bad):
    with pytest.raises(DynBatchConfigError, match="decision_margin"):
        plan_global_batch([100, 200], max_tokens_per_gpu=1024, balance_by_flops=False, decision_margin=bad)


def test_dynamic_cp_leaves_fixed_cp_only_for_a_gain_above_the_margin():
    lengths = [16000] + [3000] * 31  # one document dominates a rank of a one-micro-batch batch
    kw = dict(model="llama-3.1-8b", parallel={"dp": 8, "tp": 2}, max_tokens_per_gpu=32768, dynamic_cp=True)
    free = plan_global_batch(lengths, decision_margin=0.0, **kw)
    gain = free.speedup_vs_fixed_cp - 1
    assert 0.1 < gain < 0.8 and free.candidate != "fixed-cp"
    mid = plan_global_batch(lengths, decision_margin=gain * 0.9, **kw)  # a tie may go to smaller groups
    assert mid.candidate != "fixed-cp" and mid.predicted_step_time < mid.fixed_cp_step_time
    assert max(mid.group_sizes()) <= max(free.group_sizes())
    held = plan_global_batch(lengths, decision_margin=gain * 1.1, **kw)
    assert held.candidate == "fixed-cp" and held.predicted_step_time == pytest.approx(held.fixed_cp_step_time)
    assert plan_global_batch(lengths, decision_margin=np.float32(0.9), **kw).candidate == "fixed-cp"


def test_past_the_margin_the_fastest_wins_and_exact_ties_go_to_smaller_groups_then_inside_a_node():
    """The fixed-CP plan unless another is faster by more than the margin; then the fastest (not the narrowest
    within the margin, which trailed Megatron-LM dev's scheduler on two bench batches); on an exact tie the
    smaller widest group, then the one inside a node."""
    from megatron_dynbatch.core.planner.dyncp.orchestrate import choose

    class Cand:
        def __init__(self, name, t, widest, crosses):
            self.name, self.t, self.widest, self.crosses_nodes = name, t, widest, crosses

        def makespan(self):
            return self.t

    fixed = Cand("fixed-cp", 1.04, 4, False)
    wide, narrow, narrow_cross = Cand("a", 1.0, 16, True), Cand("b", 1.02, 8, False), Cand("c", 1.01, 8, True)
    assert choose([fixed, wide, narrow, narrow_cross], fixed, 0.05) is fixed
    assert choose([fixed, wide, narrow, narrow_cross], fixed, 0.03) is wide
    assert choose([fixed, wide, narrow, narrow_cross], fixed, 0.0) is wide
    tie_wide, tie_cross, tie_inside = Cand("a", 1.0, 16, False), Cand("b", 1.0, 8, True), Cand("c", 1.0, 8, False)
    assert choose([tie_wide, tie_cross, tie_inside], None, 0.05) is tie_inside
    assert choose([tie_wide, tie_cross], None, 0.05) is tie_cross


def test_under_pp_more_micro_batches_need_a_gain_above_the_margin():
    rng = np.random.default_rng(3)
    lengths = rng.integers(200, 16000, 512)
    kw = dict(model="llama-3.1-70b", parallel={"dp": 4, "tp": 8, "pp": 4}, max_tokens_per_gpu=16384)
    eager = plan_global_batch(lengths, decision_margin=0.0, **kw)
    careful = plan_global_batch(lengths, decision_margin=0.5, **kw)
    assert careful.num_microbatches <= eager.num_microbatches
    assert careful.num_microbatches == plan_global_batch(lengths, num_microbatches=None, decision_margin=0.99,
                                                         **kw).num_microbatches
    assert eager.predicted_step_time <= careful.predicted_step_time * (1 + 1e-9)


def test_the_count_margin_is_charged_to_what_the_count_changes():
    """A larger count's gain is weighed against the uncertainty of the terms a count changes (per-micro-batch fixed
    costs, the pipeline bubble), not of the whole step: with pp=1 and large micro-batches the share is small, so a
    better-balanced extra micro-batch wins (bench's sft-mix-8b: 13 micro-batches, 1.9% faster than 12); under
    pp=4 vpp=2 the bubble and floors make it large, so a 0.03% gain does not buy 4 more micro-batches."""
    from megatron_dynbatch.bench.workloads import WORKLOADS
    from megatron_dynbatch.core.planner.search import count_dependent_share, within_margin

    flat = CostModel.from_model("llama-3.1-8b", ParallelConfig(dp=8, tp=2, cp=2))
    share = count_dependent_share(13, 10.3, flat)
    assert 0 < share < 0.2 and share == pytest.approx(13 * float(flat.microbatch_time(0, 0)) / 10.3)
    piped = CostModel.from_model("qwen3-32b", ParallelConfig(dp=8, tp=4, pp=4, vpp=2))
    assert count_dependent_share(20, 5.9, piped) > 1.5 / 21.5  # the bubble alone
    assert count_dependent_share(10**6, 1.0, piped) == 1.0
    scored = [(12, ([], 10.51, 1.02)), (13, ([], 10.31, 1.0))]
    assert within_margin(scored, 0.032)[0] == 12  # the whole-step margin keeps the fewer
    assert within_margin(scored, 0.032, flat)[0] == 13  # charged to the count's share, the balance gain counts
    for name, want in (("sft-mix-8b", 13), ("pp4-vpp2-qwen3-32b", 16)):
        w = WORKLOADS[name]
        plan = plan_global_batch(w.generate(0).lengths, model=w.model, parallel=w.parallel,
                                 max_tokens_per_gpu=w.max_tokens_per_gpu)
        assert plan.microbatches_per_step == [want], name


# ------------------------------------------------------------------------------------------ the file
def test_cost_model_file_round_trips_the_new_keys_and_old_files_still_load(tmp_path):
    cm = CostModel.from_model("qwen3-8b", ParallelConfig(tp=2))
    path = tmp_path / "cm.json"
    save_cost_model(cm, path, profile=FITTED)
    back = load_cost_model(path)
    assert back == CostModel(**{k: v for k, v in cm.to_dict().items() if k not in ("pp", "vpp", "ep_group", "cp")})
    assert CostModel.from_model("qwen3-8b", ParallelConfig(tp=2), profile=str(path)) == cm  # the profile section
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"linear_s_per_token": 1e-6, "attention_s_per_sq_token": 1e-10, "overhead_s": 1e-3,
                               "fit": {"num_measurements": 3}}))
    loaded = load_cost_model(old)
    assert (loaded.min_microbatch_s, loaded.cp_chunk_tokens, loaded.uncertainty) == (0.0, 0.0, 0.0)
    assert resolve_cost_model(str(old), "qwen3-8b", ParallelConfig(tp=2)) == loaded  # no profile: coefficients


@pytest.mark.parametrize("entry", [{"overhead": 1e-3}, {"min_microbatch_s": True}, {"min_microbatch_s": "1e-3"},
                                   {"cp_chunk_tokens": -1.0}, {"uncertainty": 2.0}, {"cp_comm_overlap": 1.5},
                                   {"profile": {"linear_efficiency": 0.0}}, {"profile": {"typo": 1}},
                                   {"cp_comm_inter_s_per_token": float("nan")}])
def test_hostile_cost_model_files_are_refused(tmp_path, entry):
    path = tmp_path / "bad.json"
    d = {"linear_s_per_token": 1e-6, "attention_s_per_sq_token": 1e-10, "overhead_s": 1e-3, **entry}
    path.write_text(json.dumps(d))
    with pytest.raises(DynBatchConfigError):
        load_cost_model(path)


@pytest.mark.parametrize("choice", ["fited", 3, 1.5, object(), "/no/such/file.json"])
def test_unknown_cost_models_are_refused(choice):
    with pytest.raises(DynBatchConfigError, match="cost_model"):
        plan_global_batch([100, 200], model="qwen3-8b", max_tokens_per_gpu=1024, cost_model=choice)


def test_a_profile_needs_a_model():
    with pytest.raises(DynBatchConfigError, match="needs the model"):
        plan_global_batch([100, 200], max_tokens_per_gpu=1024, cost_model="fitted", balance_by_flops=False)
    plan = plan_global_batch([100, 200], model="qwen3-8b", max_tokens_per_gpu=1024, cost_model="analytic")
    assert plan.num_microbatches == 1


# ------------------------------------------------------------------------------------------ the fit
def test_fit_records_recovers_a_known_profile_and_reports_per_group_errors():
    true = FITTED.replace(linear_efficiency=0.5, attention_efficiency=0.3, min_per_layer_s=2e-3,
                          cp_min_per_layer_s=0.5e-3, cp_chunk_tokens=300.0, cp_linear_overhead=0.1,
                          overhead_per_layer_s=1e-3)
    rng = np.random.default_rng(0)
    records = []
    for _ in range(400):
        g = int(rng.choice([1, 2, 4, 8]))
        n = int(rng.integers(1, 8))
        lengths = rng.integers(16, 40000, n).tolist() if rng.random() < 0.8 else [int(rng.integers(8, 300))]
        records.append([g, lengths, 1.0])
    secs = predict_records(true, records, "llama-3.1-8b", measured_layers=2, tp=2)
    records = [[g, L, float(s)] for (g, L, _), s in zip(records, secs)]
    cm, report = fit_records(records, "llama-3.1-8b", measured_layers=2, tp=2)
    got = CostProfile.from_dict(report.profile)
    for name in ("linear_efficiency", "attention_efficiency", "min_per_layer_s", "cp_min_per_layer_s",
                 "cp_chunk_tokens", "cp_linear_overhead", "overhead_per_layer_s"):
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-3), name
    assert report.max_rel_error < 1e-6 and set(report.per_group) == {1, 2, 4, 8}
    assert cm == CostModel.from_model("llama-3.1-8b", ParallelConfig(tp=2), profile=got)


@pytest.mark.parametrize("records", [[], [[1, [100], 0.1]] * 2, [[0, [100], 0.1]] * 3, [[1, [], 0.1]] * 3,
                                     [[1, [100], -1.0]] * 3, [[1, [1.5], 0.1]] * 3, [[1, [100]]] * 3,
                                     [[True, [100], 0.1]] * 3, "records"])
def test_fit_records_refuses_bad_records(records):
    with pytest.raises(DynBatchConfigError, match="records"):
        fit_records(records, "llama-3.1-8b", measured_layers=2, tp=2)


def test_the_shipped_profile_is_the_fit_of_the_shared_measurements():
    """benchmarks/gpu/fit_profile.py --check, in-process (the data ship in benchmarks/gpu/results)."""
    import runpy
    import sys

    sys.argv = ["fit_profile.py", "--check"]
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(ROOT / "benchmarks" / "gpu" / "fit_profile.py"), run_name="__main__")
    assert done.value.code == 0


# ------------------------------------------------------------------------------------------ CLI, bench, data
def test_plan_and_bench_take_the_cost_model_the_margin_and_gpus_per_node(tmp_path, capsys):
    from megatron_dynbatch.cli import main

    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(map(str, [30000] + [2000] * 15)))
    base = ["plan", "--lengths", str(lengths), "--model", "qwen3-8b", "--dp", "4", "--tp", "2", "--cp", "4",
            "--max-tokens-per-gpu", "20480", "--dynamic-cp", "--json"]
    assert main(base + ["--cost-model", "analytic", "--decision-margin", "0", "--gpus-per-node", "16"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["parallel"]["gpus_per_node"] == 16
    for bad in (["--gpus-per-node", "0"], ["--decision-margin", "1.5"], ["--decision-margin", "x"]):
        assert main(base + bad) == 2
        assert bad[0] in capsys.readouterr().err
    assert main(base + ["--cost-model", "fited"]) != 0
    assert "--cost-model" in capsys.readouterr().err
    out = tmp_path / "b.json"
    assert main(["bench", "--workloads", "dyncp-longdoc-8b-1mb", "--no-speed", "--cost-model", "analytic",
                 "--gpus-per-node", "4", "--decision-margin", "0.05", "--output", str(out)]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert (meta["cost_model"], meta["gpus_per_node"], meta["decision_margin"]) == ("analytic", 4, 0.05)


def test_workloads_take_an_explicit_document_file(tmp_path):
    from megatron_dynbatch.bench.workloads import WORKLOADS, load_document_lengths

    w = WORKLOADS["dyncp-longdoc-8b-1mb"]
    docs = np.arange(1000, 1100, dtype=np.int64)
    batch = w.generate(0, documents=docs)
    assert set(batch.lengths[:-1].tolist()) <= set(docs.tolist())
    assert batch.source.startswith("given document lengths (100)")
    assert w.generate(0, documents=docs).lengths.tolist() == batch.lengths.tolist()
    f = tmp_path / "docs.json"
    f.write_text(json.dumps(docs.tolist()))
    assert load_document_lengths(f).tolist() == docs.tolist()
    for bad in ([], [1.5, 2.0], [0, 10], "text"):
        f.write_text(json.dumps(bad))
        with pytest.raises(DynBatchConfigError, match="docs.json"):  # the file is named
            load_document_lengths(f)
    with pytest.raises(DynBatchConfigError, match="documents"):
        load_document_lengths(tmp_path / "missing.json")


def test_the_fast_swap_search_is_the_matrix_search():
    from megatron_dynbatch.core.planner.dyncp.deal import _rows_best, best_swap

    rng = np.random.default_rng(5)
    for t in range(3000):
        na, nb = rng.integers(1, 40, 2)
        pick = rng.random(5)
        ta = rng.choice(pick, na) if t % 3 == 0 else rng.random(na)
        tb = rng.choice(pick, nb) if t % 3 == 0 else rng.random(nb)
        ala, alb = rng.integers(1, 20, na).astype(float), rng.integers(1, 20, nb).astype(float)
        gap, ra, rb = float(rng.random() * 2), float(rng.integers(-5, 20)), float(rng.integers(-5, 20))
        dev, q = _rows_best(ta, tb, ala, alb, gap, ra, rb)
        p = int(np.argmin(dev))
        expected = (float(dev[p]), p, int(q[p])) if np.isfinite(dev[p]) else None
        assert best_swap(ta, tb, ala, alb, gap, ra, rb) == expected


def test_gpu_comparison_rebuilds_the_measured_plans():
    """benchmarks/gpu/compare.py on one measured batch: the e7fb6ba plans come back (every micro-batch share is
    in the timing records) and the fitted model puts their ratio within 3% of the measured one (H100,
    2026-11-25). The batch's lengths come from the bundle (``results/h100_2026-11-25_batches.json``), as in a clone;
    where the real document file is there, the bundle is checked against a fresh draw from it."""
    import sys

    docs = ROOT.parent / "shared" / "data" / "document_lengths_wlbllm.json"
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    try:
        import compare
        from gpu_data import measured_lookup, measured_ratios

        key = "dyncp-longdoc-8b-1mb/s0"
        batches = compare.measured_batches(str(docs) if docs.is_file() else None)
        row = compare.evaluate(key, measured_ratios()[key], batches[key], measured_lookup())
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "gpu"))
    assert row["composed"] == pytest.approx(row["measured"], rel=0.01)
    assert row["fitted_compute"] == pytest.approx(row["measured"], rel=0.03)
    assert abs(row["analytic"] / row["measured"] - 1) > 0.05  # the old model was off by 7%
    assert row["new_ratio"] >= 1.8


@pytest.mark.parametrize("field, value", [("cost_model", "fited"), ("cost_model", 3), ("cost_model", ["fitted"]),
                                          ("decision_margin", "0.1"), ("decision_margin", -1), ("decision_margin", 1.0),
                                          ("decision_margin", float("nan")), ("decision_margin", True)])
def test_run_presets_refuse_bad_cost_models_and_margins(field, value):
    from megatron_dynbatch import RunConfig

    base = {"name": "r", "model": "qwen3-8b", "parallel": {"dp": 2}, "max_tokens_per_gpu": 8192}
    with pytest.raises(DynBatchConfigError, match=field):
        RunConfig.from_dict({**base, field: value})
    ok = RunConfig.from_dict({**base, "cost_model": "analytic", "decision_margin": np.float64(0.05)})
    assert ok.plan_options().decision_margin == 0.05 and ok.to_dict()["cost_model"] == "analytic"
    assert "--dynbatch-cost-model" in ok.to_megatron_args()
