"""Per-rank timelines of several plans for one workload (matplotlib, imported lazily).

One panel per algorithm; each DP rank is a horizontal bar made of its micro-batches in execution order
(alternating blue shades; red when the micro-batch holds more tokens than the budget, an out-of-memory risk;
with ``pp > 1`` a micro-batch's per-stage time ``t/pp``), followed by a hatched grey segment for the time the
rank's step takes beyond its own compute -- the pipeline bubble with ``pp > 1`` and the wait for the slowest
rank of an expert-parallel group in lockstep. A bar's total length is the rank's predicted time; the dashed
line is the step time (the slowest rank). A legend under the panels names every colour. Ranks beyond
``max_ranks`` are thinned out evenly, always keeping the slowest.
"""

from __future__ import annotations

import sys
from typing import Any, List, Mapping, Optional, Sequence

import numpy as np

from ..core.errors import DynBatchConfigError


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


def require_matplotlib(path: str, flag: str = "--plot") -> None:
    """Raise the CLI's one-line error now (before any work) when matplotlib cannot be imported."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise DynBatchConfigError(flag, path, "needs matplotlib, which is not installed in this environment",
                                  f"pip install matplotlib (into {sys.prefix}), or bash scripts/setup.sh --test; "
                                  f"or drop {flag}")


def _over_budget(plan: Any, r: int) -> List[bool]:
    tokens, cap = getattr(plan, "microbatch_tokens", None), getattr(plan, "cap", None)
    if tokens is None or not cap:
        return [False] * len(plan.microbatch_time[r])
    return [int(t) > int(cap) for t in tokens[r]]


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
    any_over = any_wait = False
    fig, axes = plt.subplots(len(names), 1, figsize=(11, max(3.0, height)), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [len(shown[n]) + 3 for n in names]})
    for ax, name in zip(axes[:, 0], names):
        plan = plans[name]
        pp = max(1, int(getattr(plan.parallel, "pp", 1)))
        ranks = shown[name]
        for y, r in enumerate(ranks):
            widths = np.asarray(plan.microbatch_time[r], dtype=np.float64) / pp
            lefts = np.concatenate([[0.0], np.cumsum(widths)[:-1]])
            over = _over_budget(plan, r)
            any_over = any_over or any(over)
            colors = [(OVER_COLORS if over[j] else MB_COLORS)[j % 2] for j in range(widths.size)]
            ax.broken_barh(list(zip(lefts.tolist(), widths.tolist())), (y - 0.4, 0.8), facecolors=colors,
                           edgecolor="white", linewidth=0.3)
            done = float(widths.sum())
            rest = float(plan.rank_time[r]) - done
            if rest > 1e-12:
                any_wait = True
                ax.broken_barh([(done, rest)], (y - 0.4, 0.8), facecolors=WAIT_COLOR, hatch="///",
                               edgecolor="#999999", linewidth=0.0)
        step = float(np.max(plan.rank_time))
        ax.axvline(step, color=STEP_COLOR, linestyle="--", linewidth=1.0)
        ax.set_yticks(range(len(ranks)))
        ax.set_yticklabels([str(r) for r in ranks], fontsize=6 if len(ranks) > 16 else 8)
        ax.invert_yaxis()
        extra = f", {len(ranks)} of {len(plan.rank_time)} ranks shown" if len(ranks) < len(plan.rank_time) else ""
        over = int(getattr(plan, "cap_violations", 0) or 0)
        ax.set_title(f"{name}: step {step:.3f} s, {max(len(m) for m in plan.micro_batches)} micro-batches/rank"
                     f"{f', {over} over the token budget' if over else ''}{extra}", fontsize=9, loc="left")
        ax.set_ylabel("DP rank", fontsize=8)
        ax.set_xlim(0, xmax)
    axes[-1, 0].set_xlabel("predicted (modelled) time per rank, s")
    handles = [Patch(facecolor=MB_COLORS[0], label="micro-batch (shades alternate; execution order)")]
    if any_over:
        handles.append(Patch(facecolor=OVER_COLORS[0], label="micro-batch over the token budget (OOM risk)"))
    if any_wait:
        handles.append(Patch(facecolor=WAIT_COLOR, hatch="///", edgecolor="#999999",
                             label="pipeline bubble / wait for the EP group"))
    handles.append(Line2D([0], [0], color=STEP_COLOR, linestyle="--", label="step time (slowest rank)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    legend_room = min(0.2, 0.4 / fig.get_figheight())  # about 0.4 inch under the panels
    fig.tight_layout(rect=(0, legend_room, 1, 0.985 if title else 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
