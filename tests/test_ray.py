"""megatron_dynbatch.integrations.ray: central planning on a driver, rank-local shards, order restoration -- and a
REAL local Ray with two actors, each one gloo rank of a tiny megatron-core GPT, whose log-probs and gradients equal
an unpacked single-process reference.

The planning / shard tests need no Ray. The tests marked ``ray`` start a local Ray (2 CPUs, no dashboard, a
private temp dir, token auth with an in-memory token so nothing is written under $HOME) and skip when Ray is not
installed."""

from __future__ import annotations

import dataclasses
import importlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from megatron_dynbatch import plan_global_batch  # noqa: E402
from megatron_dynbatch.demo import reference_coefficients, sample_targets, synthetic_rl_batch  # noqa: E402
from megatron_dynbatch.core.errors import DynBatchConfigError  # noqa: E402
from megatron_dynbatch.megatron.iterator import DynamicBatchIterator  # noqa: E402
from megatron_dynbatch.integrations.ray import (DynBatchActorMixin, RankShard, ShardResult, dp_rank_of,  # noqa: E402
                                   gather_in_order, plan_log_probs, plan_rollout, shard_iterator, step_loss)

REPO = Path(__file__).resolve().parents[1]
VOCAB = 128
SEED = 1234
TOL = 1e-5
TRAIN_BUDGET = 64
LP_BUDGET = 128


def _batch(n=16, seed=3, group_size=4):
    samples = synthetic_rl_batch(n, seed, max_len=40, group_size=group_size)
    samples[5]["loss_mask"] = torch.zeros(len(samples[5]["tokens"]))  # a sample without loss tokens
    return samples


PLAN = dict(parallel={"dp": 2}, max_tokens_per_gpu=TRAIN_BUDGET, balance_by_flops=False)


# ============================================================================ planning and shards (no Ray)
def test_shards_split_the_batch_and_both_plans_keep_the_rank_assignment():
    samples = _batch(24)
    rp = plan_rollout(samples, log_probs_max_tokens_per_gpu=LP_BUDGET, samples_per_step=12, put=False, **PLAN)
    assert len(rp) == 2 and rp.num_steps == 2 and rp.num_samples == 24
    held = [i for s in rp for i in s.sample_indices]
    assert sorted(held) == list(range(24))  # every sample shipped to exactly one DP rank
    for r, shard in enumerate(rp):
        assert isinstance(shard, RankShard) and shard.dp_rank == r
        assert shard.sample_indices == sorted(shard.sample_indices)
        assert [s is samples[i] for s, i in zip(shard.samples, shard.sample_indices)] == [True] * len(shard.samples)
        assert sorted(rp.plan.rank_samples(r)) == shard.sample_indices
        assert sorted(rp.log_probs_plan.rank_samples(r)) == shard.sample_indices  # same ranks for both passes
        assert {samples[i]["group_id"] for i in shard.sample_indices}.isdisjoint(
            {samples[i]["group_id"] for i in rp[1 - r].sample_indices})  # GRPO groups stay on one rank
    lp = rp.log_probs_plan
    assert lp.microbatches_per_step == [lp.num_microbatches]
    assert lp.max_microbatch_tokens <= LP_BUDGET
    assert lp.num_microbatches < rp.plan.num_microbatches  # the larger forward budget packs fewer micro-batches
    # global statistics travel with every shard
    for shard in rp:
        assert shard.loss_mask_sums.shape == (24,) and shard.loss_mask_sums[5] == 0
        assert shard.group_ids == [s["group_id"] for s in samples]
    summary = rp.summary()
    assert summary["rank_samples"] == [s.num_local_samples for s in rp] and "log_probs" in summary


def test_rank_local_iterator_equals_the_full_batch_iterator():
    samples = _batch(24, seed=4)
    rp = plan_rollout(samples, log_probs_max_tokens_per_gpu=LP_BUDGET, samples_per_step=12, loss_mode="group_mean",
                      put=False, **PLAN)
    for shard in rp:
        for forward_only, plan in ((False, rp.plan), (True, rp.log_probs_plan)):
            local = shard_iterator(shard, forward_only=forward_only, dp_rank=shard.dp_rank)
            full = DynamicBatchIterator(samples, plan, dp_rank=shard.dp_rank, loss_mode="group_mean")
            assert local.is_shard and not full.is_shard and local.local_indices == shard.sample_indices
            assert local.num_microbatches == full.num_microbatches
            for step in range(local.num_steps):
                assert local.sample_indices(step) == full.sample_indices(step)
                assert local.step_samples(step) == full.step_samples(step)
                assert local.max_seq_length(step) == full.max_seq_length(step)
                a, b = local.normalizer(step), full.normalizer(step)
                assert np.array_equal(a.coefficients, b.coefficients) and a.total_loss_tokens == b.total_loss_tokens
                for ma, mb in zip(local.microbatches(step), full.microbatches(step)):
                    assert ma.sample_indices == mb.sample_indices
                    assert torch.equal(ma.tokens, mb.tokens) and torch.equal(ma.loss_mask, mb.loss_mask)
                    assert torch.equal(ma.extras["advantages"], mb.extras["advantages"])


def test_gather_in_order_restores_the_driver_order():
    samples = _batch(16, seed=5)
    rp = plan_rollout(samples, put=False, **PLAN)
    results = []
    for shard in reversed(rp.shards):  # arrival order does not matter
        outs = [f"out{i}" for i in shard.sample_indices]
        results.append(ShardResult(batch_id=rp.batch_id, dp_rank=shard.dp_rank, kind="log_probs", step=None,
                                   sample_indices=shard.sample_indices, per_sample=outs, loss=None,
                                   local_loss_sum=None, num_microbatches=1, is_output_rank=True, seconds=0.0,
                                   local_tokens=0))
        results.append(None)  # e.g. a non-output pipeline stage
    assert gather_in_order(results, rp) == [f"out{i}" for i in range(16)]
    assert gather_in_order(results + results, rp.shards) == [f"out{i}" for i in range(16)]  # copies taken once
    with pytest.raises(DynBatchConfigError, match="missing"):
        gather_in_order(results[:1], rp)
    other = plan_rollout(samples, put=False, **PLAN)
    with pytest.raises(DynBatchConfigError, match="batch"):
        gather_in_order(results, other)
    assert step_loss([None, results[0]]) is None


def test_shard_errors_name_the_fix():
    samples = _batch(16, seed=6)
    rp = plan_rollout(samples, put=False, **PLAN)
    s0, s1 = rp[0], rp[1]
    with pytest.raises(DynBatchConfigError, match="not shipped"):  # rank 1's samples sent to a rank-0 actor
        shard_iterator(dataclasses.replace(s1, dp_rank=0), dp_rank=0)
    with pytest.raises(DynBatchConfigError, match="metadata says"):  # samples out of order
        shard_iterator(s0, samples=list(reversed(s0.samples)), dp_rank=0)
    wrong = [dict(samples[i]) for i in s0.sample_indices]
    wrong[0]["loss_mask"] = torch.ones(len(wrong[0]["tokens"]))
    with pytest.raises(DynBatchConfigError, match="loss mask"):
        shard_iterator(s0, samples=wrong, dp_rank=0)
    with pytest.raises(DynBatchConfigError, match="sample_refs"):
        plan_rollout(samples, sample_refs=[0] * 16, put=False, **PLAN)
    with pytest.raises(DynBatchConfigError, match="loss_mask_sums"):
        plan_rollout(sample_refs=list(range(16)), lengths=[5] * 16, put=False, **PLAN)
    with pytest.raises(DynBatchConfigError, match="max_tokens_per_gpu"):
        plan_rollout(samples, parallel={"dp": 2}, balance_by_flops=False, put=False)
    if not _ray_running():
        with pytest.raises(DynBatchConfigError, match="ray.init"):
            plan_rollout(samples, put=True, **PLAN)
    with pytest.raises(DynBatchConfigError, match="RankShard"):
        shard_iterator({"dp_rank": 0})


def test_refs_are_passed_through_and_run_config_is_honoured():
    from megatron_dynbatch.core.run_config import RunConfig

    rc = RunConfig.from_yaml("tiny-cpu-demo").replace(log_probs_max_tokens_per_gpu=320, loss_mode="group_mean")
    lengths = [int(x) for x in np.random.default_rng(0).integers(8, 120, size=32)]
    refs = [("ref", i) for i in range(32)]  # stand-ins: the driver never looks inside
    rp = plan_rollout(sample_refs=refs, lengths=lengths, loss_mask_sums=[L - 4 for L in lengths], run_config=rc)
    assert rp.plan.cap == 160 and rp.log_probs_plan.cap == 320 and rp.num_steps == 2
    for shard in rp:
        assert shard.sample_refs == [refs[i] for i in shard.sample_indices] and shard.samples_ref is None
        assert shard.loss_mode == "group_mean" and shard.group_ids == [i // 4 for i in range(32)]
    assert rp.for_actors([1, 0, 1], as_refs=False) == [rp[1], rp[0], rp[1]]
    with pytest.raises(DynBatchConfigError, match="actor_dp_ranks"):
        rp.for_actors([2], as_refs=False)


def test_log_prob_plan_keeps_ranks_under_pipeline_parallelism_and_reports_impossible_budgets():
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in rng.lognormal(6, 1, size=40).clip(1, 4000)]
    par = {"dp": 2, "pp": 2}
    train = plan_global_batch(lengths, model="qwen3-8b", parallel=par, max_tokens_per_gpu=4096)
    lp = plan_log_probs(train, lengths, max_tokens_per_gpu=8192, model="qwen3-8b")
    assert lp.algorithm == "dynbatch-log-probs" and lp.max_microbatch_tokens <= 8192
    for r in range(2):
        assert sorted(lp.rank_samples(r)) == sorted(train.rank_samples(r))
    # rank 0 holds one sample, rank 1 two that only fit one micro-batch under the TRAINING budget: no common count
    from megatron_dynbatch.core.planner import score_assignment as score

    train = score([[[0]], [[1, 2]]], [25, 20, 20], parallel={"dp": 2}, max_tokens_per_gpu=128)
    with pytest.raises(DynBatchConfigError, match="log_probs_max_tokens_per_gpu"):
        plan_log_probs(train, [25, 20, 20], max_tokens_per_gpu=30, balance_by_flops=False)


def test_dp_rank_of_megatron_default_order():
    par = {"dp": 3, "tp": 2, "cp": 2, "pp": 2}
    # TP fastest, then CP, then DP, then PP
    assert [dp_rank_of(r, par) for r in range(24)] == [(r // 4) % 3 for r in range(24)]
    with pytest.raises(DynBatchConfigError):
        dp_rank_of(24, par)


# =============================================================================== a real local Ray cluster
def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def _safe_ray_env() -> dict:
    """Token auth with an in-memory token (nothing written under $HOME), no usage-stats reporting."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def ray_cluster():
    already_imported = "ray" in sys.modules
    env = _safe_ray_env()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # before Ray reads its configuration
    temp_dir = tempfile.mkdtemp(prefix="rdb", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    started = False
    try:
        try:
            import ray
        except ImportError as exc:
            pytest.skip(f"Ray does not import ({exc}); pip install 'megatron-dynbatch[ray]'")
        if ray.is_initialized():
            pytest.skip("a Ray runtime is already initialised in this process")
        if already_imported:  # Ray read RAY_AUTH_MODE at import: make it re-read the environment
            from ray._raylet import Config

            Config.initialize("")
        # the actors below are classes of this module: the workers import it from the tests directory
        path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, _node_ip_address="127.0.0.1",
                 object_store_memory=256 * 1024 ** 2, log_to_driver=False, logging_level="ERROR",
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
        started = True
        yield ray
    finally:
        if started:
            ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _flat(tensors) -> "torch.Tensor":
    return torch.cat([t.detach().flatten().double() for t in tensors])


def _ppo_loss(output, packed):
    """Per-token PPO-style objective -(A * ratio) with ratio = exp(logp - old_logp); logp = -cross-entropy."""
    logp = -output
    return -(packed.extras["advantages"] * torch.exp(logp - packed.extras["old_log_probs"]))


class _TrainActor(DynBatchActorMixin):
    """One Megatron rank (gloo, CPU) of a tiny GPT wrapped in Megatron DDP: what a slime / ROLL train actor is."""

    def __init__(self) -> None:
        self.fetches = []

    def setup(self, rank: int, world_size: int, port: int) -> dict:
        torch.set_num_threads(1)
        from megatron_dynbatch.demo import quiet_megatron_warnings

        quiet_megatron_warnings()
        from megatron.core import parallel_state

        from megatron_dynbatch.megatron import cpu as megatron_cpu

        megatron_cpu.init_cpu_distributed(rank, world_size, port=port, seed=SEED)
        config = megatron_cpu.tiny_gpt_config()
        torch.manual_seed(SEED)
        module = megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=128, thd=True)
        init = _flat(module.parameters())
        self.model = megatron_cpu.wrap_ddp(config, module)
        return {"dp_rank": parallel_state.get_data_parallel_rank(), "init": init}

    def dynbatch_samples(self, shard):
        key = self._dynbatch_key
        samples = super().dynbatch_samples(shard)
        if key != self._dynbatch_key:  # fetched from the object store
            self.fetches.append((shard.batch_id, shard.dp_rank, list(shard.sample_indices)))
        return samples

    def log_probs(self, shard, store_as=None):
        return self.dynbatch_log_probs(shard, store_as=store_as)

    def train(self, shard, step=None, ppo=False):
        self.model.zero_grad_buffer()
        res = self.dynbatch_train_step(shard, step=step, per_token_loss=_ppo_loss if ppo else None)
        res.extra["grads"] = _flat(p.main_grad for _, p in self.model.module.named_parameters())
        return res

    def fetch_log(self):
        return self.fetches


class _RolloutWorker:
    """Stands in for a rollout engine: generates samples and hands out one ObjectRef per sample + metadata."""

    def generate(self, n: int, seed: int) -> dict:
        from megatron_dynbatch.megatron.loss import loss_mask_stats

        import ray

        samples = _batch(n, seed=seed)
        sums, _ = loss_mask_stats(samples)
        return {"refs": [ray.put(s) for s in samples], "lengths": [len(s["tokens"]) for s in samples],
                "loss_mask_sums": sums.tolist(), "group_ids": [s["group_id"] for s in samples]}


@pytest.fixture(scope="module")
def ray_run(ray_cluster):
    """Two train actors (one gloo rank each, DP=2) run: rollout A (driver-held samples, one ray.put per rank) ->
    log-probs stored on the actors as old_log_probs -> a PPO-style training step with group_mean; rollout B
    (per-sample refs from a rollout actor) -> log-probs -> training step 1 of a two-step plan."""
    ray = ray_cluster
    from megatron_dynbatch.megatron.ranks import free_port

    t0 = time.perf_counter()
    Actor = ray.remote(num_cpus=1)(_TrainActor)
    actors = [Actor.remote() for _ in range(2)]
    port = free_port()
    info = ray.get([a.setup.remote(r, 2, port) for r, a in enumerate(actors)], timeout=180)
    dp_ranks = [i["dp_rank"] for i in info]
    out = {"init": [i["init"] for i in info], "dp_ranks": dp_ranks}

    # --- rollout A: the driver holds the samples
    samples_a = _batch(16, seed=11)
    rp_a = plan_rollout(samples_a, parallel={"dp": 2}, max_tokens_per_gpu=TRAIN_BUDGET, balance_by_flops=False,
                        log_probs_max_tokens_per_gpu=LP_BUDGET, loss_mode="group_mean")
    shards = rp_a.for_actors(dp_ranks)
    lp_a = ray.get([a.log_probs.remote(s, store_as="old_log_probs") for a, s in zip(actors, shards)], timeout=120)
    tr_a = ray.get([a.train.remote(s, ppo=True) for a, s in zip(actors, shards)], timeout=120)
    out["a"] = {"rp": rp_a, "samples": samples_a, "lp": lp_a, "train": tr_a}

    # --- rollout B: per-sample refs from a rollout worker; the driver only sees refs + metadata
    worker = ray.remote(num_cpus=0)(_RolloutWorker).remote()
    meta = ray.get(worker.generate.remote(16, 12), timeout=60)
    rp_b = plan_rollout(sample_refs=meta["refs"], lengths=meta["lengths"], loss_mask_sums=meta["loss_mask_sums"],
                        group_ids=meta["group_ids"], parallel={"dp": 2}, max_tokens_per_gpu=TRAIN_BUDGET,
                        balance_by_flops=False, log_probs_max_tokens_per_gpu=LP_BUDGET, samples_per_step=8)
    shards = rp_b.for_actors(dp_ranks)
    lp_b = ray.get([a.log_probs.remote(s) for a, s in zip(actors, shards)], timeout=120)
    tr_b = ray.get([a.train.remote(s, step=1) for a, s in zip(actors, shards)], timeout=120)
    out["b"] = {"rp": rp_b, "lp": lp_b, "train": tr_b}

    # --- a shard sent to an actor of the other DP rank is refused before any collective starts
    try:
        ray.get(actors[0].log_probs.remote(rp_b[1 - dp_ranks[0]]), timeout=60)
        out["wrong_rank_error"] = None
    except Exception as exc:  # noqa: BLE001 - Ray re-raises the actor's error under its own exception type
        out["wrong_rank_error"] = f"{type(exc).__name__}: {exc}"
    out["fetches"] = ray.get([a.fetch_log.remote() for a in actors])
    out["seconds"] = time.perf_counter() - t0
    for a in actors + [worker]:
        ray.kill(a)
    return out


@pytest.fixture(scope="module")
def reference(megatron_world1):
    """The tiny GPT built in THIS process with the actors' seed (unwrapped, for the unpacked reference)."""
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    config = megatron_cpu.tiny_gpt_config()
    torch.manual_seed(SEED)
    return megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=128, thd=True)


def _sbhd_log_probs(model, sample):
    tokens = torch.as_tensor(sample["tokens"]).long().unsqueeze(0)
    labels, mask = sample_targets(sample)
    ce = model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), None, labels=labels.unsqueeze(0))[0]
    return -ce, mask


def _reference_grads(model, samples, coefficients, ppo: bool):
    """sum_i c_i sum_j mask_ij * loss_ij, one sample at a time (sbhd, plain autograd); returns flat grads."""
    for p in model.parameters():
        p.grad = None
    for s, c in zip(samples, coefficients):
        logp, mask = _sbhd_log_probs(model, s)
        per_tok = -(s["advantages"] * torch.exp(logp - logp.detach())) if ppo else -logp
        loss = (per_tok.double() * mask.double()).sum() * float(c)
        if loss.requires_grad:
            loss.to(logp.dtype).backward()
    return _flat(p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters())


@pytest.mark.ray
def test_ray_actors_start_from_the_reference_weights(ray_run, reference):
    ref = _flat(reference.parameters())
    assert sorted(ray_run["dp_ranks"]) == [0, 1]
    for init in ray_run["init"]:
        assert init.shape == ref.shape and float((init - ref).abs().max()) == 0.0


@pytest.mark.ray
@pytest.mark.parametrize("rollout", ["a", "b"])
def test_ray_log_probs_in_driver_order_match_reference(ray_run, reference, rollout):
    run = ray_run[rollout]
    samples = run["samples"] if rollout == "a" else _batch(16, seed=12)
    got = gather_in_order(run["lp"], run["rp"])
    assert [r.kind for r in run["lp"]] == ["log_probs"] * 2
    with torch.no_grad():
        want = [_sbhd_log_probs(reference, s)[0] for s in samples]
    assert [len(g) for g in got] == [len(s["tokens"]) for s in samples]
    assert max(float((g - w).abs().max()) for g, w in zip(got, want)) <= TOL


@pytest.mark.ray
def test_ray_ppo_step_on_stored_log_probs_matches_reference(ray_run, reference):
    run = ray_run["a"]
    samples = run["samples"]
    gids = [s["group_id"] for s in samples]
    ref_grads = _reference_grads(reference, samples, reference_coefficients(samples, "group_mean", gids), ppo=True)
    assert float(ref_grads.abs().max()) > 1e-4  # not vacuous
    for res in run["train"]:
        assert res.kind == "train" and res.is_output_rank and res.per_sample is None  # nothing collected
        assert float((res.extra["grads"] - ref_grads).abs().max()) <= TOL


@pytest.mark.ray
def test_ray_second_step_of_a_split_batch_from_refs_matches_reference(ray_run, reference):
    run = ray_run["b"]
    samples = _batch(16, seed=12)
    step = run["rp"].step_samples(1)
    assert step == list(range(8, 16))
    sub = [samples[i] for i in step]
    ref_grads = _reference_grads(reference, sub, reference_coefficients(sub, "token_mean"), ppo=False)
    with torch.no_grad():
        ref_loss = sum(float((-_sbhd_log_probs(reference, s)[0].double() * _sbhd_log_probs(reference, s)[1].double())
                             .sum()) for s in sub) * reference_coefficients(sub, "token_mean")[0]
    for res in run["train"]:
        assert res.step == 1 and float((res.extra["grads"] - ref_grads).abs().max()) <= TOL
    assert step_loss(run["train"]) == pytest.approx(ref_loss, rel=1e-5)


@pytest.mark.ray
def test_ray_each_actor_fetched_only_its_own_samples_once_per_batch(ray_run):
    for rollout in ("a", "b"):
        rp = ray_run[rollout]["rp"]
        seen = []
        for log, dp_rank in zip(ray_run["fetches"], ray_run["dp_ranks"]):
            mine = [f for f in log if f[0] == rp.batch_id]
            assert len(mine) == 1  # one fetch serves the log-prob pass and the training step
            assert mine[0][2] == rp[dp_rank].sample_indices
            seen += mine[0][2]
        assert sorted(seen) == list(range(16))
    assert isinstance(ray_run["a"]["rp"][0].samples_ref, type(ray_run["b"]["rp"][0].sample_refs[0]))
    assert "data-parallel rank" in (ray_run["wrong_rank_error"] or "")


@pytest.mark.ray
def test_ray_trainer_example_runs():
    """scripts/ray_trainer_example.py --steps 1 (its own local Ray; the module's actors are gone by now)."""
    try:
        importlib.import_module("ray")  # the script needs it
    except ImportError as exc:
        pytest.skip(f"Ray does not import ({exc}); pip install 'megatron-dynbatch[ray]'")
    temp_dir = tempfile.mkdtemp(prefix="rdx", dir="/tmp")
    env = dict(os.environ, **_safe_ray_env())
    try:
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / "ray_trainer_example.py"), "--steps", "1",
                               "--ray-temp-dir", temp_dir],
                              cwd=str(REPO), env=env, capture_output=True, text=True, timeout=240)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 0:" in proc.stdout and "loss=" in proc.stdout and "done" in proc.stdout
