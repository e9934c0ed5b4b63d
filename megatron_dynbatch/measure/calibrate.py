"""Offline calibration: time a calibration grid on a slice of the user's model and fit the cost model to it.

:func:`calibrate` is the Python API behind ``megatron-dynbatch calibrate``: :func:`~megatron_dynbatch.core.
calibration.setup.plan_calibration` validates the run and builds the grid; :func:`run_calibration` builds the slice
(:func:`~.slices.build_slice`: megatron-core ``GPTModel``, ``layers`` decoder layers at the per-TP-rank widths,
Transformer Engine's layer spec where TE is installed and every share is a whole micro-batch, else this package's
local THD spec), times the points in order (:meth:`~.slices.ModelSlice.time_records`: CUDA events on a GPU,
``perf_counter`` on a CPU, the minimum of ``repeats`` after ``warmup``), stops before a point that would finish
after ``max_seconds`` (its estimate scaled by measured / estimated so far), and fits the records with
:func:`~megatron_dynbatch.core.cost_fit.fit_records`. The result's ``cost_model`` is the fitted profile applied to
the model's layers on the layout; :meth:`CalibrationResult.save` writes the cost-model file every
``--cost-model`` / ``--dynbatch-cost-model`` / ``RunConfig.options`` reads.

What is measured: compute of one GPU (one TP rank's widths, one CP member's share) -- not the TP collectives, not
the CP ring's transfers, not the pipeline's p2p, not the optimizer. Those keep the base profile's numbers.

Memory (``setup.memory``, on by default on a GPU): after the timings, the peak memory of one forward + backward on
1- and 2-layer slices and a 1-layer slice with the LM head (:func:`~.memory.measure_memory`, read through the
memory-reader seam :mod:`megatron_dynbatch.megatron.memory_reader`: a ``CudaPeakReader``, or the ``memory_reader``
given -- a ``FakeMemoryReader`` in CPU tests) is fitted by
:func:`~megatron_dynbatch.core.memory.fit.fit_memory_records`; the result's ``memory_fit`` profile is the file's
``memory`` section. It is skipped, with a note, when ``max_seconds`` would be passed.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..core.calibration.timebox import STARTUP_S, point_seconds, projected_finish, projected_total
from ..core.calibration.grid import MIN_POINTS
from ..core.calibration.setup import CalibrationSetup, plan_calibration
from ..core.checks import read_json
from ..core.cost_files import fitted_for, save_cost_model
from ..core.cost_fit import FitReport, fit_records
from ..core.cost_model import CostModel
from ..core.errors import DynBatchConfigError
from ..core.memory.fit import MemoryFit, fit_memory_records
from .layout import SliceLayout
from .slices import Record, build_slice

#: progress callback: (points timed, points planned, seconds elapsed, the run's projected length in seconds:
#: :func:`~megatron_dynbatch.core.calibration.timebox.projected_total`)
Progress = Callable[[int, int, float, float], None]


@dataclass
class CalibrationResult:
    """A calibration run: its setup, the records timed, the fitted cost model and fit report, the slice's
    environment, the layer spec used (and why, ``spec_note``), whether ``max_seconds`` stopped it early."""

    setup: CalibrationSetup
    records: List[Record]
    cost_model: CostModel
    report: FitReport
    environment: Dict[str, Any] = field(default_factory=dict)
    spec: str = "local"
    spec_note: str = ""
    stopped_early: bool = False
    wall_s: float = 0.0
    memory_records: List[Dict[str, Any]] = field(default_factory=list)
    memory_fit: Optional[MemoryFit] = None
    memory_note: str = ""

    def save(self, path: str) -> None:
        """The cost-model file (:func:`~megatron_dynbatch.core.cost_files.save_cost_model`: coefficients, fit
        report, transferable profile, and the memory section when memory was measured)."""
        save_cost_model(self.cost_model, path, self.report,
                        memory=self.memory_fit.profile.to_dict() if self.memory_fit is not None else None)

    def records_json(self) -> Dict[str, Any]:
        """The records with what they were measured on -- ``calibrate --from-records`` refits from this."""
        s = self.setup
        out = {"environment": self.environment, "spec": self.spec,
               "slice": {"model": s.model.to_dict(), "measured_layers": s.layers, "tp": s.tp, "lm_head": s.lm_head},
               "records": self.records}
        if self.memory_records:
            out["memory_records"] = self.memory_records
        return out


def te_available() -> bool:
    """Whether Transformer Engine imports (it is installed and works: on a CPU machine its import raises)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False
    return True


def resolve_spec(setup: CalibrationSetup) -> Tuple[str, str]:
    """The layer spec to time with, and a note saying why (``--spec auto``: TE where installed on a GPU and every
    share is a whole micro-batch, else local)."""
    if setup.spec != "auto":
        return setup.spec, f"--spec {setup.spec}"
    if setup.device == "cpu":
        return "local", "local THD spec (CPU)"
    if not te_available():
        return "local", "local THD spec (Transformer Engine is not installed)"
    if any(p.group_size > 1 for p in setup.points):
        return "local", ("local THD spec: Transformer Engine cannot time a CP share on one GPU; for TE's kernels "
                         "calibrate --group-sizes 1 --spec te")
    return "te", "Transformer Engine spec"


def run_calibration(setup: CalibrationSetup, *, progress: Optional[Progress] = None, seed: int = 1234,
                    memory_reader: Any = None) -> CalibrationResult:
    """Time ``setup``'s grid and fit it; measure and fit memory when ``setup.memory`` or a ``memory_reader`` is
    given (module docstring)."""
    t0 = time.perf_counter()
    spec, note = resolve_spec(setup)
    layout = SliceLayout(num_layers=setup.layers, tp=setup.tp, dtype=setup.dtype, device=setup.device, kind="mcore",
                         vocab_size=setup.vocab_per_tp_rank, seed=seed, spec=spec)
    sl = build_slice(setup.model, layout)
    est = point_seconds(setup.points, setup.model, measured_layers=setup.layers, tp=setup.tp, lm_head=setup.lm_head,
                        device=setup.device, base=setup.base, warmup=setup.warmup, repeats=setup.repeats)
    records: List[Record] = []
    cache: Dict[Any, float] = {}
    done_est = done_meas = 0.0
    stopped = False
    for i, (point, e) in enumerate(zip(setup.points, est, strict=True)):
        elapsed = time.perf_counter() - t0
        if setup.max_seconds is not None and \
                projected_finish(elapsed, done_est, done_meas, float(e)) > setup.max_seconds:
            stopped = True
            break
        if progress is not None:
            left = sum(float(x) for x in est[i:])
            progress(i, len(setup.points), elapsed, projected_total(elapsed, done_est, done_meas, left))
        start = time.perf_counter()
        records += sl.time_records([point.item()], warmup=setup.warmup, repeats=setup.repeats, cache=cache)
        done_meas += time.perf_counter() - start
        done_est += float(e)
    if len(records) < MIN_POINTS:
        raise DynBatchConfigError("--max-seconds", setup.max_seconds, f"only {len(records)} micro-batches were timed "
                                  f"before the limit, fewer than the {MIN_POINTS} a fit needs",
                                  f"raise --max-seconds (start-up alone is ~{STARTUP_S:.0f} s) or shrink the grid")
    env = sl.environment()
    del sl
    cm, report = fit_setup(setup, records, name=f"calibrated on {env['device']}")
    report = _with_fitted_for(report, setup, setup.model, env.get("device", setup.device))
    result = CalibrationResult(setup, records, cm, report, env, spec, note, stopped)
    if setup.memory or memory_reader is not None:
        elapsed = time.perf_counter() - t0
        if setup.max_seconds is not None and elapsed + setup.memory_estimate_s > setup.max_seconds:
            result.memory_note = (f"memory not measured: its ~{setup.memory_estimate_s:.0f} s would pass "
                                  f"--max-seconds {setup.max_seconds:g}")
        else:
            from .memory import measure_memory

            result.memory_records, _ = measure_memory(setup.model, tp=setup.tp, dtype=setup.dtype,
                                                      device=setup.device, spec=spec, seed=seed, reader=memory_reader,
                                                      max_tokens_per_gpu=setup.max_tokens_per_gpu)
            result.memory_fit = fit_memory(setup, result.memory_records, env)
    result.wall_s = time.perf_counter() - t0
    return result


def fit_memory(setup: CalibrationSetup, records: List[Dict[str, Any]], env: Dict[str, Any]) -> MemoryFit:
    """The memory fit of ``records`` for ``setup``'s model on its layout, with what it was measured on."""
    return fit_memory_records(records, setup.model, setup.parallel,
                              fitted_on={"device": env.get("device"), "dtype": setup.dtype,
                                         "torch": env.get("torch"), "megatron_core": env.get("megatron_core")})


def fit_setup(setup: CalibrationSetup, records: List[Record], *, slice_model: Any = None, slice_layers: Any = None,
              slice_tp: Any = None, slice_lm_head: Any = None, name: str = "calibrated") -> Tuple[CostModel, FitReport]:
    """Fit records measured on a slice (default: ``setup``'s own) and apply the profile to ``setup.model`` on
    ``setup.parallel``."""
    model = setup.model if slice_model is None else slice_model
    cm, report = fit_records(records, model, measured_layers=setup.layers if slice_layers is None else slice_layers,
                             tp=setup.tp if slice_tp is None else slice_tp,
                             lm_head=setup.lm_head if slice_lm_head is None else slice_lm_head,
                             parallel=setup.parallel, base=setup.base, name=name)
    if slice_model is None:  # fit_records built it for setup.model on setup.parallel already
        return cm, report
    return CostModel.from_model(setup.model, setup.parallel, profile=_profile(report)), report


def _with_fitted_for(report: FitReport, setup: CalibrationSetup, measured: Any, device: str,
                     timed_on: Any = None) -> FitReport:
    """``report`` with what it was fitted on (:func:`~megatron_dynbatch.core.cost_files.fitted_for`; ``timed_on``:
    the torch device of the timings, default ``setup``'s): the file records it, and using the file for another
    model warns or is refused (docs/cost_model.md)."""
    kind = "cpu" if str(setup.device if timed_on is None else timed_on) == "cpu" else "cuda"
    return replace(report, fitted_for=fitted_for(measured, device=str(device), device_type=kind, dtype=setup.dtype,
                                                 tp=setup.tp))


def _profile(report: FitReport) -> Any:
    from ..core.cost_profiles import CostProfile

    return CostProfile.from_dict(report.profile)


def refit_from_file(setup: CalibrationSetup, path: str) -> Tuple[CostModel, FitReport, Dict[str, Any]]:
    """Fit the records a previous run saved (:meth:`CalibrationResult.records_json`) for ``setup``'s model and
    layout: the slice they were measured on comes from the file."""
    data = read_json(path, field="--from-records", fix="pass a file written by calibrate --records")
    if not isinstance(data, dict) or not isinstance(data.get("slice"), dict) or "records" not in data:
        raise DynBatchConfigError("--from-records", path, "is not a calibrate records file (no 'slice' and "
                                  "'records')", "pass a file written by calibrate --records")
    sl = data["slice"]
    env = data.get("environment") if isinstance(data.get("environment"), dict) else {}
    device = env.get("device", "recorded timings")
    timed_on = env.get("layout", {}).get("device") if isinstance(env.get("layout"), dict) else None
    cm, report = fit_setup(setup, data["records"], slice_model=sl.get("model"), slice_layers=sl.get("measured_layers"),
                           slice_tp=sl.get("tp", 1), slice_lm_head=sl.get("lm_head", False),
                           name=f"calibrated on {device}")
    return cm, _with_fitted_for(report, setup, sl.get("model") or setup.model, device, timed_on), data


def refit_memory_from_data(setup: CalibrationSetup, data: Dict[str, Any]) -> Optional[MemoryFit]:
    """The memory fit of a records file's ``memory_records`` (``None`` without them). They fit only the model and
    TP width they were measured on: another model or width is refused."""
    recs = data.get("memory_records") if isinstance(data, dict) else None
    if not recs:
        return None
    sl = data.get("slice") or {}
    from ..core.model_spec import ModelSpec

    if sl.get("model") is not None and ModelSpec.from_any(sl["model"]) != setup.model or sl.get("tp", 1) != setup.tp:
        raise DynBatchConfigError("--from-records", "memory_records", "were measured on another model or tp width "
                                  "than this calibration's", "refit them with the model and --tp they were measured "
                                  "with, or calibrate memory again")
    return fit_memory(setup, recs, data.get("environment") or {})


def calibrate(model: Any, *, progress: Optional[Progress] = None, seed: int = 1234, memory_reader: Any = None,
              **options: Any) -> CalibrationResult:
    """Calibrate the cost model on this machine: ``model`` as ``ModelSpec.from_any`` takes it (a preset name, a
    YAML/JSON file, Megatron's parsed args), ``options`` those of :func:`~megatron_dynbatch.core.calibration.setup.
    plan_calibration` (``parallel``, ``max_tokens_per_gpu``, ``device``, ``layers``, ``dtype``, ``spec``,
    ``lm_head``, ``dynamic_cp``, ``group_sizes``, ``tokens``, ``seqs``, ``warmup``, ``repeats``,
    ``max_seconds``, ``base``, ``memory``). ``result.save(path)`` writes the cost-model file."""
    if "parallel" not in options and hasattr(model, "tensor_model_parallel_size"):  # Megatron args: their layout
        from ..megatron.args import parallel_from_args

        options["parallel"] = parallel_from_args(model)
    return run_calibration(plan_calibration(model, **options), progress=progress, seed=seed,
                           memory_reader=memory_reader)


__all__ = ["CalibrationResult", "calibrate", "run_calibration", "fit_setup", "fit_memory", "refit_from_file",
           "refit_memory_from_data", "resolve_spec", "te_available"]
