"""Cost profiles: what one kind of GPU, kernel stack and network does per FLOP, per layer and per byte.

A :class:`CostProfile` holds the numbers that do not depend on the model or the layout, so one profile turns any
model preset on any ``tp / pp / cp`` layout into a :class:`~.cost_model.CostModel`
(:meth:`CostModel.from_model(model, parallel, profile=...) <.cost_model.CostModel.from_model>`):

* ``linear_efficiency`` / ``attention_efficiency`` of ``peak_flops``: the model's token-linear and core-attention
  FLOPs (:mod:`.flops`, fwd + bwd = 3x fwd) per GPU;
* ``overhead_per_layer_s`` (+ ``overhead_s``): fixed GPU time of one micro-batch per layer (small kernels:
  norms, RoPE, activations, optimizer-free bookkeeping), forward + backward;
* ``min_per_layer_s``: the least time a micro-batch takes per layer however small it is -- the kernels of a
  layer are issued one by one, so a tiny input is bound by issuing them, not by the GPU (measured: one short
  sample costs as much as ~1,500 tokens). A micro-batch costs ``max(floor, overhead + work)``;
* one CP member's share (a micro-batch on ``g > 1`` GPUs): its floor is ``cp_min_per_layer_s`` higher per layer
  (the ring's extra kernels), its linear work ``cp_linear_overhead`` slower (two attention calls and the merge
  of their outputs per layer), and its attention runs in chunks of the ring: per member it costs as if it
  attended ``cp_chunk_tokens`` more keys for every token of the whole micro-batch, times ``(g - 1) / g`` -- the
  smaller the chunks (``L / 2g``), the larger that share;
* topology: ring-attention K/V transfers inside a node (NVLink) and across nodes (InfiniBand / RoCE), bandwidth
  per GPU and latency per ring step and layer pass, and the share of the ring's attention that hides them;
* ``uncertainty``: how far the profile's step-time predictions are from measured ones (relative); the planner
  leaves its default choice only for a modelled gain above it (``decision_margin``, ``docs/cost_model.md``).

Two profiles are built in (:data:`PROFILES`): ``"fitted"`` (the default; fitted on H100 micro-batch timings of
2026-11-25, ``../shared/gpu`` -> ``benchmarks/gpu/results``, by :func:`.cost_fit.fit_records`; reproduce with
``python benchmarks/gpu/fit_profile.py``) and ``"analytic"`` (the assumptions this project used before any
measurement: 55% / 35% of peak, 2 ms per micro-batch, one network). A profile may also come from a JSON file
(the ``"profile"`` section :func:`.cost_files.save_cost_model` writes). Pure Python; no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Dict, Mapping, Union

from .checks import as_float
from .errors import DynBatchConfigError

#: dense bf16 peak of an H100 / H200 SXM (NVIDIA datasheets: 989 TFLOP/s without sparsity)
H100_BF16_PEAK = 989e12
#: NVLink 4 on H100 / H200 SXM: 900 GB/s per GPU both directions together, 450 GB/s each way; a ring step's
#: point-to-point copy is assumed to reach ~80% of that
NVLINK_BPS = 0.8 * 450e9
#: one 400 Gb/s InfiniBand NDR (ConnectX-7) port per GPU on HGX / DGX H100 and H200 nodes = 50 GB/s each way;
#: ~80% of it assumed reachable
INFINIBAND_BPS = 0.8 * 50e9


@dataclass(frozen=True)
class CostProfile:
    """The model- and layout-independent numbers of a cost model (module docstring). Seconds are forward +
    backward of ONE micro-batch; ``*_per_layer_s`` multiply by the model's layers."""

    name: str
    peak_flops: float = H100_BF16_PEAK
    linear_efficiency: float = 0.55
    attention_efficiency: float = 0.35
    overhead_s: float = 0.0
    overhead_per_layer_s: float = 0.0
    min_per_layer_s: float = 0.0
    cp_min_per_layer_s: float = 0.0
    cp_linear_overhead: float = 0.0
    cp_chunk_tokens: float = 0.0
    intra_node_bandwidth_Bps: float = 100e9
    intra_node_latency_s: float = 15e-6
    inter_node_bandwidth_Bps: float = 100e9
    inter_node_latency_s: float = 15e-6
    cp_comm_overlap: float = 0.8
    uncertainty: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise DynBatchConfigError("profile.name", self.name, "must be a string", "name the profile")
        for f in fields(self):
            if f.name == "name":
                continue
            positive = f.name in ("peak_flops", "linear_efficiency", "attention_efficiency",
                                  "intra_node_bandwidth_Bps", "inter_node_bandwidth_Bps")
            top = 1.0 if f.name in ("linear_efficiency", "attention_efficiency", "cp_comm_overlap", "uncertainty") \
                else None
            value = as_float(getattr(self, f.name), f"profile.{f.name}", minimum=0.0, maximum=top,
                             fix=f"pass a finite number >= 0{' and <= 1' if top else ''} (see docs/cost_model.md)")
            if positive and value <= 0:
                raise DynBatchConfigError(f"profile.{f.name}", value, "must be > 0", "pass a positive number")
            object.__setattr__(self, f.name, value)

    def replace(self, **changes: Any) -> "CostProfile":
        """This profile with some numbers changed (validated); unknown names are refused."""
        known = {f.name for f in fields(self)}
        bad = sorted(set(changes) - known)
        if bad:
            raise DynBatchConfigError(bad[0], changes[bad[0]], "is not a cost-profile field",
                                      f"use one of {sorted(known)}")
        return replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "profile") -> "CostProfile":
        if not isinstance(d, Mapping):
            raise DynBatchConfigError(where, d, "must be a mapping of profile fields", "write a JSON object")
        known = {f.name for f in fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise DynBatchConfigError(f"{where}.{bad[0]}", d[bad[0]], "is not a cost-profile field",
                                      f"use only {sorted(known)}")
        kw = dict(d)
        kw.setdefault("name", "custom")
        return cls(**kw)


#: The assumptions used before any GPU measurement (kept for comparison: ``profile="analytic"``).
ANALYTIC = CostProfile(name="analytic", overhead_s=2.0e-3)

#: Fitted on 3,698 measured CP-member micro-batch timings (H100 80GB HBM3, torch 2.11 varlen flash attention,
#: bf16, 2-layer slices of Llama-3.1-8B/70B, Qwen3-8B/32B widths; 2026-11-25) by ``benchmarks/gpu/fit_profile.py``;
#: topology from the public figures above (the timings were compute only); ``uncertainty`` = the fit's mean
#: absolute relative error, averaged over group sizes (docs/cost_model.md).
FITTED = CostProfile(
    name="fitted",
    linear_efficiency=0.611,
    attention_efficiency=0.280,
    overhead_per_layer_s=1.44e-3,
    min_per_layer_s=3.10e-3,
    cp_min_per_layer_s=1.08e-3,
    cp_linear_overhead=0.127,
    cp_chunk_tokens=434.0,
    intra_node_bandwidth_Bps=NVLINK_BPS,
    intra_node_latency_s=15e-6,
    inter_node_bandwidth_Bps=INFINIBAND_BPS,
    inter_node_latency_s=30e-6,
    cp_comm_overlap=0.8,
    uncertainty=0.032,
)

PROFILES: Dict[str, CostProfile] = {p.name: p for p in (FITTED, ANALYTIC)}
#: the profile ``CostModel.from_model`` uses when none is named
DEFAULT_PROFILE = "fitted"


def is_cost_model_choice(key: str) -> bool:
    """Whether ``key`` names a cost profile (:data:`PROFILES`) or an existing file -- what a ``cost_model``
    setting may be (each caller words its own error for anything else)."""
    return key in PROFILES or os.path.isfile(key)


def resolve_profile(profile: Union[None, str, os.PathLike, CostProfile], *, field: str = "profile") -> CostProfile:
    """A :class:`CostProfile` from ``None`` (the default), a name in :data:`PROFILES`, a JSON file (its
    ``"profile"`` section, or the whole object) or a profile itself."""
    if profile is None:
        return PROFILES[DEFAULT_PROFILE]
    if isinstance(profile, CostProfile):
        return profile
    if isinstance(profile, (str, os.PathLike)):
        key = str(profile)
        if not is_cost_model_choice(key):
            raise DynBatchConfigError(field, key, "is neither a cost profile nor a file",
                                      f"use one of {sorted(PROFILES)} or the path of a cost-model JSON file")
        if key in PROFILES:
            return PROFILES[key]
        try:
            with open(key, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError) as exc:
            raise DynBatchConfigError(field, key, f"cannot be read as JSON ({exc})",
                                      "pass a profile name or a file written by save_cost_model") from None
        if isinstance(data, Mapping) and "profile" in data:
            return CostProfile.from_dict(data["profile"], where=f"{key}: profile")
        raise DynBatchConfigError(field, key, "has no \"profile\" section",
                                  "fit one with cost_fit.fit_records and save it with save_cost_model, or use "
                                  f"one of {sorted(PROFILES)}")
    raise DynBatchConfigError(field, profile, "must be a profile name, a file path or a CostProfile",
                              f"use one of {sorted(PROFILES)}")


__all__ = ["CostProfile", "PROFILES", "DEFAULT_PROFILE", "FITTED", "ANALYTIC", "resolve_profile",
           "is_cost_model_choice", "H100_BF16_PEAK", "NVLINK_BPS", "INFINIBAND_BPS"]
