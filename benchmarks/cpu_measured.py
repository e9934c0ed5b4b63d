#!/usr/bin/env python
r"""MEASURED step times on real megatron-core (CPU, 2 gloo ranks): fixed padded batches vs slime vs verl vs dynbatch,
and dynbatch planned with a cost model calibrated on this CPU vs with the default (H100-fitted) one.

Unlike ``megatron-dynbatch bench`` (which *predicts* H100 step times with the cost model), this script runs
real forward + backward passes of a small GPT (megatron-core ``GPTModel``, local layer spec with the THD CPU
attention, fp32) wrapped in Megatron's ``DistributedDataParallel``, with DP = 2 gloo ranks on this machine,
and times them. Every algorithm sees the same global batch and the same model weights (gradients are zeroed
between steps; no optimizer step is taken, so the weights never change):

* ``fixed_padded`` -- Megatron's default: DP halves in sample order, micro-batches of a fixed sample count
  (``baselines.fixed_padded``: the largest power of two with ``mbs * max_len <= budget``) padded to their longest
  sample, unpacked ``[b, s]`` input with loss mask 0 on padding, run through ``get_forward_backward_func()``;
  the model's non-THD (sbhd) path, Megatron's own ``DotProductAttention`` with a causal mask.
* ``slime``, ``verl`` -- the baselines module's assignments (``baselines.run_baseline``), packed THD by
  ``DynamicBatchIterator`` from a ``Plan`` built by ``score_assignment``, run by ``dynamic_forward_backward``.
* ``dynbatch`` -- ``plan_global_batch`` with the model's ``ModelSpec.from_megatron(config)`` and the default cost
  model (the ``fitted`` profile: H100 timings);
* ``dynbatch-calibrated`` -- the same planner with a cost model calibrated on THIS machine: before the ranks start,
  ``megatron-dynbatch calibrate --device cpu`` times a slice of the same model (1 thread, embedding + LM head
  included) over its grid and writes the file the plan reads (``--calibrated-cost-model FILE`` reuses one);
* ``dynbatch-online`` -- online calibration: starts from the calibrated model when ``dynbatch-calibrated`` runs too
  (the recommended set-up: an offline calibration refined online), else from the default one
  (``--online-base default`` forces that), times every micro-batch of every round (``perf_counter``), refits after
  every round (the warm-up round is not recorded; one all-reduce of the fitted coefficients) and plans the next
  round with the refit -- its rounds show the refits converging.

The two ranks are DP ranks (``--pp 1``, the default) or the two stages of a pipeline (``--pp 2``: DP = 1), where the
micro-batch count trades the 1F1B bubble against the per-micro-batch cost -- the choice the cost model makes and the
calibration corrects.

Per algorithm it reports the median over ``--steps`` (after ``--warmup`` untimed steps) of: the step wall time
(barrier to barrier, max over ranks), each rank's compute time before the gradient all-reduce (the entry of
``config.finalize_model_grads_func``) and their max/mean (the measured imbalance), the all-reduce time,
tokens/s (real tokens / step time), padding fraction and micro-batches per rank. Alongside: the cost model's
predicted step-time RATIO vs ``fixed_padded`` (its absolute seconds are for an H100 and mean nothing on a CPU;
every plan is scored by the default model, plans made with the CPU calibration re-scored: ``default_model_step``),
and the same ratio under a cost model FITTED to this run's measured THD micro-batch times
(``cost_fit.fit_cost_model``), which keeps the model's structure but uses CPU coefficients.

Run (2-core CPU: ~3-4 minutes with the defaults)::

    python benchmarks/cpu_measured.py --json tmp/cpu_measured.json
    python benchmarks/cpu_measured.py --pp 2 --prompts 8 --max-tokens-per-gpu 4096 \
        --algorithms dynbatch,dynbatch-calibrated
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

ALGORITHMS = ("fixed_padded", "slime", "verl", "dynbatch", "dynbatch-calibrated", "dynbatch-online")
#: the algorithms planned by this package's planner (dynbatch-online starts from the default model's plan)
PLANNERS = ("dynbatch", "dynbatch-calibrated", "dynbatch-online")


# ------------------------------------------------------------------------------------------------- batch
def make_lengths(opts: Dict[str, Any]) -> np.ndarray:
    """Lengths in ``[32, max_len]``: lognormal GRPO-like body + truncation spike at ``max_len``."""
    from megatron_dynbatch.bench.workloads import grpo_lengths

    rng = np.random.default_rng(opts["seed"])
    max_len = opts["max_len"]
    prompt_hi = max(33, max_len // 8)
    batch = grpo_lengths(rng, prompts=opts["prompts"], group=opts["group_size"], max_response=max_len,
                         median_response=max_len / 6, prompt_range=(32, prompt_hi))
    # responses are clipped at max_len (and ~8% forced to it); prompt + response then caps at max_len: the
    # truncated rollouts form the spike at exactly max_len (a rollout cut at the context limit)
    return np.clip(batch.lengths, 32, max_len).astype(np.int64)


def make_samples(lengths: Sequence[int], vocab: int, seed: int) -> List[Dict[str, Any]]:
    """Random tokens; loss on every label position except the last (SFT-like; compute does not depend on it)."""
    import torch

    g = torch.Generator().manual_seed(int(seed))
    out = []
    for n in lengths:
        mask = torch.ones(int(n))
        mask[-1] = 0.0
        out.append({"tokens": torch.randint(1, vocab, (int(n),), generator=g), "loss_mask": mask})
    return out


# ------------------------------------------------------------------------------------------------- plans
def build_plans(lengths: np.ndarray, spec: Any, budget: int, parallel: Dict[str, int], algorithms: Sequence[str],
                calibrated: Optional[str] = None, online_base: Optional[str] = None) -> Dict[str, Any]:
    """``name -> {"plan": Plan | None, "padded": bool, "error": str | None, "notes": [...], "cost_model": ...}``;
    ``calibrated``: the cost-model file ``dynbatch-calibrated`` plans with; ``online_base``: the file
    ``dynbatch-online`` starts from (``None``: the default model). ``cost_model`` is the model a plan was planned
    -- and so scored -- with (``None``: the default); :func:`default_model_step` re-scores the others."""
    from megatron_dynbatch.bench.baselines import BaselineContext, run_baseline
    from megatron_dynbatch.core.planner import plan_global_batch

    ctx = BaselineContext.build(parallel, budget, model=spec)
    out: Dict[str, Any] = {}
    for name in algorithms:
        if name in PLANNERS:
            cm = calibrated if name == "dynbatch-calibrated" or (name == "dynbatch-online" and online_base) else None
            plan = plan_global_batch(lengths, model=spec, parallel=parallel, max_tokens_per_gpu=budget, cost_model=cm)
            out[name] = {"plan": plan, "padded": False, "error": None, "notes": [], "cost_model": cm}
            continue
        run = run_baseline(name, lengths, ctx)
        entry = {"plan": run.plan, "padded": name == "fixed_padded", "error": run.error, "notes": list(run.notes),
                 "cost_model": None}
        if run.plan is not None and not entry["padded"]:
            try:
                run.plan.validate(num_samples=len(lengths))
            except AssertionError as exc:  # the iterator would refuse it (DynBatchConfigError)
                entry["error"] = f"not runnable by DynamicBatchIterator: {exc}"
        out[name] = entry
    return out


# ------------------------------------------------------------------------------------------------ worker
def _padded_microbatches(samples: Sequence[Dict[str, Any]], mbs: Sequence[Sequence[int]]) -> List[Dict[str, Any]]:
    """``[b, s]`` micro-batches (s = longest sample of the micro-batch), padding masked out of the loss."""
    import torch

    out = []
    for idx in mbs:
        s = max(len(samples[i]["tokens"]) for i in idx)
        tokens = torch.zeros(len(idx), s, dtype=torch.long)
        labels = torch.zeros(len(idx), s, dtype=torch.long)
        mask = torch.zeros(len(idx), s)
        for row, i in enumerate(idx):
            t = samples[i]["tokens"]
            n = len(t)
            tokens[row, :n] = t
            labels[row, :n - 1] = t[1:]
            mask[row, :n] = samples[i]["loss_mask"]
        pos = torch.arange(s).unsqueeze(0).expand(len(idx), s).contiguous()
        out.append({"tokens": tokens, "labels": labels, "loss_mask": mask, "position_ids": pos,
                    "real": int(sum(len(samples[i]["tokens"]) for i in idx)), "shape": (len(idx), s)})
    return out


def _padded_forward_step(stamps: List[float]):
    import torch

    def forward_step(data_iterator: Any, model: Any):
        stamps.append(time.perf_counter())
        b = next(data_iterator)
        output = model(b["tokens"], b["position_ids"], None, labels=b["labels"])  # per-token CE [b, s]

        def loss_func(out: Any):
            m = b["loss_mask"]
            loss = (out.float() * m).sum()
            n = m.sum().to(torch.int)
            return loss, n, {"lm loss": torch.stack([loss.detach(), n.float().detach()])}

        return output, loss_func

    return forward_step


class _OnlineRunner:
    """``dynbatch-online``: each round plans with the online calibrator's current model (iterators cached per
    plan, so packing is not timed), runs the step with the calibrator (refit after every round) and keeps
    ``rounds``: micro-batches per rank and the refit's log."""

    def __init__(self, samples: Any, ddp: Any, spec: Any, parallel: Dict[str, int], budget: int,
                 stamps: List[float], base: Optional[str]) -> None:
        from megatron_dynbatch.megatron.online_calibration import OnlineCalibrator

        self.samples, self.ddp, self.stamps = samples, ddp, stamps
        self.kwargs = {"model": spec, "parallel": parallel, "max_tokens_per_gpu": budget}
        self.cal = OnlineCalibrator(spec, parallel, interval=1, log=None, base=base)
        self.lengths = np.asarray([len(x["tokens"]) for x in samples])
        self.iterators: Dict[Any, Any] = {}
        self.rounds: List[Dict[str, Any]] = []

    def run(self) -> None:
        from megatron_dynbatch.core.planner import plan_global_batch
        from megatron_dynbatch.megatron.iterator import DynamicBatchIterator
        from megatron_dynbatch.megatron.schedule import default_forward_step, dynamic_forward_backward

        plan = plan_global_batch(self.lengths, cost_model=self.cal.state.current(), **self.kwargs)
        key = json.dumps(plan.micro_batches)
        if key not in self.iterators:
            self.iterators[key] = DynamicBatchIterator(self.samples, plan)
        it = self.iterators[key]
        step_fn = _stamped(default_forward_step(it, num_microbatches=it.num_microbatches), self.stamps)
        before = len(self.cal.history)
        dynamic_forward_backward(self.ddp, it, forward_step_func=step_fn, calibrator=self.cal)
        log = self.cal.history[-1] if len(self.cal.history) > before else None
        self.rounds.append({"microbatches": plan.num_microbatches, "refit": None if log is None else {
            "fit_error": log.fit_error, "records": log.records, "line": log.line(),
            "model_change": None if log.change is None else log.change.model_change}})


def _stamped(forward_step: Any, stamps: List[float]):
    def wrapped(data_iterator: Any, model: Any):
        stamps.append(time.perf_counter())
        return forward_step(data_iterator, model)

    return wrapped


def _worker(rank: int, world_size: int, opts: Dict[str, Any]) -> Dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_dynbatch.megatron.iterator import DynamicBatchIterator
    from megatron_dynbatch.core.model_spec import ModelSpec
    from megatron_dynbatch.megatron.schedule import default_forward_step, dynamic_forward_backward
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    pp = int(opts["pp"])
    megatron_cpu.init_cpu_distributed(rank, world_size, pp=pp, seed=opts["seed"], timeout_s=float(opts["timeout"]))
    try:
        config = megatron_cpu.tiny_gpt_config(
            num_layers=opts["num_layers"], hidden_size=opts["hidden_size"], num_attention_heads=opts["heads"],
            num_query_groups=opts["query_groups"], ffn_hidden_size=opts["ffn_hidden_size"])
        torch.manual_seed(opts["seed"])
        model = megatron_cpu.build_tiny_gpt(config, vocab_size=opts["vocab"], max_seq_len=opts["max_len"], thd=True)
        ddp = megatron_cpu.wrap_ddp(config, model)
        t_fin: List[float] = []
        t_fin_end: List[float] = []
        finalize = config.finalize_model_grads_func

        def timed_finalize(*a: Any, **k: Any) -> Any:
            t_fin.append(time.perf_counter())
            try:
                return finalize(*a, **k)
            finally:
                t_fin_end.append(time.perf_counter())

        config.finalize_model_grads_func = timed_finalize
        spec = ModelSpec.from_megatron(config, vocab_size=opts["vocab"])
        lengths = np.asarray(opts["lengths"], dtype=np.int64)
        samples = make_samples(lengths, opts["vocab"], opts["seed"])
        from megatron.core import parallel_state

        parallel = {"dp": world_size // pp, "pp": pp}
        dp_rank, pp_rank = parallel_state.get_data_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
        plans = build_plans(lengths, spec, opts["max_tokens_per_gpu"], parallel, opts["algorithms"],
                            opts.get("calibrated_cost_model"), opts.get("online_base"))
        fb = get_forward_backward_func()

        results: Dict[str, Any] = {}
        runners: Dict[str, Any] = {}
        for name in opts["algorithms"]:
            entry = plans[name]
            plan = entry["plan"]
            res: Dict[str, Any] = {"error": entry["error"], "notes": entry["notes"], "steps": []}
            results[name] = res
            if entry["error"] is not None:
                continue
            mbs = plan.micro_batches[dp_rank]
            stamps: List[float] = []
            if entry["padded"]:
                batches = _padded_microbatches(samples, mbs)
                padded_tokens = sum(b["shape"][0] * b["shape"][1] for b in batches)
                mb_meta = [{"padded_tokens": b["shape"][0] * b["shape"][1],
                            "sq": float(b["shape"][0] * b["shape"][1] ** 2), "shape": list(b["shape"])}
                           for b in batches]

                def run_step(batches=batches, step_fn=_padded_forward_step(stamps)) -> None:
                    fb(forward_step_func=step_fn, data_iterator=iter(batches), model=ddp,
                       num_microbatches=len(batches), seq_length=max(b["shape"][1] for b in batches),
                       micro_batch_size=max(b["shape"][0] for b in batches), forward_only=False)
            elif name == "dynbatch-online":
                online = _OnlineRunner(samples, ddp, spec, parallel, opts["max_tokens_per_gpu"], stamps,
                                       opts.get("online_base"))
                run_step = online.run
                padded_tokens = int(sum(plan.microbatch_tokens[dp_rank]))
                mb_meta = []  # changes every round: not part of the cpu-fit
                res["online"] = online.rounds
            else:
                it = DynamicBatchIterator(samples, plan)  # one iterator per algorithm: packed micro-batches are cached
                padded_tokens = int(sum(plan.microbatch_tokens[dp_rank]))
                mb_meta = [{"padded_tokens": int(plan.microbatch_tokens[dp_rank][j]),
                            "sq": float(sum(int(lengths[i]) ** 2 for i in mb))} for j, mb in enumerate(mbs)]

                def run_step(it=it, step_fn=_stamped(default_forward_step(it, num_microbatches=it.num_microbatches),
                                                     stamps)) -> None:
                    dynamic_forward_backward(ddp, it, forward_step_func=step_fn)

            runners[name] = (run_step, stamps)
            res.update(microbatches=len(mbs), real_tokens=int(lengths[[i for mb in mbs for i in mb]].sum()),
                       padded_tokens=int(padded_tokens), mb_meta=mb_meta)

        # Rounds: every algorithm once per round (warm-up rounds first), so slow drifts of a shared CPU (other
        # tenants, frequency) hit every algorithm alike instead of whichever happens to run last.
        for k in range(opts["warmup"] + opts["steps"]):
            for name, (run_step, stamps) in runners.items():
                ddp.zero_grad_buffer()
                stamps.clear()
                del t_fin[:], t_fin_end[:]
                dist.barrier()
                t0 = time.perf_counter()
                run_step()
                t_done = time.perf_counter()
                dist.barrier()
                t1 = time.perf_counter()
                if k < opts["warmup"]:
                    continue
                marks = stamps + [t_fin[0]]
                results[name]["steps"].append({
                    "step_s": t1 - t0, "compute_s": t_fin[0] - t0, "allreduce_s": t_fin_end[0] - t_fin[0],
                    "fb_s": t_done - t0, "mb_s": [b - a for a, b in zip(marks[:-1], marks[1:])]})
                if k == opts["warmup"] + opts["steps"] - 1:
                    grads = [float(p.main_grad.abs().sum()) for p in ddp.module.parameters() if p.requires_grad]
                    results[name]["grad_abs_sum"] = float(sum(grads))
        out = {"rank": rank, "dp_rank": dp_rank, "pp_rank": pp_rank, "results": results}
        if rank == 0:
            out["plans"] = {name: (None if e["plan"] is None else {
                "micro_batches": e["plan"].micro_batches,
                "predicted_step_s": default_model_step(e, lengths, spec, opts["max_tokens_per_gpu"]),
                "predicted_step_s_own": float(e["plan"].predicted_step_time),
                "plan_dict": e["plan"].to_dict() if name in PLANNERS else None,
                "predicted_imbalance": float(e["plan"].imbalance), "cap_violations": int(e["plan"].cap_violations),
                "microbatch_tokens": e["plan"].microbatch_tokens, "padding_tokens": int(e["plan"].padding_tokens),
                "padded": e["padded"]}) for name, e in plans.items()}
            out["spec"] = spec.to_dict()
        return out
    finally:
        megatron_cpu.destroy()


def default_model_step(entry: Dict[str, Any], lengths: np.ndarray, spec: Any, max_tokens_per_gpu: int) -> float:
    """The default (H100-fitted) model's step time of ``entry["plan"]`` (an entry of :func:`build_plans`): the
    ``pred x`` column compares every plan in that one model, so a plan planned with another cost model (the CPU
    calibration of ``dynbatch-calibrated``, and of ``dynbatch-online`` when it starts from it) is re-scored, its
    grouping unchanged. Its own model's seconds would be CPU seconds against H100 seconds (a ratio of ~35)."""
    plan = entry["plan"]
    if entry.get("cost_model") is None:
        return float(plan.predicted_step_time)
    from megatron_dynbatch.core.calibration.compare import rescore

    return rescore(plan, lengths, model=spec, cost_model=None, max_tokens_per_gpu=max_tokens_per_gpu)


# ------------------------------------------------------------------------------------------------ report
def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _cpu_fitted_ratios(per_rank: List[Dict[str, Any]], plans: Dict[str, Any], lengths: np.ndarray, budget: int,
                       spec: Any) -> Dict[str, Any]:
    """Fit ``overhead + a*tokens + b*sum(L^2)`` to this run's measured THD micro-batch times (median over the
    timed steps) and re-score every plan with it: the cost model's structure with CPU coefficients."""
    from megatron_dynbatch.core.cost_fit import fit_cost_model
    from megatron_dynbatch.core.planner import score_assignment

    toks, sqs, secs = [], [], []
    for r in per_rank:
        for name, res in r["results"].items():
            if res.get("error") is not None or plans[name]["padded"] or not res.get("steps"):
                continue
            for j, meta in enumerate(res["mb_meta"]):
                toks.append(meta["padded_tokens"])
                sqs.append(meta["sq"])
                secs.append(_median([s["mb_s"][j] for s in res["steps"]]))
    if len(secs) < 3:
        return {}
    cm, report = fit_cost_model(toks, sqs, secs)
    out: Dict[str, Any] = {"coefficients": {"linear_s_per_token": cm.linear_s_per_token,
                                            "attention_s_per_sq_token": cm.attention_s_per_sq_token,
                                            "overhead_s": cm.overhead_s},
                           "fit": report.to_dict(), "predicted_step_s": {}}
    for name, p in plans.items():
        if p is None:
            continue
        plan = score_assignment(p["micro_batches"], lengths, model=spec, parallel={"dp": 2},  # pp == 1 here
                                max_tokens_per_gpu=budget, cost_model=cm, pad_to_longest=p["padded"])
        out["predicted_step_s"][name] = float(plan.predicted_step_time)
        out.setdefault("predicted_imbalance", {})[name] = float(plan.imbalance)
    return out


def _parallel(opts: Dict[str, Any]) -> Dict[str, int]:
    return {"dp": 2 // int(opts["pp"]), "pp": int(opts["pp"])}


def _calibration_summary(rows: Dict[str, Any], plans: Dict[str, Any], lengths: np.ndarray, opts: Dict[str, Any],
                         spec: Any) -> Dict[str, Any]:
    """``dynbatch-calibrated`` vs ``dynbatch``: measured step ratio, and both plans scored by the calibrated model."""
    from megatron_dynbatch.core.calibration.compare import rescore

    cal, default = rows.get("dynbatch-calibrated", {}), rows.get("dynbatch", {})
    info = dict(opts.get("calibration") or {})
    if not (cal.get("step_s") and default.get("step_s")):
        return info
    path = opts["calibrated_cost_model"]
    from megatron_dynbatch.core.planner import Plan

    default_plan = Plan.from_dict(plans["dynbatch"]["plan_dict"])
    info.update(measured_ratio=cal["step_s"] / default["step_s"],
                measured_ratio_per_round=[c / d for c, d in zip(cal["step_s_all"], default["step_s_all"])],
                modelled_default_plan_s=rescore(default_plan, lengths, model=spec, cost_model=path,
                                                max_tokens_per_gpu=opts["max_tokens_per_gpu"]),
                modelled_calibrated_plan_s=plans["dynbatch-calibrated"]["predicted_step_s_own"],
                microbatches=[default["microbatches_per_rank"], cal["microbatches_per_rank"]])
    info["modelled_ratio"] = info["modelled_calibrated_plan_s"] / info["modelled_default_plan_s"]
    return info


def _online_summary(rows: Dict[str, Any], per_rank: List[Dict[str, Any]], opts: Dict[str, Any]) -> Dict[str, Any]:
    """``dynbatch-online`` round by round (warm-up rounds included): micro-batches, refit error, step time."""
    row = rows.get("dynbatch-online", {})
    rounds = per_rank[0]["results"].get("dynbatch-online", {}).get("online")
    if not rounds or not row.get("step_s_all"):
        return {}
    timed = [None] * opts["warmup"] + list(row["step_s_all"])
    out = [dict(r, step_s=t, warmup=k < opts["warmup"]) for k, (r, t) in enumerate(zip(rounds, timed))]
    base = rows.get("dynbatch", {}).get("step_s")
    return {"rounds": out, "ratio_last_vs_dynbatch": (row["step_s_all"][-1] / base) if base else None,
            "base": opts.get("online_base") or "default (fitted)"}


def summarise(per_rank: List[Dict[str, Any]], opts: Dict[str, Any], wall_s: float) -> Dict[str, Any]:
    lengths = np.asarray(opts["lengths"], dtype=np.int64)
    plans = per_rank[0]["plans"]
    spec = per_rank[0]["spec"]
    # per-micro-batch spans from forward-step stamps are micro-batch times only without a pipeline
    fitted = _cpu_fitted_ratios(per_rank, plans, lengths, opts["max_tokens_per_gpu"], spec) if opts["pp"] == 1 else {}
    rows: Dict[str, Any] = {}
    for name in opts["algorithms"]:
        r0 = per_rank[0]["results"][name]
        row: Dict[str, Any] = {"error": r0["error"], "notes": r0["notes"]}
        p = plans.get(name)
        if p is not None:
            row.update(predicted_step_s_h100=p["predicted_step_s"], predicted_imbalance=p["predicted_imbalance"],
                       cap_violations=p["cap_violations"])
        if r0["error"] is None:
            n = len(r0["steps"])
            step = [max(r["results"][name]["steps"][k]["step_s"] for r in per_rank) for k in range(n)]
            compute = [[r["results"][name]["steps"][k]["compute_s"] for k in range(n)] for r in per_rank]
            allreduce = [[r["results"][name]["steps"][k]["allreduce_s"] for k in range(n)] for r in per_rank]
            imb = [max(c[k] for c in compute) / (sum(c[k] for c in compute) / len(compute)) for k in range(n)]
            first = [r for r in per_rank if r.get("pp_rank", 0) == 0]  # each DP rank's tokens once
            real = sum(r["results"][name]["real_tokens"] for r in first)
            padded = sum(r["results"][name]["padded_tokens"] for r in first)
            row.update(
                step_s=_median(step), step_s_all=step, step_s_min=min(step), step_s_max=max(step),
                rank_compute_s=[_median(c) for c in compute],
                measured_imbalance=_median(imb),
                allreduce_s=[_median(a) for a in allreduce],
                tokens_per_s=real / _median(step),
                real_tokens=real, padded_tokens=padded, padding_fraction=(padded - real) / padded,
                microbatches_per_rank=[r["results"][name]["microbatches"] for r in per_rank],
                grad_abs_sum=r0["grad_abs_sum"])
            if fitted:
                row["cpu_fitted_predicted_step_s"] = fitted["predicted_step_s"].get(name)
                row["cpu_fitted_predicted_imbalance"] = fitted["predicted_imbalance"].get(name)
        rows[name] = row
    base = rows.get("fixed_padded", {})
    for name, row in rows.items():
        if base.get("step_s") and row.get("step_s"):
            row["measured_ratio_vs_fixed"] = row["step_s"] / base["step_s"]
        if base.get("predicted_step_s_h100") and row.get("predicted_step_s_h100"):
            row["predicted_ratio_vs_fixed"] = row["predicted_step_s_h100"] / base["predicted_step_s_h100"]
        if base.get("cpu_fitted_predicted_step_s") and row.get("cpu_fitted_predicted_step_s"):
            row["cpu_fitted_ratio_vs_fixed"] = row["cpu_fitted_predicted_step_s"] / base["cpu_fitted_predicted_step_s"]
    calibration = _calibration_summary(rows, plans, lengths, opts, spec)
    online = _online_summary(rows, per_rank, opts)
    import torch

    return {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "settings": {k: v for k, v in opts.items() if k != "lengths"},
        "batch": {"samples": int(lengths.size), "tokens": int(lengths.sum()), "min": int(lengths.min()),
                  "median": float(np.median(lengths)), "max": int(lengths.max()),
                  "at_max": int((lengths == lengths.max()).sum()), "lengths": lengths.tolist()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "threads_per_rank": 1, "gpu": False},
        "model_spec": spec,
        "cpu_fitted_cost_model": fitted,
        "calibration": calibration,
        "online": online,
        "algorithms": rows,
        "wall_s": wall_s,
    }


def _fmt(x: Any, f: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, f)


def format_table(summary: Dict[str, Any]) -> str:
    head = (f"{'algorithm':<19} {'step s':>7} {'min-max':>11} {'x fixed':>7} {'pred x':>7} {'cpu-fit x':>9} "
            f"{'tok/s':>7} {'compute s r0/r1':>16} {'imbal':>6} {'pred imb':>8} {'fit imb':>7} {'allred s':>8} "
            f"{'pad %':>6} {'mb/rank':>8} {'cap viol':>8}  notes")
    lines = [head, "-" * len(head)]
    for name, r in summary["algorithms"].items():
        if r.get("error") is not None:
            lines.append(f"{name:<19} not run: {r['error']}")
            continue
        comp = "/".join(f"{c:.2f}" for c in r["rank_compute_s"])
        mbr = "/".join(str(m) for m in r["microbatches_per_rank"])
        ar = min(r["allreduce_s"])  # the last rank to arrive: the collective itself, no waiting
        lines.append(
            f"{name:<19} {r['step_s']:>7.2f} {r['step_s_min']:>5.2f}-{r['step_s_max']:<5.2f} "
            f"{_fmt(r.get('measured_ratio_vs_fixed'), '.3f'):>7} "
            f"{_fmt(r.get('predicted_ratio_vs_fixed'), '.3f'):>7} {_fmt(r.get('cpu_fitted_ratio_vs_fixed'), '.3f'):>9} "
            f"{r['tokens_per_s']:>7.0f} {comp:>16} {r['measured_imbalance']:>6.3f} "
            f"{_fmt(r.get('predicted_imbalance'), '.3f'):>8} {_fmt(r.get('cpu_fitted_predicted_imbalance'), '.3f'):>7} "
            f"{ar:>8.3f} {100 * r['padding_fraction']:>6.1f} "
            f"{mbr:>8} {r.get('cap_violations', 0):>8}  {'; '.join(r['notes'])}")
    b = summary["batch"]
    lines.append("")
    lines.append(f"batch: {b['samples']} samples, {b['tokens']} tokens, lengths {b['min']}..{b['max']} "
                 f"(median {b['median']:.0f}, {b['at_max']} at the max); "
                 f"budget {summary['settings']['max_tokens_per_gpu']} tokens/GPU; "
                 f"{_layout_text(summary['settings'])}, 1 thread each")
    fit = summary.get("cpu_fitted_cost_model") or {}
    if fit:
        c = fit["coefficients"]
        lines.append(f"cpu-fitted cost model (THD micro-batches): {c['overhead_s'] * 1e3:.1f} ms + "
                     f"{c['linear_s_per_token'] * 1e6:.1f} us/token + "
                     f"{c['attention_s_per_sq_token'] * 1e9:.2f} ns/sq-token "
                     f"(rel rms err {fit['fit']['rel_rms_error']:.1%}, n={fit['fit']['num_measurements']})")
    cal = summary.get("calibration") or {}
    if cal.get("measured_ratio") is not None:
        how = (f"on this CPU ({cal['wall_s']:.0f} s, fit error {cal['fit_error']:.1%})" if "wall_s" in cal else
               f"from {cal['file']}")
        lines.append(f"calibrated {how}: "
                     f"dynbatch-calibrated / dynbatch measured {cal['measured_ratio']:.3f} (per round "
                     f"{', '.join(f'{x:.3f}' for x in cal['measured_ratio_per_round'])}), modelled by the calibrated "
                     f"model {cal['modelled_ratio']:.3f}; micro-batches per rank {cal['microbatches'][0]} -> "
                     f"{cal['microbatches'][1]}")
    online = summary.get("online") or {}
    if online.get("rounds"):
        lines.append(f"dynbatch-online starts from: {online['base']}")
    for k, r in enumerate(online.get("rounds", [])):
        fit = r["refit"]
        lines.append(f"online round {k}{' (warm-up)' if r['warmup'] else ''}: {r['microbatches']} micro-batches per "
                     f"rank" + (f", step {r['step_s']:.2f} s" if r["step_s"] else "") +
                     (f"; refit after it: fit error {fit['fit_error']:.1%} on {fit['records']} records, predicted "
                      f"step of its plan {fit['model_change']:+.1%} vs the model it was planned with"
                      if fit and fit["fit_error"] is not None and fit["model_change"] is not None else
                      "; not recorded (warm-up)" if r["warmup"] else ""))
    lines.append("step s: median step wall time (barrier to barrier, max over ranks; min-max over the timed steps); "
                 "x fixed: / fixed_padded; pred x: the cost model's (H100) predicted ratio; cpu-fit x: ratio under the "
                 "cost model fitted to this run's THD micro-batch times; imbal: measured max/mean rank compute before "
                 "the all-reduce; pred imb / fit imb: the same predicted by the H100 / the CPU-fitted cost model; "
                 "allred s: finalize_model_grads on the last rank to arrive (the gloo all-reduce itself)")
    lines.append(f"(wall time {summary['wall_s']:.0f} s)")
    return "\n".join(lines)


def _layout_text(settings: Dict[str, Any]) -> str:
    return "dp=2 gloo ranks" if settings.get("pp", 1) == 1 else f"dp=1 x pp={settings['pp']} gloo ranks (stages)"


def calibrate_here(opts: Dict[str, Any], out_dir: str) -> Dict[str, Any]:
    """``megatron-dynbatch calibrate --device cpu`` on the benchmark's model and layout (1 thread, embedding and LM
    head included): the cost-model file ``dynbatch-calibrated`` plans with, and what the calibration reported."""
    import subprocess

    os.makedirs(out_dir, exist_ok=True)
    model = os.path.join(out_dir, "cpu_measured_model.json")
    with open(model, "w", encoding="utf-8") as fh:
        json.dump({"name": "cpu-measured", "num_layers": opts["num_layers"], "hidden_size": opts["hidden_size"],
                   "num_attention_heads": opts["heads"], "num_query_groups": opts["query_groups"],
                   "ffn_hidden_size": opts["ffn_hidden_size"], "swiglu": True, "vocab_size": opts["vocab"]}, fh)
    path = os.path.join(out_dir, "cpu_calibrated_cost_model.json")
    par = _parallel(opts)
    cmd = [sys.executable, "-m", "megatron_dynbatch.cli", "calibrate", "--model", model, "--device", "cpu",
           "--max-tokens-per-gpu", str(opts["max_tokens_per_gpu"]), "--dp", str(par["dp"]), "--pp", str(par["pp"]),
           "--lm-head", "--cpu-threads", "1", "--output", path, "--json"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=opts["timeout"])
    if done.returncode != 0:
        raise SystemExit(f"calibration failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    return {"file": path, "command": " ".join(cmd[2:]), "wall_s": time.perf_counter() - t0,
            "timed": report.get("timed"), "fit_error": report["fit"].get("uncertainty"),
            "per_group": report["fit"].get("per_group"), "profile": report["fit"].get("profile")}


# -------------------------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="timed steps per algorithm (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per algorithm first")
    p.add_argument("--seed", type=int, default=0, help="batch lengths, tokens and weights")
    p.add_argument("--json", metavar="OUT", help="write the full results as JSON here")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS),
                   help="comma-separated subset of " + ",".join(ALGORITHMS))
    p.add_argument("--pp", type=int, default=1, choices=(1, 2), help="pipeline stages (2: the ranks are one pipeline)")
    p.add_argument("--calibrated-cost-model", metavar="FILE", default=None,
                   help="cost-model file for dynbatch-calibrated (default: calibrate on this CPU first)")
    p.add_argument("--online-base", choices=("calibrated", "default"), default="calibrated",
                   help="dynbatch-online starts from the calibrated model (when dynbatch-calibrated runs) or the "
                        "default one")
    g = p.add_argument_group("workload")
    g.add_argument("--prompts", type=int, default=16, help="GRPO prompts")
    g.add_argument("--group-size", type=int, default=4, help="responses per prompt")
    g.add_argument("--max-len", type=int, default=1024, help="longest sample (truncation spike)")
    g.add_argument("--max-tokens-per-gpu", type=int, default=2048, help="token budget per micro-batch")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--query-groups", type=int, default=2)
    g.add_argument("--ffn-hidden-size", type=int, default=1024)
    g.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the run is declared hung")
    return p


def run(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = _parser().parse_args(list(argv) if argv is not None else None)
    algos = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in algos if a not in ALGORITHMS]
    if bad or not algos:
        raise SystemExit(f"unknown algorithm(s) {bad}; use a subset of {','.join(ALGORITHMS)}")
    if "fixed_padded" in algos:  # the reference of every ratio goes first
        algos.remove("fixed_padded")
        algos.insert(0, "fixed_padded")
    opts = {"seed": args.seed, "steps": args.steps, "warmup": args.warmup, "algorithms": algos,
            "prompts": args.prompts, "group_size": args.group_size, "max_len": args.max_len,
            "max_tokens_per_gpu": args.max_tokens_per_gpu, "num_layers": args.num_layers,
            "hidden_size": args.hidden_size, "heads": args.heads, "query_groups": args.query_groups,
            "ffn_hidden_size": args.ffn_hidden_size, "vocab": args.vocab, "timeout": args.timeout, "pp": args.pp}
    opts["lengths"] = make_lengths(opts).tolist()
    from megatron_dynbatch.megatron.ranks import run_ranks

    t0 = time.perf_counter()
    if "dynbatch-calibrated" in algos:
        if args.calibrated_cost_model:
            opts["calibration"] = {"file": args.calibrated_cost_model}
        else:
            import tempfile

            out_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else tempfile.mkdtemp()
            opts["calibration"] = calibrate_here(opts, out_dir)
        opts["calibrated_cost_model"] = opts["calibration"]["file"]
        if args.online_base == "calibrated":
            opts["online_base"] = opts["calibrated_cost_model"]
    per_rank = run_ranks(_worker, 2, opts, timeout=args.timeout, threads_per_rank=1)
    summary = summarise(per_rank, opts, time.perf_counter() - t0)
    print(format_table(summary))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
