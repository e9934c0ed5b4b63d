"""Parallel layout of one training job, as the planner needs it.

Field names follow Megatron's ``ModelParallelConfig`` / argument names. Only what changes planning is here:
``dp`` (number of data-parallel replicas that split the global batch), ``tp``, ``pp``, ``cp``, ``ep``,
``vpp`` (virtual pipeline chunks per stage), ``microbatch_group_size_per_vp_stage`` (Megatron's ``N``;
defaults to ``pp`` like Megatron), ``sequence_parallel`` (tokens per micro-batch must divide by ``tp``) and
``gpus_per_node`` (GPUs of one NVLink node, default 8: with Megatron's rank order it says which CP groups
cross nodes, :mod:`.topology`).

A mapping may say what a run preset's ``parallel:`` says (:func:`parallel_from_mapping`, one function for both,
so both accept and refuse the same keys with the same words): Megatron's long names
(``tensor_model_parallel_size``, ...), ``world_size`` instead of ``dp`` (``dp = world_size / (tp*pp*cp)``), and
``etp`` / ``expert_tensor_parallel_size`` (Megatron's expert tensor-parallel size: a launch setting that does
not change the plan; :class:`~megatron_dynbatch.core.run_config.RunConfig` keeps it for the Megatron flags).
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from .checks import as_bool, as_int, is_int
from .errors import DynBatchConfigError

#: GPUs per node when the layout does not say (an HGX/DGX H100 or H200 node: 8 GPUs on one NVLink switch fabric)
DEFAULT_GPUS_PER_NODE = 8
#: Largest parallel size accepted (a million GPUs): guards against nonsense that would allocate per-rank arrays.
MAX_RANKS = 2 ** 20
#: Megatron's argument names for the layout fields.
ALIASES: Dict[str, str] = {
    "vp": "vpp", "virtual_pipeline_model_parallel_size": "vpp", "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp", "context_parallel_size": "cp", "expert_model_parallel_size": "ep",
    "data_parallel_size": "dp", "num_gpus_per_node": "gpus_per_node"}
#: Keys of a layout mapping (a run preset's ``parallel:``) beyond the fields and their aliases.
EXTRA_KEYS = ("world_size", "etp", "expert_tensor_parallel_size")


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
        """Accept a ``ParallelConfig`` or a mapping (missing keys = 1, ``gpus_per_node`` = 8) in the form a run
        preset's ``parallel:`` takes: the fields, Megatron's names for them, ``world_size`` and ``etp``
        (:func:`parallel_from_mapping`)."""
        if parallel is None:
            return cls()
        if isinstance(parallel, cls):
            return parallel
        return parallel_from_mapping(parallel)[0]


def _known_keys() -> List[str]:
    return [f.name for f in fields(ParallelConfig)] + list(EXTRA_KEYS)


def _suggest(key: str, known: List[str]) -> str:
    close = [k for k in difflib.get_close_matches(key, known, n=3, cutoff=0.6)]
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else f"use only {known}"


def parallel_from_mapping(parallel: Any) -> Tuple[ParallelConfig, Optional[int]]:
    """A layout mapping -> ``(ParallelConfig, etp)``. ``world_size`` derives ``dp`` (it must divide by
    ``tp*pp*cp``, and agree with ``dp`` when both are given); ``etp`` / ``expert_tensor_parallel_size`` (the same
    value when both are given) is validated and returned apart, ``None`` when absent. Every problem is a
    :class:`DynBatchConfigError` naming ``parallel.<key>``, the value and the fix."""
    if not isinstance(parallel, Mapping):
        raise DynBatchConfigError("parallel", parallel, "must be a ParallelConfig or a mapping",
                                  "pass e.g. {'dp': 8, 'tp': 2} or {'world_size': 16, 'tp': 2}")
    par: Dict[str, Any] = {}
    for key, value in parallel.items():
        name = ALIASES.get(key, key) if isinstance(key, str) else key
        if name not in _known_keys():
            raise DynBatchConfigError(f"parallel.{key}", value, "unknown parallel field", _suggest(str(key), _known_keys()))
        if name in par:
            raise DynBatchConfigError(f"parallel.{key}", value, f"gives {name} a second time",
                                      f"give {name} once (under one of its names)")
        if value is None and name in ("vpp", "gpus_per_node"):  # unset: Megatron's default / an 8-GPU node
            value = 1 if name == "vpp" else DEFAULT_GPUS_PER_NODE
        par[name] = value
    etp, etp2 = par.pop("etp", None), par.pop("expert_tensor_parallel_size", None)
    if etp is not None and etp2 is not None and etp != etp2:
        raise DynBatchConfigError("parallel.etp", etp, f"conflicts with expert_tensor_parallel_size={etp2}",
                                  "give it once")
    etp = etp if etp is not None else etp2
    if etp is not None and (not is_int(etp) or etp < 1 or etp > MAX_RANKS):
        raise DynBatchConfigError("parallel.etp", etp, "must be a positive integer", "use 1 or leave it unset (= tp)")
    world = par.pop("world_size", None)
    if world is not None:
        if not is_int(world) or world < 1 or world > MAX_RANKS:
            raise DynBatchConfigError("parallel.world_size", world, "must be a positive integer",
                                      f"give the total GPU count, e.g. 256 (at most {MAX_RANKS})")
        probe = ParallelConfig(**{**par, "dp": 1})  # validates tp/pp/cp first
        mp = probe.model_parallel_size
        if world % mp:
            raise DynBatchConfigError(
                "parallel.world_size", world, f"is not divisible by tp x pp x cp = {probe.tp} x {probe.pp} x "
                f"{probe.cp} = {mp}", f"use a world size that is a multiple of {mp}, or change the layout")
        dp = world // mp
        if par.get("dp") is not None and par["dp"] != dp:
            raise DynBatchConfigError("parallel.dp", par["dp"], f"world_size={world} / (tp*pp*cp={mp}) gives dp={dp}",
                                      "give either dp or world_size, or make them agree")
        par["dp"] = dp
    return ParallelConfig(**par), (int(etp) if etp is not None else None)
