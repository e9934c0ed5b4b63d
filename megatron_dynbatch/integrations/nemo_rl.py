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
the run produces, checked against the capacity when the packer is built: before step 1). Pure Python.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Optional, Union

from ..core.dropin import nemo_rl as _core
from ..core.dropin.nemo_rl import DynBatchSequencePacker, PackingAlgorithm

SequencePacker = DynBatchSequencePacker

__all__ = ["DynBatchSequencePacker", "PackingAlgorithm", "SequencePacker", "get_packer", "nemo_rl_packer_class"]

#: where NeMo-RL defines its abstract ``SequencePacker``
NEMO_RL_ALGORITHMS = "nemo_rl.data.packing.algorithms"


def get_packer(algorithm: Union[PackingAlgorithm, str], bin_capacity: int, collect_metrics: bool = False,
               min_bin_count: Optional[int] = None, bin_count_multiple: Optional[int] = None,
               **kwargs: Any) -> DynBatchSequencePacker:
    """NeMo-RL's factory (see the module docstring): a :class:`DynBatchSequencePacker`, and a NeMo-RL
    ``SequencePacker`` where NeMo-RL can be imported."""
    return _core.get_packer(algorithm, bin_capacity, collect_metrics, min_bin_count, bin_count_multiple,
                            packer_class=nemo_rl_packer_class(), **kwargs)


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
