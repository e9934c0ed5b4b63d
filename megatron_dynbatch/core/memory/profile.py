"""The per-token coefficients a peak prediction multiplies: :class:`MemoryProfile`, analytic or fitted.

A profile is for ONE model at ONE tensor-parallel width (its numbers are bytes on one GPU). Fields, bytes per
token of one micro-batch on one GPU unless said:

==========================  =====================================================================================
``layer_bytes``             what one decoder layer keeps for backward (no recompute; selective counts the same)
``layer_peak_bytes``        one layer while it runs its backward / is recomputed (full recompute's transient; a
                            forward-only pass's working set)
``layer_input_bytes``       what full recompute keeps per layer (its input)
``backward_extra_bytes``    once per micro-batch on top of the kept activations while a layer runs backward
``head_bytes``              LM head + loss at the training peak (bf16 logits + ONE fp32 copy, final-norm input)
``head_forward_bytes``      the same in a forward-only (log-prob) pass
``fp32_copy_bytes``         one more fp32 copy of the logits (``settings.logits_fp32_copies`` - 1 of them)
``mtp_layer_bytes``         the multi-token-prediction layers on the last stage
``workspace_bytes``         bytes per micro-batch, whatever its size (kernel workspaces, small buffers)
``dropout_bytes``           of ``layer_bytes``: the hidden-dropout masks (analytic only; shown in the breakdown)
``qk_norm_bytes``           of ``layer_bytes``: the QK-layernorm inputs (analytic only)
``routed_bytes``            of ``layer_bytes``: the routed experts' activations, ``etp / tp`` of the copies
==========================  =====================================================================================

:meth:`MemoryProfile.analytic` computes them from the shape (:mod:`.analytic`; ``workspace_bytes`` 0 -- the
reserve covers workspaces; ``backward_extra_bytes`` the backward's transient -- the gradients alive beside the
kept activations while the largest layer runs backward -- and ``layer_peak_bytes`` the largest layer plus it).
A *fitted* profile (``megatron-dynbatch calibrate``, :mod:`.fit`) replaces the
measured ones -- ``layer_bytes``, ``backward_extra_bytes``, ``head_bytes``, ``workspace_bytes`` and
``layer_peak_bytes = layer + backward_extra``; ``head_forward_bytes`` stays analytic but never above the measured
training head -- and records what it was fitted on (``fitted_on``: model, tensor parallelism, slice layers,
device, dtype, date, fit error). It lives in the ``memory`` section of the
cost-model file (:func:`load_memory_profile`, :func:`resolve_memory_profile`).

A profile states what it is for (``model_key``, ``tp``, ``sequence_parallel``; for analytic ones also the
expert tensor-parallel size and MoE imbalance); :meth:`MemoryProfile.check_applies` refuses it for another model
or width, so a calibrated number never silently prices the wrong model. Pure Python.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

from ..checks import read_json
from ..cost_profiles import PROFILES
from ..errors import DynBatchConfigError
from ..model_spec import ModelLike, ModelSpec
from ..parallel import ParallelConfig
from .analytic import analytic_bytes
from .settings import MemorySettings, MemorySettingsLike

if TYPE_CHECKING:
    from ..parallel import ParallelLike

SOURCES = ("analytic", "fitted")
#: the numeric fields (bytes), each finite and in [0, MAX_BYTES]
BYTE_FIELDS = ("layer_bytes", "layer_peak_bytes", "layer_input_bytes", "backward_extra_bytes", "head_bytes",
               "head_forward_bytes", "fp32_copy_bytes", "mtp_layer_bytes", "workspace_bytes", "dropout_bytes",
               "qk_norm_bytes", "routed_bytes")
MAX_BYTES = 2.0 ** 50


def model_key(model: ModelLike) -> str:
    """A short identity of a model's shape: name, layers, hidden size, vocabulary."""
    m = ModelSpec.from_any(model)
    return f"{m.name or 'custom'}:L{m.num_layers}:h{m.hidden_size}:v{m.padded_vocab_size}"


@dataclass(frozen=True)
class MemoryProfile:
    """Per-token coefficients of one model at one TP width (module docstring)."""

    layer_bytes: float
    layer_peak_bytes: float
    layer_input_bytes: float
    head_bytes: float
    head_forward_bytes: float
    fp32_copy_bytes: float
    model_key: str
    tp: int
    backward_extra_bytes: float = 0.0
    mtp_layer_bytes: float = 0.0
    workspace_bytes: float = 0.0
    dropout_bytes: float = 0.0
    qk_norm_bytes: float = 0.0
    routed_bytes: float = 0.0
    sequence_parallel: bool = False
    source: str = "analytic"
    expert_tensor_parallel_size: Optional[int] = None
    moe_imbalance: Optional[float] = None
    fitted_on: Optional[Dict[str, Any]] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in BYTE_FIELDS:
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
            if not ok or not 0.0 <= float(v) <= MAX_BYTES:
                raise DynBatchConfigError(f"memory.{name}", v, f"must be a finite number of bytes in [0, "
                                          f"{MAX_BYTES:g}]", "recalibrate, or use the analytic memory model")
            object.__setattr__(self, name, float(v))
        if self.source not in SOURCES:
            raise DynBatchConfigError("memory.source", self.source, "is not a profile source", f"use one of {SOURCES}")
        if not isinstance(self.model_key, str) or not self.model_key:
            raise DynBatchConfigError("memory.model_key", self.model_key, "must name the model",
                                      "build the profile with MemoryProfile.analytic(model, ...)")
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise DynBatchConfigError("memory.tp", self.tp, "must be an integer >= 1", "give the TP size it is for")

    # ---------------------------------------------------------------------------------------------- builders
    @classmethod
    def analytic(cls, model: ModelLike, parallel: ParallelLike = None, settings: MemorySettingsLike = None
                 ) -> "MemoryProfile":
        """The shape-derived profile (:mod:`.analytic`) of ``model`` on ``parallel`` under ``settings``."""
        m = ModelSpec.from_any(model)
        p = ParallelConfig.from_any(parallel)
        st = MemorySettings.from_any(settings)
        etp = st.expert_tensor_parallel_size or p.tp
        b = analytic_bytes(m, p, etp, st.moe_imbalance)
        return cls(layer_bytes=b["layer"], layer_peak_bytes=b["layer_peak"], layer_input_bytes=b["layer_input"],
                   backward_extra_bytes=b["transient"], head_bytes=b["head"], head_forward_bytes=b["head"],
                   fp32_copy_bytes=b["fp32_copy"], mtp_layer_bytes=b["mtp_layers"], dropout_bytes=b["dropout"],
                   qk_norm_bytes=b["qk_norm"], routed_bytes=b["routed"], model_key=model_key(m), tp=p.tp,
                   sequence_parallel=p.sequence_parallel, source="analytic", expert_tensor_parallel_size=etp,
                   moe_imbalance=st.moe_imbalance)

    @classmethod
    def fitted(cls, model: ModelLike, parallel: ParallelLike, coefficients: Mapping[str, float],
               fitted_on: Mapping[str, Any]) -> "MemoryProfile":
        """The analytic profile with the measured ``coefficients`` (``layer``, ``backward_extra``, ``head``,
        ``workspace``: bytes per token, the last per micro-batch) put in, and what they were fitted on. The
        sequence-parallel flag is cleared: a slice measures without it, which over-counts (safely) under it."""
        par = ParallelConfig.from_any(parallel)
        base = cls.analytic(model, ParallelConfig(**{**par.to_dict(), "sequence_parallel": False}))
        a, c = float(coefficients["layer"]), float(coefficients["backward_extra"])
        head = float(coefficients["head"])
        return replace(base, layer_bytes=a, backward_extra_bytes=c, layer_peak_bytes=a + c, head_bytes=head,
                       head_forward_bytes=min(base.head_forward_bytes, head),
                       workspace_bytes=float(coefficients["workspace"]), dropout_bytes=0.0, qk_norm_bytes=0.0,
                       routed_bytes=0.0, source="fitted", expert_tensor_parallel_size=None, moe_imbalance=None,
                       fitted_on=dict(fitted_on))

    # ---------------------------------------------------------------------------------------------- checks
    def check_applies(self, model: ModelLike, parallel: ParallelConfig, settings: MemorySettings) -> None:
        """Refuse this profile for another model or TP width (or, analytic, other MoE settings)."""
        key = model_key(model)
        where = "the calibration file's memory section" if self.source == "fitted" else "the memory profile"
        fix = ("calibrate this model on this layout (megatron-dynbatch calibrate), or leave the memory profile "
               "out to use the analytic one")
        if key != self.model_key:
            raise DynBatchConfigError("memory.model_key", self.model_key, f"{where} is for another model "
                                      f"(this is {key})", fix)
        if parallel.tp != self.tp:
            raise DynBatchConfigError("memory.tp", self.tp, f"{where} is for tp={self.tp}, the layout has "
                                      f"tp={parallel.tp}", fix)
        if self.source == "analytic":
            etp = settings.expert_tensor_parallel_size or parallel.tp
            mine = (self.sequence_parallel, self.expert_tensor_parallel_size, self.moe_imbalance)
            theirs = (parallel.sequence_parallel, etp, settings.moe_imbalance)
            if mine != theirs:
                raise DynBatchConfigError("memory", mine, "the analytic profile was built for other sequence-"
                                          f"parallel / ETP / MoE-imbalance settings than these {theirs}",
                                          "build it with MemoryProfile.analytic(model, parallel, settings)")

    # ---------------------------------------------------------------------------------------------- I/O
    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        return {k: v for k, v in d.items() if v is not None}

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "memory") -> "MemoryProfile":
        if not isinstance(data, Mapping):
            raise DynBatchConfigError(where, type(data).__name__, "is not a JSON object",
                                      "write the memory section with MemoryProfile.to_dict()")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise DynBatchConfigError(where, unknown[0], "is not a memory-profile field",
                                      f"use only {', '.join(sorted(known))}")
        missing = [f.name for f in fields(cls) if f.name in BYTE_FIELDS[:6] + ("model_key", "tp")
                   and f.name not in data]
        if missing:
            raise DynBatchConfigError(where, missing[0], "is missing", "write the section with MemoryProfile.to_dict()")
        try:
            return cls(**dict(data))
        except DynBatchConfigError as exc:
            raise DynBatchConfigError(f"{where}: {exc.field}", exc.value, exc.problem, exc.fix) from None
        except TypeError as exc:
            raise DynBatchConfigError(where, str(exc), "cannot be read",
                                      "write it with MemoryProfile.to_dict()") from None


def load_memory_profile(source: Any) -> Optional[MemoryProfile]:
    """The ``memory`` section of a cost-model file (a path, or the file's parsed JSON object); ``None`` when
    the file has none (an older file, or a calibration without memory)."""
    if isinstance(source, (str, os.PathLike)):
        path = str(source)
        data = read_json(path, field="--cost-model", fix="pass a file written by megatron-dynbatch calibrate")
    else:
        path, data = "cost model", source
    if not isinstance(data, Mapping):
        raise DynBatchConfigError("--cost-model", path, "is not a JSON object", "pass a cost-model file")
    if data.get("memory") is None:
        return None
    return MemoryProfile.from_dict(data["memory"], where=f"{path}: memory")


def resolve_memory_profile(choice: Any, model: ModelLike, parallel: ParallelLike = None,
                           settings: MemorySettingsLike = None) -> MemoryProfile:
    """The profile a prediction uses: ``None`` or a cost-profile name (``"fitted"``, ``"analytic"``) -> analytic;
    a :class:`MemoryProfile`; a cost-model file (or its parsed JSON) -> its ``memory`` section (analytic when it has
    none). Checked against the model and TP width."""
    p = ParallelConfig.from_any(parallel)
    st = MemorySettings.from_any(settings)
    if choice is None or (isinstance(choice, str) and choice in PROFILES):  # a cost profile name: no memory section
        return MemoryProfile.analytic(model, p, st)
    if isinstance(choice, MemoryProfile):
        prof: Optional[MemoryProfile] = choice
    elif isinstance(choice, (str, os.PathLike, Mapping)):
        prof = load_memory_profile(choice)
    else:
        raise DynBatchConfigError("memory_profile", type(choice).__name__, "must be a MemoryProfile, a cost-model "
                                  "file or None", "pass the file megatron-dynbatch calibrate wrote, or None")
    if prof is None:
        return MemoryProfile.analytic(model, p, st)
    prof.check_applies(model, p, st)
    return prof


__all__ = ["MemoryProfile", "load_memory_profile", "resolve_memory_profile", "model_key", "BYTE_FIELDS"]
