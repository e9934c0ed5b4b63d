"""Per-rank timelines of several plans for one workload (matplotlib, imported lazily).

One panel per algorithm; each DP rank is a horizontal bar made of its micro-batches in execution order
(alternating shades; with ``pp > 1`` a micro-batch's per-stage time ``t/pp``), followed by a hatched grey
segment for the time the rank's step takes beyond its own compute -- the pipeline bubble with ``pp > 1`` and
the wait for the slowest rank of an expert-parallel group in lockstep. A bar's total length is the rank's
predicted time; the dashed line is the step time (the slowest rank). Ranks beyond ``max_ranks`` are thinned
out evenly, always keeping the slowest.
"""

from __future__ import annotations

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


def plot_timelines(plans: Mapping[str, Any], path: str, title: Optional[str] = None, max_ranks: int = 16,
                   order: Optional[Sequence[str]] = None) -> str:
    """Write a PNG (or any format matplotlib infers from ``path``) with one panel per plan; returns ``path``.

    ``plans`` maps an algorithm name to a :class:`~megatron_dynbatch.core.planner.Plan` (or anything with
    ``micro_batches``, ``microbatch_time``, ``rank_time`` and ``parallel``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - depends on the environment
        raise DynBatchConfigError("--plot", path, "needs matplotlib, which is not installed",
                                  "pip install 'megatron-dynbatch[plot]' (or matplotlib)") from None
    names = [n for n in (order or plans.keys()) if n in plans]
    if not names:
        raise DynBatchConfigError("--plot", path, "there is no plan to draw", "run at least one algorithm")
    xmax = max(float(np.max(plans[n].rank_time)) for n in names) * 1.03
    shown = {n: _ranks_to_show(np.asarray(plans[n].rank_time), max_ranks) for n in names}
    height = sum(0.13 * len(s) + 0.55 for s in shown.values()) + 0.8
    fig, axes = plt.subplots(len(names), 1, figsize=(11, max(3.0, height)), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [len(shown[n]) + 3 for n in names]})
    for ax, name in zip(axes[:, 0], names):
        plan = plans[name]
        pp = max(1, int(getattr(plan.parallel, "pp", 1)))
        ranks = shown[name]
        for y, r in enumerate(ranks):
            widths = np.asarray(plan.microbatch_time[r], dtype=np.float64) / pp
            lefts = np.concatenate([[0.0], np.cumsum(widths)[:-1]])
            colors = ["#4C72B0" if j % 2 == 0 else "#8FAADC" for j in range(widths.size)]
            ax.broken_barh(list(zip(lefts.tolist(), widths.tolist())), (y - 0.4, 0.8), facecolors=colors,
                           edgecolor="white", linewidth=0.3)
            done = float(widths.sum())
            rest = float(plan.rank_time[r]) - done
            if rest > 1e-12:
                ax.broken_barh([(done, rest)], (y - 0.4, 0.8), facecolors="#DDDDDD", hatch="///",
                               edgecolor="#999999", linewidth=0.0)
        step = float(np.max(plan.rank_time))
        ax.axvline(step, color="#C44E52", linestyle="--", linewidth=1.0)
        ax.set_yticks(range(len(ranks)))
        ax.set_yticklabels([str(r) for r in ranks], fontsize=6 if len(ranks) > 16 else 8)
        ax.invert_yaxis()
        extra = f", {len(ranks)} of {len(plan.rank_time)} ranks shown" if len(ranks) < len(plan.rank_time) else ""
        ax.set_title(f"{name}: step {step:.3f} s, {max(len(m) for m in plan.micro_batches)} micro-batches/rank"
                     f"{extra}", fontsize=9, loc="left")
        ax.set_ylabel("DP rank", fontsize=8)
        ax.set_xlim(0, xmax)
    axes[-1, 0].set_xlabel("predicted time (s): micro-batches in order; hatched = pipeline bubble / EP lockstep wait")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.985) if title else None)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
