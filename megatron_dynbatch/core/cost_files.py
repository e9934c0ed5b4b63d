"""Cost-model files and choices: what a ``cost_model=`` option names, resolved to a :class:`~.cost_model.CostModel`.

* :func:`resolve_cost_model` -- the planner's one resolution of a choice: a ``CostModel``, a profile name
  (:data:`~.cost_profiles.PROFILES`) or a cost-model JSON file (its transferable ``"profile"`` section applied to the
  model, else its coefficients);
* :func:`save_cost_model` / :func:`load_cost_model` -- the JSON file ``calibrate`` writes (coefficients, the fit
  report, the transferable profile, the fitted ``memory`` section), every key checked on reading;
* :func:`fitted_for` / :func:`check_fitted_for` -- a file's provenance (the model widths and device it was timed on)
  and the warning or refusal when it is used for another model (``docs/cost_model.md``, "A file fitted for
  another model").

The time model itself is :mod:`.cost_model`; fitting measured timings is :mod:`.cost_fit`. Pure Python; no torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

from .checks import read_json
from .cost_fit import FitReport
from .cost_model import FILE_KEYS, CostModel, CostModelLike
from .cost_profiles import PROFILES, CostProfile, is_cost_model_choice
from .errors import DynBatchConfigError
from .parallel import ParallelConfig

if TYPE_CHECKING:
    from .model_spec import ModelLike


def check_cost_model_choice(choice: CostModelLike, has_model: bool, *, field: str = "cost_model") -> None:
    """What can be said of a cost-model choice without reading anything: its kind (``None``, a profile name, a
    file path, a ``CostModel``) and a profile's need of the model's shape (whether a file reads is
    :func:`resolve_cost_model`'s question)."""
    if choice is None or isinstance(choice, CostModel):
        return
    if not isinstance(choice, (str, os.PathLike)):
        raise DynBatchConfigError(field, type(choice).__name__, "must be a CostModel, a profile name or a file path",
                                  f"use one of {sorted(PROFILES)}, a cost-model JSON file, "
                                  "or CostModel.from_model(...)")
    if str(choice) in PROFILES and not has_model:
        raise DynBatchConfigError(field, str(choice), "a cost profile needs the model's shape",
                                  "pass model=... (a preset name, dict or ModelSpec), or a coefficient file")


def resolve_cost_model(choice: CostModelLike, model: Optional[ModelLike], parallel: ParallelConfig, *,
                       field: str = "cost_model") -> CostModel:
    """The cost model a planner call uses: a :class:`CostModel` (placed on ``parallel``), a profile name
    (:data:`~.cost_profiles.PROFILES`: ``"fitted"``, ``"analytic"``) or a cost-model JSON file -- its
    ``"profile"`` section applied to ``model`` when both are there (it transfers to this layout), else its
    coefficients; ``None``: the default profile, or 1 us per token without a model."""
    if isinstance(choice, CostModel):
        return choice.with_layout(parallel)
    if choice is None:
        return CostModel.from_model(model, parallel) if model is not None else CostModel.tokens_only(parallel)
    check_cost_model_choice(choice, model is not None, field=field)
    key = str(choice)
    if key in PROFILES:
        return CostModel.from_model(model, parallel, profile=key)
    # a file is parsed once: its "profile" section applies to the model when both are there, else its coefficients
    data = unreadable = None
    if model is not None or os.path.isfile(key):
        try:
            data = _read_json(key)
        except (OSError, ValueError) as exc:
            unreadable = exc
    if model is not None and isinstance(data, dict) and "profile" in data:
        from .model_spec import ModelSpec

        spec = ModelSpec.from_any(model)  # the model is checked before the profile, as from_model(profile=key) does
        profile = CostProfile.from_dict(data["profile"], where=f"{key}: profile")
        check_fitted_for(data, spec, key, field=field, transfers=True)
        return CostModel.from_model(spec, parallel, profile=profile)
    if not is_cost_model_choice(key):  # not a profile name here, so: not a file
        raise DynBatchConfigError(field, key, "is neither a cost profile nor a file",
                                  f"use one of {sorted(PROFILES)} or the path of a cost-model JSON file")
    if unreadable is not None:
        raise _unreadable_cost_file(key, unreadable) from None
    cm = _cost_model_from_file_data(key, data)
    if model is not None:
        check_fitted_for(data, model, key, field=field, transfers=False)
    return cm.with_layout(parallel)


class CostModelMismatchWarning(UserWarning):
    """A cost-model file is used for a model other than the one it was fitted for (:func:`check_fitted_for`)."""


#: the model fields that set the shapes of a layer's kernels: what a calibration measured, and what a file's
#: ``fitted_for`` is compared on (layer count and vocabulary do not change a per-layer profile)
WIDTH_FIELDS = ("hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size", "swiglu",
                "num_experts", "moe_ffn_hidden_size", "multi_latent_attention")


def fitted_for(model: ModelLike, *, device: str, device_type: str, dtype: str, tp: int) -> Dict[str, Any]:
    """What a calibrated cost-model file records it was fitted on (its ``"fit": {"fitted_for": ...}``): the model
    timed (name and :data:`WIDTH_FIELDS`), its tensor-parallel widths, the device (its name and ``"cpu"`` /
    ``"cuda"``) and the dtype."""
    from .model_spec import ModelSpec

    spec = ModelSpec.from_any(model)
    return {"model": spec.name or "custom", "widths": {k: getattr(spec, k) for k in WIDTH_FIELDS}, "tp": int(tp),
            "device": str(device), "device_type": str(device_type), "dtype": str(dtype)}


def _describe_widths(name: str, w: Mapping[str, Any]) -> str:
    moe = f", {w['num_experts']} experts" if w.get("num_experts") else ""
    return (f"{name} (hidden {w.get('hidden_size')}, {w.get('num_attention_heads')} heads, FFN "
            f"{w.get('ffn_hidden_size')}{moe})")


def check_fitted_for(data: Any, model: ModelLike, path: Any, *, field: str = "cost_model", transfers: bool) -> None:
    """Check a cost-model file's ``fitted_for`` record (:func:`fitted_for`) against the ``model`` it is about to
    be used for. Same widths, or no record (a hand-written or older file): nothing. Other widths: when the file's
    ``"profile"`` is applied (``transfers``) a :class:`CostModelMismatchWarning` naming what it was fitted for
    and on which device -- a profile transfers by design (``bench --cost-model`` applies one to every
    workload's model), but the efficiencies of one model's kernels on one device are only a guess for other
    widths, and a CPU-fitted one predicts CPU speed; when only its coefficients would be used (no profile: they
    are per-token seconds of the model it was fitted for, nothing of them transfers) a ``DynBatchConfigError``.
    ``docs/cost_model.md`` ("A file fitted for another model") says the same."""
    import warnings

    from .model_spec import ModelSpec

    fit = data.get("fit") if isinstance(data, Mapping) else None
    record = fit.get("fitted_for") if isinstance(fit, Mapping) else None
    if not isinstance(record, Mapping) or not isinstance(record.get("widths"), Mapping):
        return
    spec = ModelSpec.from_any(model)
    mine = {k: getattr(spec, k) for k in WIDTH_FIELDS}
    theirs = dict(record["widths"])
    if all(theirs.get(k) == v for k, v in mine.items()):
        return
    was = _describe_widths(str(record.get("model", "custom")), theirs)
    now = _describe_widths(spec.name or "this model", mine)
    device = str(record.get("device", "an unrecorded device"))
    fix = (f"calibrate {spec.name or 'this model'} on the device you train on (megatron-dynbatch calibrate --model "
           f"{spec.name or 'FILE'} ...), or plan {record.get('model', 'the model it was fitted for')} with it")
    if not transfers:
        raise DynBatchConfigError(field, str(path), f"holds the per-token seconds of {was}, timed on {device}; "
                                  f"they do not apply to {now} (the file has no 'profile' section to transfer)", fix)
    guess = ("it predicts the speed of a CPU" if record.get("device_type") == "cpu"
             else "its step times are only a guess for other widths")
    warnings.warn(f"{field}={str(path)!r} was fitted for {was} on {device}, not for {now}: {guess}. "
                  f"Fix: {fix}", CostModelMismatchWarning, stacklevel=3)


def _read_json(path) -> Any:
    """The JSON value in ``path`` (``OSError`` / ``ValueError`` when it cannot be read as JSON)."""
    import json

    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def save_cost_model(model: CostModel, path, report: Optional[FitReport] = None,
                    profile: Optional[CostProfile] = None, memory: Optional[Dict[str, Any]] = None) -> None:
    """Write the per-micro-batch coefficients as JSON (the layout is not stored), with the fit report and the
    transferable profile when given (``profile``, else the report's): ``CostModel.from_model(model, parallel,
    profile=path)`` rebuilds the model for another model or layout from that section. ``memory``: a fitted
    memory profile (``MemoryProfile.to_dict()``, :mod:`.memory`), read back by ``load_memory_profile(path)``."""
    import json

    d = {k: v for k, v in model.to_dict().items() if k in FILE_KEYS and v is not None}
    prof = profile.to_dict() if profile is not None else (report.profile if report is not None else None)
    if prof is not None:
        d["profile"] = prof
    if report is not None:
        d["fit"] = report.to_dict()
    if memory is not None:
        d["memory"] = dict(memory)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(d, fh, indent=2)


def load_cost_model(path) -> CostModel:
    """Read a cost-model JSON file written by :func:`save_cost_model` (or by hand). Required: the three
    per-micro-batch numbers; optional: :data:`FILE_KEYS` (older files without them load with the old meaning:
    no floor, no CP-member terms, one network), ``"fit"``, ``"profile"``, ``"memory"`` (checked here, read by
    ``core.memory.load_memory_profile``) and keys starting with ``_``."""
    d = read_json(path, field="--dynbatch-cost-model",
                  fix="pass a file written by save_cost_model / the calibration script")
    return _cost_model_from_file_data(path, d)


def _unreadable_cost_file(path, exc: Exception) -> DynBatchConfigError:
    return DynBatchConfigError("--dynbatch-cost-model", str(path), f"cannot be read as JSON ({exc})",
                               "pass a file written by save_cost_model / the calibration script")


def _cost_model_from_file_data(path, d: Any) -> CostModel:
    """:func:`load_cost_model` of the JSON value ``d`` already read from ``path``."""
    flag = "--dynbatch-cost-model"
    if not isinstance(d, dict):
        raise DynBatchConfigError(flag, str(path), "is not a JSON object", "write an object of cost-model keys")
    keys = ("linear_s_per_token", "attention_s_per_sq_token", "overhead_s")
    missing = [k for k in keys if k not in d]
    if missing:
        raise DynBatchConfigError(flag, str(path), f"is missing {missing}",
                                  f"write the keys {list(keys)} "
                                  "(seconds per token, per squared token, per micro-batch)")
    sections = ("fit", "profile", "memory")
    unknown = sorted(k for k in d if k not in FILE_KEYS + sections and not str(k).startswith("_"))
    if unknown:
        raise DynBatchConfigError(flag, str(path), f"has unknown key {unknown[0]!r}",
                                  f"use only {list(FILE_KEYS)} (plus \"fit\", \"profile\", \"memory\", or keys "
                                  "starting with _)")
    values = {}
    for k in FILE_KEYS:
        if d.get(k) is None:
            continue
        v = d[k]
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise DynBatchConfigError(flag, str(path), f"{k} is {v!r}", f"write a number for {k}")
        values[k] = float(v)
    if d.get("profile") is not None:
        CostProfile.from_dict(d["profile"], where=f"{path}: profile")  # refused now, not at first use
    if d.get("memory") is not None:
        from .memory.profile import MemoryProfile

        MemoryProfile.from_dict(d["memory"], where=f"{path}: memory")  # likewise
    try:
        return CostModel(**values)
    except DynBatchConfigError as exc:
        raise DynBatchConfigError(flag, str(path), f"{exc.field} is {exc.value!r}: {exc.problem}", exc.fix) from None
