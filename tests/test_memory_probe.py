"""The first step protected (issue 32 item 4; megatron/probe.py) on real megatron-core (CPU, gloo, 2 ranks).

The CUDA peak reader is replaced by the deterministic fake of ``measure/memory.py`` (the same code path:
``reader.measure`` around the probe's schedule call), which reports TWICE the bytes per token on rank 1 as on
rank 0, on a card whose usable bytes hold 65 tokens per GPU at rank 1's slope. Then

* the probe runs ONE synthetic micro-batch per rank at the budget (96) through the caller's own forward step
  (which here also draws from Python's and NumPy's generators), and both ranks lower the budget alike (one MAX
  all-reduce) to what rank 1's measured slope fits; the next plan uses it; one log line per pass;
* it leaves no trace, bit for bit: parameters, Adam state (after a real optimizer step), every RNG state (Python,
  NumPy, torch, megatron's tensor-parallel tracker), gradients (zero) and the data iterator are identical after
  it; and a real step with the probe in front has exactly the loss and gradients of the same step without it --
  dropout on, so a moved generator would show;
* the log-prob pass is probed forward-only, on its own budget.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

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


def _card_for(spec, parallel, tokens_at_double: float) -> float:
    from megatron_dynbatch.core.memory.guard import MemoryGuard

    g = MemoryGuard(START, 1e12, model=spec, parallel=parallel, settings=SETTINGS)
    t = g.terms[0]
    return (t.static + 2.0 * tokens_at_double * t.per_token) / (1.0 - SETTINGS.headroom)


def _rng_state() -> dict:
    """Every generator's state, as comparable plain values."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    np_state = np.random.get_state()
    return {"python": random.getstate(), "numpy": (np_state[0], np_state[1].tolist()) + tuple(np_state[2:]),
            "torch": torch.get_rng_state().tolist(),
            "tracker": {k: v.tolist() for k, v in sorted(tracker.items())}}


def _flat(obj, key=""):
    """(path, value) leaves of a nested state dict; tensors cloned."""
    if isinstance(obj, dict):
        return [x for k in sorted(obj, key=str) for x in _flat(obj[k], f"{key}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _flat(v, f"{key}/{i}")]
    return [(key, obj.detach().clone() if torch.is_tensor(obj) else obj)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(ka == kb and (torch.equal(va, vb) if torch.is_tensor(va) else va == vb)
                                    for (ka, va), (kb, vb) in zip(a, b, strict=True))


def _worker(rank: int, world_size: int) -> dict:
    from megatron_dynbatch.demo import quiet_megatron_warnings, synthetic_rl_batch

    quiet_megatron_warnings()
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_dynbatch.core.model_spec import ModelSpec
    from megatron_dynbatch.core.planner.options import PlanOptions
    from megatron_dynbatch.megatron.memory_reader import FakeMemoryReader
    from megatron_dynbatch.megatron.probe import FirstStepProbe
    from megatron_dynbatch.megatron.schedule import default_forward_step, dynamic_forward_backward
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    megatron_cpu.init_cpu_distributed(rank, world_size)
    megatron_cpu.install_cpu_optimizer_shims()
    try:
        def build():
            config = megatron_cpu.tiny_gpt_config(hidden_dropout=0.1, attention_dropout=0.1)
            torch.manual_seed(1234)
            model = megatron_cpu.wrap_ddp(config, megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, thd=True))
            opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=False,
                                                         params_dtype=torch.float32, use_distributed_optimizer=False,
                                                         clip_grad=0.0), [model])
            return config, model, opt

        config, model, opt = build()
        spec = ModelSpec.from_megatron(config, vocab_size=VOCAB)
        parallel = {"dp": world_size}
        options = PlanOptions(model=spec, parallel=parallel, max_tokens_per_gpu=START, memory=SETTINGS,
                              memory_probe=True)
        from megatron_dynbatch.core.memory.guard import MemoryGuard

        per_token = MemoryGuard(START, 1e12, model=spec, parallel=parallel, settings=SETTINGS).terms[0].per_token

        def reader():
            return FakeMemoryReader(lambda p: (1 + rank) * per_token * p.tokens, base=1 << 20)

        card = _card_for(spec, parallel, 65)
        seen_tokens: list = []

        def users_step(it):  # the user's own forward step: it draws from Python's and NumPy's generators too
            inner = default_forward_step(it)

            def step(data_iterator, m):
                random.random()
                np.random.rand()
                return inner(data_iterator, m)

            return step

        def probing_step(data_iterator, m):  # what the probe hands the user's step: synthetic micro-batches
            from megatron_dynbatch.megatron.schedule import log_probs_collector  # noqa: F401

            packed = next(data_iterator)
            seen_tokens.append(int(packed.tokens.numel()))
            random.random()
            np.random.rand()
            out = m(packed.tokens, packed.position_ids, None, labels=packed.labels,
                    packed_seq_params=packed.packed_seq_params)
            return out, lambda o: (o.float().sum() * 0.0 + o.float().mean(), {})

        # one real optimizer step first: Adam's state exists, so "optimizer state identical" means something
        warm = synthetic_rl_batch(16, seed=3, max_len=40)
        model.zero_grad_buffer()
        dynamic_forward_backward(model, warm, options, memory_probe=False)
        opt.step()
        model.zero_grad_buffer()
        opt.zero_grad()

        batches = iter([synthetic_rl_batch(16, seed=40 + k, max_len=40) for k in range(3)])
        params0 = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        opt0 = _flat(opt.state_dict())
        rng0 = _rng_state()
        lines: list = []
        probe = FirstStepProbe(card, reader=reader(), settings=SETTINGS, multiple=16, log=lines.append)

        def run(samples, plan):
            return dynamic_forward_backward(model, samples, plan, forward_step_func=probing_step,
                                            reduce_loss=False, memory_probe=False)

        lowered = probe.protect(options.resolve(), run, model=model)
        out = {
            "lines": list(lines), "budget": lowered.max_tokens_per_gpu, "seen_tokens": list(seen_tokens),
            "result": probe.results["train"].to_dict(),
            "params_same": all(torch.equal(p, params0[n]) for n, p in model.module.named_parameters()),
            "opt_same": _same(_flat(opt.state_dict()), opt0) and len(opt0) > 4,
            "rng_same": {k: v == rng0[k] for k, v in _rng_state().items()},
            "grads_zero": all(float(p.main_grad.abs().max()) == 0.0 for p in model.module.parameters()),
        }
        first = next(batches)  # the data iterator: the probe took nothing from it
        out["data_first_len"] = [int(len(s["tokens"])) for s in first]

        # the real step with the probe in front == the same step without it (dropout on), bit for bit
        from megatron.core import tensor_parallel

        tracker0 = {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}

        def real_step(m, with_probe):  # both runs start from the same generators, the tracker's included
            m.zero_grad_buffer()
            torch.manual_seed(99)
            random.seed(5)
            np.random.seed(5)
            tensor_parallel.get_cuda_rng_tracker().set_states({k: v.clone() for k, v in tracker0.items()})
            it_box: dict = {}

            def fsf(data_iterator, mm):
                return users_step(it_box["it"])(data_iterator, mm)

            from megatron_dynbatch.megatron.iterator import DynamicBatchIterator

            opts = options.replace(max_tokens_per_gpu=out["budget"])
            it = DynamicBatchIterator(first, None, options=opts, device=torch.device("cpu"))
            it_box["it"] = it
            if with_probe:  # the probe runs right before the real step, with the same forward step
                p2 = FirstStepProbe(card, reader=reader(), settings=SETTINGS, multiple=16, log=None)
                p2.protect(opts.resolve(), lambda smp, plan: dynamic_forward_backward(
                    m, smp, plan, forward_step_func=probing_step, reduce_loss=False, memory_probe=False), model=m)
            res = dynamic_forward_backward(m, it, None, forward_step_func=fsf, memory_probe=False)
            grads = {n: p.main_grad.detach().clone() for n, p in m.module.named_parameters()}
            return res.loss, grads, random.random(), float(np.random.rand()), float(torch.rand(1))

        on = real_step(model, True)
        off = real_step(model, False)
        out["real_same"] = {"loss": on[0] == off[0], "generators": on[2:] == off[2:],
                            "grads": all(torch.equal(on[1][n], off[1][n]) for n in on[1])}
        out["real_loss"] = on[0]

        # the next plan made by dynamic_forward_backward uses the probed budget (no second probe)
        lines.clear()
        res = dynamic_forward_backward(model, first, options, memory_probe=probe)
        out["next_cap"] = res.iterator.plan.cap
        out["next_lines"] = list(lines)

        # the log-prob pass: probed once, forward only, on its own budget; no gradients appear
        model.zero_grad_buffer()
        lp_opts = options.for_forward_only(64)
        lp = dynamic_forward_backward(model, first, lp_opts, forward_only=True, memory_probe=probe)
        out["lp_lines"] = list(lines)
        out["lp_result"] = probe.results["log_prob"].to_dict()
        out["lp_has_outputs"] = lp.per_sample is not None
        out["grads_zero_after_lp"] = all(float(p.main_grad.abs().max()) == 0.0 for p in model.module.parameters())
        return out
    finally:
        megatron_cpu.destroy()


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, 2, timeout=300)


@pytest.mark.multiprocess
def test_both_ranks_lower_the_budget_alike_from_one_synthetic_microbatch(ranks):
    a, b = ranks
    assert a["seen_tokens"] == [START] and b["seen_tokens"] == [START]  # ONE micro-batch at the budget per rank
    assert a["budget"] == b["budget"] and a["budget"] < START  # rank 1's slope decides for both
    assert a["budget"] % 16 == 0 and a["result"]["reason"] == "lowered"
    r = a["result"]
    assert r["measured_peak_bytes"] > r["usable_bytes"] and r["measured_peak_bytes"] > r["predicted_peak_bytes"]
    assert a["lines"] == b["lines"] and len(a["lines"]) == 1
    assert a["lines"][0].startswith("dynbatch memory probe | training pass | 1 micro-batch of 96 tokens per GPU | "
                                    "measured peak ")
    assert f"budget 96 -> {a['budget']} tokens per GPU (lowered" in a["lines"][0]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "tuning.md").read_text(encoding="utf-8")
    assert a["lines"][0] in doc.splitlines()  # docs/tuning.md quotes this run's line exactly


@pytest.mark.multiprocess
def test_the_probe_leaves_no_trace(ranks):
    for r in ranks:
        assert r["rng_same"] == {"python": True, "numpy": True, "torch": True, "tracker": True}
        assert r["params_same"] and r["opt_same"] and r["grads_zero"]
        # the real step after the probe == without it: loss, gradients, every generator
        assert r["real_same"] == {"loss": True, "generators": True, "grads": True}
        assert r["data_first_len"] == [int(len(s["tokens"])) for s in _first_batch()]


def _first_batch():
    from megatron_dynbatch.demo import synthetic_rl_batch

    return synthetic_rl_batch(16, seed=40, max_len=40)


@pytest.mark.multiprocess
def test_later_plans_use_the_probed_budget_and_the_log_prob_pass_is_probed_forward_only(ranks):
    a, b = ranks
    assert a["next_cap"] == a["budget"] and a["next_lines"] == []  # probed once per pass
    assert a["lp_lines"] == b["lp_lines"] and len(a["lp_lines"]) == 1
    assert a["lp_lines"][0].startswith("dynbatch memory probe | log-prob pass | 1 micro-batch of 64 tokens per GPU")
    assert a["lp_result"]["pass_"] == "log_prob" and a["lp_has_outputs"] and a["grads_zero_after_lp"]


# ------------------------------------------------------------------------------------ pieces, single process
def test_microbatches_the_probe_runs():
    from megatron_dynbatch.megatron.probe import probe_microbatches

    assert probe_microbatches(1) == 1 and probe_microbatches(4) == 4
    assert probe_microbatches(4, 2) == 8  # 11 model chunks of warm-up: 6 micro-batches, a multiple of pp
    assert probe_microbatches(2, 4) % 2 == 0


def test_synthetic_samples_fill_one_microbatch_and_touch_no_global_generator():
    from megatron_dynbatch import PlanOptions
    from megatron_dynbatch.megatron.probe import synthetic_samples

    opts = PlanOptions(max_tokens_per_gpu=1000, model="tiny-gpt", parallel={"dp": 2, "cp": 2, "tp": 2,
                                                                           "sequence_parallel": True}).resolve()
    before = torch.get_rng_state()
    s = synthetic_samples(opts, 3)
    assert torch.equal(torch.get_rng_state(), before)
    n = len(s[0]["tokens"])
    assert opts.alignment.seq_len(n) <= opts.alignment.effective_cap(opts.cap) and n % opts.alignment.seq_multiple == 0
    assert n > opts.alignment.effective_cap(opts.cap) - opts.alignment.seq_multiple
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(s, synthetic_samples(opts, 3), strict=True))


def test_a_probe_that_runs_out_of_memory_says_so_before_the_first_step():
    from megatron_dynbatch import PlanOptions
    from megatron_dynbatch.megatron.memory_reader import FakeMemoryReader
    from megatron_dynbatch.megatron.probe import FirstStepProbe

    opts = PlanOptions(max_tokens_per_gpu=4096, model="tiny-gpt").resolve()
    probe = FirstStepProbe(2 ** 30, reader=FakeMemoryReader(lambda p: 1e12, capacity=2 ** 30), log=None, stage=0,
                           merge=lambda v: v, settings=SETTINGS)
    with pytest.raises(DynBatchConfigError, match="ran out of memory") as exc:
        probe.run(opts, lambda smp, plan: None)
    assert "docs/troubleshooting.md" in str(exc.value)


def test_kept_unmeasured_and_floor():
    from megatron_dynbatch import PlanOptions
    from megatron_dynbatch.megatron.memory_reader import FakeMemoryReader, MemoryReading
    from megatron_dynbatch.megatron.probe import FirstStepProbe

    opts = PlanOptions(max_tokens_per_gpu=4096, model="tiny-gpt").resolve()
    lines: list = []
    kept = FirstStepProbe(80 * 2 ** 30, reader=FakeMemoryReader(lambda p: 1000.0 * p.tokens), log=lines.append,
                          stage=0, merge=lambda v: v)
    assert kept.protect(opts, lambda smp, plan: None) == opts and kept.results["train"].reason == "kept"
    assert lines[-1].endswith("| budget 4096 kept")

    class Nan:
        def measure(self, fn, probe=None):
            fn()
            return MemoryReading(0, float("nan"))

    blind = FirstStepProbe(80 * 2 ** 30, reader=Nan(), log=lines.append, stage=0, merge=lambda v: v)
    assert blind.protect(opts, lambda smp, plan: None) == opts and blind.results["train"].reason == "unmeasured"
    assert "no rank could read its peak" in lines[-1]
    tight = FirstStepProbe(2 ** 30, reader=FakeMemoryReader(lambda p: 1e6 * p.tokens), log=lines.append, stage=0,
                           merge=lambda v: v, floor=2048, multiple=256, settings=SETTINGS)
    got = tight.protect(opts, lambda smp, plan: None)
    assert got.max_tokens_per_gpu == 2048 and tight.results["train"].reason == "floor"
    assert "at the floor" in lines[-1] and "longest sample must fit" in lines[-1]


def test_the_switch_and_the_default():
    from megatron_dynbatch import PlanOptions
    from megatron_dynbatch.megatron.probe import probe_enabled, protect_first_step

    assert probe_enabled(True) and not probe_enabled(False)
    assert probe_enabled(None) == torch.cuda.is_available()
    opts = PlanOptions(max_tokens_per_gpu=4096, model="tiny-gpt", memory_probe=False).resolve()
    ran: list = []
    assert protect_first_step(None, opts, model=object(), forward_only=False, device=None,
                              run=lambda *a: ran.append(a)) is opts and not ran
    with pytest.raises(DynBatchConfigError, match="memory_probe"):
        PlanOptions(max_tokens_per_gpu=4096, memory_probe="sometimes")


def _launch(flags, **extra):
    from megatron_dynbatch.megatron.args import add_dynamic_batch_args, validate_dynamic_batch_args

    ns = add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(flags)
    base = dict(data_parallel_size=2, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                group_query_attention=True, ffn_hidden_size=128, swiglu=True, padded_vocab_size=VOCAB,
                vocab_size=VOCAB, seq_length=64, curr_iteration=0, log_interval=1, tensorboard_log_interval=2)
    for k, v in {**base, **extra}.items():
        setattr(ns, k, v)
    return validate_dynamic_batch_args(ns)


def test_the_launch_flag_reaches_the_options_and_the_hook():
    from megatron_dynbatch.integrations.megatron_lm import DynamicForwardBackward
    from megatron_dynbatch.megatron.memory_reader import FakeMemoryReader
    from megatron_dynbatch.megatron.args import plan_options_from_args
    from megatron_dynbatch.megatron.probe import FirstStepProbe, memory_probe_from_args

    base = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"]
    with pytest.raises(DynBatchConfigError, match="--dynbatch-memory-probe=True: only applies to dynamic batching"):
        _launch(["--dynbatch-memory-probe"])
    assert plan_options_from_args(_launch(base)).memory_probe is None
    assert plan_options_from_args(_launch(base + ["--no-dynbatch-memory-probe"])).memory_probe is False
    on = _launch(base + ["--dynbatch-memory-probe"])
    opts = plan_options_from_args(on)
    assert opts.memory_probe is True
    probe = memory_probe_from_args(on, opts.resolve(), reader=FakeMemoryReader(lambda p: 0.0), card_bytes=2 ** 33,
                                   log=None)
    assert isinstance(probe, FirstStepProbe) and probe.floor == 64  # --seq-length 64 must still fit
    assert probe.settings.optimizer == "replicated"  # the launch's own flags
    off = opts.replace(memory_probe=False).resolve()
    assert memory_probe_from_args(_launch(base + ["--no-dynbatch-memory-probe"]), off) is None
    recorded: list = []

    def run_step(model, samples, options, **kw):
        recorded.append(kw)
        raise StopIteration

    off = _launch(base + ["--no-dynbatch-memory-probe"])
    hook = DynamicForwardBackward(object(), off, run_step=run_step, writers=lambda: (None, None))
    with pytest.raises(StopIteration):
        hook(data_iterator=iter([[{"tokens": list(range(20))}] * 2]), model=None, num_microbatches=1)
    assert recorded[-1]["memory_probe"] is False
    if not torch.cuda.is_available():  # forced on without a GPU: a clear error, not a silent skip
        hook = DynamicForwardBackward(object(), on, run_step=run_step, writers=lambda: (None, None))
        with pytest.raises(DynBatchConfigError, match="CUDA"):
            hook(data_iterator=iter([[{"tokens": list(range(20))}] * 2]), model=None, num_microbatches=1)


def test_troubleshooting_quotes_the_probes_messages():
    from megatron_dynbatch import PlanOptions
    from megatron_dynbatch.megatron.memory_reader import FakeMemoryReader
    from megatron_dynbatch.megatron.probe import FirstStepProbe

    doc = " ".join((Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md").read_text().split())
    got = []
    for call in (lambda: _launch(["--dynbatch-memory-probe"]),
                 lambda: PlanOptions(max_tokens_per_gpu=4096, memory_probe="sometimes"),
                 lambda: FirstStepProbe(1e9, reader=FakeMemoryReader(lambda p: 0.0)).run(
                     PlanOptions(max_tokens_per_gpu=64).resolve(), lambda smp, plan: None)):
        with pytest.raises(DynBatchConfigError) as exc:
            call()
        got.append(str(exc.value))
    probe = FirstStepProbe(2 ** 30, reader=FakeMemoryReader(lambda p: 1e12, capacity=2 ** 30), log=None, stage=0,
                           merge=lambda v: v, settings=SETTINGS)
    with pytest.raises(DynBatchConfigError) as exc:
        probe.run(PlanOptions(max_tokens_per_gpu=4096, model="tiny-gpt").resolve(), lambda smp, plan: None)
    oom = str(exc.value)
    got += [oom.split(" (training pass;")[0], oom.split("): ", 1)[1]]
    for message in got:
        assert " ".join(message.split()) in doc, message


def _pp_worker(rank: int, world_size: int) -> dict:
    """pp=2 (one DP rank): the probe runs pp micro-batches (what the first stage holds at once in 1F1B), each stage
    reads its own peak, the MAX all-reduce gives every stage's to both ranks."""
    from megatron_dynbatch.demo import quiet_megatron_warnings

    quiet_megatron_warnings()
    from megatron_dynbatch.core.memory.guard import MemoryGuard
    from megatron_dynbatch.core.model_spec import ModelSpec
    from megatron_dynbatch.core.planner.options import PlanOptions
    from megatron_dynbatch.megatron.memory_reader import FakeMemoryReader
    from megatron_dynbatch.megatron.probe import FirstStepProbe
    from megatron_dynbatch.megatron.schedule import dynamic_forward_backward
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    megatron_cpu.init_cpu_distributed(rank, world_size, pp=2)
    try:
        config = megatron_cpu.tiny_gpt_config()
        torch.manual_seed(1234)
        model = megatron_cpu.wrap_ddp(config, megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, thd=True))
        spec = ModelSpec.from_megatron(config, vocab_size=VOCAB)
        parallel = {"pp": 2}
        per_token = MemoryGuard(START, 1e12, model=spec, parallel=parallel, settings=SETTINGS).terms[0].per_token
        seen: list = []

        def peak_of(p):
            seen.append(p.tokens)
            return (1 + rank) * per_token * p.tokens

        params0 = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        lines: list = []
        probe = FirstStepProbe(1e12, reader=FakeMemoryReader(peak_of, base=1 << 20), settings=SETTINGS, multiple=16,
                               log=lines.append)
        options = PlanOptions(model=spec, parallel=parallel, max_tokens_per_gpu=START, memory=SETTINGS)
        got = probe.protect(options.resolve(), lambda smp, plan: dynamic_forward_backward(
            model, smp, plan, reduce_loss=False, memory_probe=False), model=model)
        return {"lines": lines, "budget": got.max_tokens_per_gpu, "seen": seen,
                "params_same": all(torch.equal(p, params0[n]) for n, p in model.module.named_parameters()),
                "grads_zero": all(float(p.main_grad.abs().max()) == 0.0 for p in model.module.parameters())}
    finally:
        megatron_cpu.destroy()


@pytest.mark.multiprocess
def test_under_pipeline_parallelism_the_probe_fills_the_first_stage():
    a, b = run_ranks(_pp_worker, 2, timeout=300)
    assert a["lines"] == b["lines"] and len(a["lines"]) == 1
    assert a["lines"][0].startswith("dynbatch memory probe | training pass | 2 micro-batches of 96 tokens per GPU")
    assert "on stage 1" in a["lines"][0] and a["lines"][0].endswith("| budget 96 kept")  # stage 1 read the most
    assert a["seen"] == [96] and b["seen"] == [96]  # each stage's tokens in flight: the full budget
    for r in (a, b):
        assert r["params_same"] and r["grads_zero"] and r["budget"] == START
