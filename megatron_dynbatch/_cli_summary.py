"""The text of ``megatron-dynbatch plan``'s summary, shared by the fixed-CP output (:mod:`megatron_dynbatch.cli`)
and the dynamic-CP one (:mod:`megatron_dynbatch._cli_dyncp`): both import from here, neither from the other."""

from __future__ import annotations

import argparse
from typing import Any, List


def plan_summary(plan: Any, args: argparse.Namespace, balance_by: str, n: int) -> str:
    p = plan.parallel
    a = plan.alignment
    lines = [
        f"plan: {n} samples over dp={p.dp} (tp={p.tp} pp={p.pp} cp={p.cp} ep={p.ep} vpp={p.vpp}), "
        f"model {getattr(args.model, 'name', None) or args.model or '(none)'}, balanced by {balance_by}",
        f"budget: max_tokens_per_gpu={args.max_tokens_per_gpu} -> at most {plan.cap:,} tokens per micro-batch "
        f"(sequences padded to x{a.seq_multiple}, micro-batches to x{a.total_multiple})",
        f"micro-batches per rank: {plan.num_microbatches} (lower bound {plan.lower_bound_microbatches}); "
        f"per optimizer step: {plan.microbatches_per_step}",
        f"predicted step time: {plan.predicted_step_time:.4f} s (lower bound {plan.lower_bound_step_time:.4f} s, "
        f"x{plan.step_time_vs_lower_bound:.4f}); imbalance (max/mean rank time) {plan.imbalance:.4f}",
        *token_lines(plan, "largest micro-batch"),
    ]
    if plan.oversize_samples:
        lines.append(f"samples over budget, each alone: {plan.oversize_samples}")
    return "\n".join(lines)


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
        mbt = plan.microbatch_tokens[r]
        shown = ", ".join(str(t) for t in mbt[:12]) + (f", ... (+{len(mbt) - 12})" if len(mbt) > 12 else "")
        rows.append(f"{r:>5}  {len(plan.micro_batches[r]):>4}  {sum(len(m) for m in plan.micro_batches[r]):>7}  "
                    f"{int(plan.rank_tokens[r]):>10,}  {plan.rank_flops[r] / 1e12:>10.2f}  "
                    f"{plan.rank_time[r]:>8.4f}  [{shown}]")
    if plan.dp > max_ranks:
        rows.append(f"... {plan.dp - max_ranks} more ranks (raise --max-ranks to see them, or use --json)")
    return "\n".join(rows)


__all__ = ["plan_summary", "rank_table", "token_lines"]
