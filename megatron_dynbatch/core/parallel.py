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

An unknown key is refused with what the user most likely meant (:func:`layout_key_meaning`): the key is read as
words (``tensor_parallel_size``, ``TensorParallelSize``, ``tp-size``, misspelt words like ``paralel``), and the
words that name a dimension -- ``tensor`` / ``tp``, ``pipeline``, ``context`` / ``ulysses``, ``expert``, ``data``,
``virtual``, ``sequence``, GPUs per node, world size -- say which field, so ``tensor_parallel_size`` suggests
``tp`` (Megatron: ``tensor_model_parallel_size``), never the nearer string ``expert_tensor_parallel_size``;
a key with no such word falls back to the closest spellings.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from .checks import as_bool, as_int, close_matches, did_you_mean, is_int
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


#: What :meth:`ParallelConfig.from_any` accepts: a ``ParallelConfig``, a layout mapping, or ``None`` (all ones)
ParallelLike = Union[ParallelConfig, Mapping[str, Any], None]


def _known_keys() -> List[str]:
    return [f.name for f in fields(ParallelConfig)] + list(EXTRA_KEYS)


#: words a layout key is read as (misspellings are matched to them, :func:`_words`)
_VOCABULARY = ("tensor", "pipeline", "context", "expert", "data", "virtual", "sequence", "parallel", "parallelism",
               "model", "size", "degree", "world", "gpus", "gpu", "devices", "device", "node", "nodes", "ranks",
               "microbatch", "micro", "batch", "group", "stage", "ulysses", "interleaved", "chunks", "procs")
#: short words that name a dimension outright
_SHORT = {"tp": "tp", "mp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "dp": "dp", "vp": "vpp",
          "vpp": "vpp", "etp": "etp", "sp": "sequence_parallel", "ws": "world_size"}
#: how :func:`layout_key_meaning` names each field in a suggestion: its short name and Megatron's
_SAID_AS = {"tp": ("tp", "tensor_model_parallel_size"), "pp": ("pp", "pipeline_model_parallel_size"),
            "cp": ("cp", "context_parallel_size"), "ep": ("ep", "expert_model_parallel_size"),
            "dp": ("dp", "data_parallel_size"), "vpp": ("vpp", "virtual_pipeline_model_parallel_size"),
            "etp": ("etp", "expert_tensor_parallel_size")}
#: common short forms of the words
_ABBREVIATIONS = {"seq": "sequence", "ctx": "context", "pipe": "pipeline", "exp": "expert", "virt": "virtual",
                  "par": "parallel", "nproc": "procs", "nprocs": "procs"}


def _words(key: str) -> List[str]:
    """``key`` as lower-case words: split at ``_ - . space`` and camelCase, each long word replaced by the
    :data:`_VOCABULARY` word it is a likely misspelling of (``paralel`` -> ``parallel``)."""
    out = []
    for part in re.split(r"[^A-Za-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key)):
        word = _ABBREVIATIONS.get(part.lower(), part.lower())
        if len(word) >= 4 and word not in _VOCABULARY:
            close = close_matches(word, _VOCABULARY, n=1, cutoff=0.75)
            word = close[0] if close else word
        if word:
            out.append(word)
    return out


def layout_key_meaning(key: Any, *, outside: bool = False) -> List[str]:
    """The layout keys (:func:`parallel_from_mapping`'s) that ``key`` most likely means, best first, from the
    words it is made of (module docstring): ``tensor_parallel_size`` -> ``["tp"]``, ``expert_tensor_parallel``
    -> ``["etp"]``, ``sequence_parallel_size`` (DeepSpeed's / verl's Ulysses degree) -> ``["cp",
    "sequence_parallel"]``; ``[]`` when no word names a dimension. ``outside``: the key is not under
    ``parallel:`` (a run preset's top level), so it counts only when it says parallelism outright (``parallel``
    or a short name such as ``tp``) -- ``max_seq_len`` there is a misspelt run field, not a layout key."""
    if not isinstance(key, str):
        return []
    words = _words(key)
    has = set(words).__contains__
    short = [_SHORT[w] for w in words if w in _SHORT]
    parallel = has("parallel") or has("parallelism")
    if outside and not (parallel or short):
        return []
    if (has("expert") or "ep" in short) and (has("tensor") or "tp" in short) or "etp" in short:
        return ["etp"]
    if has("micro") or has("microbatch") or (has("group") and (has("stage") or "vpp" in short)):
        return ["microbatch_group_size_per_vp_stage"]
    if has("virtual") or has("interleaved") or has("chunks") or "vpp" in short:
        return ["vpp"]
    if has("tensor") or "tp" in short:
        return ["tp"]
    if has("pipeline") or "pp" in short:
        return ["pp"]
    if has("context") or has("ulysses") or "cp" in short:
        return ["cp"]
    if has("expert") or "ep" in short or (has("moe") and parallel):
        return ["ep"]
    if has("data") or "dp" in short:
        return ["dp"]
    if (has("sequence") and parallel) or "sequence_parallel" in short:
        sized = has("size") or has("degree") or any(w.isdigit() for w in words)
        return ["cp", "sequence_parallel"] if sized else ["sequence_parallel"]
    per_node = has("node") or has("nodes")
    if per_node and (has("gpus") or has("gpu") or has("devices") or has("device") or has("procs")):
        return ["gpus_per_node"]
    if per_node:  # a node count: the layout takes GPUs (world_size) and GPUs per node
        return ["world_size", "gpus_per_node"]
    if has("world") or "world_size" in short or has("gpus") or has("devices") or has("ranks"):
        return ["world_size"]
    if has("model") and parallel:  # Megatron's old --model-parallel-size: TP
        return ["tp"]
    return []


def _said(name: str) -> str:
    short, megatron = _SAID_AS.get(name, (name, None))
    return f"{short!r} (Megatron: {megatron!r})" if megatron else repr(short)


def _suggest(key: str, known: List[str]) -> str:
    meant = layout_key_meaning(key)
    if meant:
        return f"did you mean {' or '.join(_said(m) for m in meant)}?"
    return did_you_mean(key, known + list(ALIASES)) or f"use only {known}"


def parallel_from_mapping(parallel: Mapping[str, Any]) -> Tuple[ParallelConfig, Optional[int]]:
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
            raise DynBatchConfigError(f"parallel.{key}", value, "unknown parallel field",
                                      _suggest(str(key), _known_keys()))
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
