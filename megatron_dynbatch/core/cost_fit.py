"""Fitting a cost profile to measured micro-batch timings: :func:`fit_records` (and the first, simpler fits:
:func:`fit_cost_model` -- three per-micro-batch coefficients by least squares -- and :func:`fit_cp_comm` -- the CP
exchange on top of a base model -- with their :class:`FitReport`).

A record is one measured micro-batch share: ``[group_size, lengths, seconds]`` -- the time ONE GPU of a CP group
of ``group_size`` GPUs spent, forward + backward, on its zig-zag share of a packed micro-batch of sequences of
``lengths`` tokens (``group_size = 1``: a whole micro-batch on one GPU). The format of
``benchmarks/gpu/results/*_cp_microbatches.json`` (``{"group_size", "lengths", "seconds"}`` items are accepted too,
and a fourth list entry -- sample indices -- is ignored).

The timings come from a slice of the model: ``measured_layers`` decoder layers at the per-TP-rank widths of
``model`` with tensor-parallel size ``tp`` (``lm_head=True`` if the slice ran the output layer and loss too). In
FLOPs of that slice (:mod:`.flops`; each sequence padded to ``2 * group_size`` as the zig-zag split does) the
record's time is modelled as (one member's share, ``c = 1`` for ``group_size > 1`` else 0)::

    floor   = layers * (min_per_layer_s + c * cp_min_per_layer_s)
    compute = layers * overhead_per_layer_s + linear_flops / (peak * linear_efficiency) * (1 + c * cp_linear_overhead)
              + (attention_flops + attention_per_sq * cp_chunk_tokens * tokens * (g - 1) / g)
                / (peak * attention_efficiency)
    seconds = max(floor, compute)

Given which records sit on the floor, both branches are linear in their unknowns; the fit alternates between
assigning each record to the branch the current model puts it on and solving each branch by non-negative least
squares on RELATIVE error (small micro-batches count as much as large ones), each group size weighted by
``1 / sqrt(records of that size)`` so a few wide groups still shape their terms, until the assignment stops
changing. It starts from the records whose nominal compute (60% / 30% of peak, scaled by the records' median
slowdown on a device more than 2x slower) is below half their time on the floor. Terms no record can show keep
the ``base`` profile's values: without a CP share (``group_size > 1``) the CP-member terms; a device faster than
the base's ``peak_flops`` raises the peak so both efficiencies stay <= 1. Deterministic; NumPy only. The result
transfers to any model and layout as a :class:`~.cost_profiles.CostProfile` (``FitReport.profile``); the returned
:class:`~.cost_model.CostModel` is that profile applied to ``model`` with all its layers on ``parallel``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .checks import as_bool, as_int
from .cost_model import CostModel
from .cost_profiles import CostProfile, resolve_profile
from .errors import DynBatchConfigError
from .flops import FWD_BWD_FACTOR, flops_breakdown
from .model_spec import ModelLike, ModelSpec
from .parallel import ParallelConfig

# ------------------------------------------------------- the fit report, and the first fits (no floor, no profile)
@dataclass(frozen=True)
class FitReport:
    """How well a fitted ``CostModel`` reproduces the measurements it was fitted on. :func:`.cost_fit.fit_records`
    also fills ``per_group`` (group size -> ``n``, ``mean_rel_error`` (bias), ``mean_abs_rel_error``,
    ``p95_abs_rel_error``), ``uncertainty`` (the mean over group sizes of ``mean_abs_rel_error``) and
    ``profile`` (the fitted :class:`~.cost_profiles.CostProfile` as a dict, which transfers to other layouts);
    ``megatron-dynbatch calibrate`` adds ``fitted_for`` (:func:`fitted_for`: the model and device timed), which
    :func:`resolve_cost_model` checks against the model a file is used for."""

    num_measurements: int
    rel_rms_error: float
    max_rel_error: float
    per_group: Dict[int, Dict[str, float]] = field(default_factory=dict)
    uncertainty: Optional[float] = None
    profile: Optional[Dict[str, Any]] = None
    fitted_for: Optional[Dict[str, Any]] = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["per_group"] = {str(k): v for k, v in self.per_group.items()}
        return {k: v for k, v in d.items() if v not in (None, {})}


def fit_cost_model(padded_tokens: Sequence[float], sq_tokens: Sequence[float], seconds: Sequence[float],
                   parallel: Optional[ParallelConfig] = None) -> "tuple[CostModel, FitReport]":
    """Fit ``seconds ~ overhead + a * padded_tokens + b * sq_tokens`` to measured micro-batch times.

    Each row is one measured micro-batch on one GPU (forward + backward): its padded token count, the sum of
    its sequences' squared real lengths, and its time. The fit minimises *relative* squared error (small
    micro-batches matter as much as large ones) with every coefficient kept >= 0 (an exact non-negative least
    squares over the 8 active sets of three unknowns). Returns the model and its fit error on these rows.
    """
    x = np.column_stack([np.ones(len(seconds)), np.asarray(padded_tokens, float), np.asarray(sq_tokens, float)])
    y = np.asarray(seconds, dtype=np.float64)
    if y.ndim != 1 or x.shape[0] != y.size or y.size < 3:
        raise DynBatchConfigError("measurements", int(y.size), "need at least 3 micro-batch timings of equal length",
                                  "measure micro-batches of several sizes and lengths")
    if (y <= 0).any() or not np.isfinite(x).all() or not np.isfinite(y).all():
        raise DynBatchConfigError("measurements.seconds", "non-positive or non-finite value",
                                  "every timing must be a positive, finite number of seconds",
                                  "drop failed or warm-up measurements")
    c, a, b = nnls_relative(x, y, y)
    p = parallel or ParallelConfig()
    model = CostModel(float(a), float(b), float(c), pp=p.pp, vpp=p.vpp, ep_group=max(1, p.ep), cp=p.cp)
    rel = (x @ np.array([c, a, b]) - y) / y
    return model, FitReport(int(y.size), float(np.sqrt(np.mean(rel ** 2))), float(np.max(np.abs(rel))))


def nnls_relative(x: np.ndarray, y: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Non-negative least squares of ``x @ coef ~ y`` with each row weighted by ``1 / scale`` (relative error),
    exact over every active set of the (few) columns."""
    w = 1.0 / scale
    xw, yw = x * w[:, None], y * w
    k = x.shape[1]
    best = (float(np.sum(yw ** 2)), np.zeros(k))  # all coefficients 0
    for mask in range(1, 2 ** k):
        cols = [c for c in range(k) if mask >> c & 1]
        coef, *_ = np.linalg.lstsq(xw[:, cols], yw, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(k)
        full[cols] = coef
        err = float(np.sum((xw @ full - yw) ** 2))
        if err < best[0]:
            best = (err, full)
    return best[1]


def fit_cp_comm(base: CostModel, group_sizes: Sequence[int], padded_tokens: Sequence[float],
                sq_tokens: Sequence[float], seconds: Sequence[float]) -> "tuple[CostModel, FitReport]":
    """Calibrate the CP communication term of ``base`` from measured micro-batch times on CP groups.

    Each row is one micro-batch run on a group of ``group_sizes[k]`` GPUs (any mix of sizes; rows with
    ``g == 1`` anchor the compute part): its full packed token count, sum of squared real lengths and the
    time one GPU of the group spent on it (forward + backward). ``base`` supplies the compute part (fit it first
    with :func:`fit_cost_model` on ``g == cp`` rows, or use ``from_model``); the residual
    ``seconds - (overhead + work * cp / g)`` is fitted, relative error, non-negative coefficients, to
    ``(g - 1) * per_step + (g - 1) / g * tokens * per_token - overlap * attention_time(g)`` -- the exposed
    communication without its ``max(0, .)``, so measure groups where the exchange shows (short sequences on
    large groups) as well as long ones. The overlap is clipped to [0, 1]. Returns the model and the fit error
    of the whole formula on these rows.
    """
    g = np.asarray(group_sizes, dtype=np.float64)
    t = np.asarray(padded_tokens, dtype=np.float64)
    q = np.asarray(sq_tokens, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if not (g.shape == t.shape == q.shape == y.shape) or y.ndim != 1 or y.size < 3:
        raise DynBatchConfigError("measurements", int(y.size), "need at least 3 micro-batch timings, with a group "
                                  "size, token count and squared-length sum each", "measure several group sizes")
    if (g < 1).any() or (y <= 0).any() or not (np.isfinite(t).all() and np.isfinite(q).all() and np.isfinite(y).all()):
        raise DynBatchConfigError("measurements", "bad row", "group sizes must be >= 1 and timings positive and "
                                  "finite", "drop failed or warm-up measurements")
    if not isinstance(base, CostModel):
        raise DynBatchConfigError("base", type(base).__name__, "must be a CostModel", "fit_cost_model(...) first")
    compute = base.with_cp_comm(0.0, 0.0, 0.0).group_microbatch_time(g, t, q)
    att = base.attention_s_per_sq_token * q * base.cp / g
    x = np.column_stack([g - 1.0, (g - 1.0) / g * t, np.where(g > 1, -att, 0.0)])  # one GPU: no exchange
    step, per_token, overlap = nnls_relative(x, y - compute, y)
    model = base.with_cp_comm(per_token, step, min(1.0, overlap))
    rel = (model.group_microbatch_time(g, t, q) - y) / y
    return model, FitReport(int(y.size), float(np.sqrt(np.mean(rel ** 2))), float(np.max(np.abs(rel))))


#: at most this many alternations between the floor/compute assignment and the two least-squares solves
MAX_ROUNDS = 100
#: nominal efficiencies that pick the records starting on the floor (compute below half the measured time)
_NOMINAL = (0.6, 0.3)


def parse_records(records: Sequence[Any]) -> Tuple[np.ndarray, List[np.ndarray], np.ndarray]:
    """``(group sizes, lengths per record, seconds)`` from records in the module docstring's format, or a
    ``DynBatchConfigError`` naming the first bad record."""
    if isinstance(records, (str, bytes, Mapping)) or not hasattr(records, "__len__") or len(records) < 3:
        raise DynBatchConfigError("records",
                                  type(records).__name__ if not hasattr(records, "__len__") else len(records),
                                  "need at least 3 records [group_size, lengths, seconds]",
                                  "measure micro-batches of several sizes (benchmarks/gpu/README.md)")
    groups, lens, secs = [], [], []
    for i, rec in enumerate(records):
        try:
            if isinstance(rec, Mapping):
                g, lengths, s = rec["group_size"], rec["lengths"], rec["seconds"]
            else:
                g, lengths, s = rec[0], rec[1], rec[2]
            g = as_int(g, f"records[{i}].group_size", minimum=1, maximum=2 ** 20)
            arr = np.asarray(lengths)
            if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer) or (arr < 1).any():
                raise DynBatchConfigError(f"records[{i}].lengths", lengths, "must be a non-empty list of positive "
                                          "integers", "give each sequence's token count")
            s = float(s) if isinstance(s, (int, float, np.integer, np.floating)) and not isinstance(s, bool) else None
            if s is None or not np.isfinite(s) or s <= 0:
                raise DynBatchConfigError(f"records[{i}].seconds", rec, "must be a positive, finite number",
                                          "drop failed or warm-up measurements")
        except (KeyError, IndexError, TypeError):
            raise DynBatchConfigError(f"records[{i}]", rec, "is not [group_size, lengths, seconds]",
                                      "write one list (or object) per measured micro-batch share") from None
        groups.append(g)
        lens.append(arr.astype(np.int64))
        secs.append(s)
    return np.asarray(groups, dtype=np.int64), lens, np.asarray(secs, dtype=np.float64)


def record_features(model: ModelLike, records: Sequence[Any], *, measured_layers: int, tp: int = 1,
                    lm_head: bool = False, peak_flops: float) -> Dict[str, np.ndarray]:
    """:func:`slice_features` of records (each sequence padded to a multiple of ``2 * group_size``)."""
    return record_features_padded(model, records, measured_layers=measured_layers, tp=tp, lm_head=lm_head,
                                  peak_flops=peak_flops)[0]


def record_features_padded(model: ModelLike, records: Sequence[Any], *, measured_layers: int, tp: int = 1,
                           lm_head: bool = False, peak_flops: float) -> Tuple[Dict[str, np.ndarray], np.ndarray]:
    """:func:`record_features` and each record's padded token count (the ``padded_tokens`` it passed on)."""
    g, lens, secs = parse_records(records)
    padded = np.array([float((-(-x // (2 * k)) * (2 * k)).sum()) for x, k in zip(lens, g.tolist(), strict=True)])
    sq = np.array([float((x.astype(np.float64) ** 2).sum()) for x in lens])
    out = slice_features(model, g, padded, sq, measured_layers=measured_layers, tp=tp, lm_head=lm_head,
                         peak_flops=peak_flops)
    out["seconds"] = secs
    return out, padded


def point_features(points: Sequence[Any], model: ModelLike, *, measured_layers: int, tp: int = 1,
                   lm_head: bool = False, peak_flops: float) -> Dict[str, np.ndarray]:
    """:func:`slice_features` of calibration grid points (``group_size``, ``lengths``; each sequence padded to a
    multiple of ``2 * group_size``)."""
    g = np.array([p.group_size for p in points], dtype=np.float64)
    padded = np.array([float(sum(-(-n // (2 * p.group_size)) * 2 * p.group_size for n in p.lengths))
                       for p in points])
    sq = np.array([float(sum(n * n for n in p.lengths)) for p in points])
    return slice_features(model, g, padded, sq, measured_layers=measured_layers, tp=tp, lm_head=lm_head,
                          peak_flops=peak_flops)


def slice_features(model: ModelLike, group_sizes: Any, padded_tokens: Any, sq_tokens: Any, *, measured_layers: int,
                   tp: int = 1, lm_head: bool = False, peak_flops: float) -> Dict[str, np.ndarray]:
    """Per micro-batch share (``group_sizes``; each micro-batch's full padded token count and sum of squared
    lengths), in seconds at ``peak_flops``: the slice's linear FLOPs of the member's tokens (``lin``), its attention
    FLOPs (``att``), the chunk term per unit of ``cp_chunk_tokens`` (``chunk``); plus ``g`` and ``layers``."""
    spec = ModelSpec.from_any(model)
    layers = as_int(measured_layers, "measured_layers", minimum=1, maximum=spec.num_layers + (spec.mtp_num_layers or 0),
                    fix=f"pass the decoder layers the timings ran (1 .. {spec.num_layers})")
    tp = as_int(tp, "tp", minimum=1, maximum=2 ** 20, fix="pass the tensor-parallel size the widths were split by")
    b = flops_breakdown(spec)
    per_layer = (b.linear - b.logits_per_token) / spec.num_layers
    head = b.logits_per_token / (1 + (spec.mtp_num_layers or 0)) if as_bool(lm_head, "lm_head") else 0.0
    linear = per_layer * layers + head
    quadratic = b.quadratic / spec.num_layers * layers
    g = np.asarray(group_sizes, dtype=np.float64)
    padded = np.asarray(padded_tokens, dtype=np.float64)
    unit = FWD_BWD_FACTOR / tp / peak_flops
    return {"g": g, "layers": np.full(g.shape, float(layers)), "lin": unit * linear * padded / g,
            "att": unit * quadratic * np.asarray(sq_tokens, dtype=np.float64) / g,
            "chunk": unit * quadratic * padded * (g - 1.0) / g}


def fit_records(records: Sequence[Any], model: ModelLike, *, measured_layers: int, tp: int = 1, lm_head: bool = False,
                parallel: Optional[ParallelConfig] = None, base: Any = "fitted",
                name: str = "calibrated") -> Tuple[CostModel, FitReport]:
    """Fit the cost model to measured micro-batch shares (module docstring).

    ``model``: the model the slices were cut from (preset, dict or ``ModelSpec``); ``measured_layers``, ``tp``,
    ``lm_head``: the slice. ``base``: the profile that supplies what timings of compute cannot tell -- peak
    FLOPs and the network (topology) numbers. Returns the model for ``model`` (all its layers) on ``parallel``
    (default: ``tp`` alone) and a :class:`FitReport` with the error per group size, the ``uncertainty`` (mean over
    group sizes of the mean absolute relative error) and the fitted ``profile`` -- ``save_cost_model(cm, path,
    report)`` writes both, ``--dynbatch-cost-model`` / ``plan --cost-model`` read them."""
    prof0 = resolve_profile(base, field="base")
    feats = record_features(model, records, measured_layers=measured_layers, tp=tp, lm_head=lm_head,
                            peak_flops=prof0.peak_flops)
    profile, report = fit_profile([feats], base=prof0, name=name)
    par = parallel if parallel is not None else ParallelConfig(tp=tp)
    return CostModel.from_model(model, ParallelConfig.from_any(par), profile=profile), report


def fit_profile(feature_sets: Sequence[Mapping[str, np.ndarray]], *, base: Any = "fitted",
                name: str = "calibrated", ratio_fallback: bool = True) -> Tuple[CostProfile, FitReport]:
    """The profile fit itself, over the :func:`record_features` of one or more slices (several models' slices
    fit one profile: that is how the default ``"fitted"`` profile was made, ``benchmarks/gpu/fit_profile.py``).
    A feature set may carry a ``"weight"`` per record (default 1; a group size's records count as their summed
    weight): online calibration adds low-weight records predicted by the current model as a prior. When the
    records do not separate the linear from the attention cost (a small model at short lengths, where attention
    is lost in the noise) and ``ratio_fallback`` is on, the fit is repeated with the attention / linear
    efficiency ratio of ``base`` (the profile's name says so); a ``DynBatchConfigError`` if even that fails."""
    prof0 = resolve_profile(base, field="base")
    f = {k: np.concatenate([np.asarray(s[k], dtype=np.float64) for s in feature_sets])
         for k in ("g", "seconds", "layers", "lin", "att", "chunk")}
    g, y, lay = f["g"], f["seconds"], f["layers"]
    member = (g > 1).astype(np.float64)
    x_compute = np.column_stack([lay, f["lin"], f["lin"] * member, f["att"], f["chunk"]])
    x_floor = np.column_stack([lay, lay * member])
    w = np.concatenate([np.asarray(s["weight"], dtype=np.float64) if "weight" in s else np.ones(len(s["g"]))
                        for s in feature_sets])
    if not (np.isfinite(w).all() and (w > 0).all()):
        raise DynBatchConfigError("weight", "non-positive or non-finite", "record weights must be positive, finite "
                                  "numbers", "leave 'weight' out (1 per record) or pass positive weights")
    _, where = np.unique(g, return_inverse=True)
    weight = w / np.sqrt(np.bincount(where, weights=w)[where])
    scale = y * weight.mean() / weight  # relative error, each group size weighted by 1/sqrt(its records)
    start = _initial_floor(f["lin"] / _NOMINAL[0] + f["att"] / _NOMINAL[1], y)
    comp, flr = _alternate(x_compute, x_floor, y, scale, start)
    a, il, il_cp, ia, ia_chunk = comp.tolist()
    if (il <= 0 or ia <= 0) and ratio_fallback:  # attention lost in the noise: keep the base's split
        k = prof0.linear_efficiency / prof0.attention_efficiency
        tied = np.column_stack([lay, f["lin"] + k * f["att"], f["lin"] * member, f["chunk"]])
        comp4, flr = _alternate(tied, x_floor, y, scale, start)
        a, il, il_cp, ia_chunk = comp4.tolist()
        ia, name = il * k, f"{name} (attention:linear ratio of {prof0.name})"
        comp = np.array([a, il, il_cp, ia, ia_chunk])
    if il <= 0 or ia <= 0:
        raise DynBatchConfigError("records", int(y.size), "do not determine both the linear and the attention cost "
                                  "(too few sizes and lengths measured)", "measure short and long sequences, "
                                  "several per micro-batch, as benchmarks/gpu/README.md describes")
    report = fit_report(np.maximum(x_floor @ flr, x_compute @ comp), y, g)
    up = max(1.0, 1.0 / il, 1.0 / ia)  # faster than the base's peak: raise the peak so efficiencies stay <= 1
    cp_terms = {"cp_min_per_layer_s": float(flr[1]), "cp_linear_overhead": il_cp / il,
                "cp_chunk_tokens": ia_chunk / ia} if member.any() else {}  # no CP share timed: keep the base's
    profile = prof0.replace(
        name=name, peak_flops=prof0.peak_flops * up, linear_efficiency=1.0 / (il * up),
        attention_efficiency=1.0 / (ia * up), overhead_s=0.0, overhead_per_layer_s=a, min_per_layer_s=float(flr[0]),
        uncertainty=min(1.0, report.uncertainty), **cp_terms)
    return profile, FitReport(report.num_measurements, report.rel_rms_error, report.max_rel_error,
                              report.per_group, profile.uncertainty, profile.to_dict())


def _alternate(x_compute: np.ndarray, x_floor: np.ndarray, y: np.ndarray, scale: np.ndarray,
               on_floor: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The two branches' coefficients, alternating between assigning records to the branch the current
    coefficients put them on and solving each branch (module docstring)."""
    comp, flr = np.zeros(x_compute.shape[1]), np.zeros(x_floor.shape[1])
    for _ in range(MAX_ROUNDS):
        comp = nnls_relative(x_compute[~on_floor], y[~on_floor], scale[~on_floor])
        if on_floor.sum() >= 2:
            flr = nnls_relative(x_floor[on_floor], y[on_floor], scale[on_floor])
        now = x_floor @ flr > x_compute @ comp
        if (now == on_floor).all():
            break
        on_floor = now
    return comp, flr


def _initial_floor(nominal: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The records the fit starts with on the floor: nominal compute below half the measured time. On a device
    more than 2x slower than the nominal efficiencies at the base's peak (a CPU, an older GPU) the nominal is first
    scaled by the median slowdown of the larger half of the records, so the start does not put everything there."""
    big = nominal >= np.median(nominal)
    slow = float(np.median(y[big] / nominal[big])) if big.any() else 1.0
    return nominal * (slow if slow > 2.0 else 1.0) < 0.5 * y


def fit_report(predicted: np.ndarray, seconds: np.ndarray, group_sizes: np.ndarray) -> FitReport:
    """Relative errors of ``predicted`` against ``seconds``, overall and per group size (``uncertainty``: the mean
    over group sizes of their mean absolute relative error)."""
    rel = (np.asarray(predicted, dtype=np.float64) - seconds) / seconds
    per: Dict[int, Dict[str, float]] = {}
    for s in np.unique(group_sizes).tolist():
        r = rel[group_sizes == s]
        per[int(s)] = {"n": int(r.size), "mean_rel_error": float(r.mean()),
                       "mean_abs_rel_error": float(np.abs(r).mean()),
                       "p95_abs_rel_error": float(np.percentile(np.abs(r), 95))}
    unc = float(np.mean([v["mean_abs_rel_error"] for v in per.values()]))
    return FitReport(int(rel.size), float(np.sqrt(np.mean(rel ** 2))), float(np.abs(rel).max()), per, unc)


def predict_records(cost_profile: Any, records: Sequence[Any], model: ModelLike, *, measured_layers: int, tp: int = 1,
                    lm_head: bool = False) -> np.ndarray:
    """Seconds a profile predicts for records measured on a slice (the fit's own model; module docstring)."""
    prof: CostProfile = resolve_profile(cost_profile)
    return predict_features(prof, record_features(model, records, measured_layers=measured_layers, tp=tp,
                                                  lm_head=lm_head, peak_flops=prof.peak_flops))


def predict_features(profile: CostProfile, f: Mapping[str, np.ndarray]) -> np.ndarray:
    """Seconds ``profile`` predicts for :func:`slice_features` ``f`` computed at ``profile.peak_flops``."""
    member = f["g"] > 1
    floor = f["layers"] * (profile.min_per_layer_s + member * profile.cp_min_per_layer_s)
    compute = (f["layers"] * profile.overhead_per_layer_s + profile.overhead_s
               + f["lin"] / profile.linear_efficiency * (1.0 + member * profile.cp_linear_overhead)
               + (f["att"] + f["chunk"] * profile.cp_chunk_tokens) / profile.attention_efficiency)
    return np.maximum(floor, compute)


__all__ = ["fit_records", "fit_profile", "fit_report", "predict_records", "predict_features", "parse_records",
           "record_features", "record_features_padded", "point_features", "slice_features"]
