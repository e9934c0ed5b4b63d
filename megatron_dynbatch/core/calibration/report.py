"""How a calibration reports its fit: the error per group size (a table for ``calibrate``, one line for the online
refit's log) and the fitted profile in words. Pure Python."""

from __future__ import annotations

from typing import Any, List, Mapping

from ..cost_profiles import CostProfile


def _per_group(report: Any) -> Mapping[int, Mapping[str, float]]:
    per = report.per_group if hasattr(report, "per_group") else report.get("per_group", {})
    return {int(k): v for k, v in per.items()}


def fit_table(report: Any) -> List[str]:
    """Rows of the fit error per group size: records, bias (mean relative error), mean and 95th percentile of the
    absolute relative error."""
    out = [f"{'group size':>10} {'records':>8} {'bias':>8} {'mean |err|':>11} {'p95 |err|':>10}"]
    for g, e in sorted(_per_group(report).items()):
        out.append(f"{g:>10} {int(e['n']):>8} {e['mean_rel_error']:>+8.1%} {e['mean_abs_rel_error']:>11.1%} "
                   f"{e['p95_abs_rel_error']:>10.1%}")
    return out


def fit_line(report: Any) -> str:
    """``g=1: 2.1% (n=30), g=2: 3.0% (n=12)``: mean absolute relative error per group size."""
    return ", ".join(f"g={g}: {e['mean_abs_rel_error']:.1%} (n={int(e['n'])})"
                     for g, e in sorted(_per_group(report).items()))


def profile_line(profile: Any) -> str:
    """A fitted profile in words (per layer; what compute timings determined)."""
    p = profile if isinstance(profile, CostProfile) else CostProfile.from_dict(profile)
    return (f"linear {p.linear_efficiency:.3g} and attention {p.attention_efficiency:.3g} of {p.peak_flops / 1e12:.0f} "
            f"TFLOP/s peak, overhead {p.overhead_per_layer_s * 1e3:.3g} ms and floor {p.min_per_layer_s * 1e3:.3g} ms "
            f"per layer; a CP member's share: floor +{p.cp_min_per_layer_s * 1e3:.3g} ms per layer, linear "
            f"+{p.cp_linear_overhead:.1%}, chunk term {p.cp_chunk_tokens:.0f} tokens")


__all__ = ["fit_table", "fit_line", "profile_line"]
