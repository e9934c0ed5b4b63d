"""Measured step times of benchmark plans: which micro-batches a plan runs, and how their MEASURED seconds
compose into a step. Torch-free: the timing itself is :mod:`megatron_dynbatch.measure`'s, driven by
``benchmarks/gpu/measure.py``; here a plan becomes a :class:`Schedule` whose :meth:`~Schedule.items` say what to
time (``(group_size, lengths)`` per micro-batch) and whose :meth:`~Schedule.compose` turns a
``seconds_of(group_size, lengths)`` function into a :class:`MeasuredStep`. The method is that of
``../shared/gpu/README.md`` (sections 1 and 2): one GPU emulates every rank in turn.

* **DP plans** (:class:`RankSchedule`; every ``bench`` algorithm on a fixed layout, including fixed CP where a
  micro-batch is one ``cp``-GPU group's): each DP rank's micro-batches in turn, composed per rank by the same
  code that scores plans (``step_times_of``: optimizer steps one after another, 1F1B when ``pp > 1``); each
  optimizer step is its slowest rank, the plan the sum of its steps. Padded baselines (``fixed_padded``) run
  ``b`` full rows of the longest sample's padded length (a ``[b, s]`` micro-batch attends over its padding);
  fixed-width bins (``megatron-rl-packing``) run their unused tail as one more sequence, and an empty filler bin
  as one full-width sequence.
* **Dynamic-CP plans** (:class:`PoolSchedule`): the pool simulation the planner scores with
  (``pool_sim.simulate_pool``): a group's micro-batch starts when all its members are free, 1F1B with group
  synchronisation when ``pp > 1``; per optimizer step (its last GPU to finish), steps one after another.
* **Upstream's hybrid CP** (:class:`RoundsSchedule`, from :func:`~.hybrid_cp.hybrid_cp_rounds`): each sample
  is its own micro-batch on its group, a group runs its samples in turn (1F1B per round when ``pp > 1``, as the
  benchmark models it) and a barrier over the pool ends every round: step = sum over rounds of the slowest group.

``imbalance`` is the max / mean over ranks (DP) or pool GPUs (CP) of their BUSY seconds (the sum of the
micro-batches they run; waiting and pipeline bubbles excluded).

:data:`TINY_WORKLOADS` are two batches of the ``tiny-gpt`` preset (a DP one and a dynamic-CP one) small enough
for the CPU smoke mode (``measure.py --device cpu --tiny``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence, Tuple, Union

import numpy as np

from ..core.alignment import Alignment
from ..core.cost_model import CostModel
from ..core.parallel import ParallelConfig
from ..core.planner.timing import step_times_of
from ..core.planner import PlanKind
from ..core.planner.dyncp.pool_sim import simulate_pool
from .baselines import BASELINES
from .hybrid_cp import NAME as HYBRID_CP, hybrid_cp_rounds
from .workloads import Batch, Workload, grpo_lengths

#: ``seconds_of(group_size, lengths)``: measured seconds of one micro-batch on a group of that many GPUs
SecondsOf = Callable[[int, List[int]], float]
Item = Tuple[int, List[int]]


@dataclass
class MeasuredStep:
    """One plan's step composed from measured micro-batch seconds."""

    step_s: float
    busy_s: List[float]
    microbatches: int

    @property
    def imbalance(self) -> float:
        mean = float(np.mean(self.busy_s)) if self.busy_s else 0.0
        return max(self.busy_s) / mean if mean > 0 else float("nan")


@dataclass
class RankSchedule:
    """A fixed-layout plan: ``lengths_of[r][j]`` are DP rank ``r``'s ``j``-th micro-batch's lengths."""

    group_size: int
    lengths_of: List[List[List[int]]]
    per_step: List[int]
    kind: str = field(default="dp", init=False)

    def items(self) -> List[Item]:
        return [(self.group_size, mb) for rank in self.lengths_of for mb in rank if mb]

    def compose(self, seconds_of: SecondsOf, cm: CostModel) -> MeasuredStep:
        times = [[seconds_of(self.group_size, mb) if mb else 0.0 for mb in rank] for rank in self.lengths_of]
        step_time = step_times_of(times, self.per_step, cm)[1]
        return MeasuredStep(float(sum(step_time)), [float(sum(t)) for t in times], len(self.items()))


@dataclass
class PoolSchedule:
    """A dynamic-CP plan: slot ``j`` of pool GPU ``i`` runs ``lengths_of[i][j]`` on group ``groups[i][j]``."""

    groups: List[List[Tuple[int, int]]]
    lengths_of: List[List[List[int]]]
    per_step: List[int]
    ep_width: int = 1
    kind: str = field(default="dynamic-cp", init=False)

    def _group_heads(self):
        for i, slots in enumerate(self.groups):
            for j, (start, size) in enumerate(slots):
                if start == i:
                    yield i, j, size

    def items(self) -> List[Item]:
        return [(size, self.lengths_of[i][j]) for i, j, size in self._group_heads()]

    def compose(self, seconds_of: SecondsOf, cm: CostModel) -> MeasuredStep:
        pool, m = len(self.groups), len(self.groups[0]) if self.groups else 0
        times = np.zeros((m, pool))
        for i, j, size in self._group_heads():
            times[j, i:i + size] = seconds_of(size, self.lengths_of[i][j])
        total = 0.0
        first = 0
        for count in self.per_step:
            blocks = [np.unique([self.groups[i][j][0] for i in range(pool)]) for j in range(first, first + count)]
            total += float(np.max(simulate_pool(times[first:first + count], blocks, cm, ep_width=self.ep_width),
                                  initial=0.0))
            first += count
        return MeasuredStep(total, times.sum(axis=0).tolist(), len(self.items()))


@dataclass
class RoundsSchedule:
    """Upstream's hybrid CP: per round, each GPU's samples and group id (:func:`~.hybrid_cp.hybrid_cp_rounds`)."""

    rounds: List[Tuple[List[List[int]], List[int]]]
    lengths: List[int]
    kind: str = field(default="rounds", init=False)

    def _groups(self):
        """Per round, ``(members, sample lengths)`` of each group."""
        for per_gpu, gids in self.rounds:
            members: Dict[int, List[int]] = {}
            for r, g in enumerate(gids):
                members.setdefault(g, []).append(r)
            yield [(ms, [self.lengths[i] for i in per_gpu[ms[0]]]) for ms in members.values()]

    def items(self) -> List[Item]:
        return [(len(ms), [L]) for groups in self._groups() for ms, lens in groups for L in lens]

    def compose(self, seconds_of: SecondsOf, cm: CostModel) -> MeasuredStep:
        busy = np.zeros(len(self.rounds[0][1]) if self.rounds else 0)
        step = 0.0
        for groups in self._groups():
            slowest = 0.0
            for ms, lens in groups:
                ts = [seconds_of(len(ms), [L]) for L in lens]
                slowest = max(slowest, cm.rank_time(ts))
                busy[ms] += sum(ts)
            step += slowest
        return MeasuredStep(step, busy.tolist(), len(self.items()))


#: what a plan becomes for measuring (:func:`schedule_of`)
Schedule = Union[RankSchedule, PoolSchedule, RoundsSchedule]


def schedule_of(name: str, plan: PlanKind, lengths: Sequence[int], workload: Workload) -> Schedule:
    """The :class:`Schedule` of algorithm ``name``'s ``plan`` of ``lengths`` on ``workload``'s layout."""
    lens = [int(x) for x in lengths]
    par = workload.parallel
    if name == HYBRID_CP:
        return RoundsSchedule(hybrid_cp_rounds(lens, par, workload.max_tokens_per_gpu), lens)
    if plan.dynamic_cp:
        ep = max(1, par.ep)  # the cost model's ep_group: expert-parallel ranks run in lockstep
        return PoolSchedule([list(map(tuple, g)) for g in plan.groups],
                            [[[lens[i] for i in mb] for mb in rank] for rank in plan.micro_batches],
                            list(plan.microbatches_per_step), par.cp * ep if ep > 1 else 1)
    base = BASELINES.get(name)
    padded = base is not None and base.pad_to_longest
    width = workload.max_tokens_per_gpu * par.cp if base is not None and base.fixed_bins else None
    seq_multiple = Alignment.for_layout(par).seq_multiple

    def mb_lengths(mb: Sequence[int]) -> List[int]:
        ls = [lens[i] for i in mb]
        if width is not None:  # a full-width row (Megatron RL's bins): the unused tail runs as one more sequence
            tail = width - sum(-(-x // seq_multiple) * seq_multiple for x in ls)
            return ls + [tail] if tail > 0 else ls
        if not (padded and ls):
            return ls
        s = -(-max(max(ls), 1) // seq_multiple) * seq_multiple  # [b, s] rows: padding is attended too
        return [s] * len(ls)

    return RankSchedule(par.cp, [[mb_lengths(mb) for mb in rank] for rank in plan.micro_batches],
                        list(plan.microbatches_per_step))


def layout_cost_model(workload: Workload) -> CostModel:
    """The cost model whose pipeline / expert structure composition uses (its coefficients are not)."""
    return CostModel.from_model(workload.model, workload.parallel)


# --------------------------------------------------------------------------------------------- tiny batches
def _tiny_documents(rng: np.random.Generator, _documents: Any = None) -> Batch:
    lengths = np.minimum(np.round(rng.lognormal(np.log(60), 0.8, 10)), 200).astype(np.int64)
    lengths[0] = 400 + int(rng.integers(0, 100))  # one document dominates: where dynamic CP differs
    return Batch(lengths=lengths, source="synthetic: one long document and nine short ones")


TINY_WORKLOADS: Dict[str, Workload] = {w.name: w for w in (
    Workload("tiny-rl-dp2", "tiny GRPO batch: tiny-gpt, 4 prompts x 4 responses (<= 400 tokens), dp=2",
             "tiny-gpt", ParallelConfig(dp=2), 512,
             lambda rng, _: grpo_lengths(rng, prompts=4, group=4, max_response=384, median_response=96,
                                      prompt_range=(16, 64)), default=False),
    Workload("tiny-dyncp-dp2-cp2", "tiny long-document batch: tiny-gpt, one ~450-token document and nine short "
             "ones, dp=2 cp=2 (pool of 4), 256 tokens per GPU", "tiny-gpt", ParallelConfig(dp=2, cp=2), 256,
             _tiny_documents, dynamic_cp=True, default=False),
)}


__all__ = ["MeasuredStep", "RankSchedule", "PoolSchedule", "RoundsSchedule", "schedule_of", "layout_cost_model",
           "TINY_WORKLOADS", "SecondsOf"]
