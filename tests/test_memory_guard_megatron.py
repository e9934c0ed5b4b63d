"""The online memory guard and the per-step figures on real megatron-core (CPU, gloo; issue 27 items 5 and 6).

Two DP ranks train a tiny GPT through ``dynamic_forward_backward(..., memory_guard=guard)``; the CUDA peak reader
is replaced by the deterministic fake of ``megatron/memory_reader.py`` (the same code path: reader.measure around the
schedule call), which reports a peak TWICE as large per token on rank 1 as on rank 0. Then

* one all-reduce (MAX) gives both ranks rank 1's reading: both lower the budget alike, to what rank 1's slope
  fits -- rank 0 alone would have kept the start budget -- and both plan the next step with it (identical plans);
* the loss of the guarded steps equals the loss without the guard (a new budget regroups; the math stays), and
  a step planned with the lowered budget has exactly the gradients of the same plan run unguarded;
* a rank whose reader returns NaN sends "not measured" and nobody hangs: the other rank's reading decides;
* the Ray path: each actor's ``train_on_shard(..., record_memory=True)`` returns its reading vector and its
  ``dynbatch/...`` figures; the driver's guard merges them and lowers its budget the same way.

The Megatron-LM hook's writers are tested with small fakes that record ``add_scalar`` / ``log`` calls (the real
Megatron-LM is not importable here)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_dynbatch.core.errors import DynBatchConfigError  # noqa: E402
from megatron_dynbatch.core.memory import MemorySettings  # noqa: E402
from megatron_dynbatch.megatron.ranks import run_ranks  # noqa: E402

VOCAB = 128
START = 96
SETTINGS = MemorySettings(reserve_gb=0.0, headroom=0.1)


def _plan_key(plan) -> str:
    d = plan.to_dict()
    d.pop("planning_time_s", None)
    d["summary"].pop("planning_time_s", None)
    return json.dumps(d, sort_keys=True, default=str)


def _card_for(spec, parallel, tokens_at_double: float) -> float:
    """A card whose usable bytes hold ``tokens_at_double`` tokens per GPU at twice the model's per-token cost."""
    from megatron_dynbatch.core.memory.guard import MemoryGuard

    probe = MemoryGuard(START, 1e12, model=spec, parallel=parallel, settings=SETTINGS)
    t = probe.terms[0]
    return (t.static + 2.0 * tokens_at_double * t.per_token) / (1.0 - SETTINGS.headroom)


class BrokenReader:
    """A reader that runs the step but returns a NaN peak (a broken allocator statistic)."""

    def __init__(self, inner):
        self.inner = inner

    def measure(self, fn, probe=None):
        from megatron_dynbatch.megatron.memory_reader import MemoryReading

        reading = self.inner.measure(fn, probe)
        return MemoryReading(reading.base, float("nan"))


def _worker(rank: int, world_size: int) -> dict:
    from megatron_dynbatch.demo import quiet_megatron_warnings, synthetic_rl_batch

    quiet_megatron_warnings()
    from megatron_dynbatch.core.memory.guard import MemoryGuard
    from megatron_dynbatch.core.model_spec import ModelSpec
    from megatron_dynbatch.megatron.memory_reader import FakeMemoryReader
    from megatron_dynbatch.megatron.memory_guard import StepMemoryGuard
    from megatron_dynbatch.megatron.schedule import dynamic_forward_backward
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    megatron_cpu.init_cpu_distributed(rank, world_size)
    try:
        config = megatron_cpu.tiny_gpt_config()
        torch.manual_seed(1234)
        model = megatron_cpu.wrap_ddp(config, megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, thd=True))
        spec = ModelSpec.from_megatron(config, vocab_size=VOCAB)
        parallel = {"dp": world_size}
        kwargs = {"model": spec, "parallel": parallel, "max_tokens_per_gpu": START}
        per_token = MemoryGuard(START, 1e12, model=spec, parallel=parallel, settings=SETTINGS).terms[0].per_token
        base = 1 << 20

        def reader(nan: bool = False):
            def peak_of(probe):  # rank 1 needs twice rank 0's bytes per token
                return (1 + rank) * per_token * probe.tokens

            fake = FakeMemoryReader(peak_of, base=base)
            return BrokenReader(fake) if nan else fake

        card = _card_for(spec, parallel, 65)
        lines: list = []
        guard = StepMemoryGuard(START, card, model=spec, parallel=parallel, settings=SETTINGS, reader=reader(),
                                multiple=16, skip_steps=0, log=lines.append)
        out: dict = {"steps": [], "lines": lines}

        def grads():
            return {n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()}

        for step in range(2):
            samples = synthetic_rl_batch(16, seed=40 + step, max_len=40)
            model.zero_grad_buffer()
            res = dynamic_forward_backward(model, samples, kwargs, memory_guard=guard)
            g_on = grads()
            model.zero_grad_buffer()
            off = dynamic_forward_backward(model, samples, kwargs)  # the configured budget, no guard
            model.zero_grad_buffer()
            same = dynamic_forward_backward(model, samples, res.iterator.plan)  # the guarded plan, unguarded
            out["steps"].append({
                "budget_used": res.iterator.plan.cap, "budget_next": guard.budget, "plan": _plan_key(res.iterator.plan),
                "loss": res.loss, "loss_off": off.loss, "loss_same": same.loss,
                "grad_diff_same": max(float((g_on[n] - g).abs().max()) for n, g in grads().items()),
                "peak": res.peak_bytes, "predicted": res.predicted_peak_bytes, "seconds": res.seconds,
                "metrics": res.metrics(), "max_mb": res.iterator.plan.max_microbatch_tokens})
        # a rank whose reader gives NaN: "not measured", no hang; the other rank's reading decides
        nan_guard = StepMemoryGuard(START, card, model=spec, parallel=parallel, settings=SETTINGS,
                                    reader=reader(nan=(rank == 1)), multiple=16, skip_steps=0, log=None)
        dynamic_forward_backward(model, synthetic_rl_batch(16, seed=77, max_len=40), kwargs, memory_guard=nan_guard)
        out["nan"] = {"budget": nan_guard.budget, "merged": nan_guard.last_merged.tolist()}
        # the Ray path without Ray: plan on "the driver" (here every rank), train this rank's shard
        from megatron_dynbatch.integrations.ray import plan_rollout, train_on_shard

        rollout = plan_rollout(synthetic_rl_batch(16, seed=90, max_len=40), put=False, log_probs=False, **kwargs)
        model.zero_grad_buffer()
        shard_res = train_on_shard(model, rollout[rank], record_memory=True, memory_reader=reader())
        out["ray"] = {"memory": shard_res.memory, "metrics": shard_res.metrics, "rollout": rollout.metrics(),
                      "plan": _plan_key(rollout.plan)}
        return out
    finally:
        megatron_cpu.destroy()


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, 2, timeout=300)


@pytest.mark.multiprocess
def test_both_ranks_lower_the_budget_alike_to_what_the_heaviest_rank_fits(ranks):
    a, b = ranks
    first = a["steps"][0]
    assert first["budget_used"] == START  # step 1 ran with the configured budget
    assert first["budget_next"] == 64  # rank 1's slope (2x the model) fits 65 tokens: lowered to the multiple
    for s in range(2):
        assert a["steps"][s]["budget_next"] == b["steps"][s]["budget_next"]
        assert a["steps"][s]["plan"] == b["steps"][s]["plan"]  # the same plan on both ranks, no other exchange
        assert a["steps"][s]["peak"] == b["steps"][s]["peak"]  # the max over the ranks
    for s in (1,):  # the following step is planned with the lowered budget, under it
        assert a["steps"][s]["budget_used"] == 64 and a["steps"][s]["max_mb"] <= 64
    assert a["lines"] == b["lines"] and len(a["lines"]) == 1
    assert a["lines"][0].startswith("dynbatch memory guard | step 1 | budget 96 -> 64 tokens per GPU (lowered)")
    doc = (Path(__file__).resolve().parents[1] / "docs" / "tuning.md").read_text(encoding="utf-8")
    assert a["lines"][0] in doc.splitlines()  # docs/tuning.md quotes this run's line exactly


@pytest.mark.multiprocess
def test_the_guard_never_changes_the_math(ranks):
    for r in ranks:
        for s in r["steps"]:
            assert s["loss"] == pytest.approx(s["loss_off"], rel=1e-5, abs=1e-6)  # regrouped, same loss
            assert s["loss"] == s["loss_same"] and s["grad_diff_same"] == 0.0  # the same plan, bit for bit


@pytest.mark.multiprocess
def test_each_step_reports_its_figures(ranks):
    for r in ranks:
        for s in r["steps"]:
            m = s["metrics"]
            assert m["dynbatch/max_tokens_per_gpu"] == s["budget_used"]
            assert m["dynbatch/measured_step_time_s"] == s["seconds"] > 0  # measured: the reader synchronises
            assert m["dynbatch/peak_memory_gb"] * 2 ** 30 == pytest.approx(s["peak"])
            assert m["dynbatch/predicted_peak_memory_gb"] > 0 and m["dynbatch/microbatches"] >= 1


@pytest.mark.multiprocess
def test_a_rank_with_an_unreadable_peak_neither_hangs_nor_decides(ranks):
    a, b = ranks
    assert a["nan"] == b["nan"]
    merged = a["nan"]["merged"]
    assert merged[1] > merged[0] > 0 and a["nan"]["budget"] == START  # rank 0's reading alone: fits, kept


@pytest.mark.multiprocess
def test_ray_actors_send_readings_and_figures_and_the_driver_guard_lowers_alike(ranks):
    from megatron_dynbatch.core.memory.guard import MemoryGuard
    from megatron_dynbatch.core.planner import Plan
    from megatron_dynbatch.integrations.ray import plan_rollout, update_memory_guard
    from megatron_dynbatch.integrations.ray.shards import RolloutPlan, ShardResult

    a, b = ranks
    assert a["ray"]["plan"] == b["ray"]["plan"] and a["ray"]["rollout"] == b["ray"]["rollout"]
    assert a["ray"]["rollout"]["dynbatch/max_tokens_per_gpu"] == START
    for r in ranks:
        m = r["ray"]["metrics"]
        assert m["dynbatch/peak_memory_gb"] > 0 and "dynbatch/microbatches" in m  # this actor's own peak
    assert a["ray"]["memory"][1] < b["ray"]["memory"][1]  # rank 1 read twice the bytes per token
    from megatron_dynbatch.megatron import cpu as megatron_cpu  # noqa: F401  (the same tiny model's shape)

    spec = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
            "ffn_hidden_size": 128, "swiglu": True, "vocab_size": VOCAB}
    from megatron_dynbatch.core.model_spec import ModelSpec

    spec = ModelSpec.from_any(spec)
    guard = MemoryGuard(START, _card_for(spec, {"dp": 2}, 65), model=spec, parallel={"dp": 2}, settings=SETTINGS,
                        multiple=16, skip_steps=0)
    plan = Plan.from_dict(json.loads(a["ray"]["plan"]))
    rollout = RolloutPlan("b", [], plan, None)

    def result(r, mem):
        return ShardResult("b", r, "train", 0, [], None, None, None, 1, True, 0.0, 0, memory=mem)

    change = update_memory_guard(guard, [result(0, a["ray"]["memory"]), None, result(1, b["ray"]["memory"])], rollout)
    assert change is not None and guard.budget == 64
    nxt = plan_rollout(lengths=[30] * 8, sample_refs=list(range(8)), loss_mask_sums=[10] * 8, put=False,
                       log_probs=False, memory_guard=guard, model=spec, parallel={"dp": 2})
    assert nxt.plan.cap == 64 and nxt.metrics()["dynbatch/max_tokens_per_gpu"] == 64
    with pytest.raises(DynBatchConfigError, match="record_memory=True"):
        update_memory_guard(guard, [result(0, None)], rollout)


# ------------------------------------------------------------------------------------ the Megatron-LM hook
class FakeTensorBoard:
    def __init__(self):
        self.calls = []

    def add_scalar(self, name, value, step):
        self.calls.append((name, value, step))


class FakeWandb:
    def __init__(self):
        self.calls = []

    def log(self, values, step):
        self.calls.append((dict(values), step))


def _launch(flags, **extra):
    from megatron_dynbatch.megatron.args import add_dynamic_batch_args, validate_dynamic_batch_args

    ns = add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(flags)
    base = dict(data_parallel_size=2, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                group_query_attention=True, ffn_hidden_size=128, swiglu=True, padded_vocab_size=VOCAB,
                vocab_size=VOCAB, seq_length=64, curr_iteration=0, log_interval=1, tensorboard_log_interval=2)
    for k, v in {**base, **extra}.items():
        setattr(ns, k, v)
    return validate_dynamic_batch_args(ns)


def _fake_step(recorded):
    from megatron_dynbatch.core.planner.api import plan_resolved

    def run_step(model, samples, options, **kw):  # the hook's options: resolved once per run
        recorded.append(kw)
        plan = plan_resolved([len(s["tokens"]) for s in samples], options)
        res = SimpleNamespace(loss=1.5, num_microbatches=plan.num_microbatches, iterator=SimpleNamespace(plan=plan))
        from megatron_dynbatch.core.metrics import step_metrics

        res.metrics = lambda: step_metrics(plan, measured_step_s=0.5)
        return res

    return run_step


def test_the_hook_writes_the_figures_to_megatrons_writers_on_the_iterations_it_logs():
    from megatron_dynbatch.integrations.megatron_lm import DynamicForwardBackward

    args = _launch(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"])
    tb, wb = FakeTensorBoard(), FakeWandb()
    recorded: list = []
    hook = DynamicForwardBackward(object(), args, run_step=_fake_step(recorded), writers=lambda: (tb, wb))
    batch = [{"tokens": list(range(n))} for n in (10, 30, 50, 20)]
    for it in range(4):
        args.curr_iteration = it
        hook(data_iterator=iter([batch]), model=None, num_microbatches=1)
        assert hook.last_metrics["dynbatch/max_tokens_per_gpu"] == 64
        assert hook.last_metrics["dynbatch/measured_step_time_s"] == 0.5
    logged = sorted({step for _, _, step in tb.calls})
    assert logged == [2, 4]  # --tensorboard-log-interval 2: the iterations Megatron writes its own scalars
    assert {name for name, _, _ in tb.calls} == set(hook.last_metrics)
    assert [step for _, step in wb.calls] == [2, 4] and wb.calls[-1][0] == hook.last_metrics
    assert "memory_guard" not in recorded[0]  # off unless --dynbatch-memory-guard


def test_the_hook_writes_nothing_where_megatron_has_no_writer():
    from megatron_dynbatch.integrations.megatron_lm import DynamicForwardBackward
    from megatron_dynbatch.integrations.megatron_lm.training import megatron_writers

    assert megatron_writers() == (None, None)  # no Megatron-LM here: the lazy lookup finds none
    args = _launch(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"], tensorboard_log_interval=1)
    hook = DynamicForwardBackward(object(), args, run_step=_fake_step([]), writers=lambda: (None, None))
    hook(data_iterator=iter([[{"tokens": list(range(20))}] * 2]), model=None, num_microbatches=1)
    assert hook.last_metrics  # still kept for the caller


def test_the_hook_hands_its_guard_to_every_step():
    from megatron_dynbatch.integrations.megatron_lm import DynamicForwardBackward
    from megatron_dynbatch.megatron.memory_reader import FakeMemoryReader
    from megatron_dynbatch.megatron.args import plan_options_from_args
    from megatron_dynbatch.megatron.memory_guard import memory_guard_from_args

    args = _launch(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--dynbatch-memory-guard"])
    opts = plan_options_from_args(args)
    guard = memory_guard_from_args(args, opts.resolve(), card_bytes=80 * 2 ** 30,
                                   reader=FakeMemoryReader(lambda p: 0.0), log=None)
    assert guard.budget == 64 and guard.state.floor == 64  # --seq-length 64 must still fit
    assert guard.state.settings.optimizer == "replicated"  # the launch's flags: no --use-distributed-optimizer
    recorded: list = []
    hook = DynamicForwardBackward(object(), args, run_step=_fake_step(recorded), memory_guard=guard,
                                  writers=lambda: (None, None))
    hook(data_iterator=iter([[{"tokens": list(range(20))}] * 2]), model=None, num_microbatches=1)
    assert recorded[0]["memory_guard"] is guard


def test_the_flag_and_its_checks():
    args = _launch(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--dynbatch-memory-guard"])
    assert args.dynbatch_memory_guard is True
    with pytest.raises(DynBatchConfigError, match="--dynbatch-memory-guard=True: only applies to dynamic batching"):
        _launch(["--dynbatch-memory-guard"])


def test_no_card_size_known_on_a_machine_without_cuda():
    from megatron_dynbatch.megatron.args import plan_options_from_args
    from megatron_dynbatch.megatron.memory_guard import StepMemoryGuard, card_bytes_of, memory_guard_from_args

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    args = _launch(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--dynbatch-memory-guard"])
    with pytest.raises(DynBatchConfigError, match="no card size is known"):
        card_bytes_of()
    with pytest.raises(DynBatchConfigError, match="no card size is known"):
        memory_guard_from_args(args, plan_options_from_args(args).resolve())
    with pytest.raises(DynBatchConfigError, match="CUDA"):  # a card given, but no CUDA allocator to read
        StepMemoryGuard(64, 80 * 2 ** 30, model="tiny-gpt")
    with pytest.raises(DynBatchConfigError, match="measure"):
        StepMemoryGuard(64, 80 * 2 ** 30, model="tiny-gpt", reader=object())
    from megatron_dynbatch.megatron.memory_guard import MemoryRecorder

    with pytest.raises(DynBatchConfigError, match="measure"):
        MemoryRecorder(reader=object())
    with pytest.raises(DynBatchConfigError, match="CUDA"):
        MemoryRecorder()
    from megatron_dynbatch.integrations.ray import update_memory_guard

    with pytest.raises(DynBatchConfigError, match="RolloutPlan"):
        update_memory_guard(None, [], rollout="a plan")


def test_the_floor_is_what_the_longest_sample_needs():
    from megatron_dynbatch import PlanOptions
    from megatron_dynbatch.megatron.memory_guard import floor_for

    assert floor_for(PlanOptions(max_tokens_per_gpu=4096, parallel={"dp": 2, "cp": 2}), 1001) == 502  # 1004 / cp
    assert floor_for(PlanOptions(max_tokens_per_gpu=4096, oversize="alone"), 5000) is None
    assert floor_for(PlanOptions(max_tokens_per_gpu=4096), None) is None
    assert np.isclose(floor_for(PlanOptions(max_tokens_per_gpu=4096, fp8_alignment="fp8"), 100), 112)
