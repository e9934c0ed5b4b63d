"""Online calibration: refit the cost model during training from the micro-batch times the ranks record.

:class:`OnlineCalibration` is the torch-free state every consumer shares -- one per rank in a Megatron job
(:class:`megatron_dynbatch.megatron.online_calibration.OnlineCalibrator` feeds it and merges with one all-reduce),
one on the driver of a Ray trainer (fed with the actors' :class:`~megatron_dynbatch.integrations.ray.shards.
ShardResult` timings). Its contract:

* **records** ``[group_size, lengths, seconds]`` (:mod:`..cost_fit`) of what ONE rank spent on a micro-batch,
  forward + backward, together with the *slice* that rank runs (:class:`SliceInfo`: the decoder layers on its
  pipeline stage, the TP size of its widths, whether its stage holds the LM head). Non-finite, non-positive or
  over-:data:`.records.MAX_RECORD_S` timings and malformed records are dropped (and counted), never fitted;
* a **bounded window**: the latest ``window`` records; the first ``skip_steps`` steps are not recorded (warm-up:
  allocator, autotuning);
* every ``interval`` steps :meth:`OnlineCalibration.end_step` **refits**: :func:`..cost_fit.fit_profile` over the
  window (one feature set per slice, so stages of different depth fit one per-layer profile), then once more
  without records the first fit misses by more than :data:`OUTLIER` (a GC pause, a straggling collective), and
  packs the result into a small vector (:func:`.shared.profile_vector`). Training micro-batches are all about the
  budget's size, so the window alone may not separate the per-micro-batch overhead from the per-token cost: the
  fit then adds a **prior** -- the calibration grid (:func:`.grid.build_grid` over the window's group sizes and sizes)
  timed by the model planning now, scaled to the window (the median ratio of measured to predicted seconds),
  together weighing :data:`PRIOR_WEIGHT` of the window -- which holds the shape of the terms the window does not
  determine (start from an offline ``calibrate`` file as ``base`` for the best prior). A window of
  :data:`MIN_ALONE` records or more is fitted alone first, the prior joining only when that is undetermined; a
  smaller one (a few steps of same-sized micro-batches, which pin the terms only by accident) always has the
  prior; where even that is undetermined, the refit is the current profile scaled by that ratio
  (:func:`.shared.scale_profile`);
* the vector goes through ``merge`` -- identity on one process; on a Megatron job a SUM all-reduce over every
  rank -- and the **shared model** is built from the merged vector only (:func:`.shared.merged_profile`: the mean
  over the ranks whose fit succeeded, per-layer seconds averaged, the CP-member terms over the ranks that timed CP
  shares).
  Every rank thus plans with a bit-identical :class:`~..cost_model.CostModel` (same vector, same arithmetic), and no
  rank's plan depends on records only it has seen;
* each refit is logged (:class:`RefitLog`: the fit error, the change in the predicted step time of the last
  step's plan under the previous and the refitted model, and the re-planned time when planning arguments are
  known) and kept in ``history``.

It never touches the math: a new model only changes how the next batches are grouped, and budgets are the
planner's hard limits whatever the model says.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from ..checks import as_int
from ..cost_fit import fit_profile, fit_report, point_features, predict_features, record_features_padded
from ..cost_model import CostModel
from ..cost_files import resolve_cost_model
from ..cost_profiles import CostProfile, resolve_profile
from ..errors import DynBatchConfigError
from ..parallel import ParallelConfig
from .records import SliceInfo, clean_records
from .report import fit_line
from .shared import merged_profile, profile_vector, scale_profile

if TYPE_CHECKING:
    from ..model_spec import ModelLike, ModelSpec
    from ..parallel import ParallelLike
    from ..planner.options import ResolvedOptions
    from ..planner.plan_kind import PlanKind
    from .compare import StepTimeChange

#: records the first fit misses by more than this (relative) are dropped before the final fit
OUTLIER = 1.0
DEFAULT_INTERVAL = 50
DEFAULT_WINDOW = 4096
#: the prior's records together weigh this share of the window's
PRIOR_WEIGHT = 0.1
#: a window is fitted alone only from this many records on (fewer: a few steps' same-sized micro-batches, which pin
#: the terms only by accident -- the prior holds them until the window has seen enough)
MIN_ALONE = 64


@dataclass
class RefitLog:
    """One refit: at ``step``, over ``records`` local records (``dropped`` refused or outliers); ``ranks_fitted``
    of ``ranks`` contributed; ``fit_error`` is the merged uncertainty (mean over ranks of each fit's mean absolute
    relative error); ``per_group`` the shared model's error on this rank's window; ``change`` the predicted step
    time of the last plan (:class:`~.compare.StepTimeChange`); ``profile`` the shared profile."""

    step: int
    refit: int
    records: int
    dropped: int
    ranks_fitted: int
    ranks: int
    fit_error: Optional[float]
    per_group: Dict[int, Dict[str, float]] = field(default_factory=dict)
    change: Any = None
    profile: Optional[Dict[str, Any]] = None

    def line(self) -> str:
        if self.profile is None:
            return (f"dynbatch calibration | step {self.step} | refit {self.refit} skipped: no rank has enough "
                    f"records yet ({self.records} here) | planning with the previous model")
        text = (f"dynbatch calibration | step {self.step} | refit {self.refit} | {self.records} records here "
                f"({self.dropped} dropped), {self.ranks_fitted}/{self.ranks} ranks fitted | fit error "
                f"{self.fit_error:.1%} ({fit_line({'per_group': self.per_group})})")
        if self.change is not None:
            text += " | " + self.change.describe("previous model", "refitted model")
        return text


class OnlineCalibration:
    """Online calibration state (module docstring). ``model``, ``parallel``: what the planner plans (the shared
    model is ``CostModel.from_model(model, parallel, profile=...)``); ``base``: the cost model before the first
    refit and the profile supplying what timings cannot tell (a profile name, a cost-model file with a profile,
    default ``"fitted"``); ``merge``: vector -> summed vector over all ranks (identity by default); ``log``: where
    refit lines go (``None``: nowhere)."""

    def __init__(self, model: ModelLike, parallel: ParallelLike = None, *, interval: Any = DEFAULT_INTERVAL,
                 window: Any = DEFAULT_WINDOW, skip_steps: Any = 1, base: Any = None, ranks: int = 1,
                 merge: Optional[Callable[[np.ndarray], np.ndarray]] = None,
                 log: Optional[Callable[[str], None]] = None) -> None:
        from ..model_spec import ModelSpec

        self.model = ModelSpec.from_any(model)
        self.parallel = ParallelConfig.from_any(parallel)
        self.interval = as_int(interval, "--dynbatch-calibration-interval", minimum=1, maximum=10 ** 9,
                               fix="pass a refit interval in optimizer steps, e.g. 50")
        self.window = as_int(window, "calibration window", minimum=16, maximum=10 ** 7,
                             fix="keep at least 16 recent records, e.g. 4096")
        self.skip_steps = as_int(skip_steps, "skip_steps", minimum=0, maximum=10 ** 9, fix="pass e.g. 1")
        self.base_profile = _shape_of(base)
        self._base_model = base if isinstance(base, CostModel) else None
        self._base_choice = base
        self.ranks = int(ranks)
        self.merge = merge or (lambda v: v)
        self.log = log
        self._window: Deque[Tuple[SliceInfo, List[Any]]] = deque(maxlen=self.window)
        self.steps = 0
        self.dropped = 0
        self.cost_model: Optional[CostModel] = None
        self._shared: Optional[CostProfile] = None
        self.history: List[RefitLog] = []

    # ------------------------------------------------------------------ recording
    @property
    def recording(self) -> bool:
        """Whether the current step's micro-batches are recorded (not during the first ``skip_steps``)."""
        return self.steps >= self.skip_steps

    def add(self, records: Any, slice_info: SliceInfo) -> int:
        """Add one step's records of one rank's slice; returns how many were kept."""
        if not isinstance(slice_info, SliceInfo):
            raise DynBatchConfigError("slice_info", type(slice_info).__name__, "must be a SliceInfo",
                                      "pass SliceInfo(measured_layers=..., tp=..., lm_head=...)")
        good, bad = clean_records(records)
        self.dropped += bad
        self._window.extend((slice_info, r) for r in good)
        return len(good)

    def add_timings(self, timings: Any) -> int:
        """Add what a rank recorded as ``{"slice": {"measured_layers", "tp", "lm_head"}, "records": [...]}`` (a Ray
        actor's ``ShardResult.timings``); ``None`` adds nothing. Returns how many records were kept."""
        if timings is None:
            return 0
        if not isinstance(timings, dict) or not isinstance(timings.get("slice"), dict):
            raise DynBatchConfigError("timings", type(timings).__name__, "is not {'slice': {...}, 'records': [...]}",
                                      "pass ShardResult.timings of train_on_shard(..., record_timings=True) unchanged")
        return self.add(timings.get("records", []), SliceInfo(**timings["slice"]))

    @classmethod
    def from_run_config(cls, run: Any, **kwargs: Any) -> "OnlineCalibration":
        """The online calibration a run preset asks for (``online_calibration``, ``calibration_interval``, its
        ``cost_model`` as the base); ``kwargs`` as for the constructor."""
        from ..run_config import RunConfig

        rc = RunConfig.from_any(run)
        if not rc.online_calibration:
            raise DynBatchConfigError("online_calibration", False, f"the run preset {rc.name!r} does not turn it on",
                                      "write online_calibration: true in the preset (or build OnlineCalibration "
                                      "yourself)")
        kwargs.setdefault("interval", rc.calibration_interval or DEFAULT_INTERVAL)
        kwargs.setdefault("base", rc.options.cost_model)
        return cls(rc.model_spec(), rc.parallel(), **kwargs)

    @property
    def num_records(self) -> int:
        return len(self._window)

    # ------------------------------------------------------------------ refitting
    def current(self) -> CostModel:
        """The model the planner uses now: the shared refit, else the base."""
        if self.cost_model is not None:
            return self.cost_model
        if self._base_model is None:
            self._base_model = resolve_cost_model(self._base_choice or "fitted", self.model, self.parallel,
                                                  field="--dynbatch-cost-model")
        return self._base_model

    def end_step(self, plan: Optional[PlanKind] = None, lengths: Any = None, options: Optional[ResolvedOptions] = None
                 ) -> Optional[RefitLog]:
        """Count a finished optimizer step; every ``interval`` recorded steps refit (on every rank at the same
        step: the merge is a collective). ``plan`` / ``lengths`` (the step's) give the log's step-time change,
        ``options`` (the ResolvedOptions it was planned with) its re-planned time."""
        self.steps += 1
        recorded = self.steps - self.skip_steps
        if recorded <= 0 or recorded % self.interval:
            return None
        return self.refit(plan, lengths, options)

    def local_fit(self) -> Tuple[Optional[CostProfile], bool, Dict[SliceInfo, Any]]:
        """This rank's fit of its window: (profile or None, whether CP shares were timed, features per slice)."""
        by_slice: Dict[SliceInfo, List[List[Any]]] = {}
        for sl, rec in self._window:
            by_slice.setdefault(sl, []).append(rec)
        feats = {}
        for sl, recs in by_slice.items():
            if len(recs) >= 3:
                feats[sl], padded = record_features_padded(self.model, recs, measured_layers=sl.measured_layers,
                                                           tp=sl.tp, lm_head=sl.lm_head,
                                                           peak_flops=self.base_profile.peak_flops)
                feats[sl]["padded"] = padded
        if not feats:
            return None, False, feats
        timed_cp = any((f["g"] > 1).any() for f in feats.values())
        current = self._shared or self.base_profile
        secs = np.concatenate([f["seconds"] for f in feats.values()])
        ratio = float(np.median(secs / np.concatenate([predict_features(current, f) for f in feats.values()])))
        prof = None
        attempts = [self._prior(feats, scale_profile(current, ratio))]
        if self.num_records >= MIN_ALONE:
            attempts.insert(0, [])  # a large window alone first
        for prior in attempts:
            try:
                prof = self._fit(feats, prior, current)
                break
            except DynBatchConfigError:  # undetermined: add the prior, then keep the current shape
                continue
        if prof is None:
            prof = scale_profile(current, ratio)
        pred = np.concatenate([predict_features(prof, f) for f in feats.values()])
        gs = np.concatenate([f["g"] for f in feats.values()])
        prof = prof.replace(uncertainty=min(1.0, fit_report(pred, secs, gs).uncertainty))  # on the window only
        return prof, timed_cp, feats

    def _fit(self, feats: Dict[SliceInfo, Dict[str, np.ndarray]], prior: List[Dict[str, np.ndarray]],
             current: CostProfile) -> CostProfile:
        """One fit of the window (plus ``prior``; with it, attention and linear may keep ``current``'s ratio),
        repeated without the records it misses by over :data:`OUTLIER`."""
        kw = dict(base=current, name="online", ratio_fallback=bool(prior))
        prof, _ = fit_profile(list(feats.values()) + prior, **kw)
        keep = {sl: np.abs(predict_features(prof, f) / f["seconds"] - 1.0) <= OUTLIER for sl, f in feats.items()}
        if not all(k.all() for k in keep.values()):
            trimmed = [{k: v[keep[sl]] for k, v in f.items()} for sl, f in feats.items() if keep[sl].sum()]
            prof, _ = fit_profile(trimmed + prior, **kw)
        return prof

    def _prior(self, feats: Dict[SliceInfo, Dict[str, np.ndarray]], prof: CostProfile) -> List[Dict[str, np.ndarray]]:
        """The prior's feature sets (module docstring): per slice, the grid over the window's group sizes up to its
        largest per-GPU share, timed by ``prof``, weighing :data:`PRIOR_WEIGHT` of the slice's records."""
        from .grid import build_grid

        out = []
        for sl, f in feats.items():
            sizes = sorted({int(g) for g in f["g"]})
            per_gpu = max(32, int(np.max(f["padded"] / f["g"])))
            grid = build_grid(per_gpu, sizes)
            pf = point_features(grid, self.model, measured_layers=sl.measured_layers, tp=sl.tp,
                                lm_head=sl.lm_head, peak_flops=self.base_profile.peak_flops)
            pf["seconds"] = predict_features(prof, pf)
            pf["weight"] = np.full(pf["g"].shape, PRIOR_WEIGHT * len(f["g"]) / len(grid))
            out.append(pf)
        return out

    def refit(self, plan: Optional[PlanKind] = None, lengths: Any = None, options: Optional[ResolvedOptions] = None
              ) -> RefitLog:
        """Refit now (module docstring); returns (and logs) the :class:`RefitLog`."""
        prof, timed_cp, feats = self.local_fit()
        summed = np.asarray(self.merge(profile_vector(prof, self.num_records, timed_cp)), dtype=np.float64)
        shared = merged_profile(summed, self.base_profile)
        entry = RefitLog(self.steps, len(self.history) + 1, self.num_records, self.dropped,
                         int(summed[0]) if summed.size else 0, self.ranks, None)
        if shared is not None:
            new = CostModel.from_model(self.model, self.parallel, profile=shared)
            entry.fit_error, entry.profile = shared.uncertainty, shared.to_dict()
            if feats:
                secs = np.concatenate([f["seconds"] for f in feats.values()])
                gs = np.concatenate([f["g"] for f in feats.values()])
                pred = np.concatenate([predict_features(shared, f) for f in feats.values()])
                entry.per_group = fit_report(pred, secs, gs).per_group
            if plan is not None and lengths is not None:
                entry.change = _change(plan, lengths, new, self.model, options)
            self.cost_model, self._shared = new, shared
        self.history.append(entry)
        if self.log is not None:
            self.log(entry.line())
        return entry


def _shape_of(base: Any) -> CostProfile:
    """The profile behind ``base``: a profile name or a file with a ``"profile"`` section; ``"fitted"`` for a
    ``CostModel`` or a coefficients-only file (they carry no per-layer terms to shape the prior with)."""
    if base is None or isinstance(base, CostModel):
        return resolve_profile("fitted")
    try:
        return resolve_profile(base, field="--dynbatch-cost-model")
    except DynBatchConfigError:
        if isinstance(base, str) and os.path.isfile(base):
            return resolve_profile("fitted")
        raise


def _change(plan: PlanKind, lengths: Any, new: CostModel, model: ModelSpec, options: Optional[ResolvedOptions]
            ) -> Optional[StepTimeChange]:
    from .compare import step_time_change

    budget = int(plan.max_tokens_per_gpu)
    try:
        return step_time_change(np.asarray(lengths), old_plan=plan, new=new, options=options, model=model,
                                max_tokens_per_gpu=budget)
    except DynBatchConfigError:  # a plan the scorer cannot rebuild (a trainer's own) -- the refit still stands
        return None


__all__ = ["OnlineCalibration", "RefitLog", "DEFAULT_INTERVAL", "DEFAULT_WINDOW", "MIN_ALONE", "PRIOR_WEIGHT"]
