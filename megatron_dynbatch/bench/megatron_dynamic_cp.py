"""``megatron-dynamic-cp``: Megatron-LM dev's dynamic context parallelism (``DefaultDynamicCPScheduler``),
re-implemented from its public behaviour for the benchmark and scored like every dynamic-CP algorithm.

Read at NVIDIA/Megatron-LM ``dev`` commit ``d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1`` (2026-08-21):
``megatron/core/datasets/data_schedule.py::DefaultDynamicCPScheduler.get_groups_and_subsamples`` and
``megatron/core/datasets/data_schedule_utils.py::next_hdp_group_packing_aware``, ``align_sample_id_groups``,
``dcp_gpus_needed``; selected with ``--dynamic-context-parallel --sequence-packing-scheduler default_dynamic_cp``
and ``--min-dynamic-context-parallel-size``. We re-wrote the behaviour; no code is copied.

The scheduler itself lives in the planner (:mod:`megatron_dynbatch.core.planner.dyncp.upstream`, with what it
does as we model it), where it is also one candidate of our own dynamic CP; this module runs it alone as the
bench's ``megatron-dynamic-cp`` row. Where upstream would stop the row raises
:class:`~.partitioning.BaselineInfeasible`, and the bench shows the error.

Scoring: each micro-batch is a pool-wide slot whose groups run their packed sequences together
(:func:`~megatron_dynbatch.core.planner.dyncp.build_dynamic_cp_plan`: the same cost model, CP exchange,
``2 g`` alignment, node topology and synchronised pool simulation as ``dynbatch-dyncp``). With ``pp > 1`` the
slots run as upstream's scheduler feeds them to Megatron's 1F1B schedule (every stage the same groups), which
the simulation models operation by operation; the row says so in its notes. Scoring pads each sequence for its
group only (``2 g`` per sequence), less than upstream's pool-wide padding: generous to upstream, so the
comparison is conservative.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, List, Optional, Sequence


from ..core.alignment import fp8_multiple
from ..core.parallel import ParallelConfig
from ..core.planner.dyncp import build_dynamic_cp_plan
from ..core.planner.dyncp.plan import DynamicCPPlan
from ..core.planner.dyncp.upstream import (CAP_SLACK, Group, UpstreamInfeasible, gpus_needed, next_microbatch,
                                           upstream_microbatches)
from ..core.planner.dyncp.upstream import align_for_vpp as _align_for_vpp
from .partitioning import BaselineInfeasible

if TYPE_CHECKING:
    from ..core.cost_model import CostModelLike
    from ..core.model_spec import ModelLike

NAME = "megatron-dynamic-cp"
PROVENANCE = ("Megatron-LM dev DefaultDynamicCPScheduler (d48bd6b): power-of-two CP groups per sequence, larger "
              "ones where they shorten the critical path, L^2/cp balancing under a tallest x per-rank cap, one "
              "pool-wide micro-batch per round")
#: the commit of NVIDIA/Megatron-LM ``dev`` the behaviour was read from
UPSTREAM_COMMIT = "d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1"


def align_for_vpp(microbatches: List[List[Group]], multiple: int, pool: int) -> List[List[Group]]:
    """Upstream's VPP split (:func:`~megatron_dynbatch.core.planner.dyncp.upstream.align_for_vpp`); where upstream
    would stop: :class:`BaselineInfeasible`."""
    try:
        return _align_for_vpp(microbatches, multiple, pool)
    except UpstreamInfeasible as e:
        raise BaselineInfeasible(str(e)) from e


def dynamic_cp_microbatches(lengths: Sequence[int], parallel: ParallelConfig, max_tokens_per_gpu: int,
                            min_cp_size: int = 1, fp8_alignment: Any = None) -> List[List[Group]]:
    """Upstream's micro-batches for ``lengths`` over the ``dp * cp`` pool: per micro-batch its groups
    ``(start, size, sample ids)`` in pool order. Raises :class:`BaselineInfeasible` where upstream would not run."""
    try:
        return upstream_microbatches(lengths, parallel, max_tokens_per_gpu, min_cp_size, fp8_multiple(fp8_alignment))
    except UpstreamInfeasible as e:
        raise BaselineInfeasible(str(e)) from e


def plan_megatron_dynamic_cp(lengths: Sequence[int], parallel: ParallelConfig, max_tokens_per_gpu: int, *,
                             model: Optional[ModelLike] = None, cost_model: CostModelLike = None, min_cp_size: int = 1,
                             fp8_alignment: Any = None) -> DynamicCPPlan:
    """Upstream's schedule (:func:`dynamic_cp_microbatches`) as a :class:`DynamicCPPlan`, scored exactly like the
    dynamic-CP planner's plans (module docstring). ``planning_time_s`` is the scheduler's time, scoring excluded."""
    t0 = time.perf_counter()
    mbs = dynamic_cp_microbatches(lengths, parallel, max_tokens_per_gpu, min_cp_size, fp8_alignment)
    planning = time.perf_counter() - t0
    plan = build_dynamic_cp_plan(lengths, mbs, parallel=parallel, max_tokens_per_gpu=max_tokens_per_gpu, model=model,
                                 cost_model=cost_model, fp8_alignment=fp8_alignment)
    plan.algorithm = NAME
    plan.candidate = f"{len(mbs)} micro-batches"
    plan.planning_time_s = planning
    return plan


__all__ = ["NAME", "PROVENANCE", "UPSTREAM_COMMIT", "CAP_SLACK", "gpus_needed", "next_microbatch", "align_for_vpp",
           "dynamic_cp_microbatches", "plan_megatron_dynamic_cp"]
