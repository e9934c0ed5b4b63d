"""This planner as a Megatron-LM packing scheduler: ``--sequence-packing-scheduler dynbatch``.

Megatron-LM (dev branch, Aug 2026) packs variable-length samples itself when ``--sequence-packing-scheduler``
names an entry of ``megatron.core.datasets.data_schedule.scheduler_map``: each step it gathers every DP rank's
sample lengths, asks the scheduler class to group them (``get_groups_and_subsamples``), reroutes the samples
to their ranks, packs them into THD micro-batches and runs that many micro-batches. Upstream's own
``DpBalancedScheduler`` fills micro-batches first-fit in sample order, by tokens only.

:func:`register_packing_scheduler` adds ``dynbatch`` to that map: a subclass of upstream's
``DpBalancedScheduler`` (so rerouting, packing, broadcasting and VPP handling stay upstream's) whose grouping
is :func:`megatron_dynbatch.plan_global_batch` -- FLOPs balance across DP ranks, equal micro-batch counts,
the budget ``--max-seqlen-per-dp-cp-rank`` x CP never exceeded, Megatron's VPP rule -- converted to upstream's
format by :func:`sample_id_groups_from_plan`. Selecting it is upstream's own flag; no wrapper, no hook.

Feature detection, never versions (:mod:`megatron_dynbatch.megatron.compat`): the probe looks for
``scheduler_map`` with string keys and ``DpBalancedScheduler.get_groups_and_subsamples``. megatron-core 0.15-0.19 and Megatron-LM main have
no such extension point (main carries the classes but an enum-keyed map and no flag); there
:func:`register_packing_scheduler` returns ``False`` and the ``pretrain()`` hook
(:mod:`megatron_dynbatch.integrations.megatron_lm`) is the way in.

Exactness: the packed micro-batches go through upstream's loss function. Only with
``--calculate-per-token-loss`` is that the global token mean (otherwise Megatron averages per-micro-batch
means, which depends on how samples were grouped), so the scheduler refuses to run without it.
"""

from __future__ import annotations

import argparse
import typing
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..core.errors import DynBatchConfigError

__all__ = [
    "SCHEDULER_NAME",
    "packing_scheduler_support",
    "register_packing_scheduler",
    "extend_scheduler_flag",
    "sample_id_groups_from_plan",
    "scheduler_plan_kwargs",
]

#: The name upstream's ``--sequence-packing-scheduler`` selects this planner by.
SCHEDULER_NAME = "dynbatch"
_FLAG = "--sequence-packing-scheduler"
_CLASS: Dict[str, type] = {}


# ------------------------------------------------------------------------------------------ pure parts
def sample_id_groups_from_plan(plan: Any, sample_ids: Sequence[int], cp_size: int) -> List[List[List[int]]]:
    """Upstream's grouping format from a :class:`~megatron_dynbatch.Plan`: ``groups[i][j]`` lists the sample
    ids of micro-batch ``i`` on DP x CP index ``j``; the ``cp_size`` consecutive indices of DP rank ``d``
    (``j // cp_size == d``) share DP rank ``d``'s micro-batch, as in upstream's ``DpBalancedScheduler``.
    ``sample_ids[k]`` is the id of the plan's sample ``k``."""
    if cp_size < 1:
        raise DynBatchConfigError("cp_size", cp_size, "must be >= 1", "pass the context-parallel size")
    dp = len(plan.micro_batches)
    count = plan.num_microbatches
    return [[[int(sample_ids[k]) for k in plan.micro_batches[j // cp_size][i]] for j in range(dp * cp_size)]
            for i in range(count)]


def scheduler_plan_kwargs(*, max_seqlen_per_dp_cp_rank: int, dp: int, cp: int, config: Any = None,
                          args: Any = None, microbatch_group_size_per_vp_stage: Optional[int] = None) -> Dict[str, Any]:
    """:func:`plan_global_batch` arguments for the scheduler: the budget is upstream's
    ``max_seqlen_per_dp_cp_rank`` (per GPU; a micro-batch holds up to that x CP), DP/CP are the scheduler's,
    PP/VPP/TP/sequence parallelism come from the model ``config``; the FLOPs model from Megatron's ``args``
    (preferred: they know the vocabulary) or ``config``. ``--balance-by-flops`` is this planner's default here;
    ``args.dynbatch_cost_model``, ``dynbatch_decision_margin``, ``dynbatch_oversize`` and ``dynbatch_fp8_alignment`` apply when set."""
    from ..core.model_spec import ModelSpec
    from ..core.parallel import ParallelConfig

    if not isinstance(max_seqlen_per_dp_cp_rank, int) or max_seqlen_per_dp_cp_rank < 1:
        raise DynBatchConfigError("--max-seqlen-per-dp-cp-rank", max_seqlen_per_dp_cp_rank,
                                  "the dynbatch scheduler needs a per-GPU token budget",
                                  "pass --max-seqlen-per-dp-cp-rank N (tokens one GPU can hold in a micro-batch)")
    src = config if config is not None else args
    vpp = getattr(src, "virtual_pipeline_model_parallel_size", None) if src is not None else None
    parallel = ParallelConfig(
        dp=int(dp), cp=int(cp),
        tp=int(getattr(src, "tensor_model_parallel_size", 1) or 1),
        pp=int(getattr(src, "pipeline_model_parallel_size", 1) or 1),
        vpp=int(vpp) if vpp else 1,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage if vpp else None,
        sequence_parallel=bool(getattr(src, "sequence_parallel", False)),
    )
    kwargs: Dict[str, Any] = {"parallel": parallel, "max_tokens_per_gpu": int(max_seqlen_per_dp_cp_rank)}
    model_src = args if args is not None and getattr(args, "padded_vocab_size", None) else None
    if model_src is not None:
        kwargs["model"] = ModelSpec.from_megatron(model_src)
        kwargs["balance_by_flops"] = True
    else:  # no vocabulary known: balance tokens (the logits term is linear in tokens anyway)
        kwargs["balance_by_flops"] = False
    if args is not None:
        from ..megatron.args import fp8_alignment_from_args

        kwargs["oversize"] = getattr(args, "dynbatch_oversize", None) or "error"
        kwargs["fp8_alignment"] = fp8_alignment_from_args(args)
        if getattr(args, "dynbatch_cost_model", None):  # a profile name or a file: the planner resolves it
            kwargs["cost_model"] = str(args.dynbatch_cost_model)
        if getattr(args, "dynbatch_decision_margin", None) is not None:
            kwargs["decision_margin"] = float(args.dynbatch_decision_margin)
    return kwargs


# ------------------------------------------------------------------------------------ feature detection
def packing_scheduler_support() -> Tuple[bool, str]:
    """``(True, "")`` when the installed megatron-core has upstream's string-keyed packing-scheduler map,
    else ``(False, why)`` (the probe lives in :func:`megatron_dynbatch.megatron.compat.packing_scheduler_point`)."""
    from ..megatron.compat import packing_scheduler_point

    module, why = packing_scheduler_point()
    return module is not None, why


def _scheduler_class(base: type) -> type:
    """The ``dynbatch`` scheduler: upstream's ``DpBalancedScheduler`` pipeline with this planner's grouping."""
    if base in _CLASS:
        return _CLASS[base]

    class DynBatchScheduler(base):  # type: ignore[misc, valid-type]
        """Groups samples with megatron-dynbatch's planner (FLOPs-balanced, budget-safe, equal counts)."""

        _config: Any = None

        def run(self, data_iterator: Any, num_microbatches: int, dp_group: Any, tp_group: Any, pp_group: Any,
                dp_cp_group: Any, dev: Any, config: Any) -> Any:
            if not getattr(config, "calculate_per_token_loss", False):
                raise DynBatchConfigError(
                    "--calculate-per-token-loss", False,
                    "with packed micro-batches Megatron's default loss is the mean of per-micro-batch means, "
                    "which depends on the grouping; only the per-token loss equals plain batching",
                    "add --calculate-per-token-loss")
            self._config = config
            return super().run(data_iterator, num_microbatches, dp_group, tp_group, pp_group, dp_cp_group,
                               dev, config)

        def get_groups_and_subsamples(self, sample_id_seqlens: Any, *unused: Any) -> List[List[List[int]]]:
            from ..core.planner import plan_global_batch

            ids = [int(i) for i, _ in sample_id_seqlens]
            lengths = [int(n) for _, n in sample_id_seqlens]
            kwargs = scheduler_plan_kwargs(
                max_seqlen_per_dp_cp_rank=self.max_seqlen_per_dp_cp_rank, dp=self.dp_size, cp=self.cp_size,
                config=self._config, args=_megatron_args(),
                microbatch_group_size_per_vp_stage=self.microbatch_group_size_per_vp_stage)
            plan = plan_global_batch(lengths, **kwargs)
            return sample_id_groups_from_plan(plan, ids, self.cp_size)

    DynBatchScheduler.__qualname__ = DynBatchScheduler.__name__
    _CLASS[base] = DynBatchScheduler
    return DynBatchScheduler


def _megatron_args() -> Any:
    try:
        from megatron.training import get_args

        return get_args()
    except Exception:  # noqa: BLE001 - no Megatron-LM, or args not parsed yet: plan from the config alone
        return None


def _allow_in_config_field(name: str, config_class: Any = None) -> None:
    """Add ``name`` to the ``Literal`` choices of ``ModelParallelConfig.sequence_packing_scheduler`` (shared
    by every config dataclass derived from it), which Megatron-LM turns into the argparse choices of
    ``--sequence-packing-scheduler``."""
    if config_class is None:
        try:
            from megatron.core.model_parallel_config import ModelParallelConfig as config_class
        except Exception:  # noqa: BLE001
            return
    field = getattr(config_class, "__dataclass_fields__", {}).get("sequence_packing_scheduler")
    if field is None or isinstance(field.type, str):
        return
    literal = next((a for a in typing.get_args(field.type) if typing.get_origin(a) is typing.Literal),
                   field.type if typing.get_origin(field.type) is typing.Literal else None)
    if literal is None or name in typing.get_args(literal):
        return
    choices = typing.get_args(literal) + (name,)
    field.type = Optional[typing.Literal[choices]]  # type: ignore[valid-type]


def extend_scheduler_flag(parser: argparse.ArgumentParser, name: str = SCHEDULER_NAME) -> bool:
    """Let ``--sequence-packing-scheduler`` accept ``name`` on an already-built Megatron-LM parser (the flag's
    choices come from a ``Literal``). Returns whether the parser has the flag."""
    for action in getattr(parser, "_actions", []):
        if _FLAG in getattr(action, "option_strings", ()):
            if action.choices is not None and name not in action.choices:
                action.choices = tuple(action.choices) + (name,)
            return True
    return False


def register_packing_scheduler(name: str = SCHEDULER_NAME, *, strict: bool = False) -> bool:
    """Register this planner in upstream's packing-scheduler map under ``name`` and let
    ``--sequence-packing-scheduler`` accept it. Call before ``pretrain()`` (the Megatron-LM extra-args
    provider :func:`megatron_dynbatch.integrations.megatron_lm.add_dynamic_batch_args` does it for you).
    Returns False when the installed megatron-core has no such extension point (``strict``: raise
    :class:`DynBatchConfigError` instead). Idempotent."""
    from ..megatron.compat import packing_scheduler_point

    ds, why = packing_scheduler_point()
    if ds is None:
        if strict:
            raise DynBatchConfigError(_FLAG, name, why, "use megatron_dynbatch.integrations.megatron_lm.install()")
        return False
    ds.scheduler_map[name] = _scheduler_class(ds.DpBalancedScheduler)
    _allow_in_config_field(name)
    return True
