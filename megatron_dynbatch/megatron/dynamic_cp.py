"""Running a dynamic-CP plan on megatron-core: the per-micro-batch CP process groups and the one place where
megatron-core 0.16 reads the model's FIXED CP group for THD inputs.

**Groups.** A :class:`~megatron_dynbatch.core.planner.dyncp.plan.DynamicCPPlan` runs each micro-batch on a
node of the pool tree (:mod:`megatron_dynbatch.core.planner.dyncp.pool`): GPUs ``start .. start + size - 1`` of the
data-parallel-with-context-parallel group (pool rank ``dp_rank * cp + cp_rank``).
:func:`setup_dynamic_cp_groups` creates one process group per node, for every pool of the world (each
pipeline stage and tensor-parallel rank has its own pool): every rank calls ``new_group`` for every group, in
one order, as torch requires. The whole pool reuses Megatron's DP x CP group. When Megatron was initialised
with ``hybrid_context_parallel=True``, its aligned power-of-two groups (``create_hybrid_dp_cp_groups``) are the
tree's nodes of those sizes and are reused; single GPUs and non-power-of-two nodes (layouts with ``dp`` or
``cp`` not a power of two) get groups of ours -- megatron-core has none of those.

On GPU, Transformer Engine's attention switches groups on a CUDA stream megatron-core creates only for models
built with ``context_parallel_size > 1``; :func:`setup_dynamic_cp_groups` creates it for ``cp == 1`` layouts.

**The micro-batch's group reaches the model** through ``PackedSeqParams.cp_group`` and ``local_cp_size``
(:class:`~megatron_dynbatch.megatron.packing.PackedMicroBatch` sets them), which Transformer Engine's attention
(``TEDotProductAttention``) and this package's CPU attention (``ThdDotProductAttention``) honour per call.
megatron-core 0.16.1's ``Attention`` applies THD RoPE with ``self.pg_collection.cp`` -- the model's fixed CP
group -- to pick each CP rank's zig-zag positions, so with a different group per micro-batch the positions
would be wrong. :func:`microbatch_cp_group` (used by :func:`megatron_dynbatch.megatron.schedule.
default_forward_step`; wrap your own forward step in it) points every ``Attention`` module's
``pg_collection.cp`` at the micro-batch's group for the duration of its forward (a shallow copy of the
collection, restored afterwards). Backward needs no swap: RoPE's backward uses no group and the attention
collectives keep the group they ran with.

**Refused** (:func:`check_dynamic_cp_model`, at start-up from the flags and again per step from the model config):
multi-token prediction. megatron-core 0.16.1 rolls the MTP labels and loss mask one token left with
``roll_tensor(..., cp_group=self.cp_group, packed_seq_params=...)`` (``models/gpt/gpt_model.py``, the MTP branch
of ``_postprocess``; ``transformer/multi_token_prediction.py`` does the same), where ``self.cp_group`` is the
model's FIXED CP group (``LanguageModule.__init__`` takes it from ``pg_collection``), and the THD roll exchanges
each sequence's boundary tokens between the ranks of that group. Under dynamic CP a micro-batch is sliced for its
own group, so the roll would exchange tokens with a rank that holds a different micro-batch (wrong MTP labels) or
expect a slicing the micro-batch does not have. The fix is upstream's: take ``packed_seq_params.cp_group`` when
set.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..core.errors import DynBatchConfigError
from ..core.planner.dyncp.pool import PoolTree, pool_tree

__all__ = ["DynamicCPGroups", "setup_dynamic_cp_groups", "get_dynamic_cp_groups", "destroy_dynamic_cp_groups",
           "microbatch_cp_group", "check_dynamic_cp_model"]

_GROUPS: Optional["DynamicCPGroups"] = None


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class DynamicCPGroups:
    """This rank's CP group for every pool-tree node it belongs to (module docstring).

    ``pool_rank``: this rank's index in its pool; ``group(start, size)``: the group of that node (``None`` when
    this rank is not in it); ``ranks(start, size)``: its global ranks."""

    def __init__(self, dp: int, cp: int, pool_ranks: List[int], groups: Dict[Tuple[int, int], Any],
                 pool_rank: int, reused: Tuple[Tuple[int, int], ...]) -> None:
        self.dp, self.cp = dp, cp
        self.tree: PoolTree = pool_tree(dp, cp)
        self.pool_ranks = list(pool_ranks)
        self._groups = groups
        self.pool_rank = pool_rank
        self.reused = reused  # nodes served by megatron-core's own groups

    def group(self, start: int, size: int) -> Any:
        self.tree.node(start, size)  # a clear error for a non-tree group
        return self._groups.get((int(start), int(size)))

    def ranks(self, start: int, size: int) -> List[int]:
        node = self.tree.node(start, size)
        return self.pool_ranks[node.start:node.stop]


def setup_dynamic_cp_groups() -> DynamicCPGroups:
    """Create (once) the process groups of every pool-tree node; every rank of the world must call this at the
    same point (after ``parallel_state.initialize_model_parallel``). Idempotent: later calls return the same
    object until :func:`destroy_dynamic_cp_groups`."""
    global _GROUPS
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if _GROUPS is not None:
        return _GROUPS
    if not ps.model_parallel_is_initialized():
        raise DynBatchConfigError("parallel_state", "not initialised", "dynamic CP needs Megatron's process groups",
                                  "call parallel_state.initialize_model_parallel(...) first")
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    mine = [int(r) for r in dist.get_process_group_ranks(dp_cp)]
    dp, cp = ps.get_data_parallel_world_size(), ps.get_context_parallel_world_size()
    if len(mine) != dp * cp:  # pragma: no cover - Megatron's own invariant
        raise RuntimeError(f"DP x CP group has {len(mine)} ranks, expected dp*cp = {dp * cp}")
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    pools = sorted({tuple(p) for p in every})
    tree = pool_tree(dp, cp)
    hybrid = bool(getattr(ps, "_HYBRID_DP_CP_GROUPS", None))
    me = dist.get_rank()
    groups: Dict[Tuple[int, int], Any] = {}
    reused = []
    for pool in pools:
        for node in tree.nodes:
            ranks = list(pool[node.start:node.stop])
            key = (node.start, node.size)
            if node.size == tree.size:
                if me in ranks:
                    groups[key] = dp_cp
                continue
            if hybrid and _is_pow2(node.size) and node.size >= 2 and node.start % node.size == 0:
                if me in ranks:
                    g = ps.get_hybrid_data_context_parallel_groups(group_size=node.size)
                    if [int(r) for r in dist.get_process_group_ranks(g)] != ranks:  # pragma: no cover
                        raise RuntimeError(f"megatron-core's hybrid CP group of size {node.size} is not the pool "
                                           f"block {ranks}")
                    groups[key] = g
                    reused.append(key)
                continue
            g = dist.new_group(ranks)
            if me in ranks:
                groups[key] = g
    _GROUPS = DynamicCPGroups(dp, cp, mine, groups, mine.index(me), tuple(sorted(set(reused))))
    _te_cp_stream()
    return _GROUPS


def _te_cp_stream() -> None:
    """Transformer Engine's attention switches to a micro-batch's CP group with megatron-core's shared
    ``TEDotProductAttention.cp_stream``, which megatron-core only creates for models built with
    ``context_parallel_size > 1``; create it for a ``cp == 1`` layout too (GPU with TE only; a no-op here)."""
    import torch

    if not torch.cuda.is_available():
        return
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except ImportError:  # pragma: no cover - no Transformer Engine
        return
    if getattr(TEDotProductAttention, "cp_stream", None) is None:  # pragma: no cover - GPU only
        TEDotProductAttention.cp_stream = torch.cuda.Stream()


def get_dynamic_cp_groups() -> DynamicCPGroups:
    """The groups of :func:`setup_dynamic_cp_groups` (created on first use -- by every rank at once)."""
    return _GROUPS if _GROUPS is not None else setup_dynamic_cp_groups()


def destroy_dynamic_cp_groups() -> None:
    """Forget the groups (call before ``parallel_state.destroy_model_parallel``; the process groups themselves
    go with ``torch.distributed.destroy_process_group``)."""
    global _GROUPS
    _GROUPS = None


def check_dynamic_cp_model(args_or_config: Any, flag: str = "config.mtp_num_layers") -> None:
    """Refuse model features that read the model's fixed CP group where a dynamic-CP micro-batch needs its own
    (module docstring): multi-token prediction (``mtp_num_layers`` in Megatron's args or a
    ``TransformerConfig``). ``flag`` names the setting in the error."""
    mtp = getattr(args_or_config, "mtp_num_layers", None)
    if mtp:
        raise DynBatchConfigError(
            flag, mtp, "multi-token prediction rolls its labels across the model's FIXED context-parallel group "
            "(megatron-core's roll_tensor with GPTModel.cp_group), which under dynamic CP holds other micro-batches",
            "drop --dynbatch-dynamic-cp (fixed --context-parallel-size works with MTP), or train without MTP")


# ------------------------------------------------------------------------------------------ RoPE's group
def _attention_modules(model: Any) -> List[Any]:
    from megatron.core.transformer.attention import Attention

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for c in chunks for m in c.modules() if isinstance(m, Attention) and hasattr(m, "pg_collection")]


@contextlib.contextmanager
def microbatch_cp_group(model: Any, packed: Any) -> Iterator[None]:
    """While the block runs, megatron-core's ``Attention`` modules of ``model`` see ``packed``'s CP group as
    their ``pg_collection.cp`` (what THD RoPE reads; module docstring). A no-op for micro-batches of a
    fixed-CP plan."""
    group = getattr(packed, "cp_group", None) if getattr(packed, "dynamic_cp", False) else None
    if group is None:
        yield
        return
    swapped = []
    for m in _attention_modules(model):
        pgc = m.pg_collection
        new = copy.copy(pgc)
        new.cp = group
        swapped.append((m, pgc))
        m.pg_collection = new
    try:
        yield
    finally:
        for m, pgc in swapped:
            m.pg_collection = pgc
