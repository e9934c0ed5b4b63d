#!/usr/bin/env python
"""ROLL drop-in on CPU: ``dynamic_batching_shard`` (``use_dynamic_batching_in_train`` +
``max_tokens_per_microbatch_in_train``) and the micro-batches ROLL's strategy then runs.

In ROLL the change is one import in its pipelines (``roll/pipeline/rlvr/rlvr_pipeline.py`` and others)::

    from megatron_dynbatch.integrations.roll import dynamic_batching_shard

ROLL is not installed here: the batch is a stand-in DataProto with the fields ROLL's function reads; the
micro-batches are cut as ROLL's ``make_micro_batch_iter_for_dynamic_batching`` cuts them (rows ``[start, end)``
of each rank's shard, columns up to the micro-batch's length). Run: ``python examples/roll_dynamic_batching.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_dynbatch.integrations.roll import dynamic_batching_shard
from megatron_dynbatch.testing.peer_types import grpo_batch


def main() -> None:
    rng = np.random.default_rng(2)
    dp, budget, width = 4, 8192, 4096
    lengths = rng.integers(64, width, 64).tolist()
    batch, metrics = dynamic_batching_shard(grpo_batch(lengths, group_size=8, width=width), dp, budget, 64,
                                            pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                            log_prefix="actor_train/train_step", model="qwen3-8b")
    meta = batch.meta_info
    print(f"{meta['num_micro_batchs']} micro-batches per rank (pp=2, vpp=2: Megatron's rule), "
          f"removed padding {metrics['dynamic_batching/actor_train/train_step/removed_padding_ratio']:.0%}")
    shard = len(batch) // dp
    for r in range(dp):
        rank = batch.slice(r * shard, (r + 1) * shard)
        real = 0
        for (a, b), s in zip(meta["micro_batch_indices"], meta["micro_batch_lengths"]):
            mb = rank.slice(a, b)
            mask = mb.batch["attention_mask"][:, :s]  # ROLL narrows every field to the micro-batch length
            assert mask.numel() <= budget and int(mask.sum()) == int(mb.batch["attention_mask"].sum())
            real += int(mask.sum())
        print(f"  rank {r}: {shard} samples, {real} real tokens")
    assert torch.equal(torch.sort(torch.tensor(batch.non_tensor_batch["sample_id"].tolist())).values,
                       torch.arange(len(lengths)))
    print(f"ok: every [rows, length] micro-batch within {budget} tokens, no real token cut")


if __name__ == "__main__":
    main()
