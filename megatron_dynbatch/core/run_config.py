"""Run presets: one typed, validated object for everything a dynamic-batching training run decides.

A :class:`RunConfig` names the model (a preset such as ``"qwen3-8b"`` or an inline mapping of
:class:`~megatron_dynbatch.core.model_spec.ModelSpec` fields), the parallel layout, the token budgets, the
balancing mode, the oversize policy, FP8 alignment, the loss normalisation, the optimizer-step size and whether
the ``dp x cp`` GPUs are planned as one dynamic-CP pool (``docs/dynamic_cp.md``). It is
the single source for three consumers that must agree with each other:

* the planner -- :meth:`RunConfig.plan_options` gives the planner's
  :class:`~megatron_dynbatch.core.planner.options.PlanOptions` (training, or the forward-only log-prob pass),
  built once at construction, so the preset's planning fields are checked by the planner's own rules;
* Megatron -- :meth:`RunConfig.to_megatron_args` gives the command-line flags the preset implies (layout,
  dispatcher, batching flags); model-shape flags stay in the launch script;
* people -- ``configs/runs/<name>.yaml`` is readable and is checked at load time.

Every problem raises :class:`~megatron_dynbatch.core.errors.DynBatchConfigError` at construction, naming the field,
its value and the fix; unknown keys are rejected with close-match suggestions. Bare names resolve in the
``runs/`` sibling of every model-preset directory (:func:`run_preset_dirs`), so ``$MEGATRON_DYNBATCH_CONFIGS``
works for both kinds of preset.

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
from .planner.options import AUTO, BalanceBy, PlanOptions
from .presets import available_presets, available_run_presets, load_run_mapping, resolve_run_preset, run_preset_dirs
from .parallel import ALIASES as _PARALLEL_ALIASES
from .parallel import EXTRA_KEYS as _PARALLEL_EXTRA
from .parallel import DEFAULT_GPUS_PER_NODE, ParallelConfig, layout_key_meaning, parallel_from_mapping

__all__ = ["RunConfig", "run_preset_dirs", "available_run_presets", "LOSS_MODES", "MOE_DISPATCHERS",
           "dynamic_cp_problem"]

# Kept as literals (not imported from megatron/loss.py, which needs torch); tests check them against it.
LOSS_MODES = ("token_mean", "sample_mean", "group_mean", "token_sum")
GROUP_REDUCE = ("token", "sample")
#: MoE token dispatchers that accept variable token counts per rank (``allgather`` does not).
MOE_DISPATCHERS = ("alltoall", "flex")

# Megatron flags that make an uneven pipeline split legal (layers not divisible by pp * vpp).
_UNEVEN_PP_FLAGS = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                    "--pipeline-model-parallel-layout")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A validated run preset. Build it with :meth:`from_yaml` (a file or a preset name), :meth:`from_dict` or
    :meth:`from_any`; see ``configs/runs/*.yaml`` for the YAML form and the module docstring for the purpose.

    Fields:
        name: label of the run.
        model: a model preset name (``"qwen3-8b"``) or a mapping of ModelSpec fields.
        layout: the :class:`ParallelConfig` -- the ``parallel:`` mapping of the YAML form (``dp`` is derived from
            ``world_size`` when given; ``etp`` goes to ``expert_tensor_parallel_size``). Read it with
            :meth:`parallel`.
        max_tokens_per_gpu: per-GPU token budget of a training micro-batch (a micro-batch holds at most
            ``max_tokens_per_gpu * cp`` tokens after alignment padding), or ``auto``: the largest the memory model
            says fits ``gpu_memory_gb`` with :meth:`memory_settings` (:meth:`budget` gives the number).
        log_probs_max_tokens_per_gpu: budget of forward-only passes (log-probs, reference model); no
            activations are kept for backward there, so it is usually larger; ``auto`` sizes it for the forward
            pass. Default: ``max_tokens_per_gpu``.
        balance_by: what balancing equalises: ``"time"`` (default: the cost model's seconds -- FLOPs at their
            kernels' efficiency), ``"flops"`` (raw FLOPs) or ``"tokens"``
            (:class:`~megatron_dynbatch.core.planner.options.BalanceBy`).
        oversize: ``"error"`` (default) or ``"alone"`` for a sample longer than the budget.
        fp8_alignment: ``None``, a recipe name (``"fp8"``, ``"mxfp8"``, ``"nvfp4"``, ...) or a token multiple.
        loss_mode: ``"token_mean"`` (default), ``"sample_mean"``, ``"group_mean"`` or ``"token_sum"``.
        group_reduce: for ``group_mean``: ``"token"`` (default) or ``"sample"``.
        samples_per_step: samples per optimizer step (Megatron's ``--global-batch-size``); ``None`` = the whole
            global batch is one step.
        group_size: samples per group (GRPO responses per prompt); consecutive samples form a group and stay on
            one DP rank. ``None`` = no groups.
        expert_tensor_parallel_size: Megatron's ETP for expert layers (default: ``tp``).
        moe_token_dispatcher_type: ``"alltoall"`` (default for MoE) or ``"flex"``; ``"allgather"`` is refused.
        dynamic_cp: plan the ``dp x cp`` GPUs of each pipeline stage as one pool and give every micro-batch its
            own CP group (``plan_global_batch(..., dynamic_cp=True)``, Megatron flag ``--dynbatch-dynamic-cp``;
            ``docs/dynamic_cp.md``). Refused where the run cannot use it: a pool of one GPU, ``pp=2`` with
            ``vpp > 1``, ``group_size`` (GRPO groups on one DP rank), ``balance_by`` other than ``time`` (dynamic
            CP balances the cost model's seconds: the planner options' rule) and Megatron's own
            ``--hybrid-context-parallel`` in ``megatron_args``.
        min_cp_size: with ``dynamic_cp``: every CP group the planner forms has at least this many GPUs (a power
            of two, at most ``cp``; ``None`` = 1); passed as ``--dynbatch-min-cp-size`` (Megatron-LM dev's
            ``--min-dynamic-context-parallel-size``; ``docs/dynamic_cp.md``).
        cost_model: the cost model the planner uses: a profile name (``fitted``, the default; ``analytic``) or
            a cost-model JSON file (``docs/cost_model.md``); passed as ``--dynbatch-cost-model``.
        decision_margin: the planner leaves its default choice (fewest micro-batches; fixed CP under
            ``dynamic_cp``) only for a modelled gain above this (relative); ``None`` = the cost model's
            ``uncertainty``. Passed as ``--dynbatch-decision-margin``.
        online_calibration: time every micro-batch during training and refit the cost model every
            ``calibration_interval`` steps (default 50), every rank planning with the same refitted model
            (``--dynbatch-online-calibration``; ``docs/cost_model.md``). Never changes the loss.
        calibration_interval: optimizer steps between refits (needs ``online_calibration``); passed as
            ``--dynbatch-calibration-interval``.
        gpu_memory_gb: the GPU's memory in GiB; needed by an ``auto`` budget (passed as
            ``--dynbatch-gpu-memory-gb``, so the launch plans for the card the preset was written for).
        trainers: the trainers the preset is written for (``megatron-lm``, ``slime``, ``verl``, ``roll``,
            ``nemo-rl``; empty: ``megatron-lm``, this package's own launch). Each loss keeps its own bytes over the
            vocabulary (``core/memory/loss_paths.py``): ``megatron-dynbatch budget --run`` prints every named
            trainer's budget from its own loss path and judges numeric budgets against each, and the shipped
            presets fit every trainer they name (``tests/test_run_config.py``). An ``auto`` budget is chosen
            again with the loss path of the trainer that launches.
        memory: memory-model settings the Megatron flags in ``megatron_args`` do not imply
            (:class:`~megatron_dynbatch.core.memory.MemorySettings` fields, e.g. ``{headroom: 0.15}``; passed as
            ``--dynbatch-memory``); :meth:`memory_settings` is what an ``auto`` budget assumes.
        memory_probe: the first-step memory probe (``megatron/probe.py``): ``None`` = on where a CUDA device is
            present, ``false`` = off (``--no-dynbatch-memory-probe``), ``true`` = on (``--dynbatch-memory-probe``).
        max_seq_len: the longest sample the run can produce (prompt + response); checked against both budgets
            at construction, so a budget too small for it fails before step 1 (``OversizeSampleError``, or a
            warning under ``oversize: alone``), and passed to Megatron as ``--dynbatch-max-seq-length``.
            ``None`` = not checked here (Megatron's flags check ``--seq-length``).
        megatron_args: extra Megatron flags appended verbatim by :meth:`to_megatron_args`.
        description: free text.
    """

    name: str
    model: Union[str, Mapping[str, Any]]
    layout: ParallelConfig
    max_tokens_per_gpu: Union[int, str]
    log_probs_max_tokens_per_gpu: Union[None, int, str] = None
    gpu_memory_gb: Optional[float] = None
    memory: Mapping[str, Any] = field(default_factory=dict, hash=False)
    trainers: Tuple[str, ...] = ()
    balance_by: str = "time"
    oversize: str = "error"
    fp8_alignment: Union[None, str, int] = None
    loss_mode: str = "token_mean"
    group_reduce: str = "token"
    samples_per_step: Optional[int] = None
    group_size: Optional[int] = None
    expert_tensor_parallel_size: Optional[int] = None
    moe_token_dispatcher_type: Optional[str] = None
    dynamic_cp: bool = False
    min_cp_size: Optional[int] = None
    cost_model: Optional[str] = None
    decision_margin: Optional[float] = None
    online_calibration: bool = False
    calibration_interval: Optional[int] = None
    max_seq_len: Optional[int] = None
    memory_probe: Optional[bool] = None
    megatron_args: Tuple[str, ...] = ()
    description: str = ""
    _spec: Optional[ModelSpec] = field(default=None, init=False, repr=False, compare=False)
    _options: Any = field(default=None, init=False, repr=False, compare=False)

    # ------------------------------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
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
        self._check_trainers()
        for f in fields(self):  # NumPy integers (accepted like ints) are stored as plain ints
            value = getattr(self, f.name)
            if _is_int(value):
                set_(f.name, int(value))
        if not _is_bool(self.dynamic_cp):
            raise DynBatchConfigError("dynamic_cp", self.dynamic_cp, "must be true or false",
                                      "write dynamic_cp: true (one dynamic-CP pool) or dynamic_cp: false")
        set_("dynamic_cp", bool(self.dynamic_cp))
        self._check_cost_model()
        self._check_calibration()
        spec = self._resolve_model()
        set_("_spec", spec)
        if not isinstance(self.layout, ParallelConfig):
            set_("layout", ParallelConfig.from_any(self.layout))
        par: ParallelConfig = self.layout

        self._check_dynamic_cp(par)  # before the options: it names dynamic_cp, theirs the layout
        set_("_options", self._build_options(spec, par))
        self._check_choices()
        self._check_max_seq_len(par)
        self._check_steps(par)
        self._check_layout(spec, par)
        self._check_moe(spec, par)

    def _check_trainers(self) -> None:
        from .memory.loss_paths import TRAINERS, check_trainer

        if isinstance(self.trainers, (str, bytes, Mapping)) or not isinstance(self.trainers, (list, tuple)):
            raise DynBatchConfigError("trainers", self.trainers, "must be a list of trainer names",
                                      f"write e.g. trainers: [megatron-lm, slime] (known: {', '.join(TRAINERS)})")
        object.__setattr__(self, "trainers", tuple(check_trainer(t, f"trainers[{i}]")
                                                   for i, t in enumerate(self.trainers)))

    def named_trainers(self) -> Tuple[str, ...]:
        """The trainers the preset names (``("megatron-lm",)`` when it names none)."""
        return self.trainers or ("megatron-lm",)

    def _check_cost_model(self) -> None:
        from .cost_profiles import PROFILES, is_cost_model_choice

        if self.cost_model is not None and (not isinstance(self.cost_model, str) or
                                            not is_cost_model_choice(self.cost_model)):
            raise DynBatchConfigError("cost_model", self.cost_model, "is neither a cost profile nor a file",
                                      f"write one of {sorted(PROFILES)} or the path of a cost-model JSON file")

    def _check_calibration(self) -> None:
        if not _is_bool(self.online_calibration):
            raise DynBatchConfigError("online_calibration", self.online_calibration, "must be true or false",
                                      "write online_calibration: true (refit the cost model while training) or false")
        object.__setattr__(self, "online_calibration", bool(self.online_calibration))
        if self.calibration_interval is None:
            return
        if not self.online_calibration:
            raise DynBatchConfigError("calibration_interval", self.calibration_interval, "only means something with "
                                      "online_calibration: true", "add online_calibration: true, or drop the interval")
        if not _is_int(self.calibration_interval) or self.calibration_interval < 1:
            raise DynBatchConfigError("calibration_interval", self.calibration_interval, "must be a whole number of "
                                      "optimizer steps >= 1", "write e.g. calibration_interval: 50")

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

    def _build_options(self, spec: ModelSpec, par: ParallelConfig) -> PlanOptions:
        """The preset's planning fields as the planner's options -- every field of ``PlanOptions`` this class
        has under the same name (``memory``: :meth:`memory_settings`) -- checked by the planner's own rules; the
        log-prob budget is checked as the budget of the forward-only options."""
        if not isinstance(self.memory, Mapping):
            raise DynBatchConfigError("memory", self.memory, "must be a mapping of memory settings",
                                      "write e.g. memory: {headroom: 0.15, trainer: slime}")
        object.__setattr__(self, "memory", dict(self.memory))
        shared = [name for name in PlanOptions.names() if name in _OWN_FIELDS and name not in ("model", "memory")]
        auto = AUTO in (self.max_tokens_per_gpu, self.log_probs_max_tokens_per_gpu)
        options = PlanOptions(**{name: getattr(self, name) for name in shared}, model=spec, parallel=par,
                              memory=self.memory_settings() if auto else None)
        resolved = options.resolve()  # a preset is refused when it is read: its cost-model file, its "auto"
        for name in shared:  # stored as the options hold them: 4096.0 -> 4096, BalanceBy.TIME -> "time"
            value = getattr(options, name)
            if name == "max_tokens_per_gpu" and options.auto_budget:
                value = AUTO  # the preset says auto: a launch chooses it again for its card
            if name == "balance_by" and value is None:
                value = resolved.balance_by  # the default made explicit, as the preset stores it
            object.__setattr__(self, name, str(value) if isinstance(value, BalanceBy) else value)
        if self.log_probs_max_tokens_per_gpu is not None:
            with trainer_terms({"max_tokens_per_gpu": "log_probs_max_tokens_per_gpu"}):
                forward = options.for_forward_only(self.log_probs_max_tokens_per_gpu)
                forward.resolve()
            object.__setattr__(self, "log_probs_max_tokens_per_gpu",
                               AUTO if forward.auto_budget else forward.max_tokens_per_gpu)
        return options

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
        return self.plan_options(forward_only=forward_only).resolve().max_tokens_per_gpu

    def _check_max_seq_len(self, par: ParallelConfig) -> None:
        """The start-up check (``core/startup.py``) for both budgets, when ``max_seq_len`` is set."""
        if self.max_seq_len is None:
            return
        from .checks import as_int
        from .startup import check_max_seq_len_fits

        object.__setattr__(self, "max_seq_len", as_int(  # stored as the plain int it is (also when given as 8192.0)
            self.max_seq_len, "max_seq_len", minimum=1, fix="set the longest sample the run can produce"))
        for name in ("max_tokens_per_gpu", "log_probs_max_tokens_per_gpu"):
            if getattr(self, name) is not None:
                resolved = self.plan_options(forward_only=name.startswith("log_probs")).resolve()
                check_max_seq_len_fits(self.max_seq_len, max_tokens_per_gpu=resolved.max_tokens_per_gpu, parallel=par,
                                       fp8_alignment=self.fp8_alignment, oversize=self.oversize,
                                       length_field="max_seq_len", budget_field=name, dynamic_cp=self.dynamic_cp,
                                       options=resolved)

    def _check_choices(self) -> None:
        for name, allowed in (("loss_mode", LOSS_MODES), ("group_reduce", GROUP_REDUCE)):
            value = getattr(self, name)
            if value not in allowed:
                hint = did_you_mean(value, allowed, n=1, cutoff=0.5)
                hint = hint + " " if hint else ""
                raise DynBatchConfigError(name, value, "is not a known choice", f"{hint}use one of {list(allowed)}")

    def _check_steps(self, par: ParallelConfig) -> None:
        for name in ("samples_per_step", "group_size"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise DynBatchConfigError(name, value, "must be a positive integer or null",
                                          f"set {name} to a whole number, or remove it")
        g = self.group_size or 1
        if self.samples_per_step is not None:
            if self.samples_per_step % g:
                raise DynBatchConfigError("samples_per_step", self.samples_per_step,
                                          f"is not a multiple of group_size={g}, so a group would span two steps",
                                          f"use a multiple of {g}")
            if self.samples_per_step % par.dp:
                raise DynBatchConfigError(
                    "samples_per_step", self.samples_per_step,
                    f"is not divisible by dp={par.dp}; it becomes Megatron's --global-batch-size, which must divide by "
                    f"--micro-batch-size (1) x dp", f"use a multiple of {par.dp}")
            if self.samples_per_step // g < par.dp:
                what = "groups" if self.group_size else "samples"
                raise DynBatchConfigError(
                    "samples_per_step", self.samples_per_step,
                    f"gives {self.samples_per_step // g} {what} per step for dp={par.dp} ranks, so a rank would run "
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

    def _check_moe(self, spec: ModelSpec, par: ParallelConfig) -> None:
        dispatcher = self.moe_token_dispatcher_type
        if not spec.is_moe:
            if par.ep > 1:
                raise DynBatchConfigError("parallel.ep", par.ep, f"expert parallelism needs an MoE model; "
                                          f"{spec.name} is dense", "set ep: 1")
            if dispatcher is not None:
                raise DynBatchConfigError("moe_token_dispatcher_type", dispatcher, f"{spec.name} is dense",
                                          "remove moe_token_dispatcher_type")
            return
        if dispatcher is None:
            object.__setattr__(self, "moe_token_dispatcher_type", "alltoall")
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

    def _check_dynamic_cp(self, par: ParallelConfig) -> None:
        flag = "--dynbatch-dynamic-cp"
        if flag in self.megatron_args:
            raise DynBatchConfigError("megatron_args", flag, "turns dynamic CP on behind the planner's back "
                                      "(planner_kwargs would not know)", f"remove {flag} and set dynamic_cp: true")
        if not self.dynamic_cp:
            return
        problem = dynamic_cp_problem(par, grouped=self.group_size is not None,
                                     hybrid_cp="--hybrid-context-parallel" in self.megatron_args)
        if problem is not None:
            raise DynBatchConfigError("dynamic_cp", True, problem[0], problem[1])

    # --------------------------------------------------------------------------------------------- views
    def model_spec(self) -> ModelSpec:
        """The resolved :class:`ModelSpec` (validated at construction)."""
        assert self._spec is not None
        return self._spec

    def parallel(self) -> ParallelConfig:
        """The :class:`ParallelConfig` of the run (the YAML ``parallel:`` mapping, validated)."""
        return self.layout

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def effective_log_probs_max_tokens_per_gpu(self) -> int:
        return self.log_probs_max_tokens_per_gpu or self.max_tokens_per_gpu

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
        """The planner's options for this run (checked at construction); pass them as
        ``plan_global_batch(lengths, run.plan_options(), group_ids=run.group_ids(n))``.

        ``forward_only=True`` plans a log-prob / reference pass: the budget is
        ``log_probs_max_tokens_per_gpu`` and there is no optimizer step, so ``samples_per_step`` is dropped."""
        if forward_only:
            return self._options.for_forward_only(self.effective_log_probs_max_tokens_per_gpu)
        return self._options

    def to_megatron_args(self) -> List[str]:
        """The Megatron-LM command-line flags this preset implies, as an argv list.

        Layout (``--tensor-model-parallel-size`` ... ``--sequence-parallel``), the MoE dispatcher, the batch
        shape Megatron's bookkeeping needs (``--micro-batch-size 1 --global-batch-size samples_per_step``: the
        learning-rate schedule and the consumed-samples counter then count samples exactly), and the
        dynamic-batching flags of :mod:`megatron_dynbatch.megatron.args` (without ``fp8_alignment`` the flag is left
        out, so that :mod:`megatron_dynbatch.megatron.args` derives it from Megatron's own ``--fp8-*`` flags).
        ``group_size`` has no flag: at run time groups come from each sample's ``group_id``. Model-shape flags
        (``--num-layers``, norms, RoPE, ...) are not implied by a :class:`ModelSpec` and stay in the launch script.
        ``dp`` is not a flag: Megatron derives it from the world size.
        """
        p = self.layout
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
        if self.samples_per_step is not None:
            out += ["--micro-batch-size", "1", "--global-batch-size", str(self.samples_per_step),
                    "--dynbatch-samples-per-step", str(self.samples_per_step)]
        out += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(self.max_tokens_per_gpu)]
        if self.log_probs_max_tokens_per_gpu is not None:
            out += ["--log-probs-max-tokens-per-gpu", str(self.log_probs_max_tokens_per_gpu)]
        if self.gpu_memory_gb is not None:
            out += ["--dynbatch-gpu-memory-gb", repr(self.gpu_memory_gb)]
        if self.memory:
            out += ["--dynbatch-memory", ",".join(f"{k}={v}" for k, v in self.memory.items())]
        if self.balance_by == "time":
            out.append("--balance-by-flops")  # the peers' name for balancing compute: BalanceBy.TIME (the default)
        else:
            out += ["--dynbatch-balance-by", self.balance_by]
        if self.oversize != "error":
            out += ["--dynbatch-oversize", self.oversize]
        if self.fp8_alignment is not None:
            out += ["--dynbatch-fp8-alignment", str(self.fp8_alignment)]
        if self.loss_mode != "token_mean":
            out += ["--dynbatch-loss-mode", self.loss_mode]
        if self.group_reduce != "token":
            out += ["--dynbatch-group-reduce", self.group_reduce]
        if self.dynamic_cp:
            out.append("--dynbatch-dynamic-cp")
        if self.min_cp_size is not None:
            out += ["--dynbatch-min-cp-size", str(self.min_cp_size)]
        if self.cost_model is not None:
            out += ["--dynbatch-cost-model", self.cost_model]
        if self.decision_margin is not None:
            out += ["--dynbatch-decision-margin", repr(self.decision_margin)]
        if self.online_calibration:
            out.append("--dynbatch-online-calibration")
        if self.calibration_interval is not None:
            out += ["--dynbatch-calibration-interval", str(self.calibration_interval)]
        if p.gpus_per_node != DEFAULT_GPUS_PER_NODE:
            out += ["--dynbatch-gpus-per-node", str(p.gpus_per_node)]
        if self.max_seq_len is not None:
            out += ["--dynbatch-max-seq-length", str(self.max_seq_len)]
        if self.memory_probe is not None:
            out.append("--dynbatch-memory-probe" if self.memory_probe else "--no-dynbatch-memory-probe")
        return out + list(self.megatron_args)

    # ----------------------------------------------------------------------------------- serialisation
    def to_dict(self) -> Dict[str, Any]:
        """The YAML form (``parallel:`` as a mapping, model as given); ``RunConfig.from_dict(d) == self``."""
        out: Dict[str, Any] = {}
        for f in fields(self):
            if f.name.startswith("_"):
                continue
            value = getattr(self, f.name)
            if f.name == "layout":
                value = value.to_dict()
                if self.expert_tensor_parallel_size is not None:
                    value["etp"] = self.expert_tensor_parallel_size
                out["parallel"] = value
                continue
            if f.name == "expert_tensor_parallel_size":
                continue
            if f.name in ("megatron_args", "trainers"):
                value = list(value)
            if f.name == "model" and isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        return out

    def replace(self, **changes: Any) -> "RunConfig":
        """A copy with some fields changed (validated again). ``parallel=`` (a mapping merged into the current
        layout, or a ParallelConfig) is accepted for ``layout=``."""
        if "parallel" in changes:
            changes["layout"] = changes.pop("parallel")
        if "layout" in changes and not isinstance(changes["layout"], ParallelConfig):
            if not isinstance(changes["layout"], Mapping):
                raise DynBatchConfigError("parallel", changes["layout"], "must be a ParallelConfig or a mapping",
                                          "pass e.g. parallel={'dp': 4}")
            new = {_PARALLEL_ALIASES.get(k, k): v for k, v in changes["layout"].items()}
            merged = {**self.layout.to_dict(), **new}
            if "world_size" in new and "dp" not in new:
                merged.pop("dp")  # dp follows the new world size
            par, etp = _parallel_from_mapping(merged)
            changes["layout"] = par
            if etp is not None:
                changes.setdefault("expert_tensor_parallel_size", etp)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, name: Optional[str] = None) -> "RunConfig":
        """Build from the YAML mapping. Unknown keys raise an error naming the key with close matches."""
        if isinstance(data, RunConfig):
            return data
        if not isinstance(data, Mapping):
            raise DynBatchConfigError("run", type(data).__name__, "must be a mapping of run fields",
                                      "write 'model: ...', 'parallel: {...}', 'max_tokens_per_gpu: ...' "
                                      "at the top level")
        known = ["parallel" if f.name == "layout" else f.name for f in fields(cls) if f.init]
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
        par = kwargs.pop("parallel")
        kwargs["layout"] = par
        if not isinstance(par, ParallelConfig):
            par, etp = _parallel_from_mapping(par)
            kwargs["layout"] = par
            if etp is not None:
                if kwargs.get("expert_tensor_parallel_size") not in (None, etp):
                    raise DynBatchConfigError("parallel.etp", etp, "conflicts with expert_tensor_parallel_size",
                                              "give the expert tensor-parallel size once")
                kwargs["expert_tensor_parallel_size"] = etp
        if "megatron_args" in kwargs and isinstance(kwargs["megatron_args"], list):
            kwargs["megatron_args"] = tuple(str(a) if _is_int(a) else a for a in kwargs["megatron_args"])
        return cls(**kwargs)

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


#: the run fields that are planner options under the same name (:meth:`RunConfig._build_options`)
_OWN_FIELDS = frozenset(f.name for f in fields(RunConfig))


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
