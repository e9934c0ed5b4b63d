"""Drop-in for NeMo-RL's ``nemo_rl.data.packing.get_packer``: change the import in
``nemo_rl/distributed/batched_data_dict.py``::

    from megatron_dynbatch.integrations.nemo_rl import get_packer   # was: from nemo_rl.data.packing import ...

Same factory signature (``algorithm, bin_capacity, collect_metrics=False, min_bin_count=None,
bin_count_multiple=None``), same packer interface (``pack``, ``min_bin_count``, ``bin_count_multiple``,
``bin_capacity``, ``reset_metrics``, ``compute_metrics``, ``get_aggregated_metrics``, ``print_metrics``), empty
input -> no bins, a sequence over the capacity -> ``ValueError``. The bins come back interleaved so that
NeMo-RL's round-robin dealing (bin ``j`` to rank ``j % shards``, with ``bin_count_multiple = shards``) gives
every rank a balanced, equal-count share under the cap: see :mod:`megatron_dynbatch.core.dropin.nemo_rl`.

Extra keyword arguments of ``get_packer`` (optional): ``parallel`` (the layout: ``pp``, ``vpp``,
``microbatch_group_size_per_vp_stage``, ``cp`` -- for Megatron's exact VPP rule and the cost model),
``model`` (balance the model's time, not tokens), ``cost_model``, ``max_seq_len`` (the longest padded sequence
the run produces, checked against the capacity when the packer is built: before step 1). Pure Python.
"""

from __future__ import annotations

from ..core.dropin.nemo_rl import DynBatchSequencePacker, PackingAlgorithm, get_packer

SequencePacker = DynBatchSequencePacker

__all__ = ["DynBatchSequencePacker", "PackingAlgorithm", "SequencePacker", "get_packer"]
