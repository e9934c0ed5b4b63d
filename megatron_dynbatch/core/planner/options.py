"""``PlanOptions``: every choice a planning call takes, in one typed object validated at construction, and
``ResolvedOptions``: the same options with what they name read and computed, by one explicit step.

One path
--------
Every entry point builds one ``PlanOptions`` at its boundary, once, resolves it once and hands the planner the
``ResolvedOptions``: the Python API
(:func:`~megatron_dynbatch.plan_global_batch` builds it from its keywords), run presets
(:meth:`RunConfig.plan_options <megatron_dynbatch.core.run_config.RunConfig.plan_options>`), Megatron-LM flags
(:func:`megatron_dynbatch.megatron.args.plan_options_from_args`), the ``plan`` command, Megatron-Core's packing
seat, the trainer drop-ins, the data iterator and the Ray driver. Nobody copies option names into a list of its
own: adding an option is one field here (with its docstring and, where a launch can set it, its spellings in
``metadata``) plus its use in the planner. ``tests/test_plan_options.py`` sends every field through every entry
point and checks it arrives.

Resolution
----------
Constructing ``PlanOptions`` does no I/O and runs no model: ``__post_init__`` checks types, values and every
cross-field rule, and normalises (a mapping or Megatron object to a ``ModelSpec``, strings to enums, numbers to
their types) -- nowhere else is a field set. A preset name or file path in ``model``, a profile or file in
``cost_model``, ``max_tokens_per_gpu="auto"`` and a default ``balance_by`` (``None``) stay as given.
:meth:`PlanOptions.resolve` is the one step that turns them into what the planner computes with and returns a
frozen :class:`ResolvedOptions`: the ``ModelSpec`` (preset YAML / JSON read), the ``CostModel`` on this layout
(profile applied or file read), the budget in tokens (for ``"auto"`` the memory model's
:class:`~megatron_dynbatch.core.memory.BudgetChoice`), the padding rules (:class:`Alignment`) and the balancing
mode in effect. Errors that need what is read (an unknown preset, an unreadable cost-model file, an automatic
budget the card cannot hold) are raised there, with the same field, problem and fix as before. Below the doors
everything takes a ``ResolvedOptions``; :meth:`ResolvedOptions.replace` re-resolves only what a change touches (a
budget lowered by the memory guard or the first-step probe reads no file again), so a Megatron-LM run resolves
its options once per pass (training, forward-only).

What is not an option: the batch itself -- ``lengths`` and the per-sample ids (``group_ids``,
``microbatch_group_ids``, ``rollout_ids``) go to the planning call next to the options.

Spellings
---------
A field's ``metadata`` names it where a user types it: ``megatron`` (the Megatron-LM launch flag), ``cli`` (the
``megatron-dynbatch plan`` flag); a run preset's key is the field's own name (every option with a launch flag
is a preset key, which :meth:`RunConfig.from_dict <megatron_dynbatch.core.run_config.RunConfig.from_dict>` routes
into ``RunConfig.options``; ``tests/test_plan_options.py`` checks it). Errors raised here
name the Python keyword; an entry point re-raises them in its users' words with
:func:`~megatron_dynbatch.core.errors.trainer_terms` and :meth:`PlanOptions.spellings` (a launch error says
``--max-tokens-per-gpu``, a Python error ``max_tokens_per_gpu``).

One vocabulary
--------------
:class:`BalanceBy` is what balancing equalises, with one meaning everywhere (API, presets, flags, docs):
``time`` -- the cost model's seconds (each sample's linear and attention FLOPs at their kernels' efficiency, the
default); ``flops`` -- raw FLOPs (every FLOP weighs the same); ``tokens`` -- padded tokens.

**The one default rule, at every door** (Python API, presets, the ``plan`` command, a Megatron launch, the
drop-ins): unset, it is ``time`` whenever the model is known and ``tokens`` without one. (A Megatron launch always
knows its model, so it balances time unless ``--dynbatch-balance-by`` says otherwise; before this rule it balanced
tokens unless ``--balance-by-flops`` was given.) The Megatron flag ``--balance-by-flops`` (the name the peers use)
is kept as the legacy switch for ``time``; the Python keyword ``balance_by_flops`` is the same switch (``True``:
``time``, and a model is required; ``False``: ``tokens``), mapped once by :meth:`BalanceBy.resolve`.

**Dynamic CP** balances the cost model's seconds only: with ``dynamic_cp=True`` an explicit ``balance_by`` other
than ``time`` (``flops``, ``tokens``, ``balance_by_flops=False``) is refused here, from every door, instead of
being silently ignored; left unset it is the default above.

Flags
-----
The ``megatron`` and ``cli`` spellings are not only names: :mod:`.option_flags` builds the flags themselves from
the fields -- name, type (from the annotation, or ``kind``), choices, metavar and the help text, which is the
field's ``#:`` docstring -- for the Megatron launch (:func:`megatron_dynbatch.megatron.args.add_dynamic_batch_args`)
and the ``plan`` command alike, as Megatron-Core's ``ArgumentGroupFactory`` builds argparse from a config
dataclass (NVIDIA/Megatron-LM ``megatron/training/argument_utils.py``). A new field with a ``--`` spelling gets its
flag and its help with nothing else to write; ``tests/test_option_flags.py`` fails until the docs' flag tables list
it (``docs/architecture.md``, "Adding an option").
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..alignment import Alignment
from ..checks import as_bool, as_float, as_int, did_you_mean
from ..cost_model import CostModel
from ..cost_files import check_cost_model_choice, resolve_cost_model
from ..errors import DynBatchConfigError, UnknownOptionError
from ..memory import MAX_GPU_MEMORY_GB, BudgetChoice, MemorySettings, choose_budget
from ..model_spec import ModelSpec
from ..parallel import MAX_RANKS, ParallelConfig
from .inputs import check_budget

__all__ = ["AUTO", "BalanceBy", "OVERSIZE_POLICIES", "PlanOptions", "ResolvedOptions", "BATCH_ARGUMENTS"]

#: the budget that chooses itself: ``max_tokens_per_gpu="auto"``
AUTO = "auto"

#: what happens to a sample longer than the budget: refuse the batch, or run it alone over the budget
OVERSIZE_POLICIES = ("error", "alone")
#: per-sample arguments of a planning call that are batch data, not options
BATCH_ARGUMENTS = ("group_ids", "microbatch_group_ids", "rollout_ids")


class BalanceBy(str, enum.Enum):
    """What the planner equalises across DP ranks and micro-batches (module docstring)."""

    TIME = "time"
    FLOPS = "flops"
    TOKENS = "tokens"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: Any, field_name: str = "balance_by") -> "BalanceBy":
        """A member from itself or its name (any case), or a ``DynBatchConfigError`` with the close match."""
        if isinstance(value, cls):
            return value
        key = value.strip().lower() if isinstance(value, str) else None
        for member in cls:
            if key == member.value:
                return member
        choices = [m.value for m in cls]
        hint = did_you_mean(value, choices, n=1, cutoff=0.5)
        hint = hint + " " if hint else ""
        raise DynBatchConfigError(field_name, value, "unknown balancing mode",
                                  f"{hint}use one of {tuple(choices)} (time: the cost model's seconds, the default; "
                                  f"flops: raw FLOPs; tokens: padded tokens)")

    @classmethod
    def resolve(cls, balance_by: Any = None, balance_by_flops: Optional[bool] = None) -> Optional["BalanceBy"]:
        """The one mapping of the switch Megatron's ``--balance-by-flops`` names (and the Python keyword
        ``balance_by_flops``): an explicit ``balance_by`` wins; else ``True`` -> ``time``, ``False`` ->
        ``tokens``; neither -> ``None`` (the options' default)."""
        if balance_by is not None:
            return cls.parse(balance_by)
        if balance_by_flops is None:
            return None
        return cls.TIME if as_bool(balance_by_flops, "balance_by_flops") else cls.TOKENS


def _option(default: Any = None, *, megatron: Optional[str] = None, cli: Optional[str] = None,
            default_factory: Any = None, kind: Optional[str] = None, metavar: Optional[str] = None,
            choices: Optional[Sequence[str]] = None) -> Any:
    """A field with its spellings at the entry points (module docstring). ``kind``, ``metavar`` and ``choices``
    shape its generated flags where the annotation does not say enough (:mod:`.option_flags`)."""
    meta = {"megatron": megatron, "cli": cli, "kind": kind, "metavar": metavar,
            "choices": tuple(choices) if choices is not None else None}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class PlanOptions:
    """How to plan (module docstring). Build it with keywords, :meth:`from_kwargs` (unknown names refused with
    a close match) or :meth:`replace`; every field is checked here, cross-field rules included, so a planning
    call only meets problems of the batch itself."""

    #: per-GPU token budget: a micro-batch holds at most ``max_tokens_per_gpu * cp`` tokens, padding included;
    #: ``"auto"``: the largest the memory model says fits ``gpu_memory_gb``, chosen by :meth:`resolve`
    #: (:attr:`ResolvedOptions.budget_choice` tells why)
    max_tokens_per_gpu: Union[int, str] = _option(None, megatron="--max-tokens-per-gpu", cli="--max-tokens-per-gpu",
                                                  kind="budget", metavar="N|auto")
    #: the model's shape (``ModelSpec``, a dict of Megatron field names or a preset name / file path, which
    #: :meth:`resolve` reads); FLOPs and the default cost model come from it. A Megatron launch reads it from
    #: Megatron's own model flags.
    model: Union[None, str, ModelSpec] = _option(None, megatron="(Megatron's model flags)", cli="--model")
    #: the parallel layout (``ParallelConfig`` or a mapping of ``dp, tp, pp, cp, ep, vpp, ...``; missing = 1)
    parallel: ParallelConfig = _option(megatron="(Megatron's layout flags)", cli="(--dp, --tp, --pp, --cp, ...)",
                                       default_factory=ParallelConfig)
    #: what balancing equalises: ``time`` (the cost model's seconds), ``flops`` (raw FLOPs) or ``tokens`` (padded
    #: tokens); default: ``time`` whenever the model is known, else ``tokens``; dynamic CP takes only ``time``
    balance_by: Optional[BalanceBy] = _option(None, megatron="--dynbatch-balance-by", cli="--balance-by")
    #: the step-time model: a profile name (``"fitted"``, the default with a model; ``"analytic"``), a cost-model
    #: JSON file (``docs/cost_model.md``) or, from Python, a ``CostModel``
    cost_model: Union[None, str, CostModel] = _option(None, megatron="--dynbatch-cost-model", cli="--cost-model",
                                                      kind="text", metavar="NAME|FILE")
    #: leave the default choice (fewest micro-batches; fixed CP under ``dynamic_cp``) only for a modelled gain
    #: above this (relative); ``None``: the cost model's ``uncertainty``
    decision_margin: Optional[float] = _option(None, megatron="--dynbatch-decision-margin", cli="--decision-margin",
                                               kind="fraction", metavar="X")
    #: a sample longer than the budget: ``"error"`` (refuse the batch) or ``"alone"`` (its own micro-batch)
    oversize: str = _option("error", megatron="--dynbatch-oversize", cli="--oversize", choices=OVERSIZE_POLICIES)
    #: token multiple FP8 GEMMs need: ``None``, ``"fp8"``, ``"mxfp8"``, ``"nvfp4"``/``"blockwise"`` or an int
    fp8_alignment: Union[None, str, int] = _option(None, megatron="--dynbatch-fp8-alignment", cli="--fp8",
                                                   kind="int_or_text", metavar="RECIPE|N")
    #: split the batch into optimizer steps of exactly this many consecutive samples
    samples_per_step: Optional[int] = _option(None, megatron="--dynbatch-samples-per-step", cli="--samples-per-step")
    #: count optimizer steps in rollouts instead (with per-sample ``rollout_ids``; slime's global batch size)
    rollouts_per_step: Optional[int] = _option(None)
    #: one dp x cp pool with a CP group chosen per micro-batch (``docs/dynamic_cp.md``)
    dynamic_cp: bool = _option(False, megatron="--dynbatch-dynamic-cp", cli="--dynamic-cp")
    #: dynamic CP only: every CP group the planner forms has at least this many GPUs (a power of two, at most
    #: ``cp``), so no sequence runs on fewer GPUs than this -- e.g. to keep every sample's activations spread
    #: over at least that many GPUs' memory, or to keep short sequences off single GPUs; ``None``: 1 (Megatron-LM
    #: dev's ``--min-dynamic-context-parallel-size``, ``docs/dynamic_cp.md``)
    min_cp_size: Optional[int] = _option(None, megatron="--dynbatch-min-cp-size", cli="--min-cp-size")
    #: the GPU's memory in GiB, for ``max_tokens_per_gpu="auto"`` (a Megatron launch reads it from the device)
    gpu_memory_gb: Optional[float] = _option(None, megatron="--dynbatch-gpu-memory-gb", cli="--gpu-memory-gb",
                                             metavar="G")
    #: what ``"auto"`` assumes about memory: optimizer layout, recompute, dtypes, headroom, ...
    #: (:class:`~megatron_dynbatch.core.memory.MemorySettings` or a mapping; default: a bf16 Megatron run; a launch
    #: reads it from Megatron's own flags)
    memory: Optional[MemorySettings] = _option(None, megatron="(Megatron's optimizer / recompute flags)",
                                               cli="(--recompute, --optimizer, --headroom, ...)")
    #: the first step protected: before a pass's first real step, one synthetic micro-batch at its budget is run
    #: and measured, and the budget lowered if its peak crosses the headroom (``megatron/probe.py``, off: False);
    #: ``None``: on where a CUDA device is present. The planner itself ignores it.
    memory_probe: Optional[bool] = _option(None, megatron="--dynbatch-memory-probe")
    #: a forward-only pass (log-probs, reference model): no optimizer step; ``"auto"`` sizes it without the
    #: activations kept for backward (:meth:`for_forward_only`)
    forward_only: bool = _option(False)
    #: force the per-rank count of every optimizer step: one int, or one per step
    num_microbatches: Union[None, int, Tuple[int, ...]] = _option(None, cli="--num-microbatches", kind="int")
    #: cap on rank-refinement rounds (default ``4 * dp``; ``4 * dp * cp`` under dynamic CP)
    refine_rounds: Optional[int] = _option(None)
    # -- the trainer drop-ins' knobs (docs/planner.md#knobs-for-the-trainers-drop-ins), off by default --------
    #: every DP rank gets exactly ``n / dp`` samples of each step (verl's ``equal_size``, ROLL's equal shards)
    equal_samples_per_rank: bool = _option(False)
    #: at least this many micro-batches per rank and step (verl's ``min_num_micro_batch``)
    min_num_microbatches: Optional[int] = _option(None)
    #: every step's per-rank count divides by this (verl's ``num_batches_divided_by``), on top of the VPP rule
    num_microbatches_multiple: Optional[int] = _option(None)
    #: a trainer's own per-sequence padding multiple, counted against the budget (verl: ``tp*cp*2``)
    sequence_pad_multiple: Optional[int] = _option(None)
    #: a trainer's own padding multiple of each GPU's share of a micro-batch (slime: ``tp * pad multiplier``)
    microbatch_pad_multiple: Optional[int] = _option(None)

    # ----------------------------------------------------------------------------------------- validation
    def __post_init__(self) -> None:
        """Types, values and cross-field rules -- no I/O: a preset name or file stays as given until
        :meth:`resolve`. Normalising (strings to enums, mappings to their dataclasses) happens here only."""
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 -- frozen dataclass
        par = ParallelConfig.from_any(self.parallel)
        set_("parallel", par)
        for name in ("sequence_pad_multiple", "microbatch_pad_multiple", "min_num_microbatches",
                     "num_microbatches_multiple", "samples_per_step", "rollouts_per_step", "refine_rounds"):
            value = getattr(self, name)
            if value is not None:
                low = 0 if name == "refine_rounds" else 1
                set_(name, as_int(value, name, minimum=low, fix=_INT_FIX[name]))
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            set_("model", ModelSpec.from_any(self.model))  # a mapping or a Megatron object: pure; names wait
        if self.gpu_memory_gb is not None:
            set_("gpu_memory_gb", as_float(
                self.gpu_memory_gb, "gpu_memory_gb", minimum=1e-3, maximum=MAX_GPU_MEMORY_GB,
                fix="pass the GPU's memory in GiB, e.g. gpu_memory_gb=79.1 for an H100 80GB"))
        if self.memory is not None:
            set_("memory", MemorySettings.from_any(self.memory))
        set_("max_tokens_per_gpu", self._checked_budget(par))
        if self.oversize not in OVERSIZE_POLICIES:  # also a non-str: never equal to a policy name
            raise DynBatchConfigError("oversize", self.oversize, "unknown oversize-sample policy",
                                      f"use one of {OVERSIZE_POLICIES}")
        set_("dynamic_cp", as_bool(self.dynamic_cp, "dynamic_cp"))
        set_("forward_only", as_bool(self.forward_only, "forward_only"))
        if self.memory_probe is not None:
            set_("memory_probe", as_bool(self.memory_probe, "memory_probe"))
        set_("equal_samples_per_rank", as_bool(self.equal_samples_per_rank, "equal_samples_per_rank"))
        set_("num_microbatches", _check_counts(self.num_microbatches))
        if self.balance_by is not None:  # None stays None: the default, derived by resolve() (module docstring)
            set_("balance_by", BalanceBy.parse(self.balance_by))
        if self.dynamic_cp and self.balance_by not in (None, BalanceBy.TIME):
            raise DynBatchConfigError(
                "balance_by", str(self.balance_by), f"dynamic_cp always balances the cost model's seconds (time), "
                f"so balance_by {self.balance_by} would be silently ignored",
                f"drop balance_by {self.balance_by} (or pass balance_by time), or turn dynamic_cp off")
        if self.model is None and self.balance_by is BalanceBy.FLOPS:
            raise DynBatchConfigError("model", None, "balancing by FLOPs needs the model's shape",
                                      "pass model=ModelSpec/dict/preset name, or balance_by='tokens'")
        check_cost_model_choice(self.cost_model, self.model is not None)  # the file itself: resolve()
        if self.decision_margin is not None:
            set_("decision_margin", as_float(
                self.decision_margin, "decision_margin", minimum=0.0, maximum=0.999,
                fix="pass a relative margin such as 0.03 (3%), 0 to take any modelled gain, or None for the cost "
                    "model's own uncertainty"))
        if self.samples_per_step is not None and self.rollouts_per_step is not None:
            raise DynBatchConfigError("samples_per_step", self.samples_per_step, "given with rollouts_per_step",
                                      "pass samples_per_step, or rollout_ids with rollouts_per_step")
        if self.dynamic_cp:
            self._check_dynamic_cp(par)
        if self.min_cp_size is not None:
            set_("min_cp_size", self._checked_min_cp_size(par))

    def _checked_budget(self, par: ParallelConfig) -> Union[int, str]:
        """The budget: an int that holds at least one aligned sequence, or ``"auto"`` with what choosing it needs
        (the model and the card; the memory model itself runs in :meth:`resolve`)."""
        budget = self.max_tokens_per_gpu
        if isinstance(budget, str) and budget.strip().lower() == AUTO:
            if self.model is None:
                raise DynBatchConfigError("max_tokens_per_gpu", AUTO, "an automatic budget needs the model's shape",
                                          "pass model=<preset, dict or ModelSpec>, or a number of tokens")
            if self.gpu_memory_gb is None:
                raise DynBatchConfigError("gpu_memory_gb", None, "max_tokens_per_gpu='auto' needs the card's memory",
                                          "pass gpu_memory_gb=<GiB> (torch.cuda.get_device_properties(0)."
                                          "total_memory / 2**30; 79.1 for an H100 80GB), or a number of tokens")
            Alignment.for_layout(par, self.fp8_alignment, self.sequence_pad_multiple, self.microbatch_pad_multiple)
            return AUTO
        if budget is None or isinstance(budget, str):
            raise DynBatchConfigError("max_tokens_per_gpu", budget,
                                      "is required (the per-GPU token budget)" if budget is None
                                      else "is neither a number of tokens nor 'auto'",
                                      "pass max_tokens_per_gpu=<tokens>, e.g. 16384, or 'auto' with gpu_memory_gb=")
        check_budget(budget, par, self.fp8_alignment, self.sequence_pad_multiple, self.microbatch_pad_multiple)
        return as_int(budget, "max_tokens_per_gpu")

    def _check_dynamic_cp(self, par: ParallelConfig) -> None:
        knobs = {"equal_samples_per_rank": self.equal_samples_per_rank or None,
                 "min_num_microbatches": self.min_num_microbatches,
                 "num_microbatches_multiple": self.num_microbatches_multiple,
                 "rollouts_per_step": self.rollouts_per_step, "sequence_pad_multiple": self.sequence_pad_multiple,
                 "microbatch_pad_multiple": self.microbatch_pad_multiple}
        given = [k for k, v in knobs.items() if v is not None]
        if given:
            raise dynamic_cp_knob_error(given)
        if par.dp * par.cp == 1:  # the same verdict as a preset, the plan command and a launch give
            raise DynBatchConfigError(
                "parallel", "dp=1 x cp=1", "dynamic CP chooses a CP group per micro-batch inside the dp x cp pool of "
                "a pipeline stage, and this pool is one GPU, so there is no group to choose",
                "use dp x cp > 1, or dynamic_cp=False")
        if par.dp * par.cp > MAX_RANKS:
            raise DynBatchConfigError(
                "parallel", f"dp={par.dp} x cp={par.cp}", f"dynamic CP plans every GPU of the dp x cp pool, and this "
                f"one has {par.dp * par.cp:,} (at most {MAX_RANKS:,}: a plan lists each GPU's micro-batches)",
                "check dp and cp (their product is the GPUs of one pipeline stage), or plan with dynamic_cp=False")
        if par.pp == 2 and par.vpp > 1:
            raise DynBatchConfigError(
                "parallel.vpp", par.vpp, "dynamic CP with pp=2 and interleaving needs one micro-batch length per "
                "rank (megatron-core 0.16's pipeline shape exchange, NVIDIA/Megatron-LM #5100), which CP groups of "
                "different sizes do not give", "use vpp=1, pp != 2, or dynamic_cp=False")
        if isinstance(self.num_microbatches, tuple):
            raise DynBatchConfigError("num_microbatches", list(self.num_microbatches), "dynamic CP forces one "
                                      "count for every optimizer step", "pass one integer, or dynamic_cp=False")

    def _checked_min_cp_size(self, par: ParallelConfig) -> int:
        """``min_cp_size``: an int, a power of two, at most ``cp`` (the fixed-CP plan -- the planner's
        never-slower-than-fixed-CP candidate -- runs on groups of ``cp`` GPUs), and only with dynamic CP."""
        value = as_int(self.min_cp_size, "min_cp_size", minimum=1,
                       fix="pass a power of two such as 2 or 4 (GPUs), or None for no minimum")
        if not self.dynamic_cp:
            raise DynBatchConfigError("min_cp_size", value, "only applies to dynamic CP (with a fixed layout every "
                                      "micro-batch already runs on the layout's cp GPUs)",
                                      "add dynamic_cp=True, or drop min_cp_size")
        if value & (value - 1):
            raise DynBatchConfigError("min_cp_size", value, "must be a power of two (dynamic CP's groups are "
                                      "power-of-two blocks of the pool)", f"use {1 << (value.bit_length() - 1)} or "
                                      f"{1 << value.bit_length()}")
        if value > par.cp:
            raise DynBatchConfigError("min_cp_size", value, f"is above the layout's cp={par.cp}: the planner keeps "
                                      "the fixed-CP plan (groups of cp GPUs) as a candidate, so the minimum can be "
                                      "at most cp", f"use at most {par.cp}, or raise cp (--context-parallel-size)")
        return value

    @property
    def min_group_size(self) -> int:
        """The smallest CP group dynamic CP may form: ``min_cp_size``, else 1."""
        return 1 if self.min_cp_size is None else int(self.min_cp_size)

    # ------------------------------------------------------------------------------------------ building
    @classmethod
    def names(cls) -> Tuple[str, ...]:
        """The option names (the keywords :func:`plan_global_batch` takes besides the batch)."""
        return tuple(f.name for f in fields(cls) if f.init)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any], *, base: Optional["PlanOptions"] = None) -> "PlanOptions":
        """Options from keywords (on top of ``base``): the fields, plus ``balance_by_flops`` -- the legacy switch,
        mapped by :meth:`BalanceBy.resolve`. An unknown name is an :class:`UnknownOptionError` (a
        ``DynBatchConfigError`` and a ``TypeError``) with the close matches."""
        kw = dict(kwargs)
        known = cls.names()
        unknown = [k for k in kw if k not in known and k != "balance_by_flops"]
        if unknown:
            raise unknown_option_error(unknown[0], kw[unknown[0]], known + ("balance_by_flops",))
        if "balance_by_flops" in kw:
            flops = kw.pop("balance_by_flops")
            explicit = kw.get("balance_by")
            kw["balance_by"] = BalanceBy.resolve(explicit, flops)
            if explicit is None and flops and kw.get("model", base.model if base else None) is None:
                raise DynBatchConfigError("model", None, "balancing by FLOPs needs the model's shape",
                                          "pass model=ModelSpec/dict/preset name, or balance_by_flops=False")
        if base is None:
            return cls(**kw)
        return base.replace(**kw)

    def replace(self, **changes: Any) -> "PlanOptions":
        """A copy with some options changed (validated again; ``balance_by_flops`` accepted as in
        :meth:`from_kwargs`). An automatic budget stays ``"auto"`` and a default ``balance_by`` stays ``None``
        unless given: :meth:`resolve` derives both again for the new options."""
        if "balance_by_flops" in changes or any(k not in self.names() for k in changes):
            return PlanOptions.from_kwargs(changes, base=self)
        return dataclasses.replace(self, **changes)

    def to_kwargs(self) -> Dict[str, Any]:
        """The options as keywords (``PlanOptions(**o.to_kwargs()) == o``)."""
        return {name: getattr(self, name) for name in self.names()}

    def for_forward_only(self, max_tokens_per_gpu: Union[None, int, str] = None) -> "PlanOptions":
        """The options of a forward-only pass (log-probs, reference model) of the same run: its own budget (default:
        this one; ``"auto"`` -- or an automatic budget here -- sizes it for the forward pass), and no
        optimizer-step split (there is no optimizer step)."""
        budget = max_tokens_per_gpu if max_tokens_per_gpu is not None else self.max_tokens_per_gpu
        return self.replace(max_tokens_per_gpu=budget, samples_per_step=None, rollouts_per_step=None,
                            forward_only=True)

    @property
    def auto_budget(self) -> bool:
        """Whether the memory model chooses the budget (``max_tokens_per_gpu="auto"``)."""
        return self.max_tokens_per_gpu == AUTO

    # ----------------------------------------------------------------------------------------- resolution
    def resolve(self, reuse: Optional["ResolvedOptions"] = None) -> "ResolvedOptions":
        """The one step that reads and computes what the options name (module docstring, "Resolution"): the
        model (a preset name or file -> :class:`ModelSpec`), the cost model (a profile or file -> :class:`CostModel`
        on this layout), ``"auto"`` (the memory model's :class:`BudgetChoice`), the padding rules and the
        balancing mode in effect. ``reuse``: a resolution of earlier options of the same run -- whatever these
        options did not change is taken from it instead of read or computed again (a budget lowered by the
        memory guard re-resolves nothing but the budget)."""
        par = self.parallel
        prev = reuse.options if reuse is not None else None

        def same(*names: str) -> bool:
            return prev is not None and all(_same(getattr(prev, n), getattr(self, n)) for n in names)

        if self.model is None:
            model = None
        elif same("model"):
            model = reuse.model  # type: ignore[union-attr]
        else:
            model = ModelSpec.from_any(self.model)
        choice: Optional[BudgetChoice] = None
        if self.auto_budget:
            profile = _memory_profile(self.cost_model)
            if prev is not None and prev.auto_budget and _same(_memory_profile(prev.cost_model), profile) \
                    and same("model", "parallel", "gpu_memory_gb", "memory", "forward_only"):
                choice = reuse.budget_choice  # type: ignore[union-attr]
            else:
                choice = choose_budget(model, par, self.gpu_memory_gb, settings=self.memory, profile=profile,
                                       pass_="log_prob" if self.forward_only else "train")
            budget = choice.tokens_per_gpu  # type: ignore[union-attr]
        else:
            budget = int(self.max_tokens_per_gpu)
        _, align, _ = check_budget(budget, par, self.fp8_alignment, self.sequence_pad_multiple,
                                   self.microbatch_pad_multiple)
        if same("cost_model", "model", "parallel"):
            cost = reuse.cost_model  # type: ignore[union-attr]
        else:
            cost = resolve_cost_model(self.cost_model, model, par)
        balance = self.balance_by or (BalanceBy.TIME if model is not None else BalanceBy.TOKENS)
        return ResolvedOptions(options=self, model=model, cost_model=cost, max_tokens_per_gpu=budget,
                               alignment=align, balance_by=balance, budget_choice=choice)

    @classmethod
    def spellings(cls, entry: str) -> Dict[str, str]:
        """``field -> flag`` at an entry point (``"megatron"``, ``"cli"``) for the fields it sets by a flag of
        their own: the words :func:`~megatron_dynbatch.core.errors.trainer_terms` re-raises errors in."""
        return {f.name: f.metadata[entry] for f in fields(cls)
                if f.init and str(f.metadata.get(entry) or "").startswith("--")}


_INT_FIX = {
    "sequence_pad_multiple": "pass the trainer's per-sequence padding multiple (a whole number >= 1) or None",
    "microbatch_pad_multiple": "pass the trainer's micro-batch padding multiple (a whole number >= 1) or None",
    "min_num_microbatches": "pass a whole number >= 1, or None",
    "num_microbatches_multiple": "pass a whole number >= 1, or None",
    "samples_per_step": "pass a whole number of samples per optimizer step, or None for one step",
    "rollouts_per_step": "pass a whole number of rollouts per optimizer step",
    "refine_rounds": "pass None for the default (4 * dp)",
}


def _check_counts(value: Any) -> Union[None, int, Tuple[int, ...]]:
    """``num_microbatches``: ``None``, one whole number >= 1, or a 1-D sequence of them (kept as a tuple)."""
    if value is None:
        return None
    fix = "pass one whole number >= 1, or a list with one count per optimizer step"
    if isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim == 1):
        return tuple(as_int(v, "num_microbatches", minimum=1, fix=fix) for v in value)
    return as_int(value, "num_microbatches", minimum=1, fix=fix)


def _same(a: Any, b: Any) -> bool:
    """Whether an option is unchanged between two options objects (identity, or equal plain values)."""
    if a is b:
        return True
    if isinstance(a, CostModel) or isinstance(b, CostModel):
        return False  # an object of arrays: only the same object is the same
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _memory_profile(cost_model: Any) -> Any:
    """What an automatic budget reads from ``cost_model``: a file's ``memory`` section (a path), else nothing."""
    return cost_model if isinstance(cost_model, (str, os.PathLike)) else None


@dataclass(frozen=True)
class ResolvedOptions:
    """:class:`PlanOptions` with what they name read and computed (:meth:`PlanOptions.resolve`): what the planner,
    the plan's report and the Megatron edge work from. Build it with ``options.resolve()``, never by hand."""

    #: the options resolved (every plain option is read from here: ``resolved.options.oversize``)
    options: PlanOptions
    #: the model's shape (``None``: no model given)
    model: Optional[ModelSpec]
    #: the step-time model, on this layout
    cost_model: CostModel
    #: the per-GPU token budget in tokens (``"auto"``: the memory model's choice)
    max_tokens_per_gpu: int
    #: the padding rules of this layout and these options
    alignment: Alignment
    #: what balancing equalises (the default made explicit: ``time`` with a model, ``tokens`` without)
    balance_by: BalanceBy
    #: for ``max_tokens_per_gpu="auto"``: what chose the budget and what limits it (``summary()``: the breakdown)
    budget_choice: Optional[BudgetChoice] = None

    def __post_init__(self) -> None:
        if not isinstance(self.options, PlanOptions):
            raise DynBatchConfigError("options", type(self.options).__name__, "must be a PlanOptions",
                                      "build it with PlanOptions(...).resolve()")

    @property
    def parallel(self) -> ParallelConfig:
        """The parallel layout."""
        return self.options.parallel

    @property
    def auto_budget(self) -> bool:
        """Whether the budget was chosen by the memory model (``max_tokens_per_gpu="auto"``)."""
        return self.budget_choice is not None

    @property
    def cap(self) -> int:
        """Tokens one micro-batch may hold (``max_tokens_per_gpu * cp``, before tail-padding rounding)."""
        return self.max_tokens_per_gpu * self.options.parallel.cp

    @property
    def margin(self) -> float:
        """The decision margin in effect: ``decision_margin``, else the cost model's ``uncertainty``."""
        if self.options.decision_margin is None:
            return float(self.cost_model.uncertainty)
        return float(self.options.decision_margin)

    @property
    def min_group_size(self) -> int:
        """The smallest CP group dynamic CP may form: ``min_cp_size``, else 1."""
        return self.options.min_group_size

    def replace(self, **changes: Any) -> "ResolvedOptions":
        """The options with some changed, resolved again reusing this resolution where nothing it depends on
        changed (:meth:`PlanOptions.resolve`'s ``reuse``)."""
        return self.options.replace(**changes).resolve(reuse=self)


def dynamic_cp_knob_error(given: Sequence[str]) -> DynBatchConfigError:
    """Trainer drop-in knobs given with ``dynamic_cp=True`` (the options' and the batch ids' shared refusal)."""
    return DynBatchConfigError(
        given[0], "given with dynamic_cp=True", "the trainer drop-in knobs describe DP ranks and their "
        "micro-batches, and a dynamic-CP plan has neither (its micro-batches run on CP groups of the pool)",
        f"drop {', '.join(given)}, or plan with dynamic_cp=False")


def unknown_option_error(name: str, value: Any, known: Sequence[str]) -> UnknownOptionError:
    fix = did_you_mean(name, known) or f"use only {', '.join(known)}"
    return UnknownOptionError(name, value, "is not a planning option", fix)
