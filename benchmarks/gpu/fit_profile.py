#!/usr/bin/env python
"""Reproduce the ``"fitted"`` cost profile (``megatron_dynbatch/core/cost_profiles.py``) from the H100 timings.

Fits :func:`megatron_dynbatch.core.cost_fit.fit_profile` to every measured CP-member micro-batch share of
``results/h100_2026-11-25_{cp,pp}_microbatches.json`` (2-layer slices of four models' per-TP-rank widths; see
``gpu_data.py``), prints the fitted numbers, the fit error per group size and per measured batch, and the error of
the SAME profile on the DP-only measurements (other widths, LM head included, never fitted on). ``--check``
exits non-zero when the shipped profile differs from this fit by more than rounding.

    python benchmarks/gpu/fit_profile.py [--json FILE] [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_data import SLICE_LAYERS, dp_slices, slices  # noqa: E402

from megatron_dynbatch.core.cost_fit import fit_profile, fit_report, predict_features, record_features, slice_features  # noqa: E402,E501
from megatron_dynbatch.core.cost_profiles import FITTED  # noqa: E402

#: fields compared by --check, and the relative tolerance (the shipped numbers are rounded to 3 digits)
CHECKED = ("linear_efficiency", "attention_efficiency", "overhead_per_layer_s", "min_per_layer_s",
           "cp_min_per_layer_s", "cp_linear_overhead", "cp_chunk_tokens")
RTOL = 0.01


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="also write the profile and the errors as JSON")
    ap.add_argument("--check", action="store_true", help="fail if the shipped 'fitted' profile differs from this fit")
    args = ap.parse_args()

    sets = [(key, record_features(spec, recs, measured_layers=SLICE_LAYERS, tp=tp, peak_flops=FITTED.peak_flops))
            for key, spec, tp, recs in slices()]
    profile, report = fit_profile([f for _, f in sets], base=FITTED, name="fitted")
    print(f"fitted on {report.num_measurements} measured micro-batch shares (H100, 2026-11-25):")
    for name in CHECKED:
        print(f"  {name:<22} {getattr(profile, name):.4g}")
    print(f"  uncertainty            {profile.uncertainty:.4f}  (mean over group sizes of the mean |relative error|)")
    print("\nfit error per group size (relative):")
    print(f"  {'g':>3} {'n':>6} {'mean (bias)':>12} {'mean |err|':>11} {'p95 |err|':>10}")
    for g, v in sorted(report.per_group.items()):
        print(f"  {g:>3} {v['n']:>6} {v['mean_rel_error']:>+12.4f} {v['mean_abs_rel_error']:>11.4f} "
              f"{v['p95_abs_rel_error']:>10.4f}")
    print("\nper measured batch (mean |relative error|, bias):")
    per_batch = {}
    for key, f in sets:
        rel = (predict_features(profile, f) - f["seconds"]) / f["seconds"]
        per_batch[key] = (float(np.abs(rel).mean()), float(rel.mean()), int(rel.size))
        print(f"  {key:<34} n={rel.size:>5}  {per_batch[key][0]:.4f}  {per_batch[key][1]:+.4f}")
    print("\nthe same profile on the DP-only measurements (never fitted on; LM head included):")
    dp = {}
    for key, spec, layers, tokens, sq, secs in dp_slices():
        f = slice_features(spec, np.ones(tokens.size), tokens, sq, measured_layers=layers, tp=1, lm_head=True,
                           peak_flops=profile.peak_flops)
        rep = fit_report(predict_features(profile, f), secs, np.ones(tokens.size))
        dp[key] = rep.per_group[1]
        print(f"  {key:<20} n={tokens.size:>5}  mean |err| {dp[key]['mean_abs_rel_error']:.4f}  "
              f"bias {dp[key]['mean_rel_error']:+.4f}  p95 {dp[key]['p95_abs_rel_error']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": profile.to_dict(), "fit": report.to_dict(),
                                               "per_batch": per_batch, "dp": dp}, indent=1))
    if args.check:
        bad = [n for n in CHECKED if not np.isclose(getattr(FITTED, n), getattr(profile, n), rtol=RTOL)]
        if bad:
            print(f"\nshipped profile differs in {bad}: update core/cost_profiles.py FITTED", file=sys.stderr)
            return 1
        print("\nthe shipped 'fitted' profile matches this fit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
