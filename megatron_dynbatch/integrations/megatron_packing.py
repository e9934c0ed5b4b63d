"""This planner as Megatron-Core's sequence-packing scheduler, on every Megatron-LM that has one.

Megatron-Core's ``wrap_data_iterator(data_iterator, config, num_microbatches, pg_collection)``
(``megatron/core/datasets/data_schedule.py``) builds a scheduler from ``config.max_seqlen_per_dp_cp_rank``, the DP
and CP sizes and, under VPP, ``config.microbatch_group_size_per_vp_stage``; the scheduler's ``run()`` gathers
every DP rank's sample lengths, asks ``get_groups_and_subsamples`` to group them, reroutes the samples, packs THD
micro-batches and returns ``(iterator, num_micro_batches, sum(seqlen), sum(seqlen**2))``. Upstream's
``DpBalancedScheduler`` groups next-fit in loader order, by tokens only.

:func:`scheduler_class` subclasses the installed ``DpBalancedScheduler`` (so gathering, rerouting, packing,
the PP/TP broadcasts, VPP iterators and the returned sums stay upstream's) and replaces only the grouping with
:func:`megatron_dynbatch.core.dropin.megatron_packing.plan_sample_id_groups`: the cost model's count, FLOPs
balance across ranks and micro-batches, the budget ``max_seqlen_per_dp_cp_rank x cp`` never exceeded,
upstream's count rule (a multiple of ``microbatch_group_size_per_vp_stage`` when given), ``max_num_seqs``.
Three ways in, by what the installed Megatron-LM offers (probed in :mod:`megatron_dynbatch.megatron.compat`):

* a name-keyed scheduler map (Megatron-LM ``dev``): :func:`register_packing_scheduler` adds ``dynbatch``;
  ``--sequence-packing-scheduler dynbatch`` selects it (the Megatron-LM extra-args provider registers it);
* an enum-keyed map (Megatron-LM ``main``: nothing can be added): call :func:`wrap_data_iterator` of this
  module where upstream's would be called -- same arguments, same four results;
* neither: the ``pretrain()`` hook (:mod:`megatron_dynbatch.integrations.megatron_lm`).

Exactness: the packed micro-batches go through upstream's loss function. Only with
``--calculate-per-token-loss`` is that the global token mean (otherwise Megatron averages per-micro-batch
means, which depends on how samples were grouped), so the scheduler refuses to run without it.
"""

from __future__ import annotations

import argparse
import typing
from typing import Any, Dict, List, Optional, Tuple

from ..core.dropin.megatron_packing import plan_sample_id_groups, sample_id_groups_from_plan
from ..core.checks import whole_number
from ..core.errors import DynBatchConfigError
from ..core.planner.options import PlanOptions

__all__ = [
    "SCHEDULER_NAME",
    "extend_scheduler_flag",
    "packed_seq_padding",
    "packing_scheduler_support",
    "register_packing_scheduler",
    "sample_id_groups_from_plan",
    "scheduler_class",
    "scheduler_plan_options",
    "wrap_data_iterator",
]

#: The name upstream's ``--sequence-packing-scheduler`` selects this planner by.
SCHEDULER_NAME = "dynbatch"
_FLAG = "--sequence-packing-scheduler"
_CLASS: Dict[type, type] = {}
#: Planner options every scheduler instance uses unless given its own (``model``, ``cost_model``, ...).
_DEFAULT_OPTIONS: Dict[str, Any] = {}


# ------------------------------------------------------------------------------------------ pure parts
def scheduler_plan_options(*, max_seqlen_per_dp_cp_rank: int, dp: int, cp: int, config: Any = None,
                           args: Any = None, microbatch_group_size_per_vp_stage: Optional[int] = None) -> PlanOptions:
    """The planner's options for the scheduler: the budget is upstream's ``max_seqlen_per_dp_cp_rank`` (per
    GPU; a micro-batch holds up to that x CP), DP/CP are the scheduler's, PP/VPP/TP/sequence parallelism come from
    the model ``config``; the FLOPs model from Megatron's ``args`` (preferred: they know the vocabulary). With
    ``args`` every other option comes from the launch flags as in a ``--use-dynamic-batch-size`` launch
    (:func:`~megatron_dynbatch.megatron.args.plan_options_from_args`: ``--dynbatch-cost-model``,
    ``--dynbatch-oversize``, ...); balancing follows the options' one default rule (``time`` when the model is
    known, tokens otherwise: the logits term is linear in tokens anyway) unless the launch says otherwise."""
    from ..core.model_spec import ModelSpec
    from ..core.parallel import ParallelConfig

    if not isinstance(max_seqlen_per_dp_cp_rank, int) or isinstance(max_seqlen_per_dp_cp_rank, bool) \
            or max_seqlen_per_dp_cp_rank < 1:
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
    pad = packed_seq_padding(config if config is not None and hasattr(config, "pad_packed_seq_alignment")
                             else args, int(max_seqlen_per_dp_cp_rank))
    model = ModelSpec.from_megatron(args) if args is not None and getattr(args, "padded_vocab_size", None) else None
    own = {"parallel": parallel, "max_tokens_per_gpu": int(max_seqlen_per_dp_cp_rank), "model": model,
           "microbatch_pad_multiple": pad}
    if args is None:
        return PlanOptions(**own)
    from ..megatron.args import plan_options_from_args

    return plan_options_from_args(args, **own)


def packed_seq_padding(src: Any, max_seqlen_per_dp_cp_rank: int) -> Optional[int]:
    """The per-GPU multiple that upstream pads each packed micro-batch to AFTER the scheduler grouped it
    (Megatron-LM ``dev``'s ``--pad-packed-seq-alignment``; ``None`` where it is unset or unknown), so that the
    planner counts that padding against the budget and in the modelled time: ``N`` pads each CP rank's share to
    a multiple of ``N``; ``max`` -- and any alignment under a THD CUDA graph (``--cuda-graph-impl`` other than
    ``none``), which upstream pads to a static shape -- pads every share to ``max_seqlen_per_dp_cp_rank``."""
    alignment = getattr(src, "pad_packed_seq_alignment", None) if src is not None else None
    if alignment is None:
        return None
    if alignment == "max" or getattr(src, "cuda_graph_impl", "none") not in (None, "none"):
        return int(max_seqlen_per_dp_cp_rank)
    multiple = whole_number(int(alignment) if isinstance(alignment, str) and alignment.isdigit() else alignment)
    if multiple is None or not 1 <= multiple <= max_seqlen_per_dp_cp_rank:
        raise DynBatchConfigError("--pad-packed-seq-alignment", alignment,
                                  f"must be 'max' or an integer from 1 to --max-seqlen-per-dp-cp-rank "
                                  f"({max_seqlen_per_dp_cp_rank})", "pass max or a token multiple such as 128")
    return multiple


# ------------------------------------------------------------------------------------ feature detection
def packing_scheduler_support() -> Tuple[bool, str]:
    """``(True, "")`` when the installed megatron-core has upstream's NAME-keyed packing-scheduler map (a flag
    selects entries), else ``(False, why)`` (probe: :func:`megatron_dynbatch.megatron.compat.packing_scheduler_point`).
    :func:`wrap_data_iterator` works wherever ``DpBalancedScheduler`` exists, map or not."""
    from ..megatron.compat import packing_scheduler_point

    module, why = packing_scheduler_point()
    return module is not None, why


def scheduler_class(base: Optional[type] = None) -> type:
    """The ``dynbatch`` scheduler: upstream's ``DpBalancedScheduler`` pipeline with this planner's grouping.
    ``base`` defaults to the installed megatron-core's ``DpBalancedScheduler``; one class per base."""
    if base is None:
        from ..megatron.compat import packing_scheduler_api

        api = packing_scheduler_api()
        if api.base is None:
            raise DynBatchConfigError(_FLAG, SCHEDULER_NAME, api.why,
                                      "use megatron_dynbatch.integrations.megatron_lm.install()")
        base = api.base
    if base not in _CLASS:
        _CLASS[base] = _make_scheduler_class(base)
    return _CLASS[base]


def _make_scheduler_class(base: type) -> type:
    from ..megatron.compat import scheduler_takes_max_num_seqs

    takes_max_num_seqs = scheduler_takes_max_num_seqs(base)

    class DynBatchScheduler(base):  # type: ignore[misc, valid-type]
        """Groups samples with megatron-dynbatch's planner (FLOPs-balanced, budget-safe, equal counts)."""

        _config: Any = None

        def __init__(self, max_seqlen_per_dp_cp_rank: int, cp_size: int, dp_size: int,
                     microbatch_group_size_per_vp_stage: Optional[int] = None, *args: Any,
                     max_num_seqs: Optional[int] = None, plan_options: Optional[Dict[str, Any]] = None,
                     **kwargs: Any) -> None:
            if takes_max_num_seqs:
                kwargs["max_num_seqs"] = max_num_seqs
            super().__init__(max_seqlen_per_dp_cp_rank, cp_size, dp_size, microbatch_group_size_per_vp_stage,
                             *args, **kwargs)
            self.max_num_seqs = max_num_seqs
            self.plan_options = dict(_DEFAULT_OPTIONS if plan_options is None else plan_options)
            self.last_plan: Any = None

        def run(self, data_iterator: Any, num_microbatches: int, dp_group: Any, tp_group: Any, pp_group: Any,
                dp_cp_group: Any, dev: Any, config: Any) -> Any:
            if not getattr(config, "calculate_per_token_loss", False):
                raise DynBatchConfigError(
                    "--calculate-per-token-loss", False,
                    "with packed micro-batches Megatron's default loss is the mean of per-micro-batch means, "
                    "which depends on the grouping; only the per-token loss equals plain batching",
                    "add --calculate-per-token-loss")
            self._config = config
            real_num_seqs = getattr(_data_schedule(), "_get_scheduler_max_real_num_seqs", None)
            if real_num_seqs is not None and getattr(config, "thd_max_packed_sequences", None) is not None:
                self.max_num_seqs = real_num_seqs(config)  # upstream's rule: a dummy tail sequence takes a slot
            return super().run(data_iterator, num_microbatches, dp_group, tp_group, pp_group, dp_cp_group,
                               dev, config)

        def get_groups_and_subsamples(self, sample_id_seqlens: Any, *unused: Any) -> List[List[List[int]]]:
            options = scheduler_plan_options(
                max_seqlen_per_dp_cp_rank=self.max_seqlen_per_dp_cp_rank, dp=self.dp_size, cp=self.cp_size,
                config=self._config, args=_megatron_args(),
                microbatch_group_size_per_vp_stage=self.microbatch_group_size_per_vp_stage)
            own = dict(self.plan_options)  # a model given here and balancing left unset: its time (the default rule)
            options = options.replace(**own) if own else options
            groups, self.last_plan = plan_sample_id_groups(
                sample_id_seqlens, options, max_seqlen_per_dp_cp_rank=options.max_tokens_per_gpu, dp=self.dp_size,
                cp=self.cp_size, microbatch_group_size_per_vp_stage=self.microbatch_group_size_per_vp_stage,
                max_num_seqs=self.max_num_seqs)
            return groups

    DynBatchScheduler.__qualname__ = DynBatchScheduler.__name__
    return DynBatchScheduler


def _data_schedule() -> Any:
    """``megatron.core.datasets.data_schedule``, or None -- what ``packing_scheduler_api().module`` answers, without
    re-probing the scheduler signatures on every training step."""
    try:
        from megatron.core.datasets import data_schedule
    except Exception:  # noqa: BLE001 - absent, or not importable here (as packing_scheduler_api)
        return None
    return data_schedule


def _megatron_args() -> Any:
    try:
        from megatron.training import get_args

        return get_args()
    except Exception:  # noqa: BLE001 - no Megatron-LM, or args not parsed yet: plan from the config alone
        return None


def wrap_data_iterator(data_iterator: Any, config: Any, num_microbatches: int, pg_collection: Any = None,
                       **plan_options: Any) -> Tuple[Any, int, float, float]:
    """Upstream's ``wrap_data_iterator`` with this planner's scheduler: same arguments (plus optional planner
    options: ``model``, ``cost_model``, ``oversize``, ...), same four results -- the new data iterator (a list
    under VPP), the micro-batch count, and the global batch's sum of sequence lengths and of their squares.
    Works on every megatron-core with ``DpBalancedScheduler`` (Megatron-LM ``main``, whose scheduler map is
    keyed by an enum, and ``dev``). ``config.max_num_seqs`` comes from ``thd_max_packed_sequences`` as upstream's
    ``dp_balanced`` reads it."""
    if pg_collection is None:
        from megatron.core import parallel_state as ps

        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        dp, tp, pp = ps.get_data_parallel_group(), ps.get_tensor_model_parallel_group(), \
            ps.get_pipeline_model_parallel_group()
    else:
        dp_cp, dp, tp, pp = pg_collection.dp_cp, pg_collection.dp, pg_collection.tp, pg_collection.pp
    if any(g is None for g in (dp_cp, dp, tp, pp)):
        raise DynBatchConfigError("pg_collection", "incomplete", "dp_cp, dp, tp and pp groups are needed",
                                  "initialise parallel_state or pass a full ProcessGroupCollection")
    import torch

    budget = getattr(config, "max_seqlen_per_dp_cp_rank", None)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise DynBatchConfigError("config.max_seqlen_per_dp_cp_rank", budget, "the scheduler needs a per-GPU budget",
                                  "set --max-seqlen-per-dp-cp-rank N (tokens one GPU holds in a micro-batch)")
    vpp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    group = None if vpp is None else getattr(config, "microbatch_group_size_per_vp_stage", None)
    cls = scheduler_class()
    scheduler = cls(budget, dp_cp.size() // dp.size(), dp.size(), group,
                    max_num_seqs=getattr(config, "thd_max_packed_sequences", None),
                    plan_options={**_DEFAULT_OPTIONS, **plan_options})
    dev = torch.cuda.current_device()
    return scheduler.run(data_iterator, num_microbatches, dp, tp, pp, dp_cp, dev, config)


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


def extend_scheduler_flag(parser: argparse.ArgumentParser, name: str = SCHEDULER_NAME, flag: str = _FLAG) -> bool:
    """Let ``flag`` (default ``--sequence-packing-scheduler``) accept ``name`` on an already-built Megatron-LM
    parser (the flag's choices come from a ``Literal`` or a list). Returns whether the parser has the flag."""
    for action in getattr(parser, "_actions", []):
        if flag in getattr(action, "option_strings", ()):
            if action.choices is not None and name not in action.choices:
                action.choices = tuple(action.choices) + (name,)
            return True
    return False


def register_packing_scheduler(name: str = SCHEDULER_NAME, *, strict: bool = False, **plan_options: Any) -> bool:
    """Register this planner in upstream's NAME-keyed packing-scheduler map under ``name`` and let
    ``--sequence-packing-scheduler`` accept it. Call before ``pretrain()`` (the Megatron-LM extra-args
    provider :func:`megatron_dynbatch.integrations.megatron_lm.add_dynamic_batch_args` does it for you).
    ``plan_options`` (``model``, ``cost_model``, ``oversize``, ...) become every instance's planner options.
    Returns False when the installed megatron-core has no such map -- Megatron-LM ``main`` keys it by an enum:
    use :func:`wrap_data_iterator` there (``strict``: raise :class:`DynBatchConfigError` instead). Idempotent."""
    from ..megatron.compat import packing_scheduler_point

    ds, why = packing_scheduler_point()
    if ds is None:
        if strict:
            raise DynBatchConfigError(_FLAG, name, why, "call megatron_dynbatch.integrations.megatron_packing."
                                      "wrap_data_iterator where upstream's is called, or use the pretrain() hook")
        return False
    _DEFAULT_OPTIONS.clear()
    _DEFAULT_OPTIONS.update(plan_options)
    ds.scheduler_map[name] = scheduler_class(ds.DpBalancedScheduler)
    _allow_in_config_field(name)
    return True
