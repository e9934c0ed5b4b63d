"""Command-line arguments for Megatron-style training scripts.

``add_dynamic_batch_args(parser)`` is THE Megatron ``extra_args_provider`` (one function, also exported as
``megatron_dynbatch.add_dynamic_batch_args`` and
``megatron_dynbatch.integrations.megatron_lm.add_dynamic_batch_args``): it adds the dynamic-batching and
data-source argument groups and returns the parser. ``validate_dynamic_batch_args(args)`` checks the
combination against the parallel layout Megatron parsed (raising
:class:`~megatron_dynbatch.core.errors.DynBatchConfigError` with the flag, its value and the fix) and fills in
derived defaults. ``model_spec_from_args`` / ``parallel_from_args`` / ``plan_options_from_args``
turn Megatron's ``args`` into the planner's inputs: one
:class:`~megatron_dynbatch.core.planner.options.PlanOptions`, whose fields name their launch flags (its
``metadata["megatron"]``), and whose errors are re-raised with those flags.

The planner's options among these flags are generated from :class:`PlanOptions`' fields (their
``metadata["megatron"]`` spelling, type, choices and ``#:`` docstring: :mod:`~megatron_dynbatch.core.planner.
option_flags`); the run's own flags (loss, calibration, memory guard, data source) are written here. Choices are
matched case-insensitively, and a miss names the close match. ``docs/integration.md`` lists them all (a test
checks the table against the parser).

==========================================  ===========================================================
flag                                        meaning
==========================================  ===========================================================
``--use-dynamic-batch-size``                plan FLOPs/token-balanced variable micro-batches (THD packing)
``--max-tokens-per-gpu N|auto``             per-GPU token budget of one micro-batch (x cp per micro-batch)
``--dynbatch-balance-by {time,flops,tokens}``  what balancing equalises; default ``time`` (a launch knows its
                                            model); ``flops``: raw FLOPs
``--balance-by-flops``                      legacy switch for ``--dynbatch-balance-by time``
``--log-probs-max-tokens-per-gpu N|auto``   budget of forward-only (log-prob / reference) passes;
                                            default ``--max-tokens-per-gpu``
``--dynbatch-gpu-memory-gb G``              the card for an ``auto`` budget (default: read from the device)
``--dynbatch-memory KEY=VALUE,...``         memory settings Megatron's flags do not imply, for ``auto``
``--dynbatch-oversize {error,alone}``       a sample over the budget: fail, or run it alone
``--dynbatch-fp8-alignment X``              token multiple for FP8 GEMMs: none|fp8|mxfp8|nvfp4|blockwise|int;
                                            default: from ``--fp8-format``/``--fp8-recipe``/``--fp4-format``
``--dynbatch-loss-mode M``                  token_mean | sample_mean | group_mean | token_sum
``--dynbatch-group-reduce {token,sample}``  how ``group_mean`` reduces inside a group
``--dynbatch-samples-per-step N``           split a global batch into optimizer steps of N samples
``--dynbatch-cost-model NAME|FILE``         cost model the planner uses: profile ``fitted`` (default) or
                                            ``analytic``, or a calibrated cost-model JSON file
``--dynbatch-decision-margin X``            leave the default choice only for a modelled gain above X
                                            (default: the cost model's uncertainty; ``docs/cost_model.md``)
``--dynbatch-online-calibration``           time every micro-batch while training and refit the cost model
                                            every ``--dynbatch-calibration-interval N`` steps (default 50)
``--dynbatch-memory-guard``                 read every training step's peak memory (max over ranks) and lower the
                                            budget before a step predicted to cross the headroom; raise it back
                                            only as far as measured steps support (``docs/tuning.md``)
``--[no-]dynbatch-memory-probe``            before the first step, run one synthetic micro-batch at the budget,
                                            read its peak (max over ranks) and lower the budget if it crosses the
                                            headroom; default on where a CUDA device is present (``docs/tuning.md``)
``--dynbatch-gpus-per-node N``              GPUs per node (default ``$LOCAL_WORLD_SIZE``, else 8): which CP
                                            groups cross nodes
``--dynbatch-max-seq-length N``             the longest sample the run can produce (default ``--seq-length``);
                                            checked against both budgets at start-up
``--dynbatch-dynamic-cp``                   dynamic context parallelism: the dp x cp GPUs form one pool and
                                            each micro-batch gets its own CP group (``docs/dynamic_cp.md``)
``--dynbatch-min-cp-size N``                with ``--dynbatch-dynamic-cp``: every CP group has at least N GPUs
                                            (a power of two <= ``--context-parallel-size``; Megatron-LM dev's
                                            ``--min-dynamic-context-parallel-size``)
``--dynbatch-train-data`` ...               the Megatron-LM entry point's data source (:func:`add_data_source_args`)
==========================================  ===========================================================

Start-up check: with ``--use-dynamic-batch-size``, the longest sample the run can produce
(``--dynbatch-max-seq-length``, else Megatron's ``--seq-length``) must fit one micro-batch of
``--max-tokens-per-gpu`` and of ``--log-probs-max-tokens-per-gpu`` (padding included), so a budget too small fails
before step 1 rather than when the first long sample arrives; with ``--dynbatch-oversize alone`` it warns instead
(:func:`megatron_dynbatch.core.startup.check_max_seq_len_fits`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Dict, List, Optional, Union

from ..core.alignment import fp8_multiple
from ..core.checks import get_arg as _get
from ..core.checks import is_int
from ..core.cost_profiles import PROFILES, is_cost_model_choice
from ..core.errors import DynBatchConfigError, trainer_terms
from ..core.memory.budget import FIX_WORDS
from ..core.parallel import DEFAULT_GPUS_PER_NODE, MAX_RANKS, ParallelConfig
from ..core.planner.option_flags import add_option_flags, choice, tokens_or_auto
from ..core.planner.options import AUTO, BalanceBy, PlanOptions, ResolvedOptions
from .loss import GROUP_REDUCE, LOSS_MODES

__all__ = [
    "add_dynamic_batch_args",
    "add_data_source_args",
    "PARSER_EXTENSIONS",
    "validate_dynamic_batch_args",
    "model_spec_from_args",
    "parallel_from_args",
    "fp8_alignment_from_args",
    "plan_options_from_args",
    "resolve_launch_options",
    "MEGATRON_WORDS",
]

#: planner option -> its launch flag: the words launch errors are raised in (``core.errors.trainer_terms``)
MEGATRON_WORDS = PlanOptions.spellings("megatron")


#: more to do when the provider runs, registered by a loaded integration (the Megatron-LM one offers its packing
#: scheduler on a parser that has ``--sequence-packing-scheduler``); each gets the parser
PARSER_EXTENSIONS: List[Callable[[argparse.ArgumentParser], None]] = []


def add_dynamic_batch_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The one Megatron ``extra_args_provider``: adds the ``dynamic batching`` argument group -- the planner's
    options with a launch flag, generated from :class:`PlanOptions`' fields (:mod:`~megatron_dynbatch.core.planner.
    option_flags`: name, type, choices, help from the field's docstring), and the run's own flags -- and the
    data-source group of the Megatron-LM entry point (:func:`add_data_source_args`), then runs the
    :data:`PARSER_EXTENSIONS` of the loaded integrations; returns the parser. The same function is
    ``megatron_dynbatch.add_dynamic_batch_args`` and
    ``megatron_dynbatch.integrations.megatron_lm.add_dynamic_batch_args`` (importing the latter registers its
    packing scheduler with this provider)."""
    g = parser.add_argument_group(title="dynamic batching", description="megatron-dynbatch: FLOPs-balanced "
                                  "dynamic micro-batches packed in THD format")
    g.add_argument("--use-dynamic-batch-size", action="store_true", default=False,
                   help="Plan variable-size micro-batches under a per-GPU token budget (needs --max-tokens-per-gpu).")
    add_option_flags(g, "megatron")
    g.add_argument("--balance-by-flops", action="store_true", default=False,
                   help="Legacy switch for --dynbatch-balance-by time (balance compute time: each sample's FLOPs at "
                        "their kernels' efficiency), which is already the default: a launch knows its model.")
    g.add_argument("--log-probs-max-tokens-per-gpu", type=tokens_or_auto, default=None, metavar="N|auto",
                   help="Token budget of forward-only passes (log-probs, reference model); default: "
                        "--max-tokens-per-gpu. 'auto': sized for the forward pass.")
    g.add_argument("--dynbatch-memory", type=str, default=None, metavar="KEY=VALUE,...",
                   help="Memory-model settings Megatron's own flags do not imply, for an 'auto' budget, e.g. "
                        "headroom=0.15,logits_fp32_copies=2 (fields of megatron_dynbatch.core.memory.MemorySettings).")
    g.add_argument("--dynbatch-loss-mode", type=choice(LOSS_MODES), default="token_mean",
                   metavar="{" + ",".join(LOSS_MODES) + "}",
                   help="Loss normalisation over the global batch, independent of packing.")
    g.add_argument("--dynbatch-group-reduce", type=choice(GROUP_REDUCE), default="token",
                   metavar="{" + ",".join(GROUP_REDUCE) + "}",
                   help="group_mean only: a group's loss is its token mean (token) or the mean of its samples' "
                        "token means (sample).")
    g.add_argument("--dynbatch-max-seq-length", type=int, default=None, metavar="N",
                   help="The longest sample this run can produce (default: --seq-length); checked at start-up "
                        "against --max-tokens-per-gpu and --log-probs-max-tokens-per-gpu.")
    g.add_argument("--dynbatch-online-calibration", action="store_true", default=False,
                   help="Time every micro-batch's forward and backward while training (CUDA events, read once per "
                        "step) and refit the cost model every --dynbatch-calibration-interval steps; every rank plans "
                        "with the same refitted model (one small all-reduce). Never changes the loss.")
    g.add_argument("--dynbatch-calibration-interval", type=int, default=None, metavar="N",
                   help="Optimizer steps between online refits (default 50); needs --dynbatch-online-calibration.")
    g.add_argument("--dynbatch-memory-guard", action="store_true", default=False,
                   help="Online memory guard: read every training step's peak memory (CUDA allocator, max over the "
                        "ranks: one small all-reduce), refit the memory model's bytes per token from it, and lower "
                        "--max-tokens-per-gpu before a step whose predicted peak would cross the headroom; raise it "
                        "back (never above --max-tokens-per-gpu) only as far as measured steps support. Every rank "
                        "plans with the same budget; every change is logged. Never changes the loss.")
    g.add_argument("--dynbatch-gpus-per-node", type=int, default=None, metavar="N",
                   help="GPUs per node (default: $LOCAL_WORLD_SIZE as torchrun sets it, else 8); with Megatron's rank "
                        "order it tells which CP groups cross nodes.")
    add_data_source_args(parser)
    for extend in PARSER_EXTENSIONS:
        extend(parser)
    return parser


def add_data_source_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The data-source flags of the Megatron-LM entry point's datasets provider
    (``integrations/megatron_lm/sources.py``; checked there by ``check_data_source_args``)."""
    g = parser.add_argument_group(title="dynbatch data source",
                                  description="global batches for megatron_dynbatch.integrations.megatron_lm."
                                              "global_batch_datasets_provider")
    g.add_argument("--dynbatch-train-data", type=str, default=None, metavar="JSONL",
                   help="JSON-lines file, one sample per line: {\"tokens\": [...], \"loss_mask\": [...] (optional), "
                        "\"labels\": [...] (optional), \"group_id\": ... (optional)}. Read by every rank; one global "
                        "batch = --global-batch-size consecutive lines; wraps around at the end.")
    g.add_argument("--dynbatch-mock-data", action="store_true", default=False,
                   help="Synthetic long-tailed samples (seeded, identical on every rank) for smoke and speed runs.")
    g.add_argument("--dynbatch-mock-max-length", type=int, default=None,
                   help="Longest synthetic sample (default --seq-length).")
    g.add_argument("--dynbatch-mock-lengths", type=_length_list, default=None, metavar="L1,L2,...",
                   help="Synthetic samples of exactly these lengths (one per sample of the global batch, in a "
                        "seeded order per batch) instead of the long-tailed draw: a length profile to reproduce, "
                        "e.g. one long document among short answers.")
    return parser


def _length_list(text: str) -> List[int]:
    """argparse type of ``--dynbatch-mock-lengths``: comma-separated positive integers."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give one length >= 2 per sample, e.g. 128,40,16")
    return values


# ----------------------------------------------------------------------------------------- layout
def parallel_from_args(args: Any, world_size: Optional[int] = None) -> ParallelConfig:
    """:class:`ParallelConfig` from Megatron's argument names.

    ``data_parallel_size`` is used when Megatron set it; otherwise it is ``world_size / (tp * pp * cp)`` with the
    world size from ``world_size=``, ``args.world_size``, ``torch.distributed`` or ``$WORLD_SIZE`` (expert
    parallelism is carved out of DP in Megatron, so it does not divide the world size here). ``vpp`` comes from
    ``--virtual-pipeline-model-parallel-size`` or ``--num-layers-per-virtual-pipeline-stage``.
    """
    tp = int(_get(args, "tensor_model_parallel_size", 1))
    pp = int(_get(args, "pipeline_model_parallel_size", 1))
    cp = int(_get(args, "context_parallel_size", 1))
    ep = int(_get(args, "expert_model_parallel_size", 1))
    vpp = _get(args, "virtual_pipeline_model_parallel_size")
    if vpp is None and _get(args, "num_layers_per_virtual_pipeline_stage") is not None and pp > 1:
        per_stage = int(args.num_layers_per_virtual_pipeline_stage)
        num_layers = _get(args, "num_layers")
        if num_layers is None or num_layers % (pp * per_stage):
            raise DynBatchConfigError("--num-layers-per-virtual-pipeline-stage", per_stage,
                                      "does not divide the layers per pipeline stage "
                                      f"(num_layers={num_layers}, pp={pp})",
                                      "use a divisor of num_layers / pipeline-model-parallel-size")
        vpp = num_layers // pp // per_stage
    dp = _get(args, "data_parallel_size")
    if dp is None:
        ws = world_size or _get(args, "world_size")
        if ws is None:
            try:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    ws = dist.get_world_size()
            except ImportError:  # pragma: no cover
                pass
        if ws is None and os.environ.get("WORLD_SIZE"):
            ws = int(os.environ["WORLD_SIZE"])
        if ws is None:
            raise DynBatchConfigError("data_parallel_size", None, "cannot tell the data-parallel size",
                                      "set args.data_parallel_size or args.world_size, or initialise torch.distributed")
        if ws % (tp * pp * cp):
            raise DynBatchConfigError("world_size", ws, f"is not divisible by tp*pp*cp = {tp * pp * cp}",
                                      "use a world size that is a multiple of the model-parallel size")
        dp = ws // (tp * pp * cp)
    return ParallelConfig(
        dp=int(dp), tp=tp, pp=pp, cp=cp, ep=ep, vpp=int(vpp) if vpp else 1,
        microbatch_group_size_per_vp_stage=_get(args, "microbatch_group_size_per_vp_stage"),
        sequence_parallel=bool(_get(args, "sequence_parallel", False)),
        gpus_per_node=gpus_per_node_from_args(args),
    )


def gpus_per_node_from_args(args: Any) -> int:
    """``--dynbatch-gpus-per-node``, else ``$LOCAL_WORLD_SIZE`` (torchrun's processes per node), else 8."""
    value = _get(args, "dynbatch_gpus_per_node")
    if value is None:
        env = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
        if not env:
            return DEFAULT_GPUS_PER_NODE
        flag, value = "$LOCAL_WORLD_SIZE", int(env) if env.isdigit() else env
    else:
        flag = "--dynbatch-gpus-per-node"
    if not is_int(value) or not 1 <= value <= MAX_RANKS:
        raise DynBatchConfigError(flag, value, "must be a whole number of GPUs per node (>= 1)",
                                  "pass --dynbatch-gpus-per-node N, e.g. 8")
    return int(value)


def model_spec_from_args(args: Any):
    """:class:`~megatron_dynbatch.ModelSpec` from Megatron's parsed args (``ModelSpec.from_megatron``)."""
    from ..core.model_spec import ModelSpec

    return ModelSpec.from_megatron(args)


def fp8_alignment_from_args(args: Any) -> Union[None, str, int]:
    """``--dynbatch-fp8-alignment`` resolved: an explicit value wins (``none`` -> None, digits -> int); else
    ``--fp4-format`` -> ``"nvfp4"``, ``--fp8-format`` with ``--fp8-recipe mxfp8|blockwise`` -> that recipe,
    other FP8 -> ``"fp8"``; no FP8 -> None."""
    value = getattr(args, "dynbatch_fp8_alignment", None)
    if value is None:
        if getattr(args, "fp4", None):
            return "nvfp4"
        if getattr(args, "fp8", None):
            recipe = str(getattr(args, "fp8_recipe", None) or "").lower()
            return recipe if recipe in ("mxfp8", "blockwise") else "fp8"
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        result: Union[None, str, int] = value
    else:
        text = str(value).strip().lower()
        result = None if text == "none" else (int(text) if text.isdigit() else text)
    try:
        fp8_multiple(result)
    except DynBatchConfigError as exc:
        raise DynBatchConfigError("--dynbatch-fp8-alignment", value, exc.problem, exc.fix) from None
    return result


# ------------------------------------------------------------------------------------- validation
def validate_dynamic_batch_args(args: Any, world_size: Optional[int] = None) -> Any:
    """Check the dynamic-batching flags against Megatron's parsed ``args``; fill in derived defaults
    (``log_probs_max_tokens_per_gpu``, ``dynbatch_fp8_alignment``). Returns ``args``."""
    use = bool(getattr(args, "use_dynamic_batch_size", False))
    if getattr(args, "balance_by_flops", False) and not use:
        raise DynBatchConfigError("--balance-by-flops", True, "only applies to dynamic batching",
                                  "add --use-dynamic-batch-size (and --max-tokens-per-gpu), or drop --balance-by-flops")
    max_tokens = getattr(args, "max_tokens_per_gpu", None)
    if use and max_tokens is None:
        raise DynBatchConfigError("--max-tokens-per-gpu", None, "--use-dynamic-batch-size needs a per-GPU token budget",
                                  "add --max-tokens-per-gpu N (e.g. the longest sample you train on, or more)")
    for flag, name in (("--max-tokens-per-gpu", "max_tokens_per_gpu"),
                       ("--log-probs-max-tokens-per-gpu", "log_probs_max_tokens_per_gpu"),
                       ("--dynbatch-samples-per-step", "dynbatch_samples_per_step"),
                       ("--dynbatch-max-seq-length", "dynbatch_max_seq_length")):
        v = getattr(args, name, None)
        if v is not None and v != AUTO and (not is_int(v) or v < 1):
            raise DynBatchConfigError(flag, v, "must be a positive integer", f"pass {flag} N with N >= 1")
    if getattr(args, "log_probs_max_tokens_per_gpu", None) is None:
        args.log_probs_max_tokens_per_gpu = max_tokens
    mode = getattr(args, "dynbatch_loss_mode", "token_mean")
    if mode is not None and mode not in LOSS_MODES:
        raise DynBatchConfigError("--dynbatch-loss-mode", mode, "unknown loss normalisation",
                                  f"use one of {LOSS_MODES}")
    cost_model = getattr(args, "dynbatch_cost_model", None)
    if cost_model is not None and not is_cost_model_choice(str(cost_model)):
        raise DynBatchConfigError("--dynbatch-cost-model", cost_model, "is neither a cost profile nor a file",
                                  f"pass one of {sorted(PROFILES)} or the path of a cost-model JSON file, "
                                  "or drop the flag")
    _check_online_calibration(args, use)
    if getattr(args, "dynbatch_memory_guard", False) and not use:
        raise DynBatchConfigError("--dynbatch-memory-guard", True, "only applies to dynamic batching",
                                  "add --use-dynamic-batch-size (and --max-tokens-per-gpu), or drop the flag")
    if getattr(args, "dynbatch_memory_probe", None) and not use:
        raise DynBatchConfigError("--dynbatch-memory-probe", True, "only applies to dynamic batching",
                                  "add --use-dynamic-batch-size (and --max-tokens-per-gpu), or drop the flag")
    gpus_per_node_from_args(args)
    resolved = fp8_alignment_from_args(args)
    args.dynbatch_fp8_alignment = "none" if resolved is None else resolved  # stays resolved on re-reading
    if getattr(args, "dynbatch_dynamic_cp", False) and not use:
        raise DynBatchConfigError("--dynbatch-dynamic-cp", True, "only applies to dynamic batching",
                                  "add --use-dynamic-batch-size (and --max-tokens-per-gpu), "
                                  "or drop --dynbatch-dynamic-cp")
    if not use:
        return args

    par = parallel_from_args(args, world_size=world_size)
    budgets = {}
    dynamic_cp = bool(getattr(args, "dynbatch_dynamic_cp", False))
    for forward_only in (False, True):  # both passes' options: the planner's own checks, in the launch's words
        # (the model's shape is Megatron's to check; the cost model and balancing need it: checked when planning,
        # and here only for an automatic budget, which the model sizes -- and dynamic CP's balancing rule, which
        # needs no model)
        auto = AUTO in (args.max_tokens_per_gpu, args.log_probs_max_tokens_per_gpu)
        opts = plan_options_from_args(args, forward_only=forward_only, world_size=world_size, cost_model=None,
                                      **({} if dynamic_cp else {"balance_by": None}),
                                      **({} if auto else {"model": None}))
        budgets["log_probs_max_tokens_per_gpu" if forward_only else "max_tokens_per_gpu"] = \
            resolve_launch_options(opts)
    _check_max_seq_length(args, par, resolved, budgets)

    if dynamic_cp:
        from ..core.run_config import dynamic_cp_problem  # the same refusals as RunConfig and `plan --dynamic-cp`

        problem = dynamic_cp_problem(par, hybrid_cp=bool(getattr(args, "hybrid_context_parallel", False)),
                                     off="drop --dynbatch-dynamic-cp")
        if problem is not None:
            raise DynBatchConfigError("--dynbatch-dynamic-cp", True, *problem)
        from .dynamic_cp import check_dynamic_cp_model

        check_dynamic_cp_model(args, flag="--mtp-num-layers")

    experts = _get(args, "num_experts", _get(args, "num_moe_experts"))
    dispatcher = _get(args, "moe_token_dispatcher_type", "allgather")
    if experts and dispatcher == "allgather" and (par.pp > 1 or par.ep > 1):
        where = "pipeline parallelism (variable_seq_lengths)" if par.pp > 1 else "expert parallelism"
        raise DynBatchConfigError(
            "--moe-token-dispatcher-type", dispatcher,
            f"the allgather token dispatcher needs equal token counts across ranks, but dynamic batching gives "
            f"micro-batches of different lengths under {where}",
            "use --moe-token-dispatcher-type alltoall")
    return args


def _check_online_calibration(args: Any, use: bool) -> None:
    online = bool(getattr(args, "dynbatch_online_calibration", False))
    interval = getattr(args, "dynbatch_calibration_interval", None)
    if online and not use:
        raise DynBatchConfigError("--dynbatch-online-calibration", True, "only applies to dynamic batching",
                                  "add --use-dynamic-batch-size (and --max-tokens-per-gpu), or drop the flag")
    if interval is not None and not online:
        raise DynBatchConfigError("--dynbatch-calibration-interval", interval, "only means something with online "
                                  "calibration", "add --dynbatch-online-calibration, or drop the interval")
    if interval is not None and (not is_int(interval) or interval < 1):
        raise DynBatchConfigError("--dynbatch-calibration-interval", interval, "must be a whole number of "
                                  "optimizer steps >= 1", "pass e.g. --dynbatch-calibration-interval 50")


def _check_max_seq_length(args: Any, par: ParallelConfig, fp8: Union[None, str, int],
                          budgets: Dict[str, ResolvedOptions]) -> None:
    """The start-up check of the module docstring (nothing to check when neither length is set); ``budgets``: each
    pass's options (an ``auto`` budget's miss says what limits it, never "raise it")."""
    from ..core.startup import check_max_seq_len_fits

    explicit = getattr(args, "dynbatch_max_seq_length", None)
    length = explicit if explicit is not None else getattr(args, "seq_length", None)
    if length is None:
        return
    field = "--dynbatch-max-seq-length" if explicit is not None else "--seq-length"
    for flag, name in (("--max-tokens-per-gpu", "max_tokens_per_gpu"),
                       ("--log-probs-max-tokens-per-gpu", "log_probs_max_tokens_per_gpu")):
        check_max_seq_len_fits(int(length), max_tokens_per_gpu=budgets[name].max_tokens_per_gpu, parallel=par,
                               fp8_alignment=fp8, oversize=getattr(args, "dynbatch_oversize", None) or "error",
                               length_field=field, budget_field=flag,
                               dynamic_cp=bool(getattr(args, "dynbatch_dynamic_cp", False)), options=budgets[name])


def gpu_memory_gb_from_args(args: Any) -> Optional[float]:
    """``--dynbatch-gpu-memory-gb``, else the current CUDA device's memory (``None`` without one: an automatic
    budget then says which flag to pass)."""
    given = getattr(args, "dynbatch_gpu_memory_gb", None)
    if given is not None:
        return given
    from .device import device_memory_gb

    return device_memory_gb()


def memory_settings_from_args(args: Any):
    """What an automatic budget assumes about memory: the settings Megatron's own flags imply (optimizer layout,
    recompute, dtypes: :func:`~megatron_dynbatch.core.memory.settings_from_megatron`), with ``--dynbatch-memory
    KEY=VALUE,...`` on top."""
    from ..core.memory import settings_from_megatron

    return settings_from_megatron(args, **parse_memory_flag(getattr(args, "dynbatch_memory", None)))


def parse_memory_flag(text: Optional[str]) -> Dict[str, Any]:
    """``headroom=0.15,logits_fp32_copies=2`` -> ``{"headroom": 0.15, "logits_fp32_copies": 2}`` (numbers read as
    numbers, ``true`` / ``false`` as booleans -- ``trainer=slime,loss_entropy=true``; :class:`MemorySettings` checks
    names and values)."""
    out: Dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise DynBatchConfigError("--dynbatch-memory", text, f"{item!r} is not KEY=VALUE",
                                      "pass e.g. --dynbatch-memory headroom=0.15,logits_fp32_copies=2")
        value = value.strip()
        for kind in (int, float):
            try:
                value = kind(value)
                break
            except ValueError:
                continue
        if isinstance(value, str) and value.lower() in ("true", "false"):  # loss_entropy=true, loss_fused=false
            value = value.lower() == "true"
        out[key.strip()] = value
    return out


def balance_by_from_args(args: Any) -> Optional[BalanceBy]:
    """``--dynbatch-balance-by`` if given, else ``time`` for the legacy switch ``--balance-by-flops``, else
    ``None``: the options' one default rule (``time``: a launch knows its model; module docstring of
    :mod:`~megatron_dynbatch.core.planner.options`)."""
    explicit = getattr(args, "dynbatch_balance_by", None)
    flops = bool(getattr(args, "balance_by_flops", False))
    if explicit is not None and flops and BalanceBy.parse(explicit) is not BalanceBy.TIME:
        raise DynBatchConfigError("--dynbatch-balance-by", explicit, "contradicts --balance-by-flops (which means "
                                  "--dynbatch-balance-by time)", "give one of the two flags")
    return BalanceBy.resolve(explicit, True if flops else None)


def plan_options_from_args(args: Any, *, forward_only: bool = False, world_size: Optional[int] = None,
                           **given: Any) -> PlanOptions:
    """The planner's options from Megatron's ``args`` (``forward_only``: the log-prob budget and no optimizer-step
    split); ``given``: options the caller sets itself (e.g. upstream's packing scheduler: its budget and layout),
    not read from ``args``. Errors name the launch flags (:data:`MEGATRON_WORDS`)."""
    def budget() -> int:
        if forward_only and getattr(args, "log_probs_max_tokens_per_gpu", None):
            return args.log_probs_max_tokens_per_gpu
        return args.max_tokens_per_gpu

    def auto() -> bool:  # either pass's budget automatic: the memory model's card and settings come along
        if "max_tokens_per_gpu" in given:
            return given["max_tokens_per_gpu"] == AUTO
        return AUTO in (getattr(args, "max_tokens_per_gpu", None), getattr(args, "log_probs_max_tokens_per_gpu", None))

    # options read from more than their own flag; every other option with a launch flag is that flag's value
    derived = {
        "max_tokens_per_gpu": budget,
        "gpu_memory_gb": lambda: gpu_memory_gb_from_args(args) if auto() else getattr(args, "dynbatch_gpu_memory_gb",
                                                                                      None),
        "memory": lambda: memory_settings_from_args(args) if auto() else None,
        "forward_only": lambda: forward_only,
        "model": lambda: model_spec_from_args(args),
        "parallel": lambda: parallel_from_args(args, world_size=world_size),
        "balance_by": lambda: balance_by_from_args(args),
        "fp8_alignment": lambda: fp8_alignment_from_args(args),
        "memory_probe": lambda: getattr(args, "dynbatch_memory_probe", None),  # False (--no-...) is a value
        "samples_per_step": lambda: None if forward_only else getattr(args, "dynbatch_samples_per_step", None),
    }
    values = {}
    for name, flag in MEGATRON_WORDS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None and value is not False:  # store_true flags left off and unset flags: the default
            values[name] = value
    with trainer_terms(launch_words(forward_only)):
        values.update({name: read() for name, read in derived.items() if name not in given})
        values.update(given)
        return PlanOptions(**values)


def launch_words(forward_only: bool = False) -> Dict[str, str]:
    """The words a launch's planning errors are raised in: each option's flag, the pass's budget flag, and the
    memory model's fixes in flags too (an automatic budget's)."""
    words = {**FIX_WORDS["megatron"], **MEGATRON_WORDS}
    if forward_only:
        words["max_tokens_per_gpu"] = "--log-probs-max-tokens-per-gpu"
    return words


def resolve_launch_options(options: PlanOptions, reuse: Optional[ResolvedOptions] = None) -> ResolvedOptions:
    """``options.resolve(reuse)`` with its errors in the launch's words (:func:`launch_words` of the options'
    pass): the one resolution step of a Megatron launch's options."""
    with trainer_terms(launch_words(options.forward_only)):
        return options.resolve(reuse)
