"""How long timing a calibration grid takes, and the grid cut to ``--max-seconds``.

The estimate of a point is what its timing runs: ``warmup + repeats`` forward + backward passes of each member timed
(members ``0`` and ``g-1`` of a CP share, the one member of ``g = 1``), each priced by a profile on the slice's
FLOPs (:func:`..cost_fit.predict_features`) -- the ``base`` profile on a GPU (the H100 fit: an estimate, a newer GPU
is faster), :data:`CPU_ESTIMATE` on a CPU -- plus :data:`STARTUP_S` for importing megatron-core and building the
slice once. :func:`fit_to_seconds` keeps the longest prefix of the (coverage-ordered) grid that fits; the timing
loop re-checks before each point with the ratio of measured to estimated seconds so far
(:func:`projected_finish`), so a device slower than estimated still stops in time, and the progress line quotes the
run's length projected the same way (:func:`projected_total`), so the estimate improves as points are timed.
Pure Python + NumPy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

import numpy as np

from ..checks import as_float
from ..cost_fit import point_features, predict_features
from ..cost_profiles import CostProfile, resolve_profile
from ..errors import DynBatchConfigError
from .grid import MIN_POINTS, GridPoint

if TYPE_CHECKING:
    from ..model_spec import ModelLike

#: importing megatron-core and building the slice (measured ~3-8 s on this project's machines), rounded up
STARTUP_S = 10.0
#: a rough profile of one CPU thread running the megatron-core slice in fp32 (the 2-core AMD EPYC VM this project
#: runs on, 2026-11; fitted by `megatron-dynbatch calibrate --device cpu` on a 2-layer 256-wide model): for
#: estimates of CPU runs only, never for planning
CPU_ESTIMATE = CostProfile(name="cpu-estimate", linear_efficiency=8.3e-5, attention_efficiency=2.2e-5,
                           overhead_per_layer_s=5e-3)


def point_seconds(points: Sequence[GridPoint], model: ModelLike, *, measured_layers: int, tp: int = 1,
                  lm_head: bool = False, device: str = "cuda", base: Any = "fitted", warmup: int = 1,
                  repeats: int = 3) -> np.ndarray:
    """Estimated seconds of timing each point (module docstring)."""
    if not points:
        return np.zeros(0)
    prof: CostProfile = CPU_ESTIMATE if str(device) == "cpu" else resolve_profile(base, field="--base")
    f = point_features(points, model, measured_layers=measured_layers, tp=tp, lm_head=lm_head,
                       peak_flops=prof.peak_flops)
    members = np.where(f["g"] > 1, 2.0, 1.0)
    return predict_features(prof, f) * members * (int(warmup) + int(repeats))


def fit_to_seconds(points: Sequence[GridPoint], seconds: Sequence[float],
                  max_seconds: Optional[Any]) -> Tuple[List[GridPoint], float]:
    """The longest prefix of ``points`` whose estimated seconds (plus :data:`STARTUP_S`) fit ``max_seconds``
    (``None``: all), and its estimate. Refuses a time limit that cannot hold :data:`MIN_POINTS` points."""
    est = np.asarray(seconds, dtype=np.float64)
    total = STARTUP_S + np.cumsum(est)
    if max_seconds is None:
        return list(points), float(total[-1]) if total.size else STARTUP_S
    limit = as_float(max_seconds, "--max-seconds", minimum=0.0, maximum=1e7,
                     fix="pass a time limit in seconds, e.g. --max-seconds 600")
    keep = int(np.searchsorted(total, limit, side="right"))
    if keep < min(MIN_POINTS, len(points)):
        need = float(total[min(MIN_POINTS, len(points)) - 1])
        raise DynBatchConfigError("--max-seconds", max_seconds, f"is too short for the {MIN_POINTS} micro-batches a "
                                  f"fit needs (estimated {need:.0f} s with start-up)",
                                  f"pass --max-seconds {int(np.ceil(need * 1.5))} or more, or a smaller grid")
    return list(points[:keep]), float(total[keep - 1]) if keep else STARTUP_S


def projected_finish(elapsed: float, done_estimate: float, done_measured: float, next_estimate: float) -> float:
    """When the next point would finish: its estimate scaled by measured / estimated seconds so far."""
    ratio = done_measured / done_estimate if done_estimate > 0 and done_measured > 0 else 1.0
    return float(elapsed + next_estimate * ratio)


def projected_total(elapsed: float, done_estimate: float, done_measured: float, left_estimate: float) -> float:
    """The run's projected length while it goes: seconds so far plus the estimate of the points left, scaled by
    measured / estimated seconds of the points timed so far (the dry run's estimate until one is timed)."""
    ratio = done_measured / done_estimate if done_estimate > 0 and done_measured > 0 else 1.0
    return float(elapsed + max(0.0, left_estimate) * ratio)


__all__ = ["point_seconds", "fit_to_seconds", "projected_finish", "projected_total", "STARTUP_S", "CPU_ESTIMATE"]
