#!/usr/bin/env python
"""slime drop-in on CPU: ``build_dp_schedule`` with slime's own arguments, for one rollout of GRPO samples.

In slime the change is one import in ``slime/ray/rollout.py``::

    from megatron_dynbatch.integrations.slime import build_dp_schedule

slime is not installed here, so its ``args`` are a namespace with the fields slime passes (Megatron's args plus
slime's); everything else is the real drop-in. Run: ``python examples/slime_build_dp_schedule.py``.
"""

from __future__ import annotations

import numpy as np

from megatron_dynbatch.integrations.slime import build_dp_schedule, check_budget
from megatron_dynbatch.testing.peer_types import slime_args


def main() -> None:
    rng = np.random.default_rng(0)
    # 48 rollouts; a third of them (multi-turn / subagent) emit two training samples
    rollout_ids = [r for r in range(48) for _ in range(2 if r % 3 == 0 else 1)]
    lengths = rng.integers(200, 6000, len(rollout_ids)).tolist()
    args = slime_args(max_tokens_per_gpu=8192, tensor_model_parallel_size=2, sequence_parallel=True,
                      rollout_max_prompt_len=2048, rollout_max_response_len=6144, dynbatch_oversize="error")
    config = {"dp_size": 4, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    check_budget(args, config)  # at start-up: the longest possible sample fits the budget
    partitions, mbi, num_mbs, gbs = build_dp_schedule(args, config, lengths, global_batch_size=24,
                                                      rollout_indices=rollout_ids)
    print(f"{len(gbs)} optimizer steps of {gbs[0]} rollouts; micro-batches per rank and step: {num_mbs}")
    for r in range(4):
        tokens = [sum(lengths[partitions[r][i]] for i in mb) for mb in mbi[r]]
        print(f"  rank {r}: {len(partitions[r])} samples, micro-batch tokens {tokens}")
        assert len(mbi[r]) == sum(num_mbs) and all(t <= 8192 for t in tokens)
    assert sorted(i for p in partitions for i in p) == list(range(len(lengths)))
    print("ok: equal counts on every rank, every sample once, every micro-batch within 8192 tokens "
          "(slime's tp*128 padding counted)")


if __name__ == "__main__":
    main()
