"""Dynamic context parallelism: ``plan_global_batch(..., dynamic_cp=True)`` -> :class:`DynamicCPPlan`.

The ``dp * cp`` GPUs of a pipeline stage form one pool. Every GPU runs the same number ``M`` of micro-batch
slots; in each slot the pool is cut into CP groups -- nodes of the :class:`~.pool.PoolTree` -- and each group
runs one packed micro-batch, every sequence of it zig-zag split over the group's GPUs. A sequence therefore
gets as many GPUs as pay off: short ones stay on one GPU (no K/V exchange at all), long ones are spread, and
one that would set the step time alone is spread wider than memory needs.

This module is the orchestration; the parts live next to it in the ``dyncp`` package:

* :mod:`.step` -- per optimizer step and tree size: slot lengths, fit, solo times (``StepData``);
* :mod:`.candidates` -- the family of candidate schedules (``fixed-cp``, ``tree-<x>``, ``cp<cp>-tree-<x>``,
  ``all-root``) behind one interface; :mod:`.deal` deals the single-GPU samples of a tree candidate;
  :mod:`.upstream` -- Megatron-LM dev's scheduler, one more candidate (``megatron-dcp``);
* :mod:`.schedule` -- one candidate as slots: simulated makespan (:mod:`.pool_sim`), slot arrangement;
* :mod:`.assembly` -- slots -> :class:`~.plan.DynamicCPPlan`, and CP-communication scoring.

Strategy (deterministic, no communication)
------------------------------------------
1. Inputs are checked as for the fixed layout; the cost model gets its CP communication term
   (:func:`~.assembly.cp_comm_cost_model`). Samples over the budget even spread over the whole pool are
   an :class:`OversizeSampleError`, or with ``oversize="alone"`` a warning and a micro-batch of their own.
2. The batch is cut into optimizer steps (``samples_per_step``, :func:`..steps.step_of_sample`); each step is
   planned alone and the steps' slots follow each other.
3. Per step, every candidate of the family is built and scored by simulating it (group members wait for each
   other; 1F1B with ``pp > 1``); with ``pp > 1`` each non-fixed candidate first takes the slot arrangement with
   the shortest makespan. **Decision margin** (:func:`choose`): the fixed-CP candidate wins unless another is
   modelled faster by more than ``decision_margin`` (default: the cost model's ``uncertainty``, its measured
   error); past it the fastest wins, and on an exact tie the one whose widest group is smallest, then one whose
   groups stay inside a node, then the earliest in family order. Upstream's schedule of the step
   (:mod:`.upstream`, Megatron-LM dev's scheduler) is one more candidate, last in order, so ours is never slower
   than it in the model except by less than the margin where the fixed-CP plan is kept. No
   candidate: a ``DynBatchConfigError`` (a forced count that cannot be met, or no count Megatron's VPP rule
   accepts).
4. **Never slower than the plain planner.** The fixed-CP candidate of every step is the plan plain
   ``plan_global_batch`` makes for the same layout (:class:`~.step.FixedLayout`), so together they are that
   plan. A plan's time is the sum over its steps of each step's slowest GPU (every step ends at its own
   gradient all-reduce; :mod:`..timing`), so per-step winners, each no slower than its step's fixed-CP
   candidate, are never slower together; the plan still checks it, and would take the fixed-CP candidate in
   every step if they were.
5. The plan records the winners' names (``candidate``), the fixed-CP plan's modelled time
   (``fixed_cp_step_time``: the plain planner's plan scored with the CP exchange, i.e. ``score_with_cp_comm``
   of it; NaN when the fixed layout cannot plan the batch) and a lower bound no schedule beats
   (:func:`_lower_bound`).

Invariants (``tests/test_dyncp.py``, ``DynamicCPPlan.validate``; run on megatron-core in
``tests/test_megatron_dyncp.py``)
------------------------------------------------------------------------------------------------------------
* every sample in exactly one (slot, group); no group empty; no group smaller than ``min_cp_size``; every GPU
  runs ``M`` slots (the same ``M`` per optimizer step on all GPUs) and ``M`` obeys Megatron's
  interleaved-schedule rule (and equals a forced count);
* no GPU holds more than ``max_tokens_per_gpu`` tokens after ``2 * g`` alignment and tail padding -- except
  a sample over the budget even on the whole pool, placed alone there under ``oversize="alone"``;
* the modelled step time is never above the fixed-CP plan's -- the plain planner's plan of the same layout, scored
  in the same cost model (``tests/test_dyncp.py`` compares with ``score_with_cp_comm(plan_global_batch(...))``)
  -- and below it in a step only by more than the decision margin; with ``pp == 1`` never below the lower bound;
* the plan depends only on the arguments.

Not supported together with dynamic CP (a clear error): ``group_ids`` (a sample spread over several DP ranks'
GPUs belongs to none of them), ``pp == 2`` with ``vpp > 1`` (megatron-core 0.16's shape exchange needs one
length per rank there, which CP groups of different sizes do not give) and a pool of one GPU (``dp * cp == 1``:
no group to choose; refused by :class:`~..options.PlanOptions`, as by a preset, the CLI and a launch).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from ...alignment import fp8_multiple
from ...errors import DynBatchConfigError, OversizeSampleError, OversizeSampleWarning
from ...parallel import ParallelConfig
from .assembly import StepSlots, assemble, cp_comm_cost_model
from .candidates import FIXED_CP, candidates
from .plan import DynamicCPPlan
from .schedule import Schedule
from .step import FixedLayout, StepData
from .upstream import SlotSchedule, upstream_candidate
from ..fallback import SearchWork
from ..inputs import check_lengths, flops_coefficients_of
from ..options import BalanceBy, ResolvedOptions
from .pool import PoolTree, group_alignment, pool_tree
from ..steps import indices_by_step, step_of_sample
from ..vpp import check_forced_count


#: a scored schedule of one step: one of the family's, or upstream's given as explicit slots
Candidate = Union[Schedule, SlotSchedule]


def plan_dynamic_cp(lengths: Union[Sequence[int], np.ndarray], options: ResolvedOptions, *,
                    group_ids: Optional[Sequence[Any]] = None) -> DynamicCPPlan:
    """The dynamic-CP plan of a global batch (module docstring); called by ``plan_global_batch(...,
    dynamic_cp=True)`` with its resolved options. Balancing is always by the cost model's seconds."""
    t_start = time.perf_counter()
    par = options.parallel
    lens = check_lengths(lengths)
    align = options.alignment
    budget = options.max_tokens_per_gpu
    oversize = options.options.oversize
    if group_ids is not None:
        raise DynBatchConfigError(
            "group_ids", "given", "dynamic CP spreads a sample over CP groups that span several DP ranks, so "
            "'a group stays on one DP rank' has no meaning there", "drop group_ids, or plan with dynamic_cp=False")
    coeffs = flops_coefficients_of(options.model)
    cm = cp_comm_cost_model(options.cost_model, options.model, par)
    margin = options.options.decision_margin if options.options.decision_margin is not None else float(cm.uncertainty)
    tile = fp8_multiple(options.options.fp8_alignment)
    tree = pool_tree(par.dp, par.cp)
    num_microbatches = options.options.num_microbatches
    if num_microbatches is not None:
        num_microbatches = check_forced_count(num_microbatches, par)
    samples_per_step = options.options.samples_per_step
    rounds = 4 * tree.size if options.options.refine_rounds is None else options.options.refine_rounds
    over = _oversize(lens, tree, par, budget, tile, oversize)

    # the fixed-CP candidates plan as plain plan_global_batch would: its rounds, weight and one shared search work
    fixed_how = FixedLayout(rounds=4 * par.dp if options.options.refine_rounds is None else rounds,
                            by_tokens=options.balance_by is BalanceBy.TOKENS, search=SearchWork())
    lb_time, lb_count = 0.0, 0
    picked: List[Tuple[Candidate, Optional[Candidate], np.ndarray]] = []
    step_of, n_steps = step_of_sample(int(lens.size), samples_per_step)
    for step_samples in indices_by_step(step_of, n_steps):
        st = StepData(lens[step_samples], tree, cm, par, budget, tile, over[step_samples],
                      forced=num_microbatches, rounds=rounds, margin=margin, fixed=fixed_how,
                      min_size=options.min_group_size)
        best, fixed = _plan_step(st)
        picked.append((best, fixed, step_samples))
        t, c = _lower_bound(st)
        lb_time += t
        lb_count += c
    finish = [best.finish() for best, _, _ in picked]
    fixed_time = float("nan")
    if all(fixed is not None for _, fixed, _ in picked):
        fixed_finish = [fixed.finish() for _, fixed, _ in picked]
        fixed_time = float(sum(np.max(f) for f in fixed_finish))
        if float(sum(np.max(f) for f in finish)) > fixed_time:  # step 4: the winners together lost
            picked = [(fixed, fixed, step_samples) for _, fixed, step_samples in picked]
            finish = fixed_finish
    steps: List[StepSlots] = []
    for (best, _, step_samples), done in zip(picked, finish, strict=True):
        slots, tokens, times = best.slots(step_samples)
        steps.append((slots, done, (tokens, times)))
    plan = assemble(lens, steps, par, align, budget, tile, cm, coeffs, lower_bound_microbatches=lb_count,
                    lower_bound_step_time=lb_time, oversize_samples=[int(i) for i in np.flatnonzero(over)],
                    fixed_cp_step_time=fixed_time, candidate=",".join(best.name for best, _, _ in picked))
    plan.planning_time_s = time.perf_counter() - t_start
    return plan


def _plan_step(step: StepData) -> Tuple[Candidate, Optional[Candidate]]:
    """The chosen candidate of one step (:func:`choose`), and the fixed-CP one (for reporting). The family
    (:mod:`.candidates`) plus upstream's schedule of the step (:mod:`.upstream`), scored alike."""
    cands: List[Candidate] = [*candidates(step), *upstream_candidate(step, step.tile)]
    if not cands:
        if step.forced is not None:
            lb = _lower_bound(step)[1]
            raise DynBatchConfigError(
                "num_microbatches", step.forced, f"no dynamic-CP schedule of these {step.n} samples over a pool "
                f"of {step.tree.size} GPUs has exactly {step.forced} slots within the budget (at least {lb} are "
                f"needed: tokens over pool x budget; and at most {step.n}, one sample per slot)",
                "pass None to let the planner choose, or a larger count / max_tokens_per_gpu")
        raise DynBatchConfigError(
            "len(lengths)", step.n, f"no dynamic-CP schedule of these {step.n} samples over a pool of "
            f"{step.tree.size} GPUs has a micro-batch count Megatron's interleaved schedule accepts",
            "pass more samples, or lower vpp")
    for c in cands:
        c.arrange()
    fixed = next((c for c in cands if c.name == FIXED_CP), None)
    return choose(cands, fixed, step.margin), fixed


def choose(cands: Sequence[Candidate], fixed: Optional[Candidate], margin: float) -> Candidate:
    """The decision rule (module docstring, step 3): the fixed-CP candidate unless another is faster by more than
    ``margin`` (relative); otherwise the fastest, and among candidates equally fast (``1e-9`` absorbs rounding)
    the one whose widest group is smallest, then one whose groups all stay inside a node, then the earliest in
    family order."""
    best = min(c.makespan() for c in cands)
    if fixed is not None and fixed.makespan() <= best * (1 + margin + 1e-9):
        return fixed
    tied = [(c.widest, c.crosses_nodes, k) for k, c in enumerate(cands) if c.makespan() <= best * (1 + 1e-9)]
    return cands[min(tied)[2]]


def _oversize(lens: np.ndarray, tree: PoolTree, par: ParallelConfig, budget: int, tile: int,
              policy: str) -> np.ndarray:
    """Samples over the budget even spread over the whole pool: an error, or (``"alone"``) a warning."""
    root = tree.root.size
    align = group_alignment(par, root, tile)
    aligned = align.seq_len(lens)
    over = aligned > align.effective_cap(budget * root)
    if over.any():
        first = int(np.flatnonzero(over)[0])
        where = (f"sample {first} has {int(lens[first])} tokens but even spread over the whole pool of {root} GPUs "
                 f"(dp x cp) a GPU may hold {budget} tokens (max_tokens_per_gpu); {int(over.sum())} sample(s) are over")
        if policy == "error":
            need = align.budget_for(int(aligned[over].max()), root)
            raise OversizeSampleError("max_tokens_per_gpu", budget, where,
                                      f"raise max_tokens_per_gpu to at least {need}, truncate the sample, or set "
                                      f"oversize to 'alone' (it then runs alone on the whole pool over the budget)")
        warnings.warn(f"oversize='alone': {where}; each runs alone on the whole pool over the budget",
                      OversizeSampleWarning, stacklevel=4)
    return over


def _lower_bound(step: StepData) -> Tuple[float, int]:
    """A bound no schedule of the step beats: the least GPU-seconds of every sample (over the sizes it fits)
    spread over the pool, the fewest slots the budget allows, the 1F1B bubble (``pp > 1``), and the fastest
    any single sample can run."""
    pool = step.tree.size
    best_gpu_s = np.full(step.n, np.inf)
    best_t = np.full(step.n, np.inf)
    for s in step.allowed_sizes:  # (groups below min_cp_size are not formed)
        sz = step.sizes[s]
        ok = sz.fits | step.oversize
        best_gpu_s = np.where(ok, np.minimum(best_gpu_s, s * sz.tau), best_gpu_s)
        best_t = np.where(ok, np.minimum(best_t, sz.tau), best_t)
    one = step.sizes[1]
    tokens = int(np.minimum(one.aligned, one.cap).sum())
    m_lo = max(1, -(-tokens // (pool * max(1, one.cap))))
    bound = step.cm.lower_bound(float(best_gpu_s.sum()), float(best_t.max()), pool, m_lo, max(m_lo, step.n),
                                group_size=step.allowed_sizes[0])  # a slot may run on the smallest group
    return bound, m_lo


__all__ = ["plan_dynamic_cp"]
