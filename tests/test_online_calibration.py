"""Online calibration on real megatron-core (CPU, gloo, 2 processes; issue 18 item 4): each micro-batch is timed
during training (``perf_counter`` on a CPU; the CUDA path is the same code with events), the cost model is refitted
every step here, and

* losses and gradients with online calibration equal those without it, step by step (the refitted model
  regroups the batch; the math stays);
* every rank plans with the bit-identical refitted model, so the plans stay identical with only the one
  all-reduce of the fitted coefficients;
* no micro-batch is over the budget;
* the records are this rank's slice (its stage's layers, the LM head on the last stage).

No wall-clock assertion: CPU timings on a shared machine are real but noisy; the refit's convergence is asserted on
synthetic timings in ``tests/test_online_refit.py``."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_dynbatch.megatron.ranks import run_ranks  # noqa: E402

VOCAB = 128
STEPS = 4
TOL = 1e-5
LAYOUTS = {"dp": (1, None, 2), "pp": (2, None, 2), "vpp": (2, 2, 4)}  # pp, vpp, num_layers


def _plan_key(plan) -> str:
    d = plan.to_dict()
    d.pop("planning_time_s", None)
    d.get("summary", {}).pop("planning_time_s", None)
    return json.dumps(d, sort_keys=True, default=str)


def _worker(rank: int, world_size: int, layout: str) -> dict:
    from megatron_dynbatch.demo import quiet_megatron_warnings, synthetic_rl_batch

    quiet_megatron_warnings()
    from megatron.core import parallel_state

    from megatron_dynbatch.core.model_spec import ModelSpec
    from megatron_dynbatch.megatron.online_calibration import OnlineCalibrator
    from megatron_dynbatch.megatron.schedule import dynamic_forward_backward
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    pp, vpp, layers = LAYOUTS[layout]
    megatron_cpu.init_cpu_distributed(rank, world_size, pp=pp, vpp=vpp)
    try:
        config = megatron_cpu.tiny_gpt_config(num_layers=layers, hidden_size=128, ffn_hidden_size=256,
                                              batch_p2p_comm=False)
        torch.manual_seed(1234)
        chunks = [megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=256, thd=True,
                                              vp_stage=v if vpp else None) for v in range(vpp or 1)]
        ddps = megatron_cpu.wrap_ddp(config, list(chunks))
        model = ddps if vpp else ddps[0]
        spec = ModelSpec.from_megatron(config, vocab_size=VOCAB)
        parallel = {"dp": world_size // pp, "pp": pp, "vpp": vpp or 1}
        kwargs = {"model": spec, "parallel": parallel, "max_tokens_per_gpu": 96}
        lines: list = []
        cal = OnlineCalibrator(spec, parallel, interval=1, skip_steps=1, log=lines.append)
        out: dict = {"steps": [], "last": parallel_state.is_pipeline_last_stage(ignore_virtual=True)}
        for step in range(STEPS):
            samples = synthetic_rl_batch(24, seed=100 + step, max_len=90)
            runs = {}
            for name, calibrator in (("on", cal), ("off", None)):
                for d in ddps:
                    d.zero_grad_buffer()
                res = dynamic_forward_backward(model, samples, kwargs, calibrator=calibrator)
                plan = res.iterator.plan
                runs[name] = {"loss": res.loss, "plan": _plan_key(plan), "cap_violations": plan.cap_violations,
                              "max_tokens": max(max(r) for r in plan.microbatch_tokens), "cap": plan.cap,
                              "grads": {f"{v}/{n}": p.main_grad.detach().clone()
                                        for v, d in enumerate(ddps) for n, p in d.module.named_parameters()}}
            grad_diff = max(float((runs["on"]["grads"][k] - g).abs().max()) for k, g in runs["off"]["grads"].items())
            grad_max = max(float(g.abs().max()) for g in runs["off"]["grads"].values())
            out["steps"].append({"loss_on": runs["on"]["loss"], "loss_off": runs["off"]["loss"],
                                 "grad_diff": grad_diff, "grad_max": grad_max, "plan_on": runs["on"]["plan"],
                                 "plan_off": runs["off"]["plan"],
                                 "cap_violations": runs["on"]["cap_violations"],
                                 "max_tokens": runs["on"]["max_tokens"], "cap": runs["on"]["cap"]})
        if layout == "dp":
            out["hook"] = _hook_steps(model, spec, parallel, kwargs)
            out["ray"] = _ray_shard_timings(model, spec, parallel)
        out["history"] = [{"step": h.step, "fit_error": h.fit_error, "profile": h.profile, "records": h.records,
                           "ranks_fitted": h.ranks_fitted, "line": h.line()} for h in cal.history]
        out["cost_model"] = None if cal.cost_model is None else cal.cost_model.to_dict()
        out["slice"] = cal.slice_info(model).__dict__
        out["lines"] = lines
        return out
    finally:
        megatron_cpu.destroy()


def _hook_steps(model, spec, parallel, kwargs) -> dict:
    """The Megatron-LM hook (``DynamicForwardBackward``) with ``--dynbatch-online-calibration``: it keeps one
    calibrator across iterations and its losses equal the hook's without the flag."""
    from argparse import Namespace

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_dynbatch.demo import synthetic_rl_batch
    from megatron_dynbatch.integrations.megatron_lm import DynamicForwardBackward

    losses = {}
    hooks = {}
    for online in (True, False):
        args = Namespace(dynbatch_online_calibration=online, dynbatch_calibration_interval=1 if online else None,
                         dynbatch_cost_model=None, curr_iteration=0, log_interval=1000)
        hooks[online] = hook = DynamicForwardBackward(get_forward_backward_func(), args,
                                                      plan_options=lambda a: dict(kwargs))
        losses[online] = []
        for step in range(3):
            for d in (model if isinstance(model, list) else [model]):
                d.zero_grad_buffer()
            batch = iter([synthetic_rl_batch(24, seed=200 + step, max_len=90)])
            out = hook(data_iterator=batch, model=model, num_microbatches=1, seq_length=1, micro_batch_size=1)
            losses[online].append(float(out[0]["lm loss"]) if out else None)
    cal = hooks[True].calibrator
    return {"losses_on": losses[True], "losses_off": losses[False], "refits": len(cal.history),
            "off_calibrator": hooks[False].calibrator is None}


def _ray_shard_timings(model, spec, parallel) -> dict:
    """Ray actors without Ray: ``train_on_shard(..., record_timings=True)`` sends this rank's micro-batch times
    back in ``ShardResult.timings`` (the driver's ``update_calibration`` refits from them in the test)."""
    import torch.distributed as dist

    from megatron_dynbatch.demo import synthetic_rl_batch
    from megatron_dynbatch.integrations.ray import plan_rollout, train_on_shard

    samples = synthetic_rl_batch(24, seed=300, max_len=90)
    rollout = plan_rollout(samples, model=spec, parallel=parallel, max_tokens_per_gpu=96, put=False, log_probs=False)
    for d in (model if isinstance(model, list) else [model]):
        d.zero_grad_buffer()
    res = train_on_shard(model, rollout.shards[dist.get_rank()], record_timings=True, return_outputs=False)
    return {"timings": res.timings, "num_microbatches": res.num_microbatches,
            "plan": rollout.plan.to_dict(), "lengths": rollout.shards[0].lengths.tolist()}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def results(request):
    return request.param, run_ranks(_worker, 2, request.param, timeout=300)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_online_calibration_never_changes_the_math_and_keeps_ranks_identical(results):
    layout, per_rank = results
    for r in per_rank:
        for s in r["steps"]:
            if s["loss_off"] is not None:
                assert s["loss_on"] == pytest.approx(s["loss_off"], rel=1e-6, abs=1e-7)
            assert s["grad_diff"] <= TOL * max(1.0, s["grad_max"]), (layout, s["grad_diff"])
            assert s["cap_violations"] == 0 and s["max_tokens"] <= s["cap"]
    a, b = per_rank
    assert [s["plan_on"] for s in a["steps"]] == [s["plan_on"] for s in b["steps"]]  # identical plans
    assert a["cost_model"] == b["cost_model"]  # bit-identical shared model
    assert [h["profile"] for h in a["history"]] == [h["profile"] for h in b["history"]]
    assert len(a["history"]) == STEPS - 1  # refit after every recorded step (the first step is warm-up)
    fitted = [h for h in a["history"] if h["profile"] is not None]
    assert fitted, a["lines"]
    for h in fitted:
        assert 0 <= h["fit_error"] < 1 and h["records"] > 0
        assert h["line"].startswith("dynbatch calibration | step ")
    assert a["cost_model"] is not None
    # the records are each rank's own slice: its stage's layers, the LM head on the last stage
    pp, vpp, layers = LAYOUTS[layout]
    for r in per_rank:
        assert r["slice"]["measured_layers"] == layers // pp
        assert r["slice"]["lm_head"] == r["last"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_megatron_lm_hook_and_the_ray_actors_record_without_changing_the_loss(results):
    layout, per_rank = results
    if layout != "dp":
        pytest.skip("checked once, on the DP layout")
    from megatron_dynbatch.core.calibration.online import OnlineCalibration
    from megatron_dynbatch.integrations.ray import RolloutPlan, update_calibration
    from megatron_dynbatch.integrations.ray.shards import ShardResult

    for r in per_rank:
        hook = r["hook"]
        assert hook["refits"] == 2 and hook["off_calibrator"]  # step 1 warm-up, a refit after steps 2 and 3
        for on, off in zip(hook["losses_on"], hook["losses_off"]):
            assert on == pytest.approx(off, rel=1e-6)
        t = r["ray"]["timings"]
        assert t["slice"] == {"measured_layers": 2, "tp": 1, "lm_head": True}
        assert len(t["records"]) == r["ray"]["num_microbatches"] and all(s > 0 for _, _, s in t["records"])
    # the driver: every actor's timings, one refit per interval, no collective
    model = {"name": "t", "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2,
             "ffn_hidden_size": 256, "swiglu": True, "vocab_size": VOCAB}
    cal = OnlineCalibration(model, {"dp": 2}, interval=1, skip_steps=0)
    results_ = [ShardResult(batch_id="b", dp_rank=i, kind="train", step=0, sample_indices=[], per_sample=None,
                            loss=None, local_loss_sum=None, num_microbatches=0, is_output_rank=True, seconds=0.0,
                            local_tokens=0, timings=r["ray"]["timings"]) for i, r in enumerate(per_rank)]
    from megatron_dynbatch.demo import synthetic_rl_batch
    from megatron_dynbatch.integrations.ray import plan_rollout

    rollout = plan_rollout(synthetic_rl_batch(24, seed=300, max_len=90), model=model, parallel={"dp": 2},
                           max_tokens_per_gpu=96, put=False, log_probs=False, calibration=cal)
    assert isinstance(rollout, RolloutPlan)
    assert rollout.plan.micro_batches == per_rank[0]["ray"]["plan"]["micro_batches"]
    log = update_calibration(cal, results_ + [None], rollout)
    assert log is not None and log.records == sum(len(r["ray"]["timings"]["records"]) for r in per_rank)
    assert log.profile is not None and log.change is not None and cal.cost_model is not None
    # the next rollout plans with the refit
    assert plan_rollout(synthetic_rl_batch(24, seed=301, max_len=90), model=model, parallel={"dp": 2},
                        max_tokens_per_gpu=96, put=False, log_probs=False, calibration=cal).plan.cap_violations == 0
