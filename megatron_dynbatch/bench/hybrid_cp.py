"""``megatron-hybrid-cp``: megatron-core 0.16's hybrid (dynamic) context parallelism, re-implemented from its
public behaviour for the benchmark, scored with the same cost model as every other algorithm.

What megatron-core 0.16.1 does (``pipeline_parallel/hybrid_cp_schedule.py::BalancedCPScheduler``,
``datasets/data_schedule.py::HybridCPDataLoaderWrapper``; we re-wrote the behaviour, no code is copied):

* every sample gets a CP size by memory only: the next power of two of ``L / max_seqlen_per_dp_cp_rank``
  (we pass ``max_tokens_per_gpu``), 1 when it fits one GPU; its workload is ``L^2 / cp`` (no linear term, no
  communication);
* the samples are sorted longest first ONCE; each round cuts the samples still to place (in that order) into as
  many workload-balanced buckets as there are distinct CP sizes; a sample joins the existing group of its CP
  size with the least load, or opens a new group on the first free GPUs when that is less loaded; once the
  sizes decrease, a round closes as soon as the DP x CP GPUs are within 5% of each other; the last sample is
  dropped back while that narrows the spread (dropped samples go to the END of the leftovers, which are not
  re-sorted); GPUs left empty get work by doubling the CP size of the first smallest group IN PLACE: its GPUs
  grow to the right and every later group shifts right by as many GPUs, so groups stay contiguous;
* each sample then runs as its OWN micro-batch (one ``forward_step`` per sample) on its group, groups of a
  round run their samples one after another, and a barrier over the DP x CP group ends every round.

Scoring: a sample on ``g`` GPUs costs :meth:`CostModel.group_microbatch_time` (per-micro-batch overhead and
floor, linear + attention work over ``g``, exposed K/V exchange, across nodes where the group crosses them) with
``2 g`` alignment; a round lasts its slowest group; rounds add up. Upstream's schedule is PP=1 only (0.16.1);
with ``pp > 1`` we model what the natural extension would do -- every round a separate 1F1B pipeline of each
group's samples, flushed at the round's barrier -- and say so in the row's notes.
"""

from __future__ import annotations

import math
import time
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ..core.alignment import Alignment, fp8_multiple
from ..core.cost_model import CostModel, simulate_1f1b
from ..core.parallel import ParallelConfig
from ..core.topology import group_spans_nodes
from ..core.planner.dyncp.plan import DynamicCPPlan
from ..core.planner.options import BalanceBy
from .partitioning import BaselineInfeasible

NAME = "megatron-hybrid-cp"
PROVENANCE = ("megatron-core 0.16 hybrid context parallelism (BalancedCPScheduler: CP size by memory, L^2/cp "
              "balancing, one micro-batch per sample, a barrier per round; PP=1 upstream, pp>1 modelled)")
DELTA = 0.05          # round balance slack
BUCKET_SLACK = 1.1    # a bucket closes above 1.1 x its work target


def cp_size_needed(length: int, max_seqlen_per_rank: int) -> int:
    """Upstream's ``gpus_needed``: the next power of two of ``L / max_seqlen_per_rank`` (at least 1)."""
    ratio = length / max_seqlen_per_rank
    return 1 if ratio <= 1 else 2 ** math.ceil(math.log2(ratio))


def _buckets(items: List[Tuple[int, int]], need, work) -> List[List[Tuple[int, int]]]:
    """As many roughly equal-work buckets as distinct CP sizes, in (longest-first) order."""
    k = len({need(L) for _, L in items})
    total = sum(work(L) for _, L in items)
    target = total / k
    out: List[List[Tuple[int, int]]] = []
    cur: List[Tuple[int, int]] = []
    cur_work = 0.0
    remaining_k = k
    for idx, (i, L) in enumerate(items):
        w = work(L)
        if cur and (cur_work + w > target * BUCKET_SLACK or len(items) - idx <= remaining_k - len(out)):
            out.append(cur)
            cur, cur_work = [], 0.0
            remaining_k -= 1
        cur.append((i, L))
        cur_work += w
    if cur:
        out.append(cur)
    return out


def _round(items: List[Tuple[int, int]], pool: int, need,
           work) -> Tuple[List[List[int]], List[int], List[Tuple[int, int]]]:
    """One round: per GPU its samples (in order), per GPU its group id, and the leftover items."""
    buckets = _buckets(items, need, work)
    exec_t = [0.0] * pool
    per_gpu: List[List[int]] = [[] for _ in range(pool)]
    lens_gpu: List[List[int]] = [[] for _ in range(pool)]
    gid_of: List[Optional[int]] = [None] * pool
    members: dict = {}
    gsize: dict = {}
    prev_need = None
    check = False
    while buckets:
        pick = None
        for b, bucket in enumerate(buckets):
            if not bucket:
                continue
            n = need(bucket[0][1])
            free = [r for r in range(pool) if gid_of[r] is None]
            if any(s == n for s in gsize.values()) or len(free) >= n:
                pick = b
                break
        if pick is None:
            break
        i, L = buckets[pick][0]
        n = need(L)
        prev_need = n if prev_need is None else prev_need
        cands = [g for g, s in gsize.items() if s == n]
        best_g, best_load = None, math.inf
        if cands:
            best_load, best_g = min((max(exec_t[r] for r in members[g]), g) for g in cands)
        free = sorted((r for r in range(pool) if gid_of[r] is None), key=lambda r: (exec_t[r], r))
        if len(free) >= n and exec_t[free[n - 1]] < best_load:
            best_g = len(members)
            members[best_g] = free[:n]
            gsize[best_g] = n
            for r in free[:n]:
                gid_of[r] = best_g
        w = work(L)
        for r in members[best_g]:
            per_gpu[r].append(i)
            lens_gpu[r].append(L)
            exec_t[r] += w
        buckets[pick].pop(0)
        while buckets and not buckets[0]:
            buckets.pop(0)
        if n < prev_need:
            check = True
        if check and buckets and max(exec_t) - min(exec_t) <= DELTA * max(exec_t):
            break
    leftovers = [it for b in buckets for it in b]
    # drop the last sample of the most loaded group while that narrows the spread
    while True:
        hi, lo = max(exec_t), min(exec_t)
        if hi - lo <= DELTA * hi or lo == 0:
            break
        r = exec_t.index(hi)
        if len(per_gpu[r]) <= 1:
            break
        g = gid_of[r]
        w = work(lens_gpu[r][-1])
        proj = exec_t[:]
        for q in members[g]:
            proj[q] -= w
        if max(proj) - min(proj) >= hi - lo:
            break
        leftovers.append((per_gpu[r][-1], lens_gpu[r][-1]))
        for q in members[g]:
            per_gpu[q].pop()
            lens_gpu[q].pop()
            exec_t[q] -= w
    while any(not x for x in per_gpu):
        per_gpu, lens_gpu, gid_of = _grow_smallest(per_gpu, lens_gpu, gid_of, members, gsize, pool)
    return per_gpu, [gid_of[r] for r in range(pool)], leftovers


def _grow_smallest(per_gpu, lens_gpu, gid_of, members, gsize, pool):
    """Double the CP size of the first (lowest id) smallest group in place: it takes the GPUs right after it,
    the groups behind it move right by as many GPUs (onto the empty GPUs at the end of the pool). Upstream
    would index past the pool where too few GPUs are empty; that is refused here."""
    if not members:  # upstream asserts here
        raise BaselineInfeasible("upstream formed no CP group in a round")
    g = min(gg for gg in members if gsize[gg] == min(gsize.values()))
    old = gsize[g]
    add = min(2 * old, pool) - old
    first_empty = next(r for r in range(pool) if not per_gpu[r])
    end = members[g][-1] + 1
    moved = list(range(end, first_empty))  # the GPUs of every later group, pushed right by ``add``
    if add < 1 or first_empty + add > pool or any(per_gpu[r] for r in range(first_empty, first_empty + add)):
        raise BaselineInfeasible(f"upstream cannot widen a group of {old} GPUs in a pool of {pool} "
                                 "(too few empty GPUs)")
    new_per = [list(x) for x in per_gpu]
    new_lens = [list(x) for x in lens_gpu]
    new_gid = list(gid_of)
    for r in reversed(moved):
        new_per[r + add], new_lens[r + add], new_gid[r + add] = per_gpu[r], lens_gpu[r], gid_of[r]
    for r in range(end, end + add):
        new_per[r], new_lens[r], new_gid[r] = list(per_gpu[end - 1]), list(lens_gpu[end - 1]), g
    for gg in members:
        if gg > g:
            members[gg] = [r + add for r in members[gg]]
    members[g] = list(range(members[g][0], end + add))
    gsize[g] = len(members[g])
    return new_per, new_lens, new_gid


#: one round: each pool GPU's samples in execution order, and each GPU's group id (members share an id)
Round = Tuple[List[List[int]], List[int]]


def hybrid_cp_rounds(lengths: Sequence[int], parallel: ParallelConfig, max_tokens_per_gpu: int) -> List[Round]:
    """Upstream's rounds for ``lengths`` over the ``dp * cp`` pool (module docstring; a barrier ends each round).
    Raises :class:`BaselineInfeasible` where upstream would not run."""
    pool = parallel.dp * parallel.cp
    lens = np.asarray(lengths, dtype=np.int64)
    need = lambda L: cp_size_needed(int(L), max_tokens_per_gpu)  # noqa: E731
    work = lambda L: float(L) * float(L) / need(L)  # noqa: E731
    if any(need(L) > pool for L in lens.tolist()):
        raise BaselineInfeasible(f"a sample needs more than the pool's {pool} GPUs at {max_tokens_per_gpu} "
                                 "tokens per GPU")
    nonzero = [(i, int(L)) for i, L in enumerate(lens.tolist()) if L > 0]  # upstream drops empty sub-samples
    if len(nonzero) < lens.size:
        raise BaselineInfeasible("upstream drops zero-length samples")
    items = sorted(nonzero, key=lambda x: (-x[1], x[0]))  # once: leftovers keep the order a round leaves them in
    rounds: List[Round] = []
    guard = 0
    while items:
        per_gpu, gids, items = _round(items, pool, need, work)
        rounds.append((per_gpu, gids))
        guard += 1
        if guard > 10 * lens.size + 10:  # pragma: no cover - every round places at least one sample
            raise BaselineInfeasible("no progress")
    return rounds


def plan_hybrid_cp(lengths: Sequence[int], parallel: ParallelConfig, max_tokens_per_gpu: int, cost_model: CostModel,
                   fp8_alignment: Any = None) -> DynamicCPPlan:
    """Upstream's schedule of ``lengths`` over the ``dp * cp`` pool (:func:`hybrid_cp_rounds`), scored with
    ``cost_model`` (it must carry the CP communication term). Raises :class:`BaselineInfeasible` where upstream
    would not run."""
    t0 = time.perf_counter()
    par = parallel
    pool = par.dp * par.cp
    lens = np.asarray(lengths, dtype=np.int64)
    rounds = hybrid_cp_rounds(lens, par, max_tokens_per_gpu)
    tile = fp8_multiple(fp8_alignment)
    cm = cost_model
    micro_batches: List[List[List[int]]] = [[] for _ in range(pool)]
    groups: List[List[Tuple[int, int]]] = [[] for _ in range(pool)]
    mb_time: List[List[float]] = [[] for _ in range(pool)]
    mb_tokens: List[List[int]] = [[] for _ in range(pool)]
    total = 0.0
    for per_gpu, gids in rounds:
        round_t = 0.0
        for r in range(pool):
            size = gids.count(gids[r])
            first = gids.index(gids[r])
            align = Alignment.for_layout(ParallelConfig(tp=par.tp, cp=size, sequence_parallel=par.sequence_parallel),
                                         tile)
            spans = group_spans_nodes(first, size, par)
            ts = []
            for i in per_gpu[r]:
                tok = align.padded_total(int(align.seq_len(int(lens[i]))))
                t = float(cm.group_microbatch_time(size, tok, float(lens[i]) ** 2, spans))
                ts.append(t)
                micro_batches[r].append([i])
                groups[r].append((first, size))
                mb_time[r].append(t)
                mb_tokens[r].append(tok // size)
            busy = sum(ts) if cm.pp == 1 else simulate_1f1b([t / cm.pp for t in ts], cm.pp) if ts else 0.0
            round_t = max(round_t, busy)
        total += round_t
    counts = [len(x) for x in micro_batches]
    return DynamicCPPlan(
        micro_batches=micro_batches, microbatches_per_step=[max(counts)], parallel=par,
        alignment=Alignment.for_layout(par, tile), cap=int(max_tokens_per_gpu), balance_by=BalanceBy.TOKENS,
        microbatch_tokens=mb_tokens, microbatch_time=mb_time,
        rank_tokens=np.array([sum(t) for t in mb_tokens], dtype=np.int64), rank_flops=np.zeros(pool),
        rank_time=np.full(pool, total), padding_tokens=int(sum(sum(t) for t in mb_tokens) - lens.sum()),
        real_tokens=int(lens.sum()), lower_bound_microbatches=0, lower_bound_step_time=0.0,
        planning_time_s=time.perf_counter() - t0, algorithm=NAME, groups=groups,
        max_tokens_per_gpu=int(max_tokens_per_gpu), fp8_tile=tile, candidate=f"{len(rounds)} rounds")


__all__ = ["NAME", "PROVENANCE", "Round", "cp_size_needed", "hybrid_cp_rounds", "plan_hybrid_cp"]
