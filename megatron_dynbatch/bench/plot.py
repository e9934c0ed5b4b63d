"""Per-rank timelines of several plans for one workload (matplotlib, imported lazily).

One panel per algorithm; each DP rank is a horizontal bar made of its micro-batches in execution order
(alternating blue shades; red when the micro-batch holds more tokens than the budget, an out-of-memory risk;
with ``pp > 1`` a micro-batch's per-stage time ``t/pp``), followed by a hatched grey segment for the time the
rank's step takes beyond its own compute -- the pipeline bubble with ``pp > 1`` and the wait for the slowest
rank of an expert-parallel group in lockstep. A bar's total length is the rank's predicted time; the dashed
line is the step time (the slowest rank). A legend under the panels names every colour. Ranks beyond
``max_ranks`` are thinned out evenly, always keeping the slowest.

A dynamic-CP plan (:class:`~megatron_dynbatch.core.planner.dyncp.plan.DynamicCPPlan`) is drawn per pool GPU:
its micro-batches are coloured by the size of their CP group, and each starts when the LAST GPU of its group is
free (the wait before it is hatched) -- the synchronisation its simulation models, exactly for ``pp = 1`` and
one optimizer step; with ``pp > 1`` (per-stage times ``t/pp``) and across steps an approximation like the one
above, the rest of the GPU's predicted time drawn at the end.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, List, Mapping, Optional, Sequence

import numpy as np

from ..core.errors import DynBatchConfigError

if TYPE_CHECKING:
    from ..core.planner.plan_kind import PlanKind


def _ranks_to_show(rank_time: np.ndarray, max_ranks: int) -> List[int]:
    dp = rank_time.size
    if dp <= max_ranks:
        return list(range(dp))
    picks = set(np.linspace(0, dp - 1, max_ranks - 1).round().astype(int).tolist())
    picks.add(int(np.argmax(rank_time)))
    return sorted(picks)


MB_COLORS = ("#4C72B0", "#8FAADC")      # micro-batches, alternating
OVER_COLORS = ("#C44E52", "#E8A0A2")    # micro-batches over the token budget, alternating
WAIT_COLOR, STEP_COLOR = "#DDDDDD", "#C44E52"
#: dynamic CP: one colour per CP-group size (smallest first), and the wait for the group's other GPUs
GROUP_COLORS = ("#64B5CD", "#55A868", "#DD8452", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#4C72B0")
GROUP_WAIT_COLOR = "#F2E6B3"


def group_starts(plan: PlanKind) -> Optional[np.ndarray]:
    """``[gpu, slot]`` start times of a dynamic-CP plan's micro-batches when each group starts with its last
    member (per-stage times ``t/pp``); ``None`` for other plans, or when the GPUs do not share slots."""
    groups = getattr(plan, "groups", None)
    if not groups or len({len(g) for g in groups} | {len(m) for m in plan.micro_batches}) != 1:
        return None
    pp = max(1, int(getattr(plan.parallel, "pp", 1)))
    times = np.asarray(plan.microbatch_time, dtype=np.float64) / pp
    pool, slots = times.shape
    starts = np.zeros((pool, slots))
    ready = np.zeros(pool)
    for j in range(slots):
        g = 0
        while g < pool:
            start, size = groups[g][j]
            if start != g or size < 1 or start + size > pool:
                return None  # not a pool tiling: draw it like any plan
            t0 = float(ready[start:start + size].max())
            starts[start:start + size, j] = t0
            ready[start:start + size] = t0 + times[start:start + size, j]
            g = start + size
    return starts


def require_matplotlib(path: str, flag: str = "--plot") -> None:
    """Raise the CLI's one-line error now (before any work) when matplotlib cannot be imported."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise DynBatchConfigError(flag, path, "needs matplotlib, which is not installed in this environment",
                                  f"pip install matplotlib (into {sys.prefix}), or bash scripts/setup.sh --test; "
                                  f"or drop {flag}")


def _over_budget(plan: PlanKind, r: int) -> List[bool]:
    tokens, cap = getattr(plan, "microbatch_tokens", None), getattr(plan, "cap", None)
    if tokens is None or not cap:
        return [False] * len(plan.microbatch_time[r])
    return [int(t) > int(cap) for t in tokens[r]]


def _group_color(size: int) -> str:
    """The colour of CP groups of ``size`` GPUs: by the power of two at or above it."""
    return GROUP_COLORS[min(len(GROUP_COLORS) - 1, max(0, int(size) - 1).bit_length())]


def plot_timelines(plans: Mapping[str, Any], path: str, title: Optional[str] = None, max_ranks: int = 16,
                   order: Optional[Sequence[str]] = None) -> str:
    """Write a PNG (or any format matplotlib infers from ``path``) with one panel per plan; returns ``path``.

    ``plans`` maps an algorithm name to a :class:`~megatron_dynbatch.core.planner.Plan` (or anything with
    ``micro_batches``, ``microbatch_time``, ``rank_time`` and ``parallel``; ``microbatch_tokens`` and ``cap``,
    when present, mark micro-batches over the budget).
    """
    require_matplotlib(path)
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    names = [n for n in (order or plans.keys()) if n in plans]
    if not names:
        raise DynBatchConfigError("--plot", path, "there is no plan to draw", "run at least one algorithm")
    xmax = max(float(np.max(plans[n].rank_time)) for n in names) * 1.03
    shown = {n: _ranks_to_show(np.asarray(plans[n].rank_time), max_ranks) for n in names}
    height = sum(0.13 * len(s) + 0.55 for s in shown.values()) + 1.3
    any_over = any_wait = any_group_wait = any_plain = False
    sizes_used: set = set()
    fig, axes = plt.subplots(len(names), 1, figsize=(11, max(3.0, height)), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [len(shown[n]) + 3 for n in names]})
    for ax, name in zip(axes[:, 0], names, strict=True):
        plan = plans[name]
        pp = max(1, int(getattr(plan.parallel, "pp", 1)))
        ranks = shown[name]
        starts = group_starts(plan)
        any_plain = any_plain or starts is None
        for y, r in enumerate(ranks):
            widths = np.asarray(plan.microbatch_time[r], dtype=np.float64) / pp
            over = _over_budget(plan, r)
            any_over = any_over or any(over)
            if starts is None:
                lefts = np.concatenate([[0.0], np.cumsum(widths)[:-1]])
                colors = [(OVER_COLORS if over[j] else MB_COLORS)[j % 2] for j in range(widths.size)]
                done = float(widths.sum())
            else:
                lefts = starts[r]
                sizes = [int(size) for _, size in plan.groups[r]]
                sizes_used.update(sizes)
                colors = [OVER_COLORS[0] if over[j] else _group_color(sizes[j]) for j in range(widths.size)]
                ends = lefts + widths
                prev = np.concatenate([[0.0], ends[:-1]])
                waits = [(float(a), float(b - a)) for a, b in zip(prev, lefts, strict=True)
                         if b - a > 1e-3 * xmax]  # visible
                if waits:
                    any_group_wait = True
                    ax.broken_barh(waits, (y - 0.4, 0.8), facecolors=GROUP_WAIT_COLOR, hatch="...",
                                   edgecolor="#B8A15A", linewidth=0.0)
                done = float(ends[-1]) if ends.size else 0.0
            ax.broken_barh(list(zip(lefts.tolist(), widths.tolist(), strict=True)), (y - 0.4, 0.8), facecolors=colors,
                           edgecolor="white", linewidth=0.3)
            rest = float(plan.rank_time[r]) - done
            if rest > 1e-12:
                any_wait = True
                ax.broken_barh([(done, rest)], (y - 0.4, 0.8), facecolors=WAIT_COLOR, hatch="///",
                               edgecolor="#999999", linewidth=0.0)
        step = float(plan.predicted_step_time)
        ax.axvline(step, color=STEP_COLOR, linestyle="--", linewidth=1.0)
        ax.set_yticks(range(len(ranks)))
        ax.set_yticklabels([str(r) for r in ranks], fontsize=6 if len(ranks) > 16 else 8)
        ax.invert_yaxis()
        extra = f", {len(ranks)} of {len(plan.rank_time)} ranks shown" if len(ranks) < len(plan.rank_time) else ""
        over = int(getattr(plan, "cap_violations", 0) or 0)
        unit = "GPU" if getattr(plan, "groups", None) else "rank"
        ax.set_title(f"{name}: step {step:.3f} s, {max(len(m) for m in plan.micro_batches)} micro-batches/{unit}"
                     f"{f', {over} over the token budget' if over else ''}{extra}", fontsize=9, loc="left")
        ax.set_ylabel("pool GPU" if getattr(plan, "groups", None) else "DP rank", fontsize=8)
        ax.set_xlim(0, xmax)
    axes[-1, 0].set_xlabel("predicted (modelled) time per rank, s")
    handles = ([Patch(facecolor=MB_COLORS[0], label="micro-batch (shades alternate; execution order)")]
               if any_plain else [])
    handles += [Patch(facecolor=_group_color(g), label=f"micro-batch on a CP group of {g} GPU{'s' if g > 1 else ''}")
                for g in sorted(sizes_used)]
    if any_group_wait:
        handles.append(Patch(facecolor=GROUP_WAIT_COLOR, hatch="...", edgecolor="#B8A15A",
                             label="waiting for the CP group's other GPUs"))
    if any_over:
        handles.append(Patch(facecolor=OVER_COLORS[0], label="micro-batch over the token budget (OOM risk)"))
    if any_wait:
        handles.append(Patch(facecolor=WAIT_COLOR, hatch="///", edgecolor="#999999",
                             label="pipeline bubble / wait for the EP group"))
    handles.append(Line2D([0], [0], color=STEP_COLOR, linestyle="--", label="step time (slowest rank)"))
    ncol = min(len(handles), 4)
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    legend_rows = -(-len(handles) // ncol)
    legend_room = min(0.3, (0.2 + 0.2 * legend_rows) / fig.get_figheight())  # about 0.2 inch per legend row
    fig.tight_layout(rect=(0, legend_room, 1, 0.985 if title else 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
