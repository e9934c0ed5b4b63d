"""The text of ``megatron-dynbatch plan``'s summary, shared by the fixed-CP output (:mod:`megatron_dynbatch.cli`)
and the dynamic-CP one (:mod:`megatron_dynbatch._cli_dyncp`): both import from here, neither from the other."""

from __future__ import annotations

import argparse
from typing import Any, List, Optional, Sequence


def plan_summary(plan: Any, args: argparse.Namespace, balance_by: str, n: int, groups: Optional[str] = None) -> str:
    """The summary lines of ``plan``; ``groups`` says where the GRPO groups came from (``None``: no groups)."""
    p = plan.parallel
    a = plan.alignment
    lines = [
        f"plan: {n} samples over dp={p.dp} (tp={p.tp} pp={p.pp} cp={p.cp} ep={p.ep} vpp={p.vpp}), "
        f"model {getattr(args.model, 'name', None) or args.model or '(none)'}, balanced by {balance_by}",
        f"budget: max_tokens_per_gpu={_budget_words(plan, args)} -> at most {plan.cap:,} tokens per micro-batch "
        f"(sequences padded to x{a.seq_multiple}, micro-batches to x{a.total_multiple})",
        *([groups] if groups else []),
        count_line(plan, "micro-batches per rank", grouped=bool(groups)),
        step_time_line(plan) + f"; imbalance (max/mean rank time) {plan.imbalance:.4f}",
        *token_lines(plan, "largest micro-batch"),
    ]
    if plan.oversize_samples:
        lines.append(f"samples over budget, each alone: {plan.oversize_samples}")
    return "\n".join(lines)


def _budget_words(plan: Any, args: argparse.Namespace) -> str:
    """The budget as typed, or for ``auto`` the number it chose and what limits it."""
    if getattr(plan, "budget_choice", None) is None:
        return str(args.max_tokens_per_gpu)
    return f"{plan.budget_choice.tokens_per_gpu} ({plan.budget_words()})"


def group_line(group_ids: Optional[Sequence[Any]], source: str) -> Optional[str]:
    """``groups: 32 GRPO groups (source), each kept whole on one DP rank`` -- or ``None`` without groups."""
    if group_ids is None:
        return None
    count = len(set(g if isinstance(g, (int, str, float)) else repr(g) for g in group_ids))
    return f"groups: {count} ({source}), each kept whole on one DP rank, as GRPO needs"


def count_line(plan: Any, label: str, grouped: bool = False, unit: str = "micro-batch", note: str = "") -> str:
    """``label: M (the budget allows as few as L; ...)``: what the lower bound bounds, and, when the plan has more,
    what in this layout asks for more (PP bubble, VPP's valid counts, groups, several optimizer steps)."""
    m, low = plan.num_microbatches, plan.lower_bound_microbatches
    text = f"{label}: {m} ({note + '; ' if note else ''}the budget allows as few as {low}"
    if m > low:
        p, why = plan.parallel, []
        if grouped:
            why.append("groups stay whole on their rank")
        if p.pp > 1:
            why.append(f"smaller {unit}es shrink the pp={p.pp} pipeline bubble")
        if p.vpp > 1:
            from .core.planner.vpp import is_valid_microbatch_count

            if not is_valid_microbatch_count(low, p):
                why.append(f"Megatron's interleaved schedule (vpp={p.vpp}) refuses {low}")
        if len(plan.microbatches_per_step) > 1:
            why.append(f"{len(plan.microbatches_per_step)} optimizer steps, each packed on its own")
        if not why:
            why.append("whole samples do not fill every one to the budget, or fewer would balance worse")
        text += "; more here: " + "; ".join(why)
    return f"{text}); per optimizer step: {plan.microbatches_per_step}"


def step_time_line(plan: Any) -> str:
    """The modelled step time against its lower bound, saying what the bound is."""
    return (f"predicted step time: {plan.predicted_step_time:.4f} s (modelled), x{plan.step_time_vs_lower_bound:.4f} "
            f"of the lower bound {plan.lower_bound_step_time:.4f} s that no plan of this batch beats")


def token_lines(plan: Any, largest: str) -> List[str]:
    """The summary's token and planning-time lines (``largest``: what the largest count is of)."""
    total = plan.real_tokens + plan.padding_tokens
    return [f"tokens: {plan.real_tokens:,} real + {plan.padding_tokens:,} padding "
            f"({100 * plan.padding_tokens / total if total else 0:.2f}%); {largest} "
            f"{plan.max_microbatch_tokens:,} / {plan.cap:,}; over budget: {plan.cap_violations}",
            f"planning time: {1e3 * plan.planning_time_s:.1f} ms"]


def rank_table(plan: Any, max_ranks: int) -> str:
    head = f"{'rank':>5}  {'mbs':>4}  {'samples':>7}  {'tokens':>10}  {'fwd TFLOP':>10}  {'time s':>8}  " \
           f"micro-batch tokens (execution order)"
    rows = [head, "-" * len(head)]
    for r in range(min(plan.dp, max_ranks)):
        rows.append(f"{r:>5}  {len(plan.micro_batches[r]):>4}  {sum(len(m) for m in plan.micro_batches[r]):>7}  "
                    f"{int(plan.rank_tokens[r]):>10,}  {plan.rank_flops[r] / 1e12:>10.2f}  "
                    f"{plan.rank_time[r]:>8.4f}  [{first_of(plan.microbatch_tokens[r], 12)}]")
    return table_end(rows, plan.dp, max_ranks, "ranks", "(mbs: micro-batches of the rank; tokens: with padding; fwd "
                     "TFLOP: forward FLOPs of its samples; time s: its modelled time, the step is the slowest rank's)")


def first_of(values: Sequence[Any], k: int) -> str:
    """The first ``k`` values, comma-separated, and how many more there are."""
    return ", ".join(str(v) for v in values[:k]) + (f", ... (+{len(values) - k})" if len(values) > k else "")


def table_end(rows: List[str], count: int, max_ranks: int, noun: str, legend: str) -> str:
    """A per-rank table's rows, the line on rows left out (over ``--max-ranks``) and its legend, as one text."""
    if count > max_ranks:
        rows.append(f"... {count - max_ranks} more {noun} (raise --max-ranks to see them, or use --json)")
    return "\n".join(rows + [legend])


__all__ = ["count_line", "first_of", "group_line", "plan_summary", "rank_table", "step_time_line", "table_end",
           "token_lines"]
