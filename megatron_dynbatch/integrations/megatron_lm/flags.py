"""The flags of the Megatron-LM entry point, and their checks.

:func:`add_dynamic_batch_args` is the ``extra_args_provider`` to give ``pretrain()``: the one provider of
:mod:`megatron_dynbatch.megatron.args` (re-exported here; the dynamic-batching flags ``--use-dynamic-batch-size
--max-tokens-per-gpu N ...`` and the data-source flags :mod:`.sources` reads, :func:`add_data_source_args`:
``--dynbatch-train-data FILE.jsonl`` or ``--dynbatch-mock-data``, and ``--dynbatch-mock-max-length`` /
``--dynbatch-mock-lengths`` to shape synthetic data). Importing this module extends that provider: on a
Megatron-LM whose parser has ``--sequence-packing-scheduler`` it also registers this planner there. To keep another
provider (e.g. ModelOpt's), chain them: ``extra_args_provider=lambda p: add_dynamic_batch_args(add_modelopt_args(p))``.
:func:`help_text` is their ``--help`` text.

The checks raise :class:`~megatron_dynbatch.core.errors.DynBatchConfigError` naming the flag, its value and the fix:

* :func:`validate_megatron_lm_args` -- the dynamic-batching flags
  (:func:`~megatron_dynbatch.megatron.args.validate_dynamic_batch_args`), then :func:`check_megatron_lm_args`: what
  running inside ``pretrain()`` needs (``--use-dynamic-batch-size``, ``--dataloader-type external``,
  ``--eval-iters 0``, ``--micro-batch-size 1``, no upstream flag that reroutes samples between CP ranks);
* :func:`check_data_source_args` -- exactly one data source; ``--dynbatch-mock-lengths`` only with mock data, one
  length per sample of the global batch, none over ``--seq-length``.

Flags are validated by the datasets provider (:mod:`.sources`), by the hook when ``train()`` fetches the schedule
(:mod:`.hook`), and -- earliest, optional -- by a model provider wrapped in :func:`checked_model_provider`. The
checks are cheap and idempotent, so running them at each of these points costs nothing.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

from ...megatron.args import PARSER_EXTENSIONS, add_data_source_args, add_dynamic_batch_args
from .training import megatron_args

__all__ = ["add_dynamic_batch_args", "add_data_source_args", "help_text", "validate_megatron_lm_args",
           "check_megatron_lm_args", "check_data_source_args", "checked_model_provider"]


# ============================================================================================= the flags
def _offer_packing_scheduler(parser: argparse.ArgumentParser) -> None:
    """On a Megatron-LM whose parser has ``--sequence-packing-scheduler``, register this planner there
    (:func:`megatron_dynbatch.integrations.megatron_packing.register_packing_scheduler`)."""
    from ..megatron_packing import extend_scheduler_flag, register_packing_scheduler

    if extend_scheduler_flag(parser):  # a Megatron-LM with --sequence-packing-scheduler: offer `dynbatch` there
        register_packing_scheduler()


if _offer_packing_scheduler not in PARSER_EXTENSIONS:  # the one provider, extended once by this integration
    PARSER_EXTENSIONS.append(_offer_packing_scheduler)


def help_text(prog: str = "pretrain_gpt_dynbatch.py", description: Optional[str] = None) -> str:
    """``--help`` text of the flags :func:`add_dynamic_batch_args` adds (Megatron-LM's own ``--help`` does not
    list extra-args providers: its fault-tolerance setup parses the command line before ``pretrain`` adds them)."""
    parser = argparse.ArgumentParser(prog=prog, add_help=False, description=description)
    add_dynamic_batch_args(parser)
    return parser.format_help()


# ============================================================================================ their checks
def validate_megatron_lm_args(args: Any) -> Any:
    """:func:`~megatron_dynbatch.megatron.args.validate_dynamic_batch_args` + :func:`check_megatron_lm_args`. Cheap and
    idempotent (it runs at each of the points listed in the module docstring). Returns ``args``."""
    from ...megatron.args import validate_dynamic_batch_args

    validate_dynamic_batch_args(args)
    check_megatron_lm_args(args)
    return args


def check_megatron_lm_args(args: Any) -> None:
    """Checks specific to running inside Megatron-LM's ``pretrain()`` (after
    :func:`~megatron_dynbatch.megatron.args.validate_dynamic_batch_args`)."""
    from ...core.errors import DynBatchConfigError

    if not getattr(args, "use_dynamic_batch_size", False):
        raise DynBatchConfigError("--use-dynamic-batch-size", False,
                                  "the megatron_dynbatch hook is installed, so training runs dynamic batching",
                                  "add --use-dynamic-batch-size --max-tokens-per-gpu N (or do not call install())")
    if getattr(args, "dataloader_type", "external") != "external":
        raise DynBatchConfigError("--dataloader-type", args.dataloader_type,
                                  "every rank needs the whole global batch, which Megatron's samplers do not give",
                                  "pass --dataloader-type external")
    if (getattr(args, "eval_iters", 0) or 0) > 0:
        raise DynBatchConfigError("--eval-iters", args.eval_iters, "evaluation is not wired in this entry point",
                                  "pass --eval-iters 0")
    from ...megatron.compat import upstream_cp_rerouting

    rerouting = upstream_cp_rerouting(args)
    if rerouting:
        raise DynBatchConfigError(rerouting[0], True,
                                  "upstream then reroutes samples between ranks itself, which contradicts the "
                                  "plan every rank computes from the whole global batch",
                                  f"drop {rerouting[0]} (use --context-parallel-size; see docs/dynamic_cp.md)")
    if getattr(args, "micro_batch_size", 1) not in (None, 1):
        raise DynBatchConfigError("--micro-batch-size", args.micro_batch_size,
                                  "micro-batches are planned by token budget; Megatron's count must be in samples",
                                  "pass --micro-batch-size 1 and --global-batch-size = samples per optimizer step")


def check_data_source_args(args: Any) -> None:
    """Exactly one of ``--dynbatch-train-data`` / ``--dynbatch-mock-data`` (for
    :func:`~.sources.global_batch_datasets_provider`); ``--dynbatch-mock-lengths`` only with mock data, one length
    per sample of the global batch, none over ``--seq-length``."""
    from ...core.errors import DynBatchConfigError

    if bool(getattr(args, "dynbatch_train_data", None)) == bool(getattr(args, "dynbatch_mock_data", False)):
        raise DynBatchConfigError("--dynbatch-train-data", getattr(args, "dynbatch_train_data", None),
                                  "give exactly one data source",
                                  "pass --dynbatch-train-data FILE or --dynbatch-mock-data")
    lengths = getattr(args, "dynbatch_mock_lengths", None)
    if lengths is None:
        return
    if not getattr(args, "dynbatch_mock_data", False):
        raise DynBatchConfigError("--dynbatch-mock-lengths", ",".join(map(str, lengths)),
                                  "only shapes synthetic data", "add --dynbatch-mock-data, or drop the flag")
    gbs = getattr(args, "global_batch_size", None)
    if gbs is not None and len(lengths) != int(gbs):
        raise DynBatchConfigError("--dynbatch-mock-lengths", f"{len(lengths)} lengths",
                                  f"needs one length per sample of the global batch ({gbs})",
                                  f"give {gbs} lengths, or pass --global-batch-size {len(lengths)}")
    longest = int(getattr(args, "dynbatch_mock_max_length", None) or getattr(args, "seq_length", None)
                  or max(lengths))
    if max(lengths) > longest:
        raise DynBatchConfigError("--dynbatch-mock-lengths", max(lengths),
                                  f"is longer than the longest sample the run allows ({longest})",
                                  "raise --seq-length (and --max-position-embeddings), or shorten the lengths")


def checked_model_provider(model_provider: Callable[..., Any]) -> Callable[..., Any]:
    """Optional: wrap a Megatron model provider so that the flags are validated on the first model build, the
    earliest point where Megatron's args, layout and vocabulary are all final (before the checkpoint load)."""
    state = {"done": False}

    def provider(*a: Any, **k: Any) -> Any:
        if not state["done"]:
            validate_megatron_lm_args(megatron_args())
            state["done"] = True
        return model_provider(*a, **k)

    return provider
