"""Megatron-LM's own packing paths, re-implemented for the benchmark from their public behaviour (no code copied).

* ``megatron-dp-balanced`` -- Megatron-Core's ``DpBalancedScheduler`` (``megatron/core/datasets/data_schedule.py``,
  Megatron-LM ``main`` / ``dev``, Aug 2026): samples (lengths already padded per sequence, here the layout's
  ``2*cp`` rule) are packed next-fit in loader order into packs of at most ``max_seqlen_per_dp_cp_rank * cp``
  tokens (a sample over that starts a pack of its own, over the budget); while the pack count is not a multiple
  of ``dp`` (``dp * N`` under VPP, ``N`` = ``microbatch_group_size_per_vp_stage``), the last sample of the
  last pack holding more than one is moved into a new pack of its own (upstream asserts when none is left);
  pack ``k`` is DP rank ``k % dp``'s micro-batch ``k // dp``. Tokens only, no balancing.
* ``megatron-rl-packing`` / ``megatron-rl-packing-rr`` -- Megatron RL's ``--rl-use-sequence-packing``
  (``megatron/rl/sequence_packing_utils.py``): trajectories sorted longest first (ties in sample order) go
  next-fit into bins of ``--seq-length`` tokens (here the budget ``max_tokens_per_gpu * cp``), each taking its
  length rounded up to ``2*cp`` under CP, at most 50 per bin (``--rl-sequence-packing-max-sequences-per-bin``);
  ``fifo`` deals contiguous runs of bins (the first ``bins % dp`` ranks one more), ``round-robin`` deals bin
  ``k`` to rank ``k % dp``; ranks short of ``ceil(bins / dp)`` get empty all-pad bins. Every bin is a
  ``[1, seq_length]`` micro-batch: scored with ``fixed_microbatch_tokens`` (its padding runs, an empty bin runs
  in full). A trajectory longer than a bin cannot exist there (rows are ``--seq-length`` wide): infeasible.

Each function returns ``micro_batches[rank][j]`` like every baseline in :mod:`.baselines`, which registers them.
"""

from __future__ import annotations

from typing import Any, List

import numpy as np

from .partitioning import BaselineInfeasible, next_fit_packs

#: Megatron RL's default ``--rl-sequence-packing-max-sequences-per-bin``.
RL_MAX_SEQUENCES_PER_BIN = 50


def megatron_dp_balanced(lengths: np.ndarray, ctx: Any) -> List[List[List[int]]]:
    """Megatron-Core ``DpBalancedScheduler``: next-fit in loader order by tokens, count rounded to a multiple of
    ``dp`` (x ``N`` under VPP) by splitting single samples off the tail, packs dealt round-robin."""
    par = ctx.parallel
    multiple = par.dp * (par.vp_group_size if par.vpp > 1 else 1)
    try:
        packs = next_fit_packs(ctx.alignment.seq_len(lengths), ctx.cap, lambda n: -(-n // multiple) * multiple)
    except BaselineInfeasible:
        raise BaselineInfeasible(f"megatron-dp-balanced: not enough samples to make a multiple of {multiple} "
                                 "packs (upstream asserts)") from None
    return [packs[r::par.dp] for r in range(par.dp)]


def _rl_bins(lengths: np.ndarray, ctx: Any) -> List[List[int]]:
    mult = ctx.alignment.seq_multiple
    slots = (-(-lengths // mult) * mult).tolist()
    if max(slots) > ctx.cap:
        raise BaselineInfeasible(f"megatron-rl-packing: a trajectory of {max(slots)} tokens does not fit a "
                                 f"--seq-length {ctx.cap} row")
    order = sorted(range(len(slots)), key=lambda i: -slots[i])
    bins: List[List[int]] = []
    used = 0
    for i in order:
        if bins and used + slots[i] <= ctx.cap and len(bins[-1]) < RL_MAX_SEQUENCES_PER_BIN:
            bins[-1].append(i)
            used += slots[i]
        else:
            bins.append([i])
            used = slots[i]
    return bins


def _with_filler(ranks: List[List[List[int]]]) -> List[List[List[int]]]:
    most = max(len(r) for r in ranks)
    return [r + [[] for _ in range(most - len(r))] for r in ranks]


def megatron_rl_packing(lengths: np.ndarray, ctx: Any) -> List[List[List[int]]]:
    """Megatron RL ``--rl-use-sequence-packing --rl-sequence-packing-algo fifo``: longest-first next-fit bins of
    ``--seq-length``, contiguous runs of bins per rank, empty filler bins to equal counts."""
    bins, dp = _rl_bins(lengths, ctx), ctx.parallel.dp
    base, extra = divmod(len(bins), dp)
    out, start = [], 0
    for r in range(dp):
        size = base + (1 if r < extra else 0)
        out.append(bins[start:start + size])
        start += size
    return _with_filler(out)


def megatron_rl_packing_rr(lengths: np.ndarray, ctx: Any) -> List[List[List[int]]]:
    """Megatron RL ``--rl-sequence-packing-algo round-robin``: the same bins, bin ``k`` to rank ``k % dp``,
    empty filler bins to equal counts."""
    bins, dp = _rl_bins(lengths, ctx), ctx.parallel.dp
    return _with_filler([bins[r::dp] for r in range(dp)])


__all__ = ["RL_MAX_SEQUENCES_PER_BIN", "megatron_dp_balanced", "megatron_rl_packing", "megatron_rl_packing_rr"]
