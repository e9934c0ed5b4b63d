"""Parallel layout of one training job, as the planner needs it.

Field names follow Megatron's ``ModelParallelConfig`` / argument names. Only what changes planning is here:
``dp`` (number of data-parallel replicas that split the global batch), ``tp``, ``pp``, ``cp``, ``ep``,
``vpp`` (virtual pipeline chunks per stage), ``microbatch_group_size_per_vp_stage`` (Megatron's ``N``;
defaults to ``pp`` like Megatron), ``sequence_parallel`` (tokens per micro-batch must divide by ``tp``) and
``gpus_per_node`` (GPUs of one NVLink node, default 8: with Megatron's rank order it says which CP groups
cross nodes, :mod:`.topology`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional, Union

from .checks import as_bool, as_int, is_int
from .errors import DynBatchConfigError

#: GPUs per node when the layout does not say (an HGX/DGX H100 or H200 node: 8 GPUs on one NVLink switch fabric)
DEFAULT_GPUS_PER_NODE = 8
#: Largest parallel size accepted (a million GPUs): guards against nonsense that would allocate per-rank arrays.
MAX_RANKS = 2 ** 20


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    microbatch_group_size_per_vp_stage: Optional[int] = None
    sequence_parallel: bool = False
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep", "vpp", "gpus_per_node"):
            fix = (f"pass the GPUs of one node, e.g. gpus_per_node={DEFAULT_GPUS_PER_NODE} (at most {MAX_RANKS})"
                   if name == "gpus_per_node" else f"pass {name}=1 or a larger whole number (at most {MAX_RANKS})")
            value = as_int(getattr(self, name), f"parallel.{name}", minimum=1, maximum=MAX_RANKS, fix=fix)
            object.__setattr__(self, name, value)  # NumPy integers become plain ints
        object.__setattr__(self, "sequence_parallel", as_bool(self.sequence_parallel, "parallel.sequence_parallel"))
        if self.vpp > 1 and self.pp < 2:
            raise DynBatchConfigError(
                "parallel.vpp", self.vpp, "virtual pipeline stages need pipeline parallelism (pp >= 2)",
                "set vpp=1 or pp >= 2",
            )
        n = self.microbatch_group_size_per_vp_stage
        if n is not None:
            if not is_int(n) or n < self.pp or n > MAX_RANKS:
                raise DynBatchConfigError(
                    "parallel.microbatch_group_size_per_vp_stage", n,
                    f"Megatron requires pp ({self.pp}) <= N", f"use N >= {self.pp} or leave it unset (defaults to pp)",
                )
            object.__setattr__(self, "microbatch_group_size_per_vp_stage", int(n))

    @property
    def vp_group_size(self) -> int:
        """Megatron's ``microbatch_group_size_per_vp_stage`` (N); ``pp`` when unset."""
        return self.microbatch_group_size_per_vp_stage or self.pp

    @property
    def model_parallel_size(self) -> int:
        """GPUs that hold one model replica and process one micro-batch together (TP x PP x CP)."""
        return self.tp * self.pp * self.cp

    @property
    def world_size(self) -> int:
        return self.dp * self.model_parallel_size

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_any(cls, parallel: Union["ParallelConfig", Mapping[str, Any], None]) -> "ParallelConfig":
        """Accept a ``ParallelConfig`` or a dict with keys ``dp, tp, pp, cp, ep, vpp`` (missing keys = 1) and
        ``gpus_per_node`` (missing = 8)."""
        if parallel is None:
            return cls()
        if isinstance(parallel, cls):
            return parallel
        if not isinstance(parallel, Mapping):
            raise DynBatchConfigError(
                "parallel", parallel, "must be a ParallelConfig or a dict", "pass e.g. {'dp': 8, 'tp': 2}"
            )
        known = {f.name for f in fields(cls)}
        aliases = {"vp": "vpp", "virtual_pipeline_model_parallel_size": "vpp",
                   "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
                   "context_parallel_size": "cp", "expert_model_parallel_size": "ep",
                   "data_parallel_size": "dp", "num_gpus_per_node": "gpus_per_node"}
        kwargs = {}
        for key, value in parallel.items():
            key = aliases.get(key, key)
            if key not in known:
                raise DynBatchConfigError(
                    f"parallel.{key}", value, "unknown parallel field", f"use only {sorted(known)}"
                )
            if value is None and key in ("vpp",):
                value = 1
            if value is None and key == "gpus_per_node":
                value = DEFAULT_GPUS_PER_NODE
            kwargs[key] = value
        return cls(**kwargs)
