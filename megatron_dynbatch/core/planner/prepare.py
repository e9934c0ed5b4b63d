"""Everything the planner derives from its arguments before packing: checked inputs, padding, costs, items,
optimizer steps, the count rule -- one :class:`Prepared` per call (pure NumPy).

:func:`~megatron_dynbatch.core.planner.api.plan_global_batch` and the local mode
(:mod:`megatron_dynbatch.core.planner.local`) both start here, so they check and derive identically. Checks run
in a fixed order (layout, lengths, budget and padding, policies, model, items, steps, counts), each raising a
``DynBatchConfigError`` that names the argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np

from ..alignment import Alignment
from ..cost_model import CostModel
from ..errors import DynBatchConfigError
from ..parallel import ParallelConfig
from .counts import CountRule
from .inputs import check_lengths, flops_coefficients_of, oversize_mask, sample_flops
from .options import BalanceBy, ResolvedOptions
from .packer import StepInput
from .search import SearchSettings
from .steps import Items, build_items, split_steps


@dataclass
class Step:
    """One optimizer step: its items (global item indices), the packer's input and each item's sum of squared
    real lengths."""

    items: np.ndarray
    inp: StepInput
    sq: np.ndarray


@dataclass
class Prepared:
    """What the planner derives from the options and the batch (see the module docstring)."""

    options: ResolvedOptions
    lengths: np.ndarray
    #: tokens one micro-batch may hold after the micro-batch tail padding (``Alignment.effective_cap``)
    effective_cap: int
    #: what balancing equalises, as resolved for this batch
    balance_by: BalanceBy
    flops_coefficients: Any
    aligned: np.ndarray          # per sample: length after per-sequence padding
    squared: np.ndarray          # per sample: squared real length (attention's work)
    flops: np.ndarray            # per sample: forward FLOPs (zeros without a model)
    items: Items
    item_oversize: np.ndarray
    steps: List[Step]
    count_rule: CountRule
    forced_counts: Optional[List[int]]
    refine_rounds: int

    @property
    def parallel(self) -> ParallelConfig:
        return self.options.parallel

    @property
    def alignment(self) -> Alignment:
        return self.options.alignment

    @property
    def cost_model(self) -> CostModel:
        return self.options.cost_model

    def search_settings(self) -> SearchSettings:
        """The per-batch constants every optimizer step's count search uses (:mod:`.search`)."""
        o = self.options
        return SearchSettings(parallel=o.parallel, cost_model=o.cost_model, alignment=o.alignment,
                              max_tokens_per_gpu=o.max_tokens_per_gpu, count_rule=self.count_rule,
                              refine_rounds=self.refine_rounds, margin=o.margin)

    def step_samples(self, step: Step, local_bins: List[List[List[int]]]) -> List[List[List[int]]]:
        """``bins[r][j]`` of local item indices -> global sample indices."""
        items = step.items.tolist()
        return [[self.items.samples_of([items[i] for i in mb]) for mb in rank] for rank in local_bins]

    @property
    def oversize_samples(self) -> List[int]:
        return sorted(self.items.samples_of(np.flatnonzero(self.item_oversize).tolist()))


def _auto_fit(options: ResolvedOptions):
    """For an automatic budget: ``(slot, name) -> (problem, fix)`` of a sample it cannot place (else ``None``)."""
    if options.budget_choice is None or options.model is None:
        return None
    from ..memory.auto_fit import auto_cannot_place
    from ..startup import auto_profile

    def explain(slot: int, name: str):
        return auto_cannot_place(options.budget_choice, slot, model=options.model, parallel=options.parallel,
                                 profile=auto_profile(options), fp8_alignment=options.options.fp8_alignment,
                                 sequence_pad_multiple=options.options.sequence_pad_multiple,
                                 microbatch_pad_multiple=options.options.microbatch_pad_multiple, what=name)

    return explain


def prepare(lengths, options: ResolvedOptions, *, group_ids=None, microbatch_group_ids=None,
            rollout_ids=None) -> Prepared:
    """Check the batch against the (already resolved) options and derive the planner's inputs."""
    par = options.parallel
    lens = check_lengths(lengths)
    align = options.alignment
    cap_eff = align.effective_cap(options.cap)
    budget = options.max_tokens_per_gpu
    mode = options.balance_by
    coeffs = flops_coefficients_of(options.model)
    cm = options.cost_model

    aligned = align.seq_len(lens).astype(np.int64)
    sq = lens.astype(np.float64) ** 2
    items, mb_ids = build_items(lens.size, microbatch_group_ids)
    item_aligned = items.reduce(aligned)
    label = None
    if items.members is not None:
        def label(k: int) -> str:
            first = int(items.members[k][0])
            return f"micro-batch group {mb_ids[first]!r} ({items.members[k].size} samples from sample {first})"
    over = oversize_mask(items.reduce(lens), item_aligned, cap_eff, align, par, budget, options.options.oversize,
                         label=label, auto_fit=_auto_fit(options))
    flops = sample_flops(coeffs, aligned, sq)
    if mode is BalanceBy.FLOPS:
        weight = flops
    elif mode is BalanceBy.TOKENS:
        weight = aligned.astype(np.float64)
    else:  # time: the cost model's seconds
        weight = cm.work(aligned, sq)
    item_weight, item_sq = items.reduce(weight), items.reduce(sq)

    equal = options.options.equal_samples_per_rank
    units_of_step = split_steps(items, par.dp, group_ids=group_ids, samples_per_step=options.options.samples_per_step,
                                rollout_ids=rollout_ids, rollouts_per_step=options.options.rollouts_per_step,
                                equal_samples=equal, mb_ids=mb_ids)
    rule = CountRule.build(par, options.options.min_num_microbatches, options.options.num_microbatches_multiple)
    forced = _forced_counts(options.options.num_microbatches, rule, len(units_of_step))
    rounds = 4 * par.dp if options.options.refine_rounds is None else options.options.refine_rounds
    sizes = items.sizes()
    steps = []
    for idx, units in units_of_step:
        inp = StepInput(aligned=item_aligned[idx], weight=item_weight[idx], oversize=over[idx], units=units,
                        cap=cap_eff, samples=None if sizes is None else sizes[idx], equal_samples=equal)
        steps.append(Step(idx, inp, item_sq[idx]))
    return Prepared(options, lens, cap_eff, mode, coeffs, aligned, sq, flops, items, over, steps, rule, forced,
                    rounds)


def _forced_counts(num_microbatches: Any, rule: CountRule, n_steps: int) -> Optional[List[int]]:
    """``num_microbatches`` (one count for every step, or a sequence with one per step) as a checked list."""
    if num_microbatches is None:
        return None
    if not isinstance(num_microbatches, tuple):
        return [rule.check_forced(num_microbatches)] * n_steps
    counts = list(num_microbatches)
    if len(counts) != n_steps:
        raise DynBatchConfigError("num_microbatches", f"{len(counts)} counts",
                                  f"needs one count per optimizer step ({n_steps})",
                                  "pass one integer for every step, or a list with one per step")
    return [rule.check_forced(m) for m in counts]
