"""Models of the trainers' own batching functions, for the drop-ins' property tests (test support, never imported by
the library; the trainers are not installable here).

Each model reproduces, from the trainer's public source (read Aug 2026), what a caller of that function can
observe -- which samples land in which step, shard or micro-batch, how many micro-batches, and which inputs it
refuses with which exception type -- not its exact packing. The packing steps come from the benchmark's
re-implementations (:mod:`megatron_dynbatch.bench.partitioning`, Karmarkar-Karp from the core):

* :func:`slime_build_dp_schedule` -- slime ``slime/utils/dp_schedule.py::build_dp_schedule`` (dynamic path);
* :func:`verl_rearrange_micro_batches` -- verl ``verl/utils/seqlen_balancing.py::rearrange_micro_batches``;
* :func:`nemo_rl_pack` -- NeMo-RL ``nemo_rl/data/packing/algorithms.py`` (modified first-fit decreasing);
* :func:`roll_dynamic_batching_shard` -- ROLL ``roll/utils/dynamic_batching.py::dynamic_batching_shard``.

Where the trainer asserts, the model raises ``AssertionError``; NeMo-RL's refusals are ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import numpy as np

from ..bench.partitioning import (BaselineInfeasible, adjust_bin_count, first_fit, modified_first_fit_decreasing,
                                  split_largest_bins)
from ..core.partitioning import karmarkar_karp

__all__ = ["RollLayout", "SlimeSchedule", "nemo_rl_pack", "roll_dynamic_batching_shard", "slime_build_dp_schedule",
           "verl_rearrange_micro_batches"]


@dataclass
class SlimeSchedule:
    """What slime's caller sees: each step's samples (global indices, sorted), its per-rank micro-batch count,
    and each rank's micro-batches (global indices)."""

    steps: List[List[int]]
    num_microbatches: List[int]
    micro_batches: List[List[List[int]]]


def slime_build_dp_schedule(lengths: Sequence[int], rollout_indices: Sequence[Any], global_batch_size: int,
                            dp: int, cap: int, align_to: int) -> SlimeSchedule:
    """slime's dynamic path: rollouts in first-occurrence order, ``global_batch_size`` of them per step (the
    rest dropped); per step, first fit under ``cap`` real tokens (a sample over it alone), the bin count raised
    to a multiple of ``align_to`` (``dp``, times ``N`` under VPP) by splitting bins, bins dealt to ranks with
    equal counts."""
    lens = np.asarray(lengths, dtype=np.int64)
    members: dict = {}
    for i, r in enumerate(rollout_indices):
        members.setdefault(r, []).append(i)
    order = list(members)
    n_steps = len(order) // global_batch_size
    assert n_steps >= 1, "num_rollouts < global_batch_size"
    out = SlimeSchedule([], [], [[] for _ in range(dp)])
    for s in range(n_steps):
        samples = [i for r in order[s * global_batch_size:(s + 1) * global_batch_size] for i in members[r]]
        assert len(samples) >= dp, "a step needs at least one sample per rank"
        bins = first_fit(lens[samples], cap)
        target = max(-(-len(bins) // align_to) * align_to, align_to)
        bins = split_largest_bins(bins, target, lens[samples])
        assert len(bins) == target, "too few samples to split the bins to an aligned count"
        ranks = karmarkar_karp([float(lens[samples][b].sum()) for b in bins], dp, equal_size=True)
        out.steps.append(sorted(samples))
        out.num_microbatches.append(target // dp)
        for r in range(dp):
            out.micro_batches[r] += [[samples[i] for i in bins[j]] for j in ranks[r]]
    return out


def verl_rearrange_micro_batches(lengths: Sequence[int], max_token_len: int, width: int,
                                 min_num_micro_batch: Optional[int] = None,
                                 num_batches_divided_by: Optional[int] = None,
                                 force_group_size: int = 1) -> List[List[int]]:
    """verl's micro-batches of one rank (no DP all-reduce): ``min(groups, ceil(tokens / max_token_len))``,
    at least ``min_num_micro_batch``, rounded up to ``num_batches_divided_by``; groups of ``force_group_size``
    consecutive samples split by Karmarkar-Karp on verl's workload, the budget not checked again."""
    lens = np.asarray(lengths, dtype=np.float64)
    assert max_token_len >= width, "max_token_len must be >= the sequence length"
    assert lens.size % force_group_size == 0, "batch size must divide by force_group_size"
    groups = lens.size // force_group_size
    count = min(groups, -(-int(lens.sum()) // max_token_len))
    if min_num_micro_batch is not None:
        count = max(count, min_num_micro_batch)
    if num_batches_divided_by is not None:
        count = -(-count // num_batches_divided_by) * num_batches_divided_by
    assert 1 <= count <= groups, "more micro-batches than groups (or none: verl fails on a batch of no tokens)"
    work = (24576 * lens + lens ** 2).reshape(groups, force_group_size).sum(axis=1)
    parts = karmarkar_karp(work, count, equal_size=False)
    assert all(parts), "an empty micro-batch"
    return [sorted(i for g in p for i in range(g * force_group_size, (g + 1) * force_group_size)) for p in parts]


def nemo_rl_pack(lengths: Sequence[int], bin_capacity: int, min_bin_count: Optional[int] = None,
                 bin_count_multiple: Optional[int] = None) -> List[List[int]]:
    """NeMo-RL's ``modified_first_fit_decreasing`` packer with its bin-count adjustment: no bins for no
    sequences, ``ValueError`` for a sequence over the capacity or too few sequences for the bins -- the latter in
    NeMo-RL's words, ``Cannot create N bins with only M sequences`` (``N``: first fit's count raised to
    ``min_bin_count`` and then to a multiple of ``bin_count_multiple``)."""
    if len(lengths) == 0:
        return []
    if max(lengths) > bin_capacity:
        raise ValueError("a sequence exceeds the bin capacity")
    bins = modified_first_fit_decreasing(list(lengths), bin_capacity)
    try:
        return adjust_bin_count(bins, min_bin_count or 0, bin_count_multiple or 1)
    except BaselineInfeasible:
        target = max(len(bins), min_bin_count or 0)
        target = -(-target // (bin_count_multiple or 1)) * (bin_count_multiple or 1)
        raise ValueError(f"Cannot create {target} bins with only {len(lengths)} sequences") from None


@dataclass
class RollLayout:
    """What ROLL's caller sees: the rows (each a set of ``dp`` samples of equal sorted rank, one per shard), the
    shared ``[start, end)`` ranges and their padded lengths."""

    rows: List[List[int]]
    ranges: List[List[int]]
    lengths: List[int]


def roll_dynamic_batching_shard(lengths: Sequence[int], dp: int, cap: int, rnd: int, pp: int = 1,
                                vpp: Optional[int] = None) -> RollLayout:
    """ROLL's layout: samples sorted by length and strided over ``dp`` shards (row ``i`` = sorted positions
    ``i*dp .. i*dp+dp-1``); one greedy cut of the rows shared by all shards (a micro-batch grows while
    ``rows x longest rounded length`` fits ``cap``; only the first starts at one round); with ``pp > 1`` and
    ``vpp`` set (1 included) the count rounded up to a multiple of ``pp`` by halving the largest micro-batches."""
    lens = np.asarray(lengths, dtype=np.int64)
    order = sorted(range(lens.size), key=lambda i: (int(lens[i]), i))
    assert lens.size % dp == 0, "shards must be equal"
    rows = [order[k:k + dp] for k in range(0, lens.size, dp)]
    padded = [-(-int(max(lens[r])) // rnd) * rnd for r in rows]
    assert max(padded) <= cap, "a padded sequence exceeds the micro-batch budget"
    ranges, sizes = [[0, 0]], [0]
    longest = rnd
    for k, p in enumerate(padded):
        rows_now = ranges[-1][1] - ranges[-1][0] + 1
        if rows_now * max(longest, p) <= cap:
            longest = max(longest, p)
            ranges[-1][1] += 1
            sizes[-1] = longest
        else:
            ranges.append([k, k + 1])
            longest = p
            sizes.append(p)
    if pp > 1 and vpp:
        target = -(-len(ranges) // pp) * pp
        assert pp <= len(rows) and target <= len(rows), "too few samples per shard for the pipeline"
        split = sorted((k for k, (a, b) in enumerate(ranges) if b - a > 1),
                       key=lambda k: -(ranges[k][1] - ranges[k][0]) * sizes[k])[:target - len(ranges)]
        assert len(split) == target - len(ranges), "too few micro-batches to split"
        for k in split:
            a, b = ranges[k]
            ranges.append([a + (b - a) // 2, b])
            sizes.append(sizes[k])
            ranges[k] = [a, a + (b - a) // 2]
        pairs = sorted(zip(ranges, sizes, strict=True))
        ranges, sizes = [p[0] for p in pairs], [p[1] for p in pairs]
    return RollLayout(rows, ranges, sizes)
