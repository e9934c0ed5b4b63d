"""Drop-in for NeMo-RL's ``nemo_rl.data.packing.get_packer``: change the import in
``nemo_rl/distributed/batched_data_dict.py``::

    from megatron_dynbatch.integrations.nemo_rl import get_packer   # was: from nemo_rl.data.packing import ...

Same factory signature (``algorithm, bin_capacity, collect_metrics=False, min_bin_count=None,
bin_count_multiple=None``), same packer interface (``pack``, ``min_bin_count``, ``bin_count_multiple``,
``bin_capacity``, ``reset_metrics``, ``compute_metrics``, ``get_aggregated_metrics``, ``print_metrics``), empty
input -> no bins, a sequence over the capacity -> ``ValueError``, too few sequences for the bins -> ``ValueError``
whose message holds NeMo-RL's own words (``Cannot create N bins with only M sequences``) beside the fix. The bins
come back interleaved so that NeMo-RL's round-robin dealing (bin ``j`` to rank ``j % shards``, with
``bin_count_multiple = shards``) gives every rank a balanced, equal-count share under the cap: see
:mod:`megatron_dynbatch.core.dropin.nemo_rl`.

**The packer is a NeMo-RL ``SequencePacker``** where NeMo-RL can be imported
(``nemo_rl.data.packing.algorithms``, tried once; a module already loaded is used as it is): ``get_packer``
returns an instance of a subclass of both :class:`DynBatchSequencePacker` and NeMo-RL's own abstract
``SequencePacker`` -- ours first in the method order, so every method NeMo-RL calls is ours, and
``isinstance(packer, SequencePacker)`` holds as NeMo-RL's own tests check. Without NeMo-RL it is a plain
:class:`DynBatchSequencePacker`.

Extra keyword arguments of ``get_packer`` (optional): ``parallel`` (the layout: ``pp``, ``vpp``,
``microbatch_group_size_per_vp_stage``, ``cp`` -- for Megatron's exact VPP rule and the cost model),
``model`` (balance the model's time, not tokens), ``cost_model``, ``max_seq_len`` (the longest padded sequence
the run produces, checked against the capacity when the packer is built: before step 1).

Memory at start-up: the packer sees neither the layout nor which pass it serves, so the memory check is one call
at start-up, :func:`check_budget_memory` on NeMo-RL's config (the master config or its ``policy``):
``train_mb_tokens`` / ``logprob_mb_tokens`` of ``policy.sequence_packing`` or ``policy.dynamic_batching``
(per micro-batch: ``cp`` x the per-GPU tokens) against what the memory model says fits the card, layout and
memory settings from ``policy.megatron_cfg``, the model from a local ``policy.model_name``: a
:class:`~megatron_dynbatch.core.errors.BudgetWarning` when one is over it (out of memory ahead) or under 60% of it
(speed left behind), naming the value to use; nothing when the card or the model is unknown. Pure Python.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Optional, Union

from ..core.dropin import nemo_rl as _core
from ..core.dropin.budgets import nemo_rl_budgets
from ..core.dropin.nemo_rl import DynBatchSequencePacker, PackingAlgorithm
from ..core.memory.check import FAR_UNDER

SequencePacker = DynBatchSequencePacker

__all__ = ["DynBatchSequencePacker", "PackingAlgorithm", "SequencePacker", "check_budget_memory", "get_packer",
           "nemo_rl_packer_class"]

#: where NeMo-RL defines its abstract ``SequencePacker``
NEMO_RL_ALGORITHMS = "nemo_rl.data.packing.algorithms"


def get_packer(algorithm: Union[PackingAlgorithm, str], bin_capacity: int, collect_metrics: bool = False,
               min_bin_count: Optional[int] = None, bin_count_multiple: Optional[int] = None,
               **kwargs: Any) -> DynBatchSequencePacker:
    """NeMo-RL's factory (see the module docstring): a :class:`DynBatchSequencePacker`, and a NeMo-RL
    ``SequencePacker`` where NeMo-RL can be imported."""
    return _core.get_packer(algorithm, bin_capacity, collect_metrics, min_bin_count, bin_count_multiple,
                            packer_class=nemo_rl_packer_class(), **kwargs)


def check_budget_memory(config: Any, *, model: Any = None, gpu_memory_gb: Any = None, settings: Any = None,
                        profile: Any = None, far_under: Any = FAR_UNDER, dp_size: Optional[int] = None) -> list:
    """NeMo-RL's configured budgets against what fits the card (module docstring): ``config`` NeMo-RL's master
    config (``policy``, ``cluster``) or its ``policy``; the :class:`~megatron_dynbatch.core.memory.check.
    BudgetVerdict` of each budget, a ``BudgetWarning`` for those over what fits or far under it; ``[]`` when the
    card or the model is unknown or the policy is not on Megatron. ``model`` (else a local ``policy.model_name``),
    ``gpu_memory_gb`` (else this process's GPU), ``settings`` (else what ``megatron_cfg`` implies; a mapping
    changes those fields), ``profile``, ``far_under`` (the "speed left behind" threshold; 0 turns it off),
    ``dp_size`` (else ``cluster.gpus_per_node x num_nodes / (tp x pp x cp)``). Bad input raises."""
    from .budget_check import warn_configured_budgets

    return warn_configured_budgets(nemo_rl_budgets(config, dp_size), model=model, gpu_memory_gb=gpu_memory_gb,
                                   settings=settings, profile=profile, far_under=far_under)


def nemo_rl_packer_class() -> type:
    """The packer class ``get_packer`` builds: :class:`DynBatchSequencePacker` joined with NeMo-RL's own
    ``SequencePacker`` when NeMo-RL can be imported (one class per NeMo-RL class), else ours alone."""
    # a module already loaded is used as it is (``None`` there: not importable, as Python's import treats it)
    module = sys.modules[NEMO_RL_ALGORITHMS] if NEMO_RL_ALGORITHMS in sys.modules else _import_nemo_rl()
    base = getattr(module, "SequencePacker", None)
    return DynBatchSequencePacker if not isinstance(base, type) else _joined(base)


@functools.lru_cache(maxsize=None)
def _import_nemo_rl() -> Any:
    """NeMo-RL's packing module, or ``None`` where it cannot be imported (tried once per process)."""
    try:
        return importlib.import_module(NEMO_RL_ALGORITHMS)
    except ImportError:
        return None


@functools.lru_cache(maxsize=None)
def _joined(base: type) -> type:
    """A subclass of ours and of NeMo-RL's ``SequencePacker`` ``base`` (ours first: its ``__init__``, ``pack``,
    ``_pack_implementation`` and metrics methods are the ones that run)."""
    return type("DynBatchSequencePacker", (DynBatchSequencePacker, base),
                {"__module__": __name__, "__doc__": DynBatchSequencePacker.__doc__})
