#!/usr/bin/env python
"""A Ray RL trainer loop with megatron-dynbatch, shaped like a slime / ROLL trainer. Runs on CPU:

    python scripts/ray_trainer_example.py --steps 1

Driver, once per rollout:  rollout -> advantages -> plan_rollout (ONE plan; one ray.put per DP rank)
                           -> actors: log-probs (kept on the actors) -> training steps -> gather results in order.
Actor (one Megatron rank): your usual Megatron actor + DynBatchActorMixin; two methods of a few lines each.

On CPU every actor is one gloo rank of a tiny GPT (megatron_dynbatch.megatron.cpu: CPU shims, DDP); on
GPUs keep your own model / optimizer setup -- only the two actor methods and the driver loop matter here.
See docs/ray.md for the data flow.
"""

from __future__ import annotations

import argparse
import sys
import time

import ray
import torch

from megatron_dynbatch.integrations.ray import DynBatchActorMixin, gather_in_order, plan_rollout, step_loss
from megatron_dynbatch.core.run_config import RunConfig

VOCAB = 128


# ------------------------------------------------------------------------------------------------- the loss
def ppo_clip_loss(output, packed, clip=0.2):
    """Per-token PPO clipped objective. ``output`` is the per-token cross-entropy of the labels (the model ran
    with labels), so ``-output`` are the log-probs; the extras come from the sample dicts, packed like tokens."""
    logp = -output
    ratio = torch.exp(logp - packed.extras["old_log_probs"])
    adv = packed.extras["advantages"]
    return -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)


# ------------------------------------------------------------------------------------------------ the actor
@ray.remote(num_cpus=1)
class TrainActor(DynBatchActorMixin):
    """One Megatron rank. In slime / ROLL this is the existing Megatron train actor; add the mixin and these two
    methods."""

    def __init__(self, rank: int, world_size: int, master_port: int, seed: int, lr: float):
        self.model, self.optimizer, self.dp_rank = build_cpu_megatron(rank, world_size, master_port, seed, lr)

    def compute_log_probs(self, shard):
        # old-policy log-probs of this rank's samples; stored into the local samples for the training pass
        return self.dynbatch_log_probs(shard, store_as="old_log_probs")

    def train(self, shard):
        results = []
        for step in range(shard.num_steps):  # optimizer steps of this rollout (samples_per_step)
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            results.append(self.dynbatch_train_step(shard, step=step, per_token_loss=ppo_clip_loss))
            for p in self.model.parameters():
                p.grad = p.main_grad  # Megatron DDP keeps grads in main_grad; a Megatron optimizer reads them there
            self.optimizer.step()
        return results

    def get_dp_rank(self):
        return self.dp_rank


# ---------------------------------------------------------------------------------------------- the rollout
@ray.remote(num_cpus=0)
class RolloutWorker:
    """Stands in for the inference engines: prompts -> responses + rewards (synthetic here)."""

    def generate(self, num_samples: int, group_size: int, seed: int):
        from megatron_dynbatch.demo import synthetic_rl_batch

        return synthetic_rl_batch(num_samples, seed, vocab=VOCAB, group_size=group_size)


def grpo_advantages(samples):
    """Group-normalised rewards, broadcast over each response's tokens (GRPO)."""
    groups = {}
    for s in samples:
        groups.setdefault(s["group_id"], []).append(s["reward"])
    for s in samples:
        r = torch.tensor(groups[s["group_id"]])
        adv = (s["reward"] - r.mean()) / (r.std(unbiased=False) + 1e-6)
        s["advantages"] = torch.full((len(s["tokens"]),), float(adv))
    return samples


# --------------------------------------------------------------------------------------------- the driver
def main(argv=None) -> int:
    args = parse_args(argv)
    rc = RunConfig.from_yaml(args.run_config).replace(
        log_probs_max_tokens_per_gpu=args.log_probs_max_tokens_per_gpu, loss_mode=args.loss_mode)
    dp = rc.parallel().dp
    ray.init(num_cpus=max(2, dp), include_dashboard=False, _temp_dir=args.ray_temp_dir, log_to_driver=args.verbose,
             logging_level="ERROR")
    try:
        from megatron_dynbatch.megatron.ranks import free_port

        port = free_port()
        actors = [TrainActor.remote(r, dp, port, args.seed, args.lr) for r in range(dp)]
        dp_ranks = ray.get([a.get_dp_rank.remote() for a in actors])  # or dp_rank_of(rank, rc.parallel())
        rollout = RolloutWorker.remote()
        for k in range(args.steps):
            t0 = time.perf_counter()
            # 1. rollout (+ rewards -> advantages on the driver, as slime's rollout manager does)
            samples = grpo_advantages(ray.get(rollout.generate.remote(args.samples, rc.group_size, args.seed + k)))
            # 2. plan once: training plan + log-prob plan (same ranks), each rank's samples ray.put once
            rp = plan_rollout(samples, run_config=rc)
            shards = rp.for_actors(dp_ranks)
            # 3. old log-probs: computed where they are trained on; returned here only for logging
            lp = ray.get([a.compute_log_probs.remote(s) for a, s in zip(actors, shards)])
            old_log_probs = gather_in_order(lp, rp)  # driver order: old_log_probs[i] belongs to samples[i]
            # 4. train: every optimizer step of this rollout
            per_actor = ray.get([a.train.remote(s) for a, s in zip(actors, shards)])
            losses = [step_loss(res[s] for res in per_actor) for s in range(rp.num_steps)]
            summary = rp.summary()
            mean_lp = float(torch.cat([x[s["loss_mask"] > 0] for x, s in zip(old_log_probs, samples)]).mean())
            print(f"step {k}: loss={[round(x, 6) for x in losses]} optimizer_steps={rp.num_steps} "
                  f"samples={rp.num_samples} rank_tokens={summary['rank_tokens']} "
                  f"micro_batches/rank train={rp.plan.num_microbatches} log_probs={rp.log_probs_plan.num_microbatches} "
                  f"flops_imbalance={rp.plan.flops_imbalance:.3f} mean_old_log_prob={mean_lp:.4f} "
                  f"seconds={time.perf_counter() - t0:.2f}", flush=True)
    finally:
        ray.shutdown()
    print("done", flush=True)
    return 0


# ----------------------------------------------------------------------------------- CPU setup (not Ray)
def build_cpu_megatron(rank, world_size, master_port, seed, lr):
    """A tiny GPT on one gloo rank, wrapped in Megatron DDP, with a torch optimizer (the Megatron optimizer needs
    CUDA). Replace with your own setup on GPUs."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from megatron_dynbatch.megatron import cpu as megatron_cpu

    megatron_cpu.init_cpu_distributed(rank, world_size, port=master_port, seed=seed)
    config = megatron_cpu.tiny_gpt_config()
    torch.manual_seed(seed)
    module = megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=256, thd=True)
    model = megatron_cpu.wrap_ddp(config, module)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    return model, optimizer, parallel_state.get_data_parallel_rank()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="rollouts to run (default 3)")
    p.add_argument("--samples", type=int, default=32, help="samples per rollout (default 32 = 2 optimizer steps)")
    p.add_argument("--run-config", default="tiny-cpu-demo", help="RunConfig preset or YAML (default tiny-cpu-demo)")
    p.add_argument("--log-probs-max-tokens-per-gpu", type=int, default=320)
    p.add_argument("--loss-mode", default="token_mean",
                   choices=["token_mean", "sample_mean", "group_mean", "token_sum"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ray-temp-dir", default=None, help="Ray's session directory (default: Ray's own)")
    p.add_argument("--verbose", action="store_true", help="show the actors' logs")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
