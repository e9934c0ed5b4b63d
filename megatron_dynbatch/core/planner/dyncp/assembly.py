"""Dynamic CP: slots in, :class:`~.plan.DynamicCPPlan` out -- and fixed-CP plans scored on the same terms.

* :func:`assemble` is the one place a dynamic-CP plan is put together, from consecutive optimizer steps' slots
  (``(start, size, samples)`` groups in pool order), each GPU's simulated finish time per step and, when the
  planner already knows them, each group's full packed token count and seconds (else computed here with the
  group's :func:`~.pool.group_alignment`). Every member of a group lists the group's samples, its share of the
  tokens (``tokens // size``) and the group's time; ``rank_time`` adds the steps' finish times, ``step_time``
  lists each step's last finish.
* :func:`build_dynamic_cp_plan` (public) does the same for slots a user gives -- scored exactly like the
  planner's (synchronised :func:`~.pool_sim.simulate_pool`, CP communication) -- so another system's schedule
  runs through the iterator; it does not validate (``plan.validate(n)`` does).
* :func:`score_with_cp_comm` (public) adds the CP communication of the layout's ``cp``-GPU groups to a
  fixed-layout plan, so the two kinds compare in one cost model (the benchmark does).
* :func:`cp_comm_cost_model`: the cost model both use -- the given one if it has a CP communication term, else
  the model's defaults, else none.
"""

from __future__ import annotations

import contextlib
import copy
import gc
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ...alignment import Alignment, fp8_multiple
from ...cost_model import CostModel
from ...cost_files import resolve_cost_model
from ...errors import DynBatchConfigError
from ...model_spec import ModelLike
from ...parallel import ParallelConfig
from ...topology import fixed_cp_spans_nodes, group_spans_nodes
from .plan import DynamicCPPlan, SlotList
from ..inputs import check_lengths, flops_coefficients_of, sample_flops
from ..options import PlanOptions
from ..plan import Plan
from ..timing import step_times_of
from .pool import group_alignment
from .pool_sim import simulate_pool

#: one optimizer step for :func:`assemble`: its slots, each GPU's finish time, and (when known) the groups'
#: full token counts and seconds in slot-major order
StepSlots = Tuple[SlotList, np.ndarray, Optional[Tuple[Sequence[int], Sequence[float]]]]


def build_dynamic_cp_plan(
    lengths: Union[Sequence[int], np.ndarray],
    slots: Sequence[Sequence[Tuple[int, int, Sequence[int]]]],
    *,
    parallel: Union[ParallelConfig, Mapping[str, Any], None] = None,
    max_tokens_per_gpu: int,
    model: Optional[ModelLike] = None,
    cost_model: Optional[CostModel] = None,
    fp8_alignment: Union[None, str, int] = None,
    microbatches_per_step: Optional[Sequence[int]] = None,
) -> DynamicCPPlan:
    """A :class:`DynamicCPPlan` from explicit slots -- ``slots[j]`` lists slot ``j``'s groups as ``(start, size,
    sample indices)`` -- scored like the planner's (synchronised simulation, CP communication). For running a
    schedule of your own (or another system's) through the iterator; call ``plan.validate(len(lengths))`` to
    check it. ``microbatches_per_step``: slots of each optimizer step (default: one step)."""
    opts = PlanOptions(model=model, parallel=parallel, max_tokens_per_gpu=max_tokens_per_gpu, cost_model=cost_model,
                       fp8_alignment=fp8_alignment).resolve()
    par, align = opts.parallel, opts.alignment
    lens = check_lengths(lengths)
    coeffs = flops_coefficients_of(opts.model)
    cm = cp_comm_cost_model(opts.cost_model, opts.model, par)
    tile = fp8_multiple(fp8_alignment)
    per_step = list(microbatches_per_step) if microbatches_per_step is not None else [len(slots)]
    if sum(per_step) != len(slots):
        raise DynBatchConfigError("microbatches_per_step", per_step, f"does not sum to the {len(slots)} slots",
                                  "give the slot count of every optimizer step")
    steps: List[StepSlots] = []
    first = 0
    for count in per_step:
        chunk = [[(int(a), int(b), [int(i) for i in mb]) for a, b, mb in slot] for slot in slots[first:first + count]]
        steps.append((chunk, simulate_slots(chunk, group_stats(chunk, lens, par, tile, cm)[2], par, cm), None))
        first += count
    return assemble(lens, steps, par, align, opts.max_tokens_per_gpu, tile, cm, coeffs, algorithm="external")


def assemble(lens: np.ndarray, steps: Sequence[StepSlots], par: ParallelConfig, align: Alignment, budget: int,
             tile: int, cm: CostModel, coeffs: Any, **extra: Any) -> DynamicCPPlan:
    """The plan of consecutive steps (module docstring); ``extra``: further :class:`DynamicCPPlan` fields.
    Built slot by slot as whole pool-wide columns (a group's entry repeated over its GPUs), so the work per slot
    is one Python step per group, not per GPU; the per-GPU lists (millions on a pool of a million GPUs, none in
    a reference cycle) are made with the cyclic garbage collector paused -- its passes over them, not making
    them, were most of the time."""
    with _collector_paused():
        return _assemble(lens, steps, par, align, budget, tile, cm, coeffs, **extra)


@contextlib.contextmanager
def _collector_paused():
    """Pause Python's cyclic garbage collector (if it runs) while a block makes many acyclic lists."""
    running = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if running:
            gc.enable()


def _assemble(lens: np.ndarray, steps: Sequence[StepSlots], par: ParallelConfig, align: Alignment, budget: int,
              tile: int, cm: CostModel, coeffs: Any, **extra: Any) -> DynamicCPPlan:
    pool = par.dp * par.cp
    sample_cols: List[list] = []   # per slot: each GPU's samples
    group_cols: List[list] = []    # per slot: each GPU's (start, size)
    time_cols: List[np.ndarray] = []
    token_cols: List[np.ndarray] = []
    rank_time = np.zeros(pool)
    step_time: List[float] = []
    rank_flops = np.zeros(pool)
    flops = sample_flops(coeffs, lens.astype(np.float64), lens.astype(np.float64) ** 2)
    for slots, finish, stats in steps:
        tokens, times = stats if stats is not None else group_stats(slots, lens, par, tile, cm)[1:]
        rank_time += finish
        step_time.append(float(np.max(finish)) if len(finish) else 0.0)
        k = 0
        for slot in slots:
            samples_col: list = []
            groups_col: list = []
            sizes, local, secs = [], [], []
            for start, size, samples in slot:
                samples_col += [samples] * size
                groups_col += [(start, size)] * size
                sizes.append(size)
                local.append(int(tokens[k]) // size)
                secs.append(float(times[k]))
                if coeffs is not None:
                    rank_flops[start:start + size] += float(flops[samples].sum()) / size
                k += 1
            sample_cols.append(samples_col)
            group_cols.append(groups_col)
            time_cols.append(np.repeat(np.asarray(secs, dtype=np.float64), sizes))
            token_cols.append(np.repeat(np.asarray(local, dtype=np.int64), sizes))
    by_gpu = np.stack(token_cols, axis=1) if token_cols else np.zeros((pool, 0), dtype=np.int64)
    mb_time = (np.stack(time_cols, axis=1) if time_cols else np.zeros((pool, 0))).tolist()
    extra.setdefault("algorithm", "dynbatch-dyncp")
    extra.setdefault("lower_bound_microbatches", 0)
    extra.setdefault("lower_bound_step_time", 0.0)
    return DynamicCPPlan(
        micro_batches=([list(col) for col in zip(*sample_cols, strict=True)] if sample_cols
                       else [[] for _ in range(pool)]),
        microbatches_per_step=[len(s[0]) for s in steps], parallel=par, alignment=align, cap=budget,
        balance_by="time", microbatch_tokens=by_gpu.tolist(), microbatch_time=mb_time,
        rank_tokens=by_gpu.sum(axis=1).astype(np.int64), rank_flops=rank_flops, rank_time=rank_time,
        step_time=step_time, padding_tokens=int(by_gpu.sum() - lens.sum()), real_tokens=int(lens.sum()),
        groups=[list(col) for col in zip(*group_cols, strict=True)] if group_cols else [[] for _ in range(pool)],
        max_tokens_per_gpu=budget, fp8_tile=tile, **extra)


def group_stats(slots: SlotList, lens: np.ndarray, par: ParallelConfig, tile: int,
                 cm: CostModel) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every group of every slot (slot-major, pool order): its size, its full padded token count and its
    time on each member (one vectorised :meth:`CostModel.group_microbatch_time` call)."""
    aligned: Dict[int, Tuple[Alignment, np.ndarray]] = {}
    sizes, tokens, sq, spans = [], [], [], []
    sq_all = lens.astype(np.float64) ** 2
    for slot in slots:
        for start, size, samples in slot:
            if size not in aligned:
                a = group_alignment(par, size, tile)
                aligned[size] = (a, a.seq_len(lens).astype(np.int64))
            a, al = aligned[size]
            sizes.append(size)
            tokens.append(a.padded_total(int(al[samples].sum())))
            sq.append(float(sq_all[samples].sum()))
            spans.append(group_spans_nodes(start, size, par))
    size_a = np.asarray(sizes, dtype=np.int64)
    tok_a = np.asarray(tokens, dtype=np.int64)
    return size_a, tok_a, cm.group_microbatch_time(size_a, tok_a, np.asarray(sq, dtype=np.float64),
                                                   np.asarray(spans, dtype=bool))


def simulate_slots(slots: SlotList, group_times: Sequence[float], par: ParallelConfig, cm: CostModel) -> np.ndarray:
    """Each GPU's simulated finish time (:func:`~.pool_sim.simulate_pool`) of explicit slots, given every group's
    seconds in slot-major order (:func:`group_stats`' third array)."""
    times = np.zeros((len(slots), par.dp * par.cp))
    k = 0
    for j, slot in enumerate(slots):
        for start, size, _ in slot:
            times[j, start:start + size] = group_times[k]
            k += 1
    blocks = [np.asarray([a for a, _, _ in slot], dtype=np.int64) for slot in slots]
    ep_width = par.cp * cm.ep_group if cm.ep_group > 1 else 1
    return simulate_pool(times, blocks, cm, ep_width=ep_width)


def score_with_cp_comm(plan: Plan, *, model: Optional[ModelLike] = None, cost_model: Optional[CostModel] = None,
                       lengths: Optional[Sequence[int]] = None,
                       sq_tokens: Optional[Sequence[Sequence[float]]] = None) -> Plan:
    """A copy of a fixed-layout ``plan`` (``plan_global_batch`` or ``score_assignment``) whose micro-batch and
    rank times include the CP communication of its ``cp``-GPU groups (inter-node numbers where those groups cross
    nodes, :func:`~...topology.fixed_cp_spans_nodes`), so it compares with a dynamic-CP plan.

    ``cost_model`` must be the one the plan was scored with (default: from ``model``). The exchange hides behind
    each micro-batch's attention: with ``sq_tokens`` (per rank and micro-batch, the squared lengths attention
    runs over, e.g. a padded baseline's :func:`~..api.executed_shapes`) or the batch's ``lengths`` that comes
    from its sequences; without either it is recovered from the micro-batch's time (exact unless the micro-batch
    sits on the cost model's floor, where it overstates the attention and so understates the exposed
    exchange)."""
    if plan.dynamic_cp:
        return plan
    par = plan.parallel
    cm = cp_comm_cost_model(resolve_cost_model(cost_model, model, par), model, par)
    spans = fixed_cp_spans_nodes(par)
    sq_all = None if lengths is None else check_lengths(lengths).astype(np.float64) ** 2
    times = []
    for r, (tok, t) in enumerate(zip(plan.microbatch_tokens, plan.microbatch_time, strict=True)):
        tok_a, t_a = np.asarray(tok, dtype=np.float64), np.asarray(t, dtype=np.float64)
        if sq_tokens is not None:
            att = cm.attention_s_per_sq_token * np.asarray(sq_tokens[r], dtype=np.float64)
        elif sq_all is not None:
            sq = np.array([float(sq_all[mb].sum()) for mb in plan.micro_batches[r]])
            att = cm.attention_s_per_sq_token * sq
        else:  # what is left of the time after the overhead and the token-linear work
            att = np.maximum(t_a - cm.overhead_s - cm.work(tok_a, 0.0), 0.0)
        times.append((t_a + cm.cp_comm_time(par.cp, tok_a, att, spans)).tolist())
    out = copy.copy(plan)
    out.microbatch_time = times
    out.rank_time, out.step_time = step_times_of(times, plan.microbatches_per_step, cm)
    return out


def cp_comm_cost_model(cm: CostModel, model: Optional[ModelLike], par: ParallelConfig) -> CostModel:
    """The cost model with its CP communication term: as given, else the model's defaults, else none."""
    if cm.has_cp_comm:
        return cm
    if model is not None:
        d = CostModel.from_model(model, par)
        return cm.with_cp_comm(d.cp_comm_s_per_token, d.cp_comm_s_per_step, d.cp_comm_overlap,
                               d.cp_comm_inter_s_per_token, d.cp_comm_inter_s_per_step)
    return cm.with_cp_comm(0.0, 0.0, 0.0)


__all__ = ["build_dynamic_cp_plan", "score_with_cp_comm", "assemble", "cp_comm_cost_model", "StepSlots"]
