"""``megatron-dynbatch plan --dynamic-cp``: what dynamic context parallelism does with the user's own lengths.

Prints the pool summary (pool size, slots per GPU, the CP-group sizes used, the winning candidate, the modelled
step time and its lower bound), one line per pool GPU (its group size in every slot), and the fixed-CP plan of
the same layout next to it -- ``plan_global_batch`` without ``dynamic_cp``, re-scored with the CP communication
of its ``cp``-GPU groups (:func:`~megatron_dynbatch.core.planner.dyncp.assembly.score_with_cp_comm`), so both
rows come from one cost model. ``--compare`` adds the peers' batching and megatron-core's hybrid-CP scheduler,
scored the same way (as ``bench`` does for its ``dyncp-*`` workloads); ``--plot`` draws the pool's timelines
(group-synchronised, :mod:`megatron_dynbatch.bench.plot`) above the fixed-CP plan's; ``--json`` prints the
:class:`~megatron_dynbatch.core.planner.dyncp.plan.DynamicCPPlan`.

Refused before any planning, naming ``--dynamic-cp``: what :func:`~megatron_dynbatch.core.run_config.dynamic_cp_problem`
refuses for a run preset (a pool of one GPU, ``pp=2`` with ``vpp > 1``, GRPO groups from ``--group-ids`` or the
preset's ``group_size``). A balancing mode dynamic CP would ignore (``--balance-by flops|tokens``, or a preset's)
is refused by :class:`~megatron_dynbatch.core.planner.options.PlanOptions` itself, as from every other door.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._cli_summary import count_line, first_of, step_time_line, table_end, token_lines
from .core.errors import DynBatchConfigError
from .core.planner.options import ResolvedOptions


def check_dynamic_cp_flags(args: argparse.Namespace, opts: Any, group_ids: Optional[list], run: Any) -> None:
    """Refuse what ``plan --dynamic-cp`` cannot do (module docstring)."""
    from .core.run_config import dynamic_cp_problem

    problem = dynamic_cp_problem(opts.parallel, grouped=group_ids is not None)
    if problem is not None:
        where = ""
        if group_ids is not None:
            where = " (--group-ids)" if args.group_ids else f" (the run preset's group_size={run.group_size})"
        raise DynBatchConfigError("--dynamic-cp", True, problem[0] + where, problem[1].replace(
            "turn dynamic CP off", "drop --dynamic-cp"))


def run_plan_dynamic_cp(args: argparse.Namespace, lengths: Sequence[int], opts: ResolvedOptions) -> int:
    """Plan with dynamic CP, print the summary, the per-GPU table and the fixed-CP comparison; 0 on success."""
    from .core.planner.api import plan_resolved

    plan = plan_resolved(lengths, opts)
    if args.json:
        print(plan.to_json(indent=1))
        return 0
    fixed, fixed_error = _fixed_cp_plan(lengths, opts)
    print(pool_summary(plan, args, len(lengths)))
    print()
    print(gpu_table(plan, args.max_ranks))
    print()
    others = _peers(lengths, args, opts.parallel) if args.compare else {}
    print(comparison(plan, fixed, fixed_error, others))
    if args.plot:
        from .bench.plot import plot_timelines

        p = plan.parallel
        drawn = {"dynamic CP": plan, **({f"fixed CP (cp={p.cp})": fixed} if fixed is not None else {}),
                 **{k: v for k, v in others.items() if not isinstance(v, str)}}
        plot_timelines(drawn, args.plot, max_ranks=args.max_ranks,
                       title=f"{len(lengths)} samples, dynamic CP over dp x cp = {p.dp} x {p.cp} GPUs (tp={p.tp} "
                             f"pp={p.pp}), {plan.cap:,} tokens per GPU: timelines")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _fixed_cp_plan(lengths: Sequence[int], opts: ResolvedOptions) -> Tuple[Any, Optional[str]]:
    """The fixed-CP plan of the same layout scored with CP communication, or ``(None, why it cannot plan)``."""
    import warnings

    from .core.planner.api import plan_resolved
    from .core.planner.dyncp.assembly import score_with_cp_comm

    try:
        with warnings.catch_warnings():  # the dynamic-CP plan already warned about what matters
            warnings.simplefilter("ignore")
            plan = plan_resolved(lengths, opts.replace(dynamic_cp=False, min_cp_size=None))
    except DynBatchConfigError as exc:
        return None, exc.problem
    return score_with_cp_comm(plan, model=opts.model, cost_model=opts.cost_model, lengths=lengths), None


def _peers(lengths: Sequence[int], args: argparse.Namespace, par: Any) -> Dict[str, Any]:
    """``--compare``: each peer's plan scored with CP communication (or why it failed), megatron-core's
    hybrid-CP scheduler and Megatron-LM dev's dynamic-CP scheduler, as the benchmark scores its dynamic-CP
    workloads."""
    from .bench.baselines import BASELINES, BaselineContext, run_baseline
    from .bench.hybrid_cp import BaselineInfeasible, plan_hybrid_cp
    from .core.cost_files import resolve_cost_model
    from .core.planner.dyncp.assembly import score_with_cp_comm

    cm = resolve_cost_model(getattr(args, "cost_model", None), args.model, par)
    ctx = BaselineContext.build(par, args.max_tokens_per_gpu, args.model, args.fp8)
    out: Dict[str, Any] = {}
    for name in BASELINES:
        res = run_baseline(name, lengths, ctx, cm)
        out[name] = res.error if res.error else score_with_cp_comm(res.plan, model=args.model, cost_model=cm,
                                                                   lengths=lengths)
    try:
        out["megatron-hybrid-cp"] = plan_hybrid_cp(lengths, par, args.max_tokens_per_gpu, cm)
    except BaselineInfeasible as exc:
        out["megatron-hybrid-cp"] = str(exc)
    from .bench.megatron_dynamic_cp import NAME as DYNAMIC_CP, plan_megatron_dynamic_cp

    try:  # Megatron-LM dev's scheduler, with the same minimum CP group (--min-cp-size)
        out[DYNAMIC_CP] = plan_megatron_dynamic_cp(lengths, par, args.max_tokens_per_gpu, model=args.model,
                                                   cost_model=cm, min_cp_size=getattr(args, "min_cp_size", None) or 1,
                                                   fp8_alignment=args.fp8)
    except BaselineInfeasible as exc:
        out[DYNAMIC_CP] = str(exc)
    return out


# ============================================================================================ text
def pool_summary(plan: Any, args: argparse.Namespace, n: int) -> str:
    """The dynamic-CP plan in a few lines (module docstring)."""
    p = plan.parallel
    sizes = plan.group_sizes()
    used = ", ".join(f"{g} GPU{'s' if g > 1 else ''}: {k}" for g, k in sizes.items())
    model = getattr(args.model, "name", None) or args.model or "(none: tokens-only cost model)"
    auto = f" ({plan.budget_words()})" if getattr(plan, "budget_choice", None) is not None else ""
    lines = [
        f"plan: {n} samples, dynamic CP over a pool of dp x cp = {p.dp} x {p.cp} = {plan.pool_size} GPUs per pipeline "
        f"stage (tp={p.tp} pp={p.pp} ep={p.ep} vpp={p.vpp}), model {model}, balanced by the cost model's seconds",
        f"budget: max_tokens_per_gpu={plan.cap:,} per GPU{auto}; a CP group of g GPUs holds at most g x {plan.cap:,} "
        f"tokens (each sequence padded to a multiple of 2g)",
        count_line(plan, "slots per GPU", note="a slot: one micro-batch, on a CP group of its own size"),
        f"winning candidate: {plan.candidate} -- {describe_candidates(plan.candidate, plan.pool_size, p.cp)}",
        f"CP groups used (micro-batches per group size): {used}",
        step_time_line(plan),
        *token_lines(plan, "largest share of one GPU"),
    ]
    if plan.oversize_samples:
        lines.append(f"samples over budget even on the whole pool, each alone there: {plan.oversize_samples}")
    return "\n".join(lines)


def describe_candidates(names: str, pool: int, cp: int) -> str:
    """One line on the winning candidate(s) (``plan.candidate``, one name per optimizer step): which of the
    schedules dynamic CP scores (``core/planner/dyncp/candidates.py``) was fastest, in words."""
    said = []
    for name in dict.fromkeys(n for n in names.split(",") if n):
        if name == "fixed-cp":
            said.append(f"the fixed-CP plan (every micro-batch on its DP rank's cp={cp} GPUs) was already fastest")
        elif name == "all-root":
            said.append(f"every micro-batch runs on the whole pool of {pool} GPUs (best when a few sequences dominate)")
        elif "tree-" in name:
            floor, x = name.split("tree-")
            widen = "the smallest CP group that holds it (memory only)" if x == "mem" else \
                f"a CP group widened while it alone takes over {x}x the mean GPU load"
            least = f", at least cp={floor[2:-1]} GPUs" if floor else ""
            said.append(f"each sample on {widen}{least}")
        else:
            said.append(name)
    return "; ".join(said) + " (the candidates scored: fixed-cp, tree-<x>, all-root; docs/dynamic_cp.md)"


def gpu_table(plan: Any, max_ranks: int) -> str:
    """One row per pool GPU: its DP and CP rank, slots, tokens held, predicted time, group size per slot."""
    cp = plan.parallel.cp
    head = (f"{'gpu':>5}  {'dp.cp':>6}  {'slots':>5}  {'tokens':>10}  {'time s':>8}  "
            "CP-group size per slot (execution order)")
    rows = [head, "-" * len(head)]
    for g in range(min(plan.pool_size, max_ranks)):
        sizes = [size for _, size in plan.groups[g]]
        rows.append(f"{g:>5}  {f'{g // cp}.{g % cp}':>6}  {len(sizes):>5}  {int(plan.rank_tokens[g]):>10,}  "
                    f"{plan.rank_time[g]:>8.4f}  [{first_of(sizes, 16)}]")
    return table_end(rows, plan.pool_size, max_ranks, "GPUs", "(dp.cp: the GPU's DP and CP rank in the fixed layout; "
                     "slots: micro-batches it takes part in; time s: its modelled time; a slot's group size g: the "
                     "micro-batch runs on g GPUs)")


def comparison(plan: Any, fixed: Any, fixed_error: Optional[str], others: Dict[str, Any]) -> str:
    """Dynamic CP next to the fixed-CP plan of the same layout (and, with ``--compare``, the peers)."""
    lb = plan.lower_bound_step_time
    cp = plan.parallel.cp
    out: List[str] = [
        "dynamic CP vs the same layout with fixed CP groups (one cost model, CP communication included; modelled):",
        f"{'plan':<22} {'step s':>9} {'x LB':>7} {'mb/GPU':>7} {'over budget':>11}  speed-up of dynamic CP",
        _row("dynamic CP", plan, lb, "1.000x"),
    ]
    fixed_name = f"fixed CP (cp={cp})"
    if fixed is None:
        out.append(f"{fixed_name:<22} cannot plan this batch: {fixed_error}")
    else:
        out.append(_row(fixed_name, fixed, lb, _speedup(fixed, plan)))
    for name, q in others.items():
        out.append(f"{name:<22} failed: {q}" if isinstance(q, str) else _row(name, q, lb, _speedup(q, plan)))
    out.append("(mb/GPU: micro-batches each GPU runs -- a fixed-CP micro-batch runs on all cp GPUs of its DP rank; "
               "over budget: micro-batches over the token budget, each an OOM risk; docs/dynamic_cp.md)")
    return "\n".join(out)


def _row(name: str, q: Any, lb: float, speedup: str) -> str:
    counts = {len(r) for r in q.micro_batches}
    mb = str(max(counts)) if len(counts) == 1 else f"{min(counts)}-{max(counts)}"
    ratio = q.predicted_step_time / lb if lb else 0.0
    return f"{name:<22} {q.predicted_step_time:>9.4f} {ratio:>7.4f} {mb:>7} {q.cap_violations:>11}  {speedup}"


def _speedup(other: Any, plan: Any) -> str:
    t = plan.predicted_step_time
    return f"{other.predicted_step_time / t:.3f}x" if t > 0 else "-"


__all__ = ["check_dynamic_cp_flags", "run_plan_dynamic_cp", "pool_summary", "gpu_table", "comparison",
           "describe_candidates"]
