"""``plan_global_batch``: lengths in, :class:`Plan` out.

Strategy
--------
For each optimizer step (the whole batch, or consecutive slices of ``samples_per_step`` samples):

1. Pad each sample to its alignment slot (``2*cp`` multiples) and count that padding against the budget
   ``cap = max_tokens_per_gpu * cp`` (less the micro-batch tail padding: ``Alignment.effective_cap``).
2. Start at the fewest micro-batches per rank the budget allows, ``M0 = ceil(slot tokens / (dp * cap))``,
   moved up to the next count Megatron's interleaved schedule accepts, and pack for that ``M``
   (:mod:`.packer`); if the packing is infeasible, try the next valid ``M``.
3. Score a few more counts with the cost model and keep the fastest: with ``pp > 1`` counts up to the one
   that minimises the modelled 1F1B bubble + per-micro-batch overhead, with ``pp == 1`` one more count when
   the first leaves the ranks unbalanced (an extra micro-batch can unlock a better packing).
4. Order each rank's micro-batches: largest first with ``pp == 1`` (an out-of-memory shows on the first
   micro-batch); with ``pp > 1`` the arrangement (decreasing, increasing, small-at-both-ends) with the shortest
   simulated 1F1B makespan. The arrangement is a pattern over the weight ranks, the same on every DP rank,
   so expert-parallel ranks that advance in lockstep meet micro-batches of similar size.

Invariants (asserted by ``tests/test_planner_properties.py`` over thousands of random workloads)
----------------------------------------------------------------------------------------------
* every sample is placed exactly once; no micro-batch is empty;
* every DP rank runs the same number of micro-batches, and the same number in every optimizer step;
* a micro-batch's padded token count never exceeds ``cap`` — the only exception is a sample that is alone
  over budget under ``oversize='alone'`` (it is listed in ``plan.oversize_samples`` and a warning is raised);
* with ``vpp > 1`` the count satisfies ``pp <= N <= M`` and ``M % N in {0} U [pp, N)``;
* the samples of one group (``group_ids``) share a DP rank; each optimizer step holds exactly
  ``samples_per_step`` samples;
* the result depends only on the arguments: every rank computes the same plan without communicating.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, List, Mapping, Optional, Sequence, Union

import numpy as np

from ..alignment import Alignment
from ..cost_model import CostModel
from ..errors import DynBatchConfigError, OversizeSampleError, OversizeSampleWarning
from ..parallel import ParallelConfig
from .ordering import mb_sums, order_and_time, polish_pipeline
from .packer import StepInput, plan_for_count, plan_global_bins
from .plan import Plan
from .vpp import check_forced_count, is_valid_microbatch_count, next_valid_microbatch_count

OVERSIZE_POLICIES = ("error", "alone")
BALANCE_MODES = ("flops", "tokens", "time")


def plan_global_batch(
    lengths: Union[Sequence[int], np.ndarray],
    *,
    model: Any = None,
    parallel: Union[ParallelConfig, Mapping[str, Any], None] = None,
    max_tokens_per_gpu: int,
    balance_by_flops: bool = True,
    balance_by: Optional[str] = None,
    group_ids: Optional[Sequence[Any]] = None,
    samples_per_step: Optional[int] = None,
    oversize: str = "error",
    fp8_alignment: Union[None, str, int] = None,
    cost_model: Optional[CostModel] = None,
    num_microbatches: Optional[int] = None,
    refine_rounds: Optional[int] = None,
) -> Plan:
    """Split a global batch over DP ranks and into micro-batches (see the module docstring).

    Args:
        lengths: tokens per sample (non-negative integers; 0 is allowed and takes one padding slot).
        model: ``ModelSpec``, a dict of Megatron field names or a preset name; needed to balance by FLOPs.
        parallel: ``ParallelConfig`` or dict with ``dp, tp, pp, cp, ep, vpp`` (missing = 1).
        max_tokens_per_gpu: the per-GPU budget; a micro-batch holds at most ``max_tokens_per_gpu * cp``.
        balance_by_flops: balance compute (True) or tokens (False) across ranks and micro-batches. Compute is
            the model's FLOPs per sample, linear and attention terms each at their kernel efficiency (the
            cost model's seconds), since equal time -- not equal raw FLOPs -- is what makes ranks finish
            together.
        balance_by: explicit mode overriding ``balance_by_flops``: ``"time"`` (the default with a model; pass a
            calibrated ``cost_model`` to balance measured time), ``"flops"`` (raw FLOPs) or ``"tokens"``.
        group_ids: one id per sample; samples sharing an id (a GRPO prompt group) stay on one DP rank.
        samples_per_step: split the batch into optimizer steps of exactly this many consecutive samples.
        oversize: policy for a sample longer than the budget: ``"error"`` (default) or ``"alone"``.
        fp8_alignment: ``None``, ``"fp8"``, ``"mxfp8"``, ``"nvfp4"``/``"blockwise"`` or a token multiple.
        cost_model: step-time model used to choose counts and orders; default from ``model``.
        num_microbatches: force ``M`` per rank and optimizer step (raises if the budget cannot hold it).
        refine_rounds: cap on rank-refinement rounds (default ``4 * dp``).
    """
    t_start = time.perf_counter()
    par = ParallelConfig.from_any(parallel)
    lens = _check_lengths(lengths)
    n = lens.size
    cap, align, cap_eff = _check_budget(max_tokens_per_gpu, par, fp8_alignment)
    if oversize not in OVERSIZE_POLICIES:
        raise DynBatchConfigError("oversize", oversize, "unknown oversize-sample policy",
                                  f"use one of {OVERSIZE_POLICIES}")
    mode = _balance_mode(balance_by, balance_by_flops, model is not None)

    spec = None
    if model is not None:
        from ..flops import flops_coefficients
        from ..model_spec import ModelSpec

        spec = ModelSpec.from_any(model)
        coeffs = flops_coefficients(spec)
    elif mode == "flops":
        raise DynBatchConfigError("model", None, "balancing by FLOPs needs the model's shape",
                                  "pass model=ModelSpec/dict/preset name, or balance_by_flops=False")
    if cost_model is not None:
        if not isinstance(cost_model, CostModel):
            raise DynBatchConfigError("cost_model", type(cost_model).__name__, "must be a CostModel",
                                      "build one with CostModel.from_model(...) or CostModel.from_dict")
        cm = cost_model.with_layout(par)
    elif spec is not None:
        cm = CostModel.from_flops(coeffs.linear, coeffs.quadratic, par)
    else:
        cm = CostModel.tokens_only(par)

    aligned = align.seq_len(lens).astype(np.int64)
    sq = lens.astype(np.float64) ** 2
    over = aligned > cap_eff
    if over.any():
        first = int(np.flatnonzero(over)[0])
        where = (f"sample {first} has {int(lens[first])} tokens ({int(aligned[first])} after alignment to "
                 f"{align.seq_multiple}) but a micro-batch may hold {cap_eff} (max_tokens_per_gpu="
                 f"{max_tokens_per_gpu} x cp={par.cp}, less alignment); {int(over.sum())} sample(s) are over")
        if oversize == "error":
            need = -(-int(aligned[over].max()) // par.cp)
            raise OversizeSampleError(
                "--max-tokens-per-gpu", max_tokens_per_gpu, where,
                f"raise --max-tokens-per-gpu to at least {need}, truncate the sample, or run it in a micro-batch "
                f"of its own with oversize='alone' (--dynbatch-oversize alone in a Megatron launch, --oversize "
                f"alone for megatron-dynbatch plan)",
            )
        warnings.warn(f"oversize='alone': {where}; each runs alone in its own micro-batch over the budget",
                      OversizeSampleWarning, stacklevel=2)

    flops = (coeffs.linear * aligned + coeffs.quadratic * sq) if spec is not None else np.zeros(n)
    if mode == "flops":
        weight = flops
    elif mode == "tokens":
        weight = aligned.astype(np.float64)
    else:
        weight = cm.work(aligned, sq)

    units_of_step = _steps_and_units(n, group_ids, samples_per_step, par.dp)
    if num_microbatches is not None:
        check_forced_count(num_microbatches, par)
    rounds = 4 * par.dp if refine_rounds is None else int(refine_rounds)

    micro_batches: List[List[List[int]]] = [[] for _ in range(par.dp)]
    per_step: List[int] = []
    lb_total = 0.0
    lb_m_total = 0
    for step_samples, units in units_of_step:
        inp = StepInput(aligned=aligned[step_samples], weight=weight[step_samples], oversize=over[step_samples],
                        units=units, cap=cap_eff)
        bins, lb_m = _plan_step(inp, par, cm, lens[step_samples], num_microbatches, rounds, align)
        per_step.append(len(bins[0]))
        for r in range(par.dp):
            micro_batches[r].extend([[int(step_samples[i]) for i in mb] for mb in bins[r]])
        lb_m_total += lb_m
        work = cm.work(aligned[step_samples], sq[step_samples])
        lb_total += cm.lower_bound(float(work.sum()), float(work.max()), par.dp, lb_m, step_samples.size // par.dp)

    plan = _assemble(micro_batches, per_step, par, align, cap, mode, lens, aligned, sq, flops, cm)
    plan.lower_bound_microbatches = lb_m_total
    plan.lower_bound_step_time = lb_total
    plan.oversize_samples = [int(i) for i in np.flatnonzero(over)]
    plan.planning_time_s = time.perf_counter() - t_start
    return plan


# ---------------------------------------------------------------------- validation helpers
def _check_lengths(lengths) -> np.ndarray:
    if isinstance(lengths, (str, bytes)) or lengths is None:
        raise DynBatchConfigError("lengths", lengths, "must be a sequence of token counts",
                                  "pass a list or 1-D array of non-negative integers")
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise DynBatchConfigError("lengths", f"array of shape {arr.shape}", "must be one-dimensional",
                                  "pass one token count per sample")
    if arr.size == 0:
        raise DynBatchConfigError("lengths", [], "the global batch is empty", "pass at least dp samples")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        if arr.dtype != object and np.issubdtype(arr.dtype, np.floating):
            bad = int(np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))[0]) \
                if (~np.isfinite(arr) | (arr != np.round(arr))).any() else 0
        else:
            bad = 0
            for i, v in enumerate(arr.tolist()):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    bad = i
                    break
        raise DynBatchConfigError(f"lengths[{bad}]", arr.tolist()[bad], "token counts must be integers",
                                  "pass whole token counts (e.g. len(token_ids)), not floats or strings")
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        bad = int(np.flatnonzero(arr < 0)[0])
        raise DynBatchConfigError(f"lengths[{bad}]", int(arr[bad]), "token counts cannot be negative",
                                  "pass the number of tokens of each sample (>= 0)")
    return arr


def _check_budget(max_tokens_per_gpu, par: ParallelConfig, fp8_alignment):
    if isinstance(max_tokens_per_gpu, bool) or not isinstance(max_tokens_per_gpu, (int, np.integer)) \
            or max_tokens_per_gpu < 1:
        raise DynBatchConfigError("--max-tokens-per-gpu", max_tokens_per_gpu, "must be a positive integer",
                                  "pass the per-GPU token budget, e.g. --max-tokens-per-gpu 16384")
    align = Alignment.for_layout(par, fp8_alignment)
    cap = int(max_tokens_per_gpu) * par.cp
    cap_eff = align.effective_cap(cap)
    if cap_eff < align.seq_multiple:
        need = -(-max(align.total_multiple, align.seq_multiple) // par.cp)
        raise DynBatchConfigError(
            "--max-tokens-per-gpu", max_tokens_per_gpu,
            f"the budget ({cap} tokens per micro-batch) is smaller than one aligned sequence (per-sequence "
            f"multiple {align.seq_multiple}, micro-batch multiple {align.total_multiple})",
            f"use --max-tokens-per-gpu >= {need}",
        )
    return cap, align, cap_eff


def _balance_mode(balance_by: Optional[str], balance_by_flops: bool, has_model: bool) -> str:
    """``balance_by_flops=True`` balances FLOPs *as time*: each sample's linear and attention FLOPs at the
    efficiency its kernels reach (the cost model), because that is what makes ranks finish together; with
    equal efficiencies it is plain FLOPs. ``balance_by="flops"`` asks for raw FLOPs."""
    if balance_by is None:
        if not balance_by_flops:
            return "tokens"
        return "time" if has_model else "flops"
    if balance_by not in BALANCE_MODES:
        raise DynBatchConfigError("balance_by", balance_by, "unknown balancing mode", f"use one of {BALANCE_MODES}")
    return balance_by


def _steps_and_units(n: int, group_ids, samples_per_step, dp: int):
    """Split sample indices into optimizer steps and each step into units (groups or single samples)."""
    if group_ids is not None:
        gids = list(group_ids)
        if len(gids) != n:
            raise DynBatchConfigError("group_ids", f"{len(gids)} ids", f"needs one id per sample ({n})",
                                      "pass group_ids with the same length as lengths")
    if samples_per_step is None:
        bounds = [(0, n)]
    else:
        if isinstance(samples_per_step, bool) or not isinstance(samples_per_step, (int, np.integer)) \
                or samples_per_step < 1:
            raise DynBatchConfigError("samples_per_step", samples_per_step, "must be a positive integer",
                                      "pass the number of samples per optimizer step, or None")
        if n % samples_per_step:
            raise DynBatchConfigError(
                "samples_per_step", samples_per_step, f"does not divide the global batch of {n} samples",
                f"use a divisor of {n} or a global batch that is a multiple of {samples_per_step}")
        bounds = [(s, s + samples_per_step) for s in range(0, n, samples_per_step)]
    out = []
    for step_index, (lo, hi) in enumerate(bounds):
        idx = np.arange(lo, hi, dtype=np.int64)
        if group_ids is None:
            units = None  # one unit per sample
        else:
            order: dict = {}
            for local, gid in enumerate(gids[lo:hi]):
                order.setdefault(gid, []).append(local)
            units = [np.asarray(v, dtype=np.int64) for v in order.values()]
        if (hi - lo if units is None else len(units)) < dp:
            n_units = hi - lo if units is None else len(units)
            what = "groups" if group_ids is not None else "samples"
            raise DynBatchConfigError(
                "len(lengths)" if group_ids is None else "group_ids", f"{n_units} {what}",
                f"optimizer step {step_index} has fewer {what} than dp={dp} ranks, so some rank would get an "
                f"empty micro-batch", f"give every step at least {dp} {what} (larger batch or smaller dp)")
        out.append((idx, units))
    if group_ids is not None and samples_per_step is not None:
        step_of: dict = {}
        for s, (lo, hi) in enumerate(bounds):
            for gid in gids[lo:hi]:
                if step_of.setdefault(gid, s) != s:
                    raise DynBatchConfigError(
                        "group_ids", gid, f"group spans optimizer steps {step_of[gid]} and {s}",
                        "make samples_per_step a multiple of the group size and keep each group's samples adjacent")
    return out


# ---------------------------------------------------------------------- the per-step search
def _plan_step(inp: StepInput, par: ParallelConfig, cm: CostModel, lens: np.ndarray, forced: Optional[int],
               rounds: int, align: Alignment):
    dp, cap = par.dp, inp.cap
    charged = np.where(inp.oversize, cap, inp.aligned)
    lb_m = max(1, -(-int(charged.sum()) // (dp * cap)), -(-int(inp.oversize.sum()) // dp))
    m_max = int(inp.unit_count.size and _max_count(inp, dp))
    sq = lens.astype(np.float64) ** 2

    pipeline_polish = par.pp > 1 and cm.ep_group == 1 and inp.singletons

    lockstep = cm.ep_group > 1 and inp.singletons

    def evaluate(m, polish_evals=120):
        bins = plan_for_count(inp, dp, m, rounds)
        if bins is not None and pipeline_polish:
            polish_pipeline(bins, inp.aligned, sq, inp.oversize, cap, cm, align, max_evals=polish_evals)
        best = order_and_time(bins, inp.aligned, sq, cm, align) if bins is not None else None
        if lockstep:  # expert-parallel ranks advance together: also try even micro-batches across ranks
            alt = plan_global_bins(inp, dp, m)
            if alt is not None:
                res = order_and_time(alt, inp.aligned, sq, cm, align)
                if best is None or res[1] < best[1]:
                    best = res
        return best

    if forced is not None:
        if forced > m_max:
            raise DynBatchConfigError("num_microbatches", forced,
                                      f"needs {forced} samples on every rank but the step has only {len(lens)} "
                                      f"samples for dp={dp}", f"use at most {m_max}")
        best = evaluate(forced)
        if best is None:
            raise DynBatchConfigError(
                "num_microbatches", forced, f"the samples do not fit {forced} micro-batches of {cap} tokens per rank",
                f"use at least {next_valid_microbatch_count(lb_m, par)} or raise --max-tokens-per-gpu")
        return best[0], lb_m

    m = next_valid_microbatch_count(lb_m, par)
    if m > m_max:
        raise _too_few_samples(par, len(lens), m, m_max, inp)
    best = None
    while m <= m_max:
        best = evaluate(m)
        if best is not None:
            break
        m = next_valid_microbatch_count(m + 1, par)
    if best is None:
        raise _too_few_samples(par, len(lens), m, m_max, inp)
    chosen = m
    for cand in _candidate_counts(m, m_max, par, cm, inp, best):
        res = evaluate(cand)
        if res is not None and res[1] < best[1] * (1 - 1e-9):
            best, chosen = res, cand
    if pipeline_polish:  # spend the larger polishing budget on the winner only
        final = evaluate(chosen, polish_evals=1500)
        if final[1] <= best[1]:
            best = final
    return best[0], lb_m


def _max_count(inp: StepInput, dp: int) -> int:
    """Most micro-batches every rank can fill: the rank with the fewest samples bounds it."""
    return int(inp.unit_count.sum() // dp)


def _too_few_samples(par, n, m, m_max, inp) -> DynBatchConfigError:
    vpp = ""
    if par.vpp > 1:
        vpp = (f" (interleaved pipeline: pp={par.pp}, vpp={par.vpp} needs M >= "
               f"microbatch_group_size_per_vp_stage={par.vp_group_size})")
    return DynBatchConfigError(
        "--max-tokens-per-gpu", inp.cap,
        f"{n} samples over dp={par.dp} ranks need {m} non-empty micro-batches per rank{vpp}, but at most {m_max} "
        f"can be filled without leaving one empty", "raise --max-tokens-per-gpu, lower dp or vpp, or pass more samples",
    )


def _candidate_counts(m: int, m_max: int, par: ParallelConfig, cm: CostModel, inp: StepInput, best) -> List[int]:
    """Extra counts worth scoring after the first feasible ``m``."""
    out: List[int] = []
    if par.pp > 1 and cm.overhead_s > 0:
        w = float(cm.work(inp.aligned, 0.0).sum()) / par.dp  # linear part is enough to locate the optimum
        bubble = (par.pp - 1) / max(1, par.vpp)
        target = int(math.ceil(math.sqrt(bubble * max(w, 1e-12) / cm.overhead_s)))
        hi = min(m_max, max(m, target))
        if hi > m:
            raw = np.unique(np.geomspace(m + 1, hi, num=min(5, hi - m)).round().astype(int))
            out = sorted({next_valid_microbatch_count(int(c), par) for c in raw})
    elif best[2] > 1.002:
        out = [next_valid_microbatch_count(m + 1, par)]
    return [c for c in out if m < c <= m_max and is_valid_microbatch_count(c, par)]


def _assemble(micro_batches, per_step, par, align, cap, mode, lens, aligned, sq, flops, cm) -> Plan:
    t_mult = align.total_multiple
    mb_tokens = [(-(-mb_sums(rank, aligned) // t_mult) * t_mult).astype(int).tolist() for rank in micro_batches]
    mb_time = [cm.microbatch_time(np.asarray(t, dtype=np.float64), mb_sums(rank, sq)).tolist()
               for rank, t in zip(micro_batches, mb_tokens)]
    # Steps run one after another; the rank time of the plan is the sum over steps (EP lockstep inside).
    rank_time = np.zeros(par.dp)
    start = 0
    for count in per_step:
        rank_time += cm.step_time([t[start:start + count] for t in mb_time])
        start += count
    return Plan(
        micro_batches=micro_batches,
        microbatches_per_step=per_step,
        parallel=par,
        alignment=align,
        cap=cap,
        balance_by_flops=(mode != "tokens"),
        microbatch_tokens=mb_tokens,
        microbatch_time=mb_time,
        rank_tokens=np.array([sum(t) for t in mb_tokens], dtype=np.int64),
        rank_flops=np.array([float(flops[[i for mb in rank for i in mb]].sum()) for rank in micro_batches]),
        rank_time=rank_time,
        padding_tokens=int(sum(sum(t) for t in mb_tokens) - lens.sum()),
        real_tokens=int(lens.sum()),
        lower_bound_microbatches=0,
        lower_bound_step_time=0.0,
    )


def score_assignment(
    micro_batches: Sequence[Sequence[Sequence[int]]],
    lengths: Union[Sequence[int], np.ndarray],
    *,
    model: Any = None,
    parallel: Union[ParallelConfig, Mapping[str, Any], None] = None,
    max_tokens_per_gpu: int,
    fp8_alignment: Union[None, str, int] = None,
    cost_model: Optional[CostModel] = None,
    pad_to_longest: bool = False,
    microbatches_per_step: Optional[Sequence[int]] = None,
    algorithm: str = "external",
) -> Plan:
    """Score any assignment (e.g. a baseline's) with the same cost model and statistics as the planner.

    No invariant is enforced here -- ranks may differ in micro-batch count and micro-batches may break the cap
    (``plan.cap_violations`` counts them) -- so baselines are measured honestly. ``pad_to_longest`` models
    fixed-shape ``[b, s]`` micro-batches: every sample is padded to the longest in its micro-batch and attention
    runs over the padded square.
    """
    par = ParallelConfig.from_any(parallel)
    lens = _check_lengths(lengths)
    cap, align, _ = _check_budget(max_tokens_per_gpu, par, fp8_alignment)
    spec = coeffs = None
    if model is not None:
        from ..flops import flops_coefficients
        from ..model_spec import ModelSpec

        spec = ModelSpec.from_any(model)
        coeffs = flops_coefficients(spec)
    if cost_model is not None:
        cm = cost_model.with_layout(par)
    elif coeffs is not None:
        cm = CostModel.from_flops(coeffs.linear, coeffs.quadratic, par)
    else:
        cm = CostModel.tokens_only(par)
    mbs = [[[int(i) for i in mb] for mb in rank] for rank in micro_batches]
    aligned = align.seq_len(lens).astype(np.int64)
    sq = lens.astype(np.float64) ** 2
    flops = (coeffs.linear * aligned + coeffs.quadratic * sq) if coeffs is not None else np.zeros(lens.size)
    if pad_to_longest:
        tokens = [[len(mb) * int(aligned[mb].max()) if mb else 0 for mb in rank] for rank in mbs]
        sqs = [[len(mb) * float(aligned[mb].max()) ** 2 if mb else 0.0 for mb in rank] for rank in mbs]
    else:
        tokens = [[align.padded_total(int(aligned[mb].sum())) if mb else 0 for mb in rank] for rank in mbs]
        sqs = [[float(sq[mb].sum()) for mb in rank] for rank in mbs]
    mb_time = [cm.microbatch_time(np.asarray(t, dtype=np.float64), np.asarray(q)).tolist()
               for t, q in zip(tokens, sqs)]
    per_step = list(microbatches_per_step) if microbatches_per_step else [max((len(r) for r in mbs), default=0)]
    if len({len(r) for r in mbs}) == 1:
        rank_time = np.zeros(par.dp)
        start = 0
        for count in per_step:
            rank_time += cm.step_time([t[start:start + count] for t in mb_time])
            start += count
    else:  # ragged counts: no lockstep/pipeline pairing is possible; each rank on its own
        rank_time = np.array([cm.rank_time(t) for t in mb_time])
    work = cm.work(aligned, sq)
    lb_m = max(1, -(-int(aligned.sum()) // (par.dp * cap)))
    plan = Plan(
        micro_batches=mbs, microbatches_per_step=per_step, parallel=par, alignment=align, cap=cap,
        balance_by_flops=False, microbatch_tokens=tokens, microbatch_time=mb_time,
        rank_tokens=np.array([sum(t) for t in tokens], dtype=np.int64),
        rank_flops=np.array([float(sum(flops[i] for mb in rank for i in mb)) for rank in mbs]),
        rank_time=rank_time,
        padding_tokens=int(sum(sum(t) for t in tokens) - lens.sum()), real_tokens=int(lens.sum()),
        lower_bound_microbatches=lb_m,
        lower_bound_step_time=cm.lower_bound(float(work.sum()), float(work.max()), par.dp, lb_m, lens.size // par.dp),
        algorithm=algorithm,
    )
    return plan
