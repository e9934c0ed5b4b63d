"""What every rank shares after an online refit: one small vector per rank, summed over all ranks, and the profile
built from the sum.

:func:`profile_vector` packs a rank's fitted profile into :data:`VECTOR_SIZE` numbers that add up meaningfully
(per-layer seconds and seconds per FLOP, counts and flags); a SUM all-reduce of them is the only communication of
online calibration. :func:`merged_profile` turns the sum into the shared profile -- every rank gets the same sum
and runs the same arithmetic, so every rank builds the bit-identical profile and cost model.
:func:`scale_profile` is the refit of last resort (the current shape, scaled to the measured seconds). Pure Python
+ NumPy.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..cost_profiles import CostProfile

#: the merged vector: [fitted, overhead/layer, s per linear FLOP, s per attention FLOP, floor/layer, uncertainty,
#: records, timed CP shares, cp linear overhead, cp chunk tokens, cp floor/layer]
VECTOR_SIZE = 11


def profile_vector(profile: Optional[CostProfile], records: int, timed_cp: bool) -> np.ndarray:
    """A fitted profile as the vector the ranks sum (:data:`VECTOR_SIZE`; all zeros for "no fit")."""
    v = np.zeros(VECTOR_SIZE)
    if profile is None:
        return v
    v[:7] = [1.0, profile.overhead_per_layer_s, 1.0 / (profile.peak_flops * profile.linear_efficiency),
             1.0 / (profile.peak_flops * profile.attention_efficiency), profile.min_per_layer_s,
             profile.uncertainty, float(records)]
    if timed_cp:
        v[7:] = [1.0, profile.cp_linear_overhead, profile.cp_chunk_tokens, profile.cp_min_per_layer_s]
    return v


def merged_profile(summed: Sequence[float], base: CostProfile, name: str = "online") -> Optional[CostProfile]:
    """The shared profile from the SUM of every rank's :func:`profile_vector` (None if no rank fitted): means over
    the ranks that fitted; CP-member terms from those that timed CP shares, else ``base``'s."""
    v = np.asarray(summed, dtype=np.float64)
    if v.shape != (VECTOR_SIZE,) or not np.isfinite(v).all() or v[0] < 1:
        return None
    n = v[0]
    a, s_lin, s_att, floor, unc = (v[1:6] / n).tolist()
    peak = max(base.peak_flops, 1.0 / s_lin, 1.0 / s_att)  # efficiencies stay <= 1 (see cost_fit)
    cp = {}
    if v[7] >= 1:
        cp = dict(zip(("cp_linear_overhead", "cp_chunk_tokens", "cp_min_per_layer_s"), (v[8:] / v[7]).tolist(),
                      strict=True))
    return base.replace(name=name, peak_flops=peak, linear_efficiency=1.0 / (s_lin * peak),
                        attention_efficiency=1.0 / (s_att * peak), overhead_s=0.0, overhead_per_layer_s=a,
                        min_per_layer_s=floor, uncertainty=min(1.0, unc), **cp)


def scale_profile(profile: CostProfile, ratio: float) -> CostProfile:
    """``profile`` with every compute time multiplied by ``ratio`` (efficiencies divided; the peak raised where an
    efficiency would pass 1); the network numbers unchanged."""
    r = float(ratio) if np.isfinite(ratio) and ratio > 0 else 1.0
    lin, att = profile.linear_efficiency / r, profile.attention_efficiency / r
    up = max(1.0, lin, att)
    return profile.replace(peak_flops=profile.peak_flops * up, linear_efficiency=lin / up,
                           attention_efficiency=att / up, overhead_s=profile.overhead_s * r,
                           overhead_per_layer_s=profile.overhead_per_layer_s * r,
                           min_per_layer_s=profile.min_per_layer_s * r,
                           cp_min_per_layer_s=profile.cp_min_per_layer_s * r)


__all__ = ["profile_vector", "merged_profile", "scale_profile", "VECTOR_SIZE"]
