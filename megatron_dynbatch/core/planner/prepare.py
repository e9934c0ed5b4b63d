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
from ..checks import as_int
from ..cost_model import CostModel
from ..errors import DynBatchConfigError
from ..parallel import ParallelConfig
from .counts import CountRule
from .inputs import (balance_mode, check_budget, check_lengths, check_margin, check_oversize_policy, oversize_mask,
                     resolve_costs, sample_flops)
from .packer import StepInput
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
    """The planner's derived inputs (see the module docstring)."""

    par: ParallelConfig
    lens: np.ndarray
    budget: int
    cap: int
    cap_eff: int
    align: Alignment
    mode: str
    coeffs: Any
    cm: CostModel
    aligned: np.ndarray      # per sample
    sq: np.ndarray           # per sample
    flops: np.ndarray        # per sample
    items: Items
    item_oversize: np.ndarray
    steps: List[Step]
    rule: CountRule
    forced: Optional[List[int]]
    rounds: int
    #: a larger micro-batch count must beat the first feasible one by more than this (relative; search.py)
    margin: float = 0.0

    def step_samples(self, step: Step, local_bins: List[List[List[int]]]) -> List[List[List[int]]]:
        """``bins[r][j]`` of local item indices -> global sample indices."""
        items = step.items.tolist()
        return [[self.items.samples_of([items[i] for i in mb]) for mb in rank] for rank in local_bins]

    @property
    def oversize_samples(self) -> List[int]:
        return sorted(self.items.samples_of(np.flatnonzero(self.item_oversize).tolist()))


def prepare(lengths, *, model=None, parallel=None, max_tokens_per_gpu, balance_by_flops=True, balance_by=None,
            group_ids=None, samples_per_step=None, oversize="error", fp8_alignment=None, cost_model=None,
            num_microbatches=None, refine_rounds=None, equal_samples_per_rank=False, microbatch_group_ids=None,
            min_num_microbatches=None, num_microbatches_multiple=None, rollout_ids=None, rollouts_per_step=None,
            sequence_pad_multiple=None, microbatch_pad_multiple=None, decision_margin=None) -> Prepared:
    """Check and derive (see :func:`~megatron_dynbatch.core.planner.api.plan_global_batch` for the arguments)."""
    par = ParallelConfig.from_any(parallel)
    lens = check_lengths(lengths)
    cap, align, cap_eff = check_budget(max_tokens_per_gpu, par, fp8_alignment, sequence_pad_multiple,
                                       microbatch_pad_multiple)
    budget = int(max_tokens_per_gpu)
    check_oversize_policy(oversize)
    mode = balance_mode(balance_by, balance_by_flops, model is not None)
    if model is None and mode == "flops":
        raise DynBatchConfigError("model", None, "balancing by FLOPs needs the model's shape",
                                  "pass model=ModelSpec/dict/preset name, or balance_by_flops=False")
    coeffs, cm = resolve_costs(model, par, cost_model)
    margin = check_margin(decision_margin, cm)

    aligned = align.seq_len(lens).astype(np.int64)
    sq = lens.astype(np.float64) ** 2
    items, mb_ids = build_items(lens.size, microbatch_group_ids)
    item_aligned = items.reduce(aligned)
    label = None
    if items.members is not None:
        def label(k: int) -> str:
            first = int(items.members[k][0])
            return f"micro-batch group {mb_ids[first]!r} ({items.members[k].size} samples from sample {first})"
    over = oversize_mask(items.reduce(lens), item_aligned, cap_eff, align, par, budget, oversize, label=label)
    flops = sample_flops(coeffs, aligned, sq)
    weight = {"flops": flops, "tokens": aligned.astype(np.float64)}.get(mode)
    if weight is None:  # "time": the cost model's seconds
        weight = cm.work(aligned, sq)
    item_weight, item_sq = items.reduce(weight), items.reduce(sq)

    equal = equal_samples_per_rank
    units_of_step = split_steps(items, par.dp, group_ids=group_ids, samples_per_step=samples_per_step,
                                rollout_ids=rollout_ids, rollouts_per_step=rollouts_per_step, equal_samples=equal,
                                mb_ids=mb_ids)
    equal = bool(equal)
    rule = CountRule.build(par, min_num_microbatches, num_microbatches_multiple)
    forced = _forced_counts(num_microbatches, rule, len(units_of_step))
    rounds = 4 * par.dp if refine_rounds is None else as_int(refine_rounds, "refine_rounds", minimum=0,
                                                            fix="pass None for the default (4 * dp)")
    sizes = items.sizes()
    steps = []
    for idx, units in units_of_step:
        inp = StepInput(aligned=item_aligned[idx], weight=item_weight[idx], oversize=over[idx], units=units,
                        cap=cap_eff, samples=None if sizes is None else sizes[idx], equal_samples=equal)
        steps.append(Step(idx, inp, item_sq[idx]))
    return Prepared(par, lens, budget, cap, cap_eff, align, mode, coeffs, cm, aligned, sq, flops, items, over, steps,
                    rule, forced, rounds, margin)


def _forced_counts(num_microbatches: Any, rule: CountRule, n_steps: int) -> Optional[List[int]]:
    """``num_microbatches`` (one count for every step, or a sequence with one per step) as a checked list."""
    if num_microbatches is None:
        return None
    if not isinstance(num_microbatches, (list, tuple)) and not (isinstance(num_microbatches, np.ndarray)
                                                                and num_microbatches.ndim == 1):
        return [rule.check_forced(num_microbatches)] * n_steps
    counts = list(num_microbatches)
    if len(counts) != n_steps:
        raise DynBatchConfigError("num_microbatches", f"{len(counts)} counts",
                                  f"needs one count per optimizer step ({n_steps})",
                                  "pass one integer for every step, or a list with one per step")
    return [rule.check_forced(m) for m in counts]
