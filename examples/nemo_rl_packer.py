#!/usr/bin/env python
"""NeMo-RL drop-in on CPU: ``get_packer`` as ``BatchedDataDict.shard_by_batch_size`` uses it.

In NeMo-RL the change is one import in ``nemo_rl/distributed/batched_data_dict.py``::

    from megatron_dynbatch.integrations.nemo_rl import get_packer

NeMo-RL calls ``get_packer(algorithm, bin_capacity, min_bin_count=shards, bin_count_multiple=shards)`` and deals
bin ``j`` to rank ``j % shards``; this script does the same with padded sequence lengths and shows each rank's
share. Run: ``python examples/nemo_rl_packer.py``.
"""

from __future__ import annotations

import numpy as np

from megatron_dynbatch.integrations.nemo_rl import get_packer


def main() -> None:
    rng = np.random.default_rng(1)
    shards, capacity, pad = 4, 8192, 64  # dp, train_mb_tokens, sequence_length_pad_multiple
    lengths = rng.integers(100, 7000, 96)
    padded = (-(-lengths // pad) * pad).tolist()
    packer = get_packer("modified_first_fit_decreasing", capacity, min_bin_count=shards, bin_count_multiple=shards,
                        model="qwen3-8b", max_seq_len=8192)
    bins = packer.pack(padded)
    assert packer.pack([]) == []
    ranks = [bins[r::shards] for r in range(shards)]  # NeMo-RL's round-robin dealing
    for r, rank_bins in enumerate(ranks):
        tokens = [sum(padded[i] for i in b) for b in rank_bins]
        print(f"  rank {r}: {len(rank_bins)} micro-batches, {sum(tokens)} tokens, largest {max(tokens)}")
        assert max(tokens) <= capacity
    assert len({len(b) for b in ranks}) == 1
    assert sorted(i for b in bins for i in b) == list(range(len(padded)))
    print(f"ok: {len(bins)} bins, {len(bins) // shards} per rank, none over {capacity} tokens")


if __name__ == "__main__":
    main()
