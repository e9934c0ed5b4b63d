#!/usr/bin/env python
"""verl drop-in on CPU with two real DP ranks (gloo): the driver balances the batch over the ranks
(``balance_batch``, verl's ``_balance_batch``), each rank splits its share into micro-batches
(``prepare_dynamic_batch``; the ranks agree on the count with one all-reduce over the DP group), runs a forward
per micro-batch and puts the per-token outputs back in order (``restore_dynamic_batch``). The outputs must equal
a forward over the unsplit share.

In verl the change is the ``verl.utils.seqlen_balancing`` import in each file that has one (docs/migrating.md
names the files; the names, together)::

    from megatron_dynbatch.integrations.verl import (calculate_workload, get_group_balanced_partitions,
                                                     get_reverse_idx, get_seqlen_balanced_partitions,
                                                     log_seqlen_unbalance, prepare_dynamic_batch,
                                                     rearrange_micro_batches, restore_dynamic_batch)

verl's own ``_balance_batch`` then runs unchanged; optionally ``RayPPOTrainer._balance_batch =
megatron_dynbatch.integrations.verl.trainer_balance_batch`` balances DP ranks under the budget too.

verl is not installed here: DataProto is a stand-in with the same fields. Run:
``python examples/verl_dynamic_batch.py``.
"""

from __future__ import annotations

import os

import numpy as np


def rank_main(rank: int, world_size: int, shares) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_dynbatch.integrations.verl import prepare_dynamic_batch, restore_dynamic_batch

    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}")
    data = shares[rank]
    torch.manual_seed(0)
    emb = torch.nn.Embedding(1000, 8)

    def forward(batch):  # a per-token "log-prob": any function of each token alone
        return (emb(batch["input_ids"]).sum(-1) * batch["attention_mask"]).detach()

    parts, idx = prepare_dynamic_batch(data, max_token_len=2048, dp_group=dist.group.WORLD)
    width = data.batch["input_ids"].shape[1]
    outs = torch.cat([forward(p.batch)[:, :width] for p in parts])
    restored = restore_dynamic_batch(outs, idx)
    same = bool(torch.allclose(restored, forward(data.batch)))
    tokens = [int(p.batch["attention_mask"].sum()) for p in parts]
    dist.destroy_process_group()
    return {"count": len(parts), "tokens": tokens, "same": same}


def main() -> None:
    from megatron_dynbatch.integrations.verl import balance_batch
    from megatron_dynbatch.megatron.ranks import run_ranks
    from megatron_dynbatch.testing.peer_types import grpo_batch

    rng = np.random.default_rng(3)
    lengths = rng.integers(50, 1024, 32).tolist()
    batch = grpo_batch(lengths, group_size=4, width=1024)
    metrics: dict = {}
    balance_batch(batch, 2, metrics, max_token_len=2048)  # the driver: equal, balanced shares
    half = len(batch) // 2
    shares = [batch.slice(0, half), batch.slice(half, 2 * half)]
    print(f"balanced token sums per rank: {metrics['global_seqlen/balanced_min']} .. "
          f"{metrics['global_seqlen/balanced_max']} (before: {metrics['global_seqlen/min']} .. "
          f"{metrics['global_seqlen/max']})")
    results = run_ranks(rank_main, 2, shares, timeout=120)
    for r, res in enumerate(results):
        print(f"  rank {r}: {res['count']} micro-batches, tokens {res['tokens']}")
        assert res["same"] and max(res["tokens"]) <= 2048
    assert results[0]["count"] == results[1]["count"]
    print("ok: same count on both ranks (one all-reduce), every micro-batch within 2048 tokens, outputs restored "
          "in order")


if __name__ == "__main__":
    main()
