"""``megatron-dynbatch demo``: train a tiny GPT with real megatron-core on CPU ranks with dynamic batching.

Spawns ``--dp`` gloo ranks (default 2), builds a tiny ``GPTModel`` (local layer spec with the THD CPU core
attention, fp32) wrapped in Megatron's ``DistributedDataParallel``, and runs ``--steps`` optimizer steps on
synthetic RL-like batches (short prompts, long-tailed responses, loss on the response only). Each step is
planned by :func:`megatron_dynbatch.plan_global_batch` (FLOPs-balanced), packed in THD format and run through
``get_forward_backward_func()`` by :func:`megatron_dynbatch.megatron.schedule.dynamic_forward_backward`.

``--launcher torchrun`` runs under ``torchrun`` (or Slurm + torchrun) instead of spawning: every process is
one rank, ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` come from torchrun's
environment, ``--dp`` defaults to ``WORLD_SIZE`` (and must equal it), rank 0 prints the table below and every
rank ends with the line ``demo rank R/W finished``::

    torchrun --nproc-per-node 2 -m megatron_dynbatch.demo --launcher torchrun --steps 2

Per step it prints the exact loss, tokens/s, micro-batches per rank, the plan's FLOPs imbalance and padding.
``--check`` compares the first step's gradients (after ``finalize_model_grads``) with an UNPACKED reference
(every sample run alone, sbhd, on one process, same loss definition) and prints ``max_grad_diff=<value>`` and
``check: PASS`` or ``check: FAIL`` with the 1e-5 threshold; the exit status is 1 on FAIL.

Every step's batch is planned once in this process before any rank starts, so a setting the planner refuses
(``--max-tokens-per-gpu`` below the longest sample, fewer samples or groups than ranks) is one error line, not
one traceback per rank. Missing or broken torch / megatron-core is reported by
:func:`megatron_dynbatch.requirements.import_problem` (installed-but-failing imports quote the real error).

The module also holds the unpacked reference used by the tests (:func:`unpacked_reference`,
:func:`reference_coefficients`, :func:`reference_log_probs`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

VOCAB = 128
CHECK_TOLERANCE = 1e-5
PROG = "megatron-dynbatch demo"

__all__ = ["main", "synthetic_rl_batch", "reference_coefficients", "unpacked_reference", "reference_log_probs",
           "log_prob_max_diff", "sample_targets", "quiet_megatron_warnings"]


# --------------------------------------------------------------------------------------- data
def _synthetic_shapes(num_samples: int, seed: int, max_len: int = 96) -> List[Tuple[int, int, float]]:
    """``(prompt tokens, response tokens, reward)`` of every sample of :func:`synthetic_rl_batch` (torch-free)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_samples):
        prompt = int(rng.integers(4, 17))
        resp = int(min(max_len - prompt, max(1, rng.lognormal(mean=2.8, sigma=0.8))))
        out.append((prompt, resp, float(rng.normal())))
    return out


def synthetic_rl_batch(num_samples: int, seed: int, *, vocab: int = VOCAB, max_len: int = 96,
                       group_size: int = 1) -> List[Dict[str, Any]]:
    """RL-like samples: prompt 4-16 tokens (loss mask 0), long-tailed response (loss mask 1), a per-token
    ``advantages`` extra, a scalar ``reward`` and a ``group_id`` (``group_size`` responses per prompt)."""
    import torch

    g = torch.Generator().manual_seed(int(seed))
    out = []
    for i, (prompt, resp, reward) in enumerate(_synthetic_shapes(num_samples, seed, max_len)):
        n = prompt + resp
        mask = torch.zeros(n)
        mask[prompt - 1:n - 1] = 1.0  # label positions predicting response tokens
        out.append({
            "tokens": torch.randint(1, vocab, (n,), generator=g),
            "loss_mask": mask,
            "advantages": torch.randn(n, generator=g),
            "reward": reward,
            "group_id": i // max(1, group_size),
        })
    return out


def sample_targets(sample: Mapping[str, Any], pad_token_id: int = 0) -> Tuple[Any, Any]:
    """A sample's labels and loss mask as the packer builds them (next token inside the sample by default)."""
    import torch

    from .megatron.loss import sample_loss_mask

    tokens = torch.as_tensor(sample["tokens"]).long()
    if "labels" in sample:
        labels = torch.as_tensor(sample["labels"]).long()
    else:
        labels = torch.full_like(tokens, int(pad_token_id))
        labels[:-1] = tokens[1:]
    return labels, torch.from_numpy(sample_loss_mask(sample)).float()


def reference_coefficients(samples: Sequence[Mapping[str, Any]], mode: str,
                           group_ids: Optional[Sequence[Any]] = None) -> List[float]:
    """Per-sample loss coefficients written out directly from each mode's definition (independent of
    :class:`megatron_dynbatch.megatron.loss.LossNormalizer`, which the tests check against this)."""
    masks = [sample_targets(s)[1] for s in samples]
    t = [float(m.sum()) for m in masks]
    if mode == "token_sum":
        return [1.0] * len(samples)
    if mode == "token_mean":
        total = sum(t)
        return [1.0 / total if total else 0.0 for _ in t]
    if mode == "sample_mean":
        live = [x for x in t if x > 0]
        return [1.0 / (len(live) * x) if x > 0 else 0.0 for x in t]
    if mode == "group_mean":  # token-reduced groups
        assert group_ids is not None
        group_tokens: Dict[Any, float] = {}
        for gid, x in zip(group_ids, t, strict=True):
            group_tokens[gid] = group_tokens.get(gid, 0.0) + x
        live_groups = sum(1 for v in group_tokens.values() if v > 0)
        return [1.0 / (live_groups * group_tokens[g]) if group_tokens[g] > 0 else 0.0 for g in group_ids]
    raise ValueError(mode)


def _sbhd_forward(model: Any, sample: Mapping[str, Any]) -> Any:
    """Per-token cross-entropy ``[L]`` of one sample run alone (no packing, batch of one)."""
    import torch

    tokens = torch.as_tensor(sample["tokens"]).long().unsqueeze(0)
    labels, _ = sample_targets(sample)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    return model(tokens, positions, None, labels=labels.unsqueeze(0))[0]


def unpacked_reference(model: Any, samples: Sequence[Mapping[str, Any]],
                       coefficients: Sequence[float]) -> Tuple[float, Dict[str, Any]]:
    """Loss ``sum_i c_i sum_j mask_ij * ce_ij`` and its gradients, one sample at a time (sbhd, plain autograd,
    no Megatron schedule, no DDP). ``model`` must be an unwrapped ``GPTModel``; returns ``(loss, {name: grad})``."""
    import torch

    for p in model.parameters():
        p.grad = None
    total = 0.0
    for sample, c in zip(samples, coefficients, strict=True):
        _, mask = sample_targets(sample)
        ce = _sbhd_forward(model, sample)
        loss = (ce.double() * mask.double()).sum() * float(c)
        total += float(loss.detach())
        if loss.requires_grad:
            loss.to(ce.dtype).backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in model.named_parameters()}
    return total, grads


def reference_log_probs(model: Any, samples: Sequence[Mapping[str, Any]]) -> List[Any]:
    """Per-token log-probs ``[L]`` of every sample run alone (the last entry predicts the padding label)."""
    import torch

    with torch.no_grad():
        return [-_sbhd_forward(model, s).float() for s in samples]


def log_prob_max_diff(per_sample: Sequence[Any], reference: Sequence[Any],
                      indices: Optional[Sequence[int]] = None) -> float:
    """Largest absolute difference between per-sample log-probs and :func:`reference_log_probs`'s, entry ``k``
    compared with reference sample ``indices[k]`` (default: the same position). Each sample's last entry
    predicts the padding label, so it is left out."""
    idx = range(len(per_sample)) if indices is None else indices
    return max(float((a[:-1] - reference[i][:-1]).abs().max()) if a.shape[0] > 1 else 0.0
               for a, i in zip(per_sample, idx, strict=True))


# ------------------------------------------------------------------------------------ the worker
def quiet_megatron_warnings() -> None:
    """Silence megatron-core's CPU-only import warnings (no Transformer Engine / Apex): expected here. Called
    first in every CPU rank, the demo's and the multi-rank tests' alike."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")


def _demo_worker(rank: int, world_size: int, opts: Dict[str, Any]) -> Dict[str, Any]:
    quiet_megatron_warnings()
    import torch

    from .core.model_spec import ModelSpec
    from .megatron.schedule import dynamic_forward_backward
    from .megatron import cpu as megatron_cpu

    megatron_cpu.init_cpu_distributed(rank, world_size, seed=opts["seed"],
                                      addr=opts.get("master_addr") or "127.0.0.1",
                                      timeout_s=float(opts.get("timeout_s") or 120.0))
    try:
        config = megatron_cpu.tiny_gpt_config()
        torch.manual_seed(opts["seed"])
        model = megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=256, thd=True)
        reference = None
        if opts["check"] and rank == 0:
            reference = megatron_cpu.build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=256, thd=True)
            reference.load_state_dict(model.state_dict())
        ddp = megatron_cpu.wrap_ddp(config, model)
        params = [p for p in ddp.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(params, lr=opts["lr"])
        spec = ModelSpec.from_megatron(config, vocab_size=VOCAB)
        steps: List[Dict[str, Any]] = []
        max_diff = None
        for step in range(opts["steps"]):
            samples = synthetic_rl_batch(opts["samples"], opts["seed"] * 1000 + step, group_size=opts["group_size"])
            ddp.zero_grad_buffer()
            t0 = time.perf_counter()
            res = dynamic_forward_backward(
                ddp, samples,
                {"model": spec, "parallel": {"dp": world_size}, "max_tokens_per_gpu": opts["max_tokens_per_gpu"]},
                loss_mode=opts["loss_mode"])
            elapsed = time.perf_counter() - t0
            plan = res.iterator.plan
            if step == 0 and reference is not None:
                coef = reference_coefficients(samples, opts["loss_mode"], [s["group_id"] for s in samples])
                _, ref_grads = unpacked_reference(reference, samples, coef)
                max_diff = max(float((p.main_grad - ref_grads[n]).abs().max())
                               for n, p in ddp.module.named_parameters())
            for p in params:
                p.grad = p.main_grad.clone()
            optimizer.step()
            local_tokens = sum(int(res.iterator.lengths[i]) for i in res.iterator.sample_indices())
            steps.append({
                "step": step, "loss": res.loss, "seconds": elapsed, "tokens": int(plan.real_tokens),
                "local_tokens": local_tokens, "microbatches": plan.num_microbatches,
                "flops_imbalance": plan.flops_imbalance, "padding_tokens": plan.padding_tokens,
                "rank_tokens": plan.rank_tokens.tolist(),
            })
        result = {"rank": rank, "steps": steps, "max_grad_diff": max_diff}
        if opts.get("gather"):  # torchrun: every rank gets every rank's result (before the group is torn down)
            import torch.distributed as dist

            everything: List[Any] = [None] * world_size
            dist.all_gather_object(everything, result)
            return {"rank": rank, "all": everything}
        return result
    finally:
        megatron_cpu.destroy()


class _ExplicitDp(argparse.Action):
    """Stores ``--dp`` and records that it was given (under torchrun the default is WORLD_SIZE, not 2)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.dp_given = True


def _parser() -> argparse.ArgumentParser:
    from ._argparse import SuggestingArgumentParser, choice

    about = __doc__.split("\n\n")[0].replace("``", "")  # the docstring's first paragraph, without RST markup
    p = SuggestingArgumentParser(prog=PROG, description=about)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    p.add_argument("--launcher", type=choice(("spawn", "torchrun")), choices=("spawn", "torchrun"), default="spawn",
                   help="spawn: start --dp local processes (default); torchrun: this process is one rank of a "
                        "torchrun launch (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT from the env)")
    p.add_argument("--dp", type=int, default=2, action=_ExplicitDp,
                   help="data-parallel CPU ranks (default 2; with --launcher torchrun: WORLD_SIZE)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=16, help="samples per global batch (default 16)")
    p.add_argument("--group-size", type=int, default=4, help="responses per prompt group (default 4)")
    p.add_argument("--max-tokens-per-gpu", type=int, default=160)
    modes = ("token_mean", "sample_mean", "group_mean", "token_sum")
    p.add_argument("--loss-mode", default="token_mean", type=choice(modes), choices=modes)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--check", action="store_true",
                   help=f"compare the first step's gradients with the unpacked reference: PASS if they differ by "
                        f"at most {CHECK_TOLERANCE:g}, else FAIL and exit status 1")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds before a hung run fails (spawn: the whole run; torchrun: gloo collectives)")
    return p


def _say(line: str) -> None:
    """One line to stdout in ONE write, flushed: torchrun ranks share the pipe, and print() writes the text and
    the newline separately, so another rank's line could land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _torchrun_env() -> Tuple[Optional[Dict[str, str]], Optional[str]]:
    """``(env, None)`` with torchrun's rendezvous variables, or ``(None, error message)``."""
    missing = [k for k in TORCHRUN_ENV if not os.environ.get(k)]
    if missing:
        return None, (f"--launcher torchrun needs {', '.join(missing)} in the environment (set by torchrun); "
                      f"start it as 'torchrun --nproc-per-node N -m megatron_dynbatch.demo --launcher torchrun', "
                      f"or use the default --launcher spawn")
    env = {k: os.environ[k] for k in TORCHRUN_ENV}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        if not env[k].isdigit():
            return None, f"{k}={env[k]!r} from the environment is not a non-negative integer"
    if int(env["WORLD_SIZE"]) < 1 or int(env["RANK"]) >= int(env["WORLD_SIZE"]):
        return None, f"RANK={env['RANK']} and WORLD_SIZE={env['WORLD_SIZE']} from the environment are inconsistent"
    return env, None


def _report(results: Sequence[Mapping[str, Any]], check: bool, *, verbose: bool = True) -> int:
    """Print the per-step table from every rank's result (when ``verbose``); return the exit status."""
    if verbose:
        for k, s0 in enumerate(results[0]["steps"]):
            slowest = max(r["steps"][k]["seconds"] for r in results)
            per_rank = [r["steps"][k]["local_tokens"] for r in results]
            pad = s0["padding_tokens"] / max(1, s0["padding_tokens"] + s0["tokens"])
            _say(f"step {k}: loss={s0['loss']:.6f} tokens/s={s0['tokens'] / slowest:,.0f} "
                 f"micro-batches/rank={s0['microbatches']} tokens/rank={per_rank} "
                 f"flops_imbalance={s0['flops_imbalance']:.3f} padding={s0['padding_tokens']} ({pad:.1%})")
    status = 0
    if check:
        diff = results[0]["max_grad_diff"]
        ok = diff <= CHECK_TOLERANCE
        if verbose:
            _say(f"max_grad_diff={diff:.3e}")
            if ok:
                _say(f"check: PASS (max_grad_diff {diff:.1e} <= {CHECK_TOLERANCE:g}): the packed, dynamically "
                     f"batched step gives the gradients of running every sample alone")
            else:
                _say(f"check: FAIL (max_grad_diff {diff:.1e} > {CHECK_TOLERANCE:g}): the gradients differ from the "
                     f"unpacked reference")
        if not ok:
            status = 1
    return status


def _precheck(args: argparse.Namespace) -> Optional[str]:
    """Plan every step's batch here, before any rank starts (the ranks plan the same lengths): a setting the
    planner refuses becomes one error line instead of a traceback per rank. Returns that line, or None."""
    from .core.errors import DynBatchConfigError, trainer_terms
    from .core.planner import plan_global_batch

    if args.samples < 1:
        return f"--samples={args.samples}: must be >= 1. Fix: pass --samples N with N >= --dp"
    lengths: List[int] = []
    for step in range(args.steps):  # every step's batch in one call: the error covers all of them
        lengths += [p + r for p, r, _ in _synthetic_shapes(args.samples, args.seed * 1000 + step)]
    groups = [(i // args.samples, (i % args.samples) // max(1, args.group_size)) for i in range(len(lengths))]
    try:
        with trainer_terms({"max_tokens_per_gpu": "--max-tokens-per-gpu"}):  # the demo's flag
            plan_global_batch(lengths, parallel={"dp": args.dp}, balance_by="tokens", samples_per_step=args.samples,
                              max_tokens_per_gpu=args.max_tokens_per_gpu, group_ids=groups)
    except DynBatchConfigError as exc:
        text = str(exc).replace("optimizer step", "demo step")
        if exc.field == "group_ids":
            n_groups = -(-args.samples // max(1, args.group_size))
            text += f"; here --samples {args.samples} with --group-size {args.group_size} make {n_groups} per step"
        return text
    return None


def _rank_failure_line(text: str) -> Optional[str]:
    """The message of a configuration error that every failing rank raised (then the tracebacks add nothing)."""
    import re

    found = set(re.findall(r"^megatron_dynbatch\.core\.errors\.\w+: (.+)$", text, flags=re.MULTILINE))
    return found.pop() if len(found) == 1 else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``megatron-dynbatch demo``; returns the exit status."""
    args = _parser().parse_args(list(argv) if argv is not None else None)
    env = None
    if args.launcher == "torchrun":
        env, problem = _torchrun_env()
        if problem:
            print(f"{PROG}: error: {problem}", file=sys.stderr)
            return 2
        world = int(env["WORLD_SIZE"])
        if not getattr(args, "dp_given", False):
            args.dp = world
        elif args.dp != world:
            print(f"{PROG}: error: --dp={args.dp} disagrees with WORLD_SIZE={world} from torchrun: every torchrun "
                  f"process is one data-parallel rank; drop --dp or launch {args.dp} processes "
                  f"(--nnodes x --nproc-per-node = {args.dp})", file=sys.stderr)
            return 2
    if args.steps < 1 or args.dp < 1:
        print(f"{PROG}: error: --steps and --dp must be >= 1", file=sys.stderr)
        return 2
    problem = _precheck(args)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    quiet_megatron_warnings()
    from .requirements import import_problem

    problem = import_problem("torch", "megatron.core")
    if problem:
        print(f"{PROG}: error: the demo {problem}", file=sys.stderr)
        return 2

    opts = {"steps": args.steps, "seed": args.seed, "samples": args.samples, "group_size": args.group_size,
            "max_tokens_per_gpu": args.max_tokens_per_gpu, "loss_mode": args.loss_mode, "lr": args.lr,
            "check": args.check}
    rank = int(env["RANK"]) if env else 0
    if rank == 0:
        _say(f"megatron-dynbatch demo: tiny GPT, real megatron-core on CPU, dp={args.dp} ({args.launcher}), "
             f"{args.samples} samples/step, max_tokens_per_gpu={args.max_tokens_per_gpu}, loss={args.loss_mode}")
    t0 = time.perf_counter()
    if env is None:
        from .megatron.ranks import RankFailure, run_ranks

        try:
            results = run_ranks(_demo_worker, args.dp, opts, timeout=args.timeout)
        except RankFailure as exc:
            line = _rank_failure_line(str(exc))
            print(f"{PROG}: error: {line}" if line else str(exc), file=sys.stderr)
            return 2 if line else 1
    else:  # this process is one rank; torchrun's agent store serves the rendezvous at MASTER_ADDR:MASTER_PORT
        opts.update(gather=True, master_addr=env["MASTER_ADDR"], timeout_s=args.timeout)
        results = _demo_worker(rank, args.dp, opts)["all"]
    status = _report(results, args.check, verbose=rank == 0)
    if rank == 0:
        _say(f"done in {time.perf_counter() - t0:.1f}s")
    if env is not None:
        _say(f"demo rank {rank}/{args.dp} finished")
    return status


if __name__ == "__main__":  # pragma: no cover - python -m megatron_dynbatch.demo
    # Run the package module (not this __main__ copy) so that pickled workers and constants have one identity.
    from megatron_dynbatch.demo import main as _main

    sys.exit(_main())
