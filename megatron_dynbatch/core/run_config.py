"""Run presets: one typed, validated object for everything a dynamic-batching training run decides.

A :class:`RunConfig` names the model (a preset such as ``"qwen3-8b"`` or an inline mapping of
:class:`~megatron_dynbatch.core.model_spec.ModelSpec` fields), holds the planning options -- the layout, the token
budget, the balancing, the oversize policy, FP8 alignment, the optimizer-step size, whether the ``dp x cp`` GPUs
are planned as one dynamic-CP pool (``docs/dynamic_cp.md``), ... -- as one
:class:`~megatron_dynbatch.core.planner.options.PlanOptions` (:attr:`RunConfig.options`), and adds what is the
run's own: the log-prob pass's budget, the loss normalisation, GRPO groups, the trainers, the MoE dispatcher, online
calibration, the longest sample and extra Megatron flags. It is the single source for three consumers that must
agree with each other:

* the planner -- :meth:`RunConfig.plan_options` gives the options (training, or the forward-only log-prob pass),
  built once at construction, so the preset's planning keys are checked by the planner's own rules;
* Megatron -- :meth:`RunConfig.to_megatron_args` gives the command-line flags the preset implies (layout,
  dispatcher, batching flags: each option under its field's launch spelling); model-shape flags stay in the launch
  script;
* people -- ``configs/runs/<name>.yaml`` is readable and is checked at load time.

One list of options
-------------------
No field of :class:`RunConfig` mirrors an option. The YAML form keeps the options as flat keys; the keys that go
into the options (:data:`OPTION_KEYS`) are read from the ``PlanOptions`` field metadata -- every option a Megatron
launch sets by a flag of its own (``PlanOptions.spellings("megatron")``), plus ``parallel`` -- so a new option
with a launch flag is a preset key, a ``to_megatron_args`` flag and a ``plan --run`` flag checked against the
preset (``_cli_run.py``) with nothing written here. Two keys are the run's own on purpose: ``model`` (a preset
name or mapping, with ``megatron_args``' dropout / QK-norm on top) and ``memory`` (settings on top of what
``megatron_args`` imply) are the preset's source forms, which the options hold resolved (a ``ModelSpec``, a
``MemorySettings``). Where this module reads a value ``PlanOptions`` derives -- the checks that read files and run
the memory model, the number an ``auto`` budget becomes, the balancing in effect, the as-written form -- it goes
through one small function each (``_resolved``, ``_budget_tokens``, ``_balancing``, ``_written``).

Every problem raises :class:`~megatron_dynbatch.core.errors.DynBatchConfigError` at construction, naming the field,
its value and the fix; unknown keys are rejected with close-match suggestions. Bare names resolve in the
``runs/`` sibling of every model-preset directory (:func:`run_preset_dirs`), so ``$MEGATRON_DYNBATCH_CONFIGS``
works for both kinds of preset. The dataclass is frozen and normalises only in ``__post_init__`` (its helpers
return the values it stores).

This module is pure Python (+ PyYAML): it never imports torch or megatron.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from .checks import did_you_mean
from .checks import is_bool as _is_bool
from .checks import is_int as _is_int
from .errors import DynBatchConfigError, trainer_terms
from .model_spec import ModelSpec
from .planner.options import AUTO, BalanceBy, PlanOptions, ResolvedOptions
from .presets import available_presets, available_run_presets, load_run_mapping, resolve_run_preset, run_preset_dirs
from .parallel import ALIASES as _PARALLEL_ALIASES
from .parallel import EXTRA_KEYS as _PARALLEL_EXTRA
from .parallel import DEFAULT_GPUS_PER_NODE, ParallelConfig, layout_key_meaning, parallel_from_mapping

__all__ = ["RunConfig", "run_preset_dirs", "available_run_presets", "LOSS_MODES", "MOE_DISPATCHERS", "OPTION_KEYS",
           "dynamic_cp_problem"]

# Kept as literals (not imported from megatron/loss.py, which needs torch); tests check them against it.
LOSS_MODES = ("token_mean", "sample_mean", "group_mean", "token_sum")
GROUP_REDUCE = ("token", "sample")
#: MoE token dispatchers that accept variable token counts per rank (``allgather`` does not).
MOE_DISPATCHERS = ("alltoall", "flex")

# Megatron flags that make an uneven pipeline split legal (layers not divisible by pp * vpp).
_UNEVEN_PP_FLAGS = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                    "--pipeline-model-parallel-layout")


#: the launch flag of every option a Megatron launch sets by a flag of its own (the field metadata's spelling)
_LAUNCH_FLAGS: Dict[str, str] = PlanOptions.spellings("megatron")
#: the preset keys that go into the options: the layout, and every option with a launch flag (in field order)
OPTION_KEYS: Tuple[str, ...] = ("parallel",) + tuple(_LAUNCH_FLAGS)
_OPTION_DEFAULTS: Dict[str, Any] = {f.name: f.default for f in fields(PlanOptions)
                                    if f.init and f.default is not dataclasses.MISSING}


# -------------------------------------------------------------- the reads of values PlanOptions derives
# One place to adapt when resolving the options becomes a step of its own (``PlanOptions.resolve()``): today
# constructing the options reads and checks everything, so ``_resolved`` is the options themselves.
def _resolved(options: PlanOptions) -> ResolvedOptions:
    """The options with what they name read and computed (the model, the cost model, an ``auto`` budget's number,
    the balancing in effect: :meth:`PlanOptions.resolve`); a preset is refused at load time when this fails."""
    return options.resolve()


def _written(options: PlanOptions) -> Dict[str, Any]:
    """The options as a preset writes them: ``"auto"`` for a budget the memory model chooses, ``None`` for a
    ``balance_by`` left to its default (:meth:`PlanOptions.to_kwargs`)."""
    return options.to_kwargs()


def _budget_tokens(options: PlanOptions) -> int:
    """The budget as a number of tokens (for ``"auto"``: the memory model's choice)."""
    return int(_resolved(options).max_tokens_per_gpu)


def _balancing(options: PlanOptions) -> BalanceBy:
    """What the options balance, the default made explicit (``time`` with a model)."""
    return BalanceBy.parse(_resolved(options).balance_by)


def _launch_flag(name: str, value: Any) -> List[str]:
    """The Megatron flag (and value) of preset option ``name``; nothing for a value at the option's default."""
    if name == "balance_by" and value == BalanceBy.TIME:
        return ["--balance-by-flops"]  # the peers' name for balancing compute (the default, said outright)
    if value is None or value == _OPTION_DEFAULTS.get(name):
        return []
    flag = _LAUNCH_FLAGS[name]
    if isinstance(value, bool):  # a switch; --no-... says off where the option's default is "decide for me"
        return [flag] if value else ["--no-" + flag[2:]]
    return [flag, repr(value) if isinstance(value, float) else str(value)]


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A validated run preset. Build it with :meth:`from_yaml` (a file or a preset name), :meth:`from_dict` or
    :meth:`from_any`; see ``configs/runs/*.yaml`` for the YAML form and the module docstring for the purpose.

    The planning options are one :class:`~megatron_dynbatch.core.planner.options.PlanOptions` (:attr:`options`);
    the YAML form keeps them as flat keys (``max_tokens_per_gpu: 16384``, ``parallel: {...}``), and
    :meth:`from_dict` routes every key that names a preset option (:data:`OPTION_KEYS`) into it. Read them as
    ``run.options.<field>`` (``run.options.balance_by``, ``run.options.samples_per_step``, ...).

    Fields:
        name: label of the run.
        model: a model preset name (``"qwen3-8b"``) or a mapping of ModelSpec fields -- the preset's own form,
            kept for the YAML form; the options hold the resolved :class:`ModelSpec` (with what ``megatron_args``
            say beyond its shape on top: :meth:`model_spec`).
        options: the planning options (a :class:`PlanOptions`, or a mapping of :data:`OPTION_KEYS`), with
            ``model`` and ``memory`` filled in here. The preset keys are the options a Megatron launch sets by a
            flag of its own (``PlanOptions.spellings("megatron")``: ``max_tokens_per_gpu`` -- a number or ``auto``,
            which :meth:`budget` turns into the number --, ``balance_by``, ``cost_model``, ``decision_margin``,
            ``oversize``, ``fp8_alignment``, ``samples_per_step`` (Megatron's ``--global-batch-size`` too),
            ``dynamic_cp``, ``min_cp_size``, ``gpu_memory_gb``, ``memory_probe``; each documented on its
            ``PlanOptions`` field) plus ``parallel`` -- the layout (``dp`` is derived from ``world_size`` when
            given; ``etp`` goes to ``expert_tensor_parallel_size``; read it with :meth:`parallel`). Dynamic CP is
            refused here where the run cannot use it (:func:`dynamic_cp_problem`: also ``group_size`` and
            Megatron's own ``--hybrid-context-parallel`` in ``megatron_args``).
        log_probs_max_tokens_per_gpu: budget of forward-only passes (log-probs, reference model); no
            activations are kept for backward there, so it is usually larger; ``auto`` sizes it for the forward
            pass. Default: ``max_tokens_per_gpu``. (Not an option of its own: :meth:`plan_options` with
            ``forward_only=True`` gives the options of that pass.)
        memory: memory-model settings the Megatron flags in ``megatron_args`` do not imply
            (:class:`~megatron_dynbatch.core.memory.MemorySettings` fields, e.g. ``{headroom: 0.15}``; passed as
            ``--dynbatch-memory``) -- the preset's own form, on top of ``megatron_args``; :meth:`memory_settings`
            is what an ``auto`` budget assumes (the options' ``memory``).
        trainers: the trainers the preset is written for (``megatron-lm``, ``slime``, ``verl``, ``roll``,
            ``nemo-rl``; empty: ``megatron-lm``, this package's own launch). Each loss keeps its own bytes over the
            vocabulary (``core/memory/loss_paths.py``): ``megatron-dynbatch budget --run`` prints every named
            trainer's budget from its own loss path and judges numeric budgets against each, and the shipped
            presets fit every trainer they name (``tests/test_run_config.py``). An ``auto`` budget is chosen
            again with the loss path of the trainer that launches.
        loss_mode: ``"token_mean"`` (default), ``"sample_mean"``, ``"group_mean"`` or ``"token_sum"``.
        group_reduce: for ``group_mean``: ``"token"`` (default) or ``"sample"``.
        group_size: samples per group (GRPO responses per prompt); consecutive samples form a group and stay on
            one DP rank. ``None`` = no groups.
        expert_tensor_parallel_size: Megatron's ETP for expert layers (default: ``tp``).
        moe_token_dispatcher_type: ``"alltoall"`` (default for MoE) or ``"flex"``; ``"allgather"`` is refused.
        online_calibration: time every micro-batch during training and refit the cost model every
            ``calibration_interval`` steps (default 50), every rank planning with the same refitted model
            (``--dynbatch-online-calibration``; ``docs/cost_model.md``). Never changes the loss.
        calibration_interval: optimizer steps between refits (needs ``online_calibration``); passed as
            ``--dynbatch-calibration-interval``.
        max_seq_len: the longest sample the run can produce (prompt + response); checked against both budgets
            at construction, so a budget too small for it fails before step 1 (``OversizeSampleError``, or a
            warning under ``oversize: alone``), and passed to Megatron as ``--dynbatch-max-seq-length``.
            ``None`` = not checked here (Megatron's flags check ``--seq-length``).
        megatron_args: extra Megatron flags appended verbatim by :meth:`to_megatron_args`.
        description: free text.
    """

    name: str
    model: Union[str, Mapping[str, Any]]
    options: PlanOptions
    log_probs_max_tokens_per_gpu: Union[None, int, str] = None
    memory: Mapping[str, Any] = field(default_factory=dict, hash=False)
    trainers: Tuple[str, ...] = ()
    loss_mode: str = "token_mean"
    group_reduce: str = "token"
    group_size: Optional[int] = None
    expert_tensor_parallel_size: Optional[int] = None
    moe_token_dispatcher_type: Optional[str] = None
    online_calibration: bool = False
    calibration_interval: Optional[int] = None
    max_seq_len: Optional[int] = None
    megatron_args: Tuple[str, ...] = ()
    description: str = ""

    # ------------------------------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass: normalised here only
        if not isinstance(self.name, str) or not self.name.strip():
            raise DynBatchConfigError("name", self.name, "must be a non-empty string",
                                      "name the run, e.g. 'qwen3-8b-grpo'")
        if not isinstance(self.description, str):
            raise DynBatchConfigError("description", self.description, "must be a string", "write free text or omit it")
        if isinstance(self.megatron_args, (str, bytes, Mapping)) or not isinstance(self.megatron_args, (list, tuple)) \
                or not all(isinstance(a, str) for a in self.megatron_args):
            raise DynBatchConfigError("megatron_args", self.megatron_args, "must be a list of strings",
                                      "write one flag or value per list entry, "
                                      "e.g. ['--recompute-granularity', 'full']")
        set_("megatron_args", tuple(self.megatron_args))
        set_("trainers", self._checked_trainers())
        for f in fields(self):  # NumPy integers (accepted like ints) are stored as plain ints
            value = getattr(self, f.name)
            if _is_int(value):
                set_(f.name, int(value))
        given = self._given_options()
        set_("online_calibration", self._checked_calibration())
        spec = self._resolve_model()
        if not isinstance(self.memory, Mapping):
            raise DynBatchConfigError("memory", self.memory, "must be a mapping of memory settings",
                                      "write e.g. memory: {headroom: 0.15, trainer: slime}")
        set_("memory", dict(self.memory))
        par = ParallelConfig.from_any(given.pop("parallel", ParallelConfig()))
        self._check_dynamic_cp(par, given.get("dynamic_cp", False))  # before the options: it names dynamic_cp
        options = self._build_options(given, spec, par)
        resolved = _resolved(options)  # read and checked now: a preset is refused when it is loaded, not when used
        if options.balance_by is None:  # a preset says its balancing: the default made explicit (as to_dict writes)
            options = options.replace(balance_by=resolved.balance_by)
        set_("options", options)
        set_("log_probs_max_tokens_per_gpu", self._checked_log_probs_budget(options))
        self._check_choices()
        if self.max_seq_len is not None:
            set_("max_seq_len", self._checked_max_seq_len(par))
        self._check_steps(par)
        self._check_layout(spec, par)
        set_("moe_token_dispatcher_type", self._checked_moe(spec, par))

    def _given_options(self) -> Dict[str, Any]:
        """The options as given -- a mapping of :data:`OPTION_KEYS`, or a :class:`PlanOptions` whose other fields
        are at their defaults (a preset carries only what a launch can set) -- with the preset's own checks of
        ``dynamic_cp`` and ``cost_model`` (their fixes speak the YAML form)."""
        if isinstance(self.options, PlanOptions):
            written = _written(self.options)
            for key in PlanOptions.names():
                if key not in OPTION_KEYS and key not in ("model", "memory") and \
                        written[key] != _OPTION_DEFAULTS.get(key):
                    raise DynBatchConfigError(f"options.{key}", written[key], "is not a run preset option (a Megatron "
                                              "launch has no flag for it)", f"plan with PlanOptions directly, or "
                                              f"use only {', '.join(OPTION_KEYS)}")
            given = {key: written[key] for key in OPTION_KEYS + ("model", "memory")}  # the two: _build_options
        elif isinstance(self.options, Mapping):
            unknown = [k for k in self.options if k not in OPTION_KEYS]
            if unknown:
                raise DynBatchConfigError(str(unknown[0]), self.options[unknown[0]], "is not a run preset option",
                                          did_you_mean(str(unknown[0]), OPTION_KEYS) or
                                          f"use only {', '.join(OPTION_KEYS)}")
            given = {k: int(v) if _is_int(v) else v for k, v in self.options.items()}
        else:
            raise DynBatchConfigError("options", self.options, "must be PlanOptions or a mapping of preset options",
                                      "build the run with RunConfig.from_dict / from_yaml")
        dynamic_cp = given.get("dynamic_cp", False)
        if not _is_bool(dynamic_cp):
            raise DynBatchConfigError("dynamic_cp", dynamic_cp, "must be true or false",
                                      "write dynamic_cp: true (one dynamic-CP pool) or dynamic_cp: false")
        given["dynamic_cp"] = bool(dynamic_cp)
        self._check_cost_model(given.get("cost_model"))
        return given

    def _checked_trainers(self) -> Tuple[str, ...]:
        from .memory.loss_paths import TRAINERS, check_trainer

        if isinstance(self.trainers, (str, bytes, Mapping)) or not isinstance(self.trainers, (list, tuple)):
            raise DynBatchConfigError("trainers", self.trainers, "must be a list of trainer names",
                                      f"write e.g. trainers: [megatron-lm, slime] (known: {', '.join(TRAINERS)})")
        return tuple(check_trainer(t, f"trainers[{i}]") for i, t in enumerate(self.trainers))

    def named_trainers(self) -> Tuple[str, ...]:
        """The trainers the preset names (``("megatron-lm",)`` when it names none)."""
        return self.trainers or ("megatron-lm",)

    @staticmethod
    def _check_cost_model(cost_model: Any) -> None:
        from .cost_profiles import PROFILES, is_cost_model_choice

        if cost_model is not None and (not isinstance(cost_model, str) or not is_cost_model_choice(cost_model)):
            raise DynBatchConfigError("cost_model", cost_model, "is neither a cost profile nor a file",
                                      f"write one of {sorted(PROFILES)} or the path of a cost-model JSON file")

    def _checked_calibration(self) -> bool:
        if not _is_bool(self.online_calibration):
            raise DynBatchConfigError("online_calibration", self.online_calibration, "must be true or false",
                                      "write online_calibration: true (refit the cost model while training) or false")
        on = bool(self.online_calibration)
        if self.calibration_interval is None:
            return on
        if not on:
            raise DynBatchConfigError("calibration_interval", self.calibration_interval, "only means something with "
                                      "online_calibration: true", "add online_calibration: true, or drop the interval")
        if not _is_int(self.calibration_interval) or self.calibration_interval < 1:
            raise DynBatchConfigError("calibration_interval", self.calibration_interval, "must be a whole number of "
                                      "optimizer steps >= 1", "write e.g. calibration_interval: 50")
        return on

    def _resolve_model(self) -> ModelSpec:
        """The model preset (or mapping), with what ``megatron_args`` say beyond its shape (``--hidden-dropout``,
        ``--attention-dropout``, ``--qk-layernorm``) on top: the launch decides those."""
        from .memory.megatron_flags import model_overrides_from_megatron

        over = model_overrides_from_megatron(self.megatron_args)
        if isinstance(self.model, str):
            if not self.model.strip():
                raise DynBatchConfigError("model", self.model, "is empty",
                                          f"use a preset name ({', '.join(available_presets())})")
            spec = ModelSpec.from_yaml(self.model)
            return spec.replace(**over) if over else spec
        if isinstance(self.model, Mapping):
            return ModelSpec.from_dict({"name": self.name, **dict(self.model), **over})
        raise DynBatchConfigError("model", self.model, "must be a model preset name or a mapping of ModelSpec fields",
                                  "write model: qwen3-8b, or model: {num_layers: ..., hidden_size: ...}")

    def _build_options(self, given: Dict[str, Any], spec: ModelSpec, par: ParallelConfig) -> PlanOptions:
        """The planner's options from the preset's keys, the resolved model and layout (``memory``:
        :meth:`memory_settings`, which only an ``auto`` budget reads) -- checked by the planner's own rules. Options
        given whole may hold the model and memory only as the run's own ``model`` / ``memory`` give them."""
        auto = AUTO in (given.get("max_tokens_per_gpu"), self.log_probs_max_tokens_per_gpu)
        settings = self.memory_settings()  # checked whatever the budget (a bad key fails here, as from Python)
        own = {"model": spec, "memory": settings if auto else None}
        for key, mine in own.items():
            theirs = given.pop(key, None)
            if theirs is not None and theirs != mine:
                raise DynBatchConfigError(f"options.{key}", getattr(theirs, "name", None) or type(theirs).__name__,
                                          f"differs from what the run's own '{key}' gives",
                                          f"drop it from the options and write {key}: ... at the top level")
        return PlanOptions(**given, parallel=par, **own)

    def _checked_log_probs_budget(self, options: PlanOptions) -> Union[None, int, str]:
        """The log-prob budget, checked as the budget of the forward-only options; stored as ``"auto"`` or the
        plain int (4096.0 -> 4096)."""
        if self.log_probs_max_tokens_per_gpu is None:
            return None
        with trainer_terms({"max_tokens_per_gpu": "log_probs_max_tokens_per_gpu"}):
            forward = options.for_forward_only(self.log_probs_max_tokens_per_gpu)
            _resolved(forward)
        return _written(forward)["max_tokens_per_gpu"]

    def memory_settings(self) -> Any:
        """What an ``auto`` budget assumes about memory: the settings ``megatron_args`` imply (optimizer layout,
        recompute, dtypes, ETP: :func:`~megatron_dynbatch.core.memory.settings_from_megatron`) with ``memory``
        on top."""
        from .memory import settings_from_megatron

        etp = {"expert_tensor_parallel_size": self.expert_tensor_parallel_size} \
            if self.expert_tensor_parallel_size else {}
        with trainer_terms({}):
            return settings_from_megatron(list(self.megatron_args), **etp, **dict(self.memory))

    def budget(self, *, forward_only: bool = False) -> int:
        """The token budget of the training pass (or the log-prob pass), as a number: an ``auto`` budget is the
        memory model's choice for ``gpu_memory_gb``."""
        return _budget_tokens(self.plan_options(forward_only=forward_only))

    def budget_as_written(self, *, forward_only: bool = False) -> Union[int, str]:
        """The budget of the training pass (or the log-prob pass) as the preset says it: a number or ``"auto"``
        (:meth:`budget` gives the number)."""
        train = _written(self.options)["max_tokens_per_gpu"]
        return (self.log_probs_max_tokens_per_gpu or train) if forward_only else train

    def _checked_max_seq_len(self, par: ParallelConfig) -> int:
        """The start-up check (``core/startup.py``) for both budgets; returns ``max_seq_len`` as the plain int it
        is (also when given as 8192.0)."""
        from .checks import as_int
        from .startup import check_max_seq_len_fits

        longest = as_int(self.max_seq_len, "max_seq_len", minimum=1, fix="set the longest sample the run can produce")
        opts = self.options
        for name, forward_only in (("max_tokens_per_gpu", False), ("log_probs_max_tokens_per_gpu", True)):
            if forward_only and self.log_probs_max_tokens_per_gpu is None:
                continue
            check_max_seq_len_fits(longest, max_tokens_per_gpu=self.budget(forward_only=forward_only), parallel=par,
                                   fp8_alignment=opts.fp8_alignment, oversize=opts.oversize,
                                   length_field="max_seq_len", budget_field=name, dynamic_cp=opts.dynamic_cp,
                                   options=_resolved(self.plan_options(forward_only=forward_only)))
        return longest

    def _check_choices(self) -> None:
        for name, allowed in (("loss_mode", LOSS_MODES), ("group_reduce", GROUP_REDUCE)):
            value = getattr(self, name)
            if value not in allowed:
                hint = did_you_mean(value, allowed, n=1, cutoff=0.5)
                hint = hint + " " if hint else ""
                raise DynBatchConfigError(name, value, "is not a known choice", f"{hint}use one of {list(allowed)}")

    def _check_steps(self, par: ParallelConfig) -> None:
        if self.group_size is not None and (not _is_int(self.group_size) or self.group_size < 1):
            raise DynBatchConfigError("group_size", self.group_size, "must be a positive integer or null",
                                      "set group_size to a whole number, or remove it")
        g = self.group_size or 1
        samples = self.options.samples_per_step  # a whole number >= 1 or None: the options checked it
        if samples is not None:
            if samples % g:
                raise DynBatchConfigError("samples_per_step", samples,
                                          f"is not a multiple of group_size={g}, so a group would span two steps",
                                          f"use a multiple of {g}")
            if samples % par.dp:
                raise DynBatchConfigError(
                    "samples_per_step", samples,
                    f"is not divisible by dp={par.dp}; it becomes Megatron's --global-batch-size, which must divide by "
                    f"--micro-batch-size (1) x dp", f"use a multiple of {par.dp}")
            if samples // g < par.dp:
                what = "groups" if self.group_size else "samples"
                raise DynBatchConfigError(
                    "samples_per_step", samples,
                    f"gives {samples // g} {what} per step for dp={par.dp} ranks, so a rank would run "
                    f"an empty micro-batch", f"use at least {par.dp * g}")
        if self.loss_mode == "group_mean" and self.group_size is None:
            raise DynBatchConfigError("group_size", None, "loss_mode='group_mean' needs groups",
                                      "set group_size (responses per prompt), or use loss_mode: token_mean")

    def _check_layout(self, spec: ModelSpec, par: ParallelConfig) -> None:
        heads, groups = spec.num_attention_heads, spec.num_query_groups
        if heads % par.tp:
            raise DynBatchConfigError("parallel.tp", par.tp, f"does not divide num_attention_heads={heads} of "
                                      f"{spec.name}", f"use a tp that divides {heads}")
        if not spec.multi_latent_attention and groups % par.tp:
            raise DynBatchConfigError("parallel.tp", par.tp, f"does not divide num_query_groups={groups} of "
                                      f"{spec.name} (Megatron splits KV heads over TP ranks)",
                                      f"use a tp that divides {groups}")
        if par.sequence_parallel and par.tp == 1:
            raise DynBatchConfigError("parallel.sequence_parallel", True, "needs tensor parallelism (tp > 1); "
                                      "Megatron silently turns it off at tp=1",
                                      "set sequence_parallel: false or tp > 1")
        uneven = any(a in self.megatron_args for a in _UNEVEN_PP_FLAGS)
        chunks = par.pp * par.vpp
        if chunks > 1 and spec.num_layers % chunks and not uneven:
            raise DynBatchConfigError(
                "parallel.pp", par.pp, f"pp x vpp = {chunks} does not divide num_layers={spec.num_layers}",
                f"choose pp/vpp dividing {spec.num_layers}, or add an uneven split to megatron_args "
                f"({' / '.join(_UNEVEN_PP_FLAGS)})")
        etp = self.expert_tensor_parallel_size
        if etp is not None and (not _is_int(etp) or etp < 1):
            raise DynBatchConfigError("parallel.etp", etp, "must be a positive integer",
                                      "use 1 or leave it unset (= tp)")

    def _checked_moe(self, spec: ModelSpec, par: ParallelConfig) -> Optional[str]:
        """The MoE checks; returns the token dispatcher (``alltoall`` when an MoE run names none)."""
        dispatcher = self.moe_token_dispatcher_type
        if not spec.is_moe:
            if par.ep > 1:
                raise DynBatchConfigError("parallel.ep", par.ep, f"expert parallelism needs an MoE model; "
                                          f"{spec.name} is dense", "set ep: 1")
            if dispatcher is not None:
                raise DynBatchConfigError("moe_token_dispatcher_type", dispatcher, f"{spec.name} is dense",
                                          "remove moe_token_dispatcher_type")
            return None
        if dispatcher is None:
            dispatcher = "alltoall"
        elif dispatcher not in MOE_DISPATCHERS:
            why = ("the allgather dispatcher needs the same token count on every rank, which dynamic micro-batches "
                   "do not have" if dispatcher == "allgather" else "unknown dispatcher")
            raise DynBatchConfigError("moe_token_dispatcher_type", dispatcher, why,
                                      f"use one of {list(MOE_DISPATCHERS)}")
        experts = int(spec.num_experts or 0)
        if experts % par.ep:
            raise DynBatchConfigError("parallel.ep", par.ep, f"does not divide num_experts={experts}",
                                      f"use an ep that divides {experts}")
        etp = self.expert_tensor_parallel_size or par.tp
        group = etp * par.ep * par.pp
        if par.world_size % group:
            raise DynBatchConfigError(
                "parallel.ep", par.ep, f"world size {par.world_size} is not divisible by etp x ep x pp = "
                f"{etp} x {par.ep} x {par.pp} (Megatron's expert-parallel grid)",
                "choose ep (and etp) so that etp * ep * pp divides dp * tp * pp * cp")
        return dispatcher

    def _check_dynamic_cp(self, par: ParallelConfig, dynamic_cp: bool) -> None:
        flag = "--dynbatch-dynamic-cp"
        if flag in self.megatron_args:
            raise DynBatchConfigError("megatron_args", flag, "turns dynamic CP on behind the planner's back "
                                      "(planner_kwargs would not know)", f"remove {flag} and set dynamic_cp: true")
        if not dynamic_cp:
            return
        problem = dynamic_cp_problem(par, grouped=self.group_size is not None,
                                     hybrid_cp="--hybrid-context-parallel" in self.megatron_args)
        if problem is not None:
            raise DynBatchConfigError("dynamic_cp", True, problem[0], problem[1])

    # --------------------------------------------------------------------------------------------- views
    def model_spec(self) -> ModelSpec:
        """The resolved :class:`ModelSpec` (the options' model, validated at construction)."""
        return self.options.model

    def parallel(self) -> ParallelConfig:
        """The :class:`ParallelConfig` of the run (the YAML ``parallel:`` mapping, validated; the options'
        ``parallel``)."""
        return self.options.parallel

    @property
    def world_size(self) -> int:
        return self.options.parallel.world_size

    @property
    def effective_log_probs_max_tokens_per_gpu(self) -> Union[int, str]:
        """The log-prob pass's budget as written (``log_probs_max_tokens_per_gpu``, else the training budget)."""
        return self.budget_as_written(forward_only=True)

    def group_ids(self, num_samples: int) -> Optional[List[int]]:
        """Group id of each sample when consecutive ``group_size`` samples form a group (GRPO layout), else
        ``None``. Pass it as ``plan_global_batch(..., group_ids=...)``."""
        if self.group_size is None:
            return None
        if num_samples % self.group_size:
            raise DynBatchConfigError("num_samples", num_samples, f"is not a multiple of group_size={self.group_size}",
                                      "pass whole groups (prompts x responses per prompt)")
        return [i // self.group_size for i in range(num_samples)]

    def plan_options(self, *, forward_only: bool = False) -> PlanOptions:
        """The planner's options for this run (:attr:`options`, checked at construction); pass them as
        ``plan_global_batch(lengths, run.plan_options(), group_ids=run.group_ids(n))``.

        ``forward_only=True`` plans a log-prob / reference pass: the budget is
        ``log_probs_max_tokens_per_gpu`` and there is no optimizer step, so ``samples_per_step`` is dropped."""
        if forward_only:
            return self.options.for_forward_only(self.effective_log_probs_max_tokens_per_gpu)
        return self.options

    def to_megatron_args(self) -> List[str]:
        """The Megatron-LM command-line flags this preset implies, as an argv list.

        Layout (``--tensor-model-parallel-size`` ... ``--sequence-parallel``), the MoE dispatcher, the batch
        shape Megatron's bookkeeping needs (``--micro-batch-size 1 --global-batch-size samples_per_step``: the
        learning-rate schedule and the consumed-samples counter then count samples exactly), and the
        dynamic-batching flags of :mod:`megatron_dynbatch.megatron.args`: every preset option under its launch
        flag (``PlanOptions.spellings("megatron")``; an option at its default is left out -- so without
        ``fp8_alignment`` :mod:`megatron_dynbatch.megatron.args` derives it from Megatron's own ``--fp8-*`` flags
        --, and ``balance_by: time`` is the peers' ``--balance-by-flops``), then the run's own flags.
        ``group_size`` has no flag: at run time groups come from each sample's ``group_id``. Model-shape flags
        (``--num-layers``, norms, RoPE, ...) are not implied by a :class:`ModelSpec` and stay in the launch script.
        ``dp`` is not a flag: Megatron derives it from the world size.
        """
        p = self.parallel()
        out = ["--tensor-model-parallel-size", str(p.tp), "--pipeline-model-parallel-size", str(p.pp),
               "--context-parallel-size", str(p.cp)]
        if p.vpp > 1:
            out += ["--num-virtual-stages-per-pipeline-rank", str(p.vpp)]
        if p.microbatch_group_size_per_vp_stage is not None:
            out += ["--microbatch-group-size-per-virtual-pipeline-stage", str(p.microbatch_group_size_per_vp_stage)]
        if p.sequence_parallel:
            out.append("--sequence-parallel")
        if self.model_spec().is_moe:
            out += ["--expert-model-parallel-size", str(p.ep)]
            if self.expert_tensor_parallel_size is not None:
                out += ["--expert-tensor-parallel-size", str(self.expert_tensor_parallel_size)]
            out += ["--moe-token-dispatcher-type", str(self.moe_token_dispatcher_type)]
        samples = self.options.samples_per_step
        if samples is not None:  # Megatron's own batch shape: one sample per micro-batch slot
            out += ["--micro-batch-size", "1", "--global-batch-size", str(samples)]
        out.append("--use-dynamic-batch-size")
        for name, value in self._option_items():
            out += _launch_flag(name, value)
        if self.log_probs_max_tokens_per_gpu is not None:
            out += ["--log-probs-max-tokens-per-gpu", str(self.log_probs_max_tokens_per_gpu)]
        if self.memory:
            out += ["--dynbatch-memory", ",".join(f"{k}={v}" for k, v in self.memory.items())]
        if self.loss_mode != "token_mean":
            out += ["--dynbatch-loss-mode", self.loss_mode]
        if self.group_reduce != "token":
            out += ["--dynbatch-group-reduce", self.group_reduce]
        if self.online_calibration:
            out.append("--dynbatch-online-calibration")
        if self.calibration_interval is not None:
            out += ["--dynbatch-calibration-interval", str(self.calibration_interval)]
        if p.gpus_per_node != DEFAULT_GPUS_PER_NODE:
            out += ["--dynbatch-gpus-per-node", str(p.gpus_per_node)]
        if self.max_seq_len is not None:
            out += ["--dynbatch-max-seq-length", str(self.max_seq_len)]
        return out + list(self.megatron_args)

    # ----------------------------------------------------------------------------------- serialisation
    def _option_items(self) -> List[Tuple[str, Any]]:
        """``(key, value)`` of every preset option but the layout, as the YAML form writes it (a budget ``"auto"``
        or a number; ``balance_by`` the plain string of the balancing in effect), in the options' field order."""
        written = _written(self.options)
        written["balance_by"] = _balancing(self.options).value
        return [(key, written[key]) for key in OPTION_KEYS if key != "parallel"]

    def to_dict(self) -> Dict[str, Any]:
        """The YAML form (``parallel:`` as a mapping, the options as flat keys, model as given);
        ``RunConfig.from_dict(d) == self``."""
        layout = self.parallel().to_dict()
        if self.expert_tensor_parallel_size is not None:
            layout["etp"] = self.expert_tensor_parallel_size
        out: Dict[str, Any] = {"name": self.name, "model": dict(self.model) if isinstance(self.model, Mapping)
                               else self.model, "parallel": layout}
        out.update(self._option_items())
        for f in fields(self):
            if f.name in out or f.name in ("options", "expert_tensor_parallel_size"):
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if f.name in ("megatron_args", "trainers") else value
        return out

    def replace(self, **changes: Any) -> "RunConfig":
        """A copy with some preset keys changed (validated again): the run's own fields, any of
        :data:`OPTION_KEYS` (into the options), or ``options=`` whole. ``parallel=`` (a mapping merged into the
        current layout, or a ParallelConfig; ``layout=`` is the same) changes the layout."""
        if "layout" in changes:
            changes["parallel"] = changes.pop("layout")
        if "options" in changes:
            given = [k for k in changes if k in OPTION_KEYS]
            if given:
                raise DynBatchConfigError(given[0], changes[given[0]], "given with options=",
                                          "change the options once: options=... or the keys")
            return dataclasses.replace(self, **changes)
        options: Dict[str, Any] = dict(self._option_items(), parallel=self.parallel())
        if "parallel" in changes:
            par, etp = self._merged_layout(changes.pop("parallel"))
            options["parallel"] = par
            if etp is not None:
                changes.setdefault("expert_tensor_parallel_size", etp)
        for key in [k for k in changes if k in OPTION_KEYS]:
            options[key] = changes.pop(key)
        return dataclasses.replace(self, options=options, **changes)

    def _merged_layout(self, layout: Any) -> Tuple[ParallelConfig, Optional[int]]:
        """``replace(parallel=...)``: a ParallelConfig as is, a mapping merged into the current layout."""
        if isinstance(layout, ParallelConfig):
            return layout, None
        if not isinstance(layout, Mapping):
            raise DynBatchConfigError("parallel", layout, "must be a ParallelConfig or a mapping",
                                      "pass e.g. parallel={'dp': 4}")
        new = {_PARALLEL_ALIASES.get(k, k): v for k, v in layout.items()}
        merged = {**self.parallel().to_dict(), **new}
        if "world_size" in new and "dp" not in new:
            merged.pop("dp")  # dp follows the new world size
        return _parallel_from_mapping(merged)

    @classmethod
    def yaml_keys(cls) -> Tuple[str, ...]:
        """Every key of the YAML form: the run's own fields (``parallel`` for the layout) and the preset
        options (:data:`OPTION_KEYS`)."""
        own = [f.name for f in fields(cls) if f.init and f.name != "options"]
        return tuple(own[:2] + list(OPTION_KEYS) + own[2:])

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, name: Optional[str] = None) -> "RunConfig":
        """Build from the YAML mapping: the keys of :data:`OPTION_KEYS` go into the options, the rest are the
        run's own fields. Unknown keys raise an error naming the key with close matches."""
        if isinstance(data, RunConfig):
            return data
        if not isinstance(data, Mapping):
            raise DynBatchConfigError("run", type(data).__name__, "must be a mapping of run fields",
                                      "write 'model: ...', 'parallel: {...}', 'max_tokens_per_gpu: ...' "
                                      "at the top level")
        known = cls.yaml_keys()
        kwargs: Dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                meant = layout_key_meaning(key, outside=True)
                if key in {f.name for f in fields(ParallelConfig)} or key in _PARALLEL_EXTRA:
                    fix = f"layout keys go under 'parallel:' (parallel: {{{key}: {value!r}}})"
                elif key in _PARALLEL_ALIASES or meant:
                    fix = f"layout keys go under 'parallel:' (parallel: {{{_PARALLEL_ALIASES.get(key, meant[0])}: " \
                          f"{value!r}}})"
                else:
                    fix = did_you_mean(key, known) or f"use only {', '.join(known)}"
                raise DynBatchConfigError(str(key), value, "unknown run field", fix)
            kwargs[key] = value
        if name is not None and "name" not in kwargs:
            kwargs["name"] = name
        for required in ("model", "parallel", "max_tokens_per_gpu", "name"):
            if required not in kwargs:
                raise DynBatchConfigError(required, None, "is required", f"add '{required}: ...' to the run config")
        par = kwargs["parallel"]
        if not isinstance(par, ParallelConfig):
            par, etp = _parallel_from_mapping(par)
            kwargs["parallel"] = par
            if etp is not None:
                if kwargs.get("expert_tensor_parallel_size") not in (None, etp):
                    raise DynBatchConfigError("parallel.etp", etp, "conflicts with expert_tensor_parallel_size",
                                              "give the expert tensor-parallel size once")
                kwargs["expert_tensor_parallel_size"] = etp
        if "megatron_args" in kwargs and isinstance(kwargs["megatron_args"], list):
            kwargs["megatron_args"] = tuple(str(a) if _is_int(a) else a for a in kwargs["megatron_args"])
        options = {key: kwargs.pop(key) for key in OPTION_KEYS if key in kwargs}
        return cls(options=options, **kwargs)

    @classmethod
    def from_yaml(cls, path_or_name: Union[str, os.PathLike]) -> "RunConfig":
        """Load ``configs/runs/<name>.yaml`` by bare name (see :func:`run_preset_dirs`) or any YAML file."""
        path = resolve_run_preset(path_or_name)
        return cls.from_dict(load_run_mapping(path), name=path.stem)

    @classmethod
    def from_any(cls, run: Union["RunConfig", Mapping[str, Any], str, os.PathLike]) -> "RunConfig":
        """A ``RunConfig``, a mapping, a preset name or a YAML path."""
        if isinstance(run, RunConfig):
            return run
        if isinstance(run, Mapping):
            return cls.from_dict(run)
        if isinstance(run, (str, os.PathLike)):
            return cls.from_yaml(run)
        raise DynBatchConfigError("run", run, "cannot build a RunConfig from this",
                                  f"pass a preset name ({', '.join(available_run_presets())}), a YAML path or a dict")




# --------------------------------------------------------------------------------------------- helpers
def dynamic_cp_problem(par: ParallelConfig, *, grouped: bool = False, hybrid_cp: bool = False,
                       off: str = "turn dynamic CP off") -> Optional[Tuple[str, str]]:
    """Why a run cannot use dynamic CP, as ``(problem, fix)``, or ``None`` when it can: a pool of one GPU,
    ``pp=2`` with ``vpp > 1``, GRPO groups kept on one DP rank (``grouped``), or Megatron's own hybrid CP.
    ``off`` says how the caller's user turns it off. Shared by :class:`RunConfig`, ``megatron-dynbatch plan
    --dynamic-cp`` and the ``--dynbatch-dynamic-cp`` launch flag, so all three refuse the same runs. (Balancing is
    an option's rule: :class:`PlanOptions` refuses ``balance_by`` other than ``time`` under dynamic CP.)"""
    if par.dp * par.cp == 1:
        return ("the pool (dp x cp of a pipeline stage) is one GPU, so there is no CP group to choose",
                f"use dp x cp > 1, or {off}")
    if par.pp == 2 and par.vpp > 1:
        return ("with pp=2 and an interleaved schedule megatron-core 0.16 needs one micro-batch length per rank "
                "(NVIDIA/Megatron-LM #5100), which CP groups of different sizes do not give",
                f"use vpp=1 or another pp, or {off}")
    if grouped:
        return ("groups that stay on one DP rank (group_size / group ids) have no meaning when a sample's CP group "
                "spans several DP ranks", f"drop the groups, or {off}")
    if hybrid_cp:
        return ("Megatron's own --hybrid-context-parallel reroutes samples with its scheduler; the two cannot both "
                "plan the batch", f"remove --hybrid-context-parallel, or {off}")
    return None


def _parallel_from_mapping(par: Any) -> Tuple[ParallelConfig, Optional[int]]:
    """ParallelConfig from the YAML ``parallel:`` mapping (``world_size`` derives ``dp``; ``etp`` is split off):
    :func:`~megatron_dynbatch.core.parallel.parallel_from_mapping`, which ``plan_global_batch(parallel=...)`` uses
    too."""
    return parallel_from_mapping(par)
