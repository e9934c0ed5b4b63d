"""Each trainer's configured token budgets, and what its config says about memory -- read for the drop-ins'
start-up memory check (:func:`~megatron_dynbatch.core.memory.check.check_configured_budget`; the drop-ins in
:mod:`megatron_dynbatch.integrations` add the card and warn).

One reader per trainer, each taking the trainer's own config object (a dict, an OmegaConf ``DictConfig``, a
dataclass or a namespace: keys and attributes both work) and returning :class:`ConfiguredBudgets` -- the budget
settings the run uses (under the trainer's names, only those its dynamic batching switches on), the layout, the
:class:`~megatron_dynbatch.core.memory.MemorySettings` the config implies, the model where the config names a
local one, and whether it gives the data-parallel size -- or ``None`` when the trainer does not train with
Megatron there (the memory model is Megatron's):

* :func:`slime_budgets` -- slime's Megatron ``args``: ``--max-tokens-per-gpu`` (training) and
  ``--log-probs-max-tokens-per-gpu`` (log-prob; unset, slime uses ``--max-tokens-per-gpu``), with
  ``--use-dynamic-batch-size``; memory settings from the Megatron flags
  (:func:`~megatron_dynbatch.core.memory.settings_from_megatron`);
* :func:`verl_budgets` -- verl's trainer config (or its ``actor_rollout_ref``): the actor's
  ``ppo_max_token_len_per_gpu`` (``use_dynamic_bsz``), the rollout's and -- when a reference policy is used
  (``use_kl_loss`` or ``algorithm.use_kl_in_reward``) -- the ref's ``log_prob_max_token_len_per_gpu``
  (``log_prob_use_dynamic_bsz``, default the actor's switch); layout and optimizer from ``actor.megatron``,
  recompute from its ``override_transformer_config``, ``dp`` from ``trainer.n_gpus_per_node x nnodes``;
* :func:`roll_budgets` -- a ROLL worker config (``actor_train``, ``reference``):
  ``max_tokens_per_microbatch_in_train`` / ``_in_infer`` (``use_dynamic_batching_in_train`` / ``_in_infer``);
  layout and memory settings from ``strategy_args.strategy_config`` (Megatron's argument names), ``dp`` from
  ``world_size``;
* :func:`nemo_rl_budgets` -- NeMo-RL's master config (or its ``policy``): ``train_mb_tokens`` /
  ``logprob_mb_tokens`` of ``policy.sequence_packing`` or ``policy.dynamic_batching`` (whichever is enabled);
  layout and memory settings from ``policy.megatron_cfg``, ``dp`` from ``cluster.gpus_per_node x num_nodes``.

Each reader also sets the trainer's loss path (``MemorySettings.trainer`` and its loss options,
:mod:`~megatron_dynbatch.core.memory.loss_paths`): slime's ``entropy_coef``, ``rollout_temperature`` and
``log_probs_chunk_size``; verl's actor ``entropy_coeff`` and ``model.use_fused_kernels``; ROLL's
``strategy_config.cross_entropy_loss_fusion`` (its ``entropy_loss_coef`` lives in the pipeline config, not the
worker's: pass ``settings={"loss_entropy": True}`` to the check when it is above 0); NeMo-RL's
``policy.logprob_chunk_size``.

A layout whose ``dp`` the config does not give (verl's ``actor_rollout_ref`` or NeMo-RL's ``policy`` alone) has
``dp = 1`` and ``dp_known`` false: the distributed optimizer's state per GPU depends on it, so the check refuses
to judge that case (pass ``dp_size=``); with any other optimizer ``dp`` does not change the memory. Values are
read, not validated: the check validates them (a budget of 0 is its error). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Mapping, Optional, Tuple

from ..errors import DynBatchConfigError
from ..memory.megatron_flags import settings_from_megatron
from ..memory.settings import MemorySettings
from ..model_spec import ModelSpec
from ..parallel import ParallelConfig, parallel_from_mapping

if TYPE_CHECKING:
    from ..model_spec import ModelLike

__all__ = ["ConfiguredBudgets", "model_at", "nemo_rl_budgets", "roll_budgets", "slime_budgets", "verl_budgets"]

_MISSING = object()


@dataclass(frozen=True)
class ConfiguredBudgets:
    """What a trainer's config says for the memory check. ``budgets``: ``(setting, value, note)`` -- the setting
    under the trainer's name, its value (as configured, unvalidated) and a note on it (``""`` or e.g. that it is
    unset and another setting stands in); ``dp_known``: whether the config gave the data-parallel size (else
    ``parallel.dp`` is 1)."""

    trainer: str
    budgets: Tuple[Tuple[str, Any, str], ...]
    parallel: ParallelConfig
    settings: MemorySettings
    model: Any = None
    dp_known: bool = True


def _get(obj: Any, *path: str, default: Any = None) -> Any:
    """``obj[path[0]][path[1]]...`` through mappings and attributes alike; ``default`` when a step is missing or
    ``None``."""
    for key in path:
        if obj is None:
            return default
        value = _MISSING
        if isinstance(obj, Mapping) or hasattr(obj, "get") and hasattr(obj, "keys"):
            try:
                value = obj.get(key, _MISSING)
            except Exception:  # noqa: BLE001 -- an OmegaConf interpolation that cannot resolve: treat as missing
                value = _MISSING
        if value is _MISSING:
            try:
                value = getattr(obj, key, _MISSING)
            except Exception:  # noqa: BLE001 -- the same, through attribute access
                value = _MISSING
        if value is _MISSING:
            return default
        obj = value
    return default if obj is None else obj


def model_at(path: Any) -> Optional[ModelSpec]:
    """The model of a local Hugging Face checkpoint directory (its ``config.json``), else ``None`` (a hub id, a
    missing path, an architecture :meth:`~megatron_dynbatch.core.model_spec.ModelSpec.from_hf_config` does not
    read): the check is skipped then, as when no model is known."""
    if not isinstance(path, (str, Path)) or not str(path).strip():
        return None
    p = Path(str(path)).expanduser()
    try:
        if not (p.is_dir() and (p / "config.json").is_file()):
            return None
        return ModelSpec.from_hf_config(p)
    except (DynBatchConfigError, OSError, ValueError, KeyError, TypeError):
        return None


def _layout(values: Mapping[str, Any], world: Any) -> Tuple[ParallelConfig, bool]:
    """A layout from Megatron-named values (``None`` left out) and the world size when known; whether ``dp`` is
    known."""
    par = {k: v for k, v in values.items() if v is not None}
    if "dp" not in par and isinstance(world, int) and not isinstance(world, bool) and world > 0:
        return parallel_from_mapping({**par, "world_size": world})[0], True
    return parallel_from_mapping(par)[0], "dp" in par


def _dtype(name: Any) -> Optional[str]:
    return {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
            "float32": "fp32", "fp32": "fp32", "float": "fp32"}.get(str(name).lower()) if name is not None else None


def _nonzero(coef: Any) -> bool:
    """An entropy coefficient that puts an entropy term in the loss (a number other than 0)."""
    return isinstance(coef, (int, float)) and not isinstance(coef, bool) and coef != 0


def _positive(chunk: Any) -> bool:
    """A chunk size that turns chunking on (slime's -1 and NeMo-RL's None / 0 leave it off)."""
    return isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0


def _optimizer(offload: Any, distributed: Any) -> str:
    return "cpu_offload" if offload else "distributed" if distributed else "replicated"


# --------------------------------------------------------------------------------------------- slime
def slime_budgets(args: Any, parallel: ParallelConfig, model: Optional[ModelLike] = None
                  ) -> Optional[ConfiguredBudgets]:
    """slime's budgets (module docstring); ``parallel``: the drop-in's layout of ``train_parallel_config`` and
    ``args``; ``model``: the model ``args`` describe (``None`` when they do not). ``None`` on slime's FSDP
    backend."""
    if str(_get(args, "train_backend", default="megatron")).lower() != "megatron":
        return None
    out: List[Tuple[str, Any, str]] = []
    if _get(args, "use_dynamic_batch_size", default=False):
        train = _get(args, "max_tokens_per_gpu")
        log_prob = _get(args, "log_probs_max_tokens_per_gpu")
        out.append(("--max-tokens-per-gpu", train, ""))
        out.append(("--log-probs-max-tokens-per-gpu", train if log_prob is None else log_prob,
                    "" if log_prob is not None else "unset, so slime uses --max-tokens-per-gpu there"))
    chunk = _get(args, "log_probs_chunk_size", default=-1)
    loss = {"trainer": "slime", "loss_entropy": _nonzero(_get(args, "entropy_coef", default=0.0)),
            "loss_temperature": _get(args, "rollout_temperature", default=1.0),
            "loss_chunk_tokens": chunk if _positive(chunk) else None}
    return ConfiguredBudgets("slime", tuple(b for b in out if b[1] is not None), parallel,
                             settings_from_megatron(args, **loss), model)


# --------------------------------------------------------------------------------------------- verl
def verl_budgets(config: Any, dp_size: Optional[int] = None) -> Optional[ConfiguredBudgets]:
    """verl's budgets (module docstring): ``config`` the whole trainer config or its ``actor_rollout_ref``.
    ``None`` when the actor does not run on verl's Megatron backend."""
    whole = _get(config, "actor_rollout_ref") is not None
    arr = _get(config, "actor_rollout_ref") if whole else config
    actor = _get(arr, "actor")
    if actor is None:
        raise DynBatchConfigError("config", type(config).__name__, "has no actor_rollout_ref.actor",
                                  "pass verl's trainer config (or its actor_rollout_ref)")
    if str(_get(actor, "strategy", default="megatron")).lower() != "megatron":
        return None
    meg = _get(actor, "megatron", default={})
    dynamic = bool(_get(actor, "use_dynamic_bsz", default=False))
    out: List[Tuple[str, Any, str]] = []
    if dynamic:
        out.append(("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", _get(actor, "ppo_max_token_len_per_gpu"),
                    ""))
    uses_ref = bool(_get(actor, "use_kl_loss", default=False))
    if whole:
        uses_ref = uses_ref or bool(_get(config, "algorithm", "use_kl_in_reward", default=False))
    for role in ("rollout", "ref") if uses_ref else ("rollout",):
        sec = _get(arr, role)
        if sec is not None and bool(_get(sec, "log_prob_use_dynamic_bsz", default=dynamic)):
            out.append((f"actor_rollout_ref.{role}.log_prob_max_token_len_per_gpu",
                        _get(sec, "log_prob_max_token_len_per_gpu"), ""))
    world = None
    if whole and dp_size is None:
        gpn, nodes = _get(config, "trainer", "n_gpus_per_node"), _get(config, "trainer", "nnodes")
        world = gpn * nodes if isinstance(gpn, int) and isinstance(nodes, int) else None
    values = {"tensor_model_parallel_size": _get(meg, "tensor_model_parallel_size"),
              "pipeline_model_parallel_size": _get(meg, "pipeline_model_parallel_size"),
              "context_parallel_size": _get(meg, "context_parallel_size"),
              "virtual_pipeline_model_parallel_size": _get(meg, "virtual_pipeline_model_parallel_size"),
              "expert_model_parallel_size": _get(meg, "expert_model_parallel_size"),
              "sequence_parallel": _get(meg, "sequence_parallel"), "dp": dp_size}
    par, dp_known = _layout(values, world)
    kw: dict = {"optimizer": _optimizer(_get(meg, "optimizer_offload", default=False),
                                        _get(meg, "use_distributed_optimizer", default=True))}
    gran = _get(meg, "override_transformer_config", "recompute_granularity")
    if gran in ("full", "selective"):
        kw["recompute"] = gran
    if _dtype(_get(meg, "dtype")):
        kw["param_dtype"] = _dtype(_get(meg, "dtype"))
    if _get(meg, "expert_tensor_parallel_size") is not None:
        kw["expert_tensor_parallel_size"] = _get(meg, "expert_tensor_parallel_size")
    kw.update(trainer="verl", loss_entropy=_nonzero(_get(actor, "entropy_coeff", default=0.0)),
              loss_fused=bool(_get(arr, "model", "use_fused_kernels", default=False)))
    return ConfiguredBudgets("verl", tuple(b for b in out if b[1] is not None), par, MemorySettings(**kw),
                             model_at(_get(arr, "model", "path")), dp_known)


# --------------------------------------------------------------------------------------------- ROLL
def roll_budgets(worker_config: Any, role: str = "actor_train", dp_size: Optional[int] = None
                 ) -> Optional[ConfiguredBudgets]:
    """ROLL's budgets of one worker (module docstring); ``role``: the worker's name in ROLL's pipeline config
    (``actor_train``, ``reference``), used in the settings' names. ``None`` when the worker does not run
    Megatron (``strategy_args.strategy_name`` not ``megatron_*``)."""
    strategy = _get(worker_config, "strategy_args")
    name = str(_get(strategy, "strategy_name", default="megatron_train"))
    if not name.startswith("megatron"):
        return None
    sc = _get(strategy, "strategy_config", default={})
    out: List[Tuple[str, Any, str]] = []
    for kind in ("train", "infer"):
        if _get(worker_config, f"use_dynamic_batching_in_{kind}", default=False):
            out.append((f"{role}.max_tokens_per_microbatch_in_{kind}",
                        _get(worker_config, f"max_tokens_per_microbatch_in_{kind}"), ""))
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "virtual_pipeline_model_parallel_size", "expert_model_parallel_size", "sequence_parallel")
    values = {k: _get(sc, k) for k in keys}
    values["dp"] = dp_size
    par, dp_known = _layout(values, None if dp_size is not None else _get(worker_config, "world_size"))
    argv: List[str] = []  # strategy_config holds Megatron's arguments: read as the flags they are (absent: default)
    for key in ("use_distributed_optimizer", "optimizer_cpu_offload", "fp16", "bf16", "grad_reduce_in_bf16",
                "untie_embeddings_and_output_weights"):
        if _get(sc, key, default=False) is True:
            argv.append("--" + key.replace("_", "-"))
    for key in ("recompute_granularity", "expert_tensor_parallel_size"):
        if _get(sc, key) is not None:
            argv += ["--" + key.replace("_", "-"), str(_get(sc, key))]
    st = settings_from_megatron(argv, trainer="roll",
                                loss_fused=bool(_get(sc, "cross_entropy_loss_fusion", default=False)))
    dt = _dtype(_get(worker_config, "model_args", "dtype"))
    if dt:
        st = st.replace(param_dtype=dt)
    return ConfiguredBudgets("roll", tuple(b for b in out if b[1] is not None), par, st,
                             model_at(_get(worker_config, "model_args", "model_name_or_path")), dp_known)


# --------------------------------------------------------------------------------------------- NeMo-RL
def nemo_rl_budgets(config: Any, dp_size: Optional[int] = None) -> Optional[ConfiguredBudgets]:
    """NeMo-RL's budgets (module docstring): ``config`` the master config (``policy``, ``cluster``) or its
    ``policy``. ``None`` when the policy does not run Megatron (``megatron_cfg.enabled`` false: DTensor)."""
    whole = _get(config, "policy") is not None
    policy = _get(config, "policy") if whole else config
    mcfg = _get(policy, "megatron_cfg")
    if mcfg is None or not _get(mcfg, "enabled", default=False):
        return None
    out: List[Tuple[str, Any, str]] = []
    for section in ("sequence_packing", "dynamic_batching"):
        sec = _get(policy, section)
        if sec is not None and _get(sec, "enabled", default=False):
            out = [(f"policy.{section}.train_mb_tokens", _get(sec, "train_mb_tokens"), ""),
                   (f"policy.{section}.logprob_mb_tokens", _get(sec, "logprob_mb_tokens"), "")]
            break
    world = None
    if whole and dp_size is None:
        gpn, nodes = _get(config, "cluster", "gpus_per_node"), _get(config, "cluster", "num_nodes")
        world = gpn * nodes if isinstance(gpn, int) and isinstance(nodes, int) else None
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "expert_model_parallel_size", "sequence_parallel")
    values = {k: _get(mcfg, k) for k in keys}
    values["dp"] = dp_size
    par, dp_known = _layout(values, world)
    opt = _get(mcfg, "optimizer", default={})
    kw: dict = {"optimizer": _optimizer(_get(opt, "optimizer_cpu_offload", default=False),
                                        _get(opt, "use_distributed_optimizer", default=True))}
    gran = _get(mcfg, "recompute_granularity")
    if gran in ("full", "selective"):
        kw["recompute"] = gran
    elif _get(mcfg, "activation_checkpointing", default=False):
        kw["recompute"] = "full"
    dt = _dtype(_get(policy, "precision")) or ("bf16" if _get(opt, "bf16") else "fp16" if _get(opt, "fp16") else None)
    if dt:
        kw["param_dtype"] = dt
    if _get(mcfg, "distributed_data_parallel_config", "grad_reduce_in_fp32") is False and dt in ("bf16", "fp16"):
        kw["grad_dtype"] = dt
    if _get(mcfg, "expert_tensor_parallel_size") is not None:
        kw["expert_tensor_parallel_size"] = _get(mcfg, "expert_tensor_parallel_size")
    chunk = _get(policy, "logprob_chunk_size")
    kw.update(trainer="nemo-rl", loss_chunk_tokens=chunk if _positive(chunk) else None)
    return ConfiguredBudgets("nemo-rl", tuple(b for b in out if b[1] is not None), par, MemorySettings(**kw),
                             model_at(_get(policy, "model_name")), dp_known)
