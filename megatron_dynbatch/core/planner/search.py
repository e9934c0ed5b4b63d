"""Choosing the micro-batch count of one optimizer step (see ``api.py`` for the strategy).

Start at the fewest micro-batches the budget allows (moved to a count Megatron's interleaved schedule accepts),
raise it while the packing is infeasible, then score a few more counts with the cost model and keep the
fastest. Pure NumPy; deterministic.
"""

from __future__ import annotations

import math
from typing import List, Optional

import numpy as np

from ..alignment import Alignment
from ..cost_model import CostModel
from ..errors import DynBatchConfigError
from ..parallel import ParallelConfig
from .ordering import order_and_time, polish_pipeline
from .packer import StepInput, plan_for_count, plan_global_bins
from .vpp import is_valid_microbatch_count, next_valid_microbatch_count


def plan_step(inp: StepInput, par: ParallelConfig, cm: CostModel, lens: np.ndarray, forced: Optional[int],
               rounds: int, align: Alignment):
    dp, cap = par.dp, inp.cap
    charged = np.where(inp.oversize, cap, inp.aligned)
    lb_m = max(1, -(-int(charged.sum()) // (dp * cap)), -(-int(inp.oversize.sum()) // dp))
    m_max = int(inp.unit_count.size and _max_count(inp, dp))
    sq = lens.astype(np.float64) ** 2

    pipeline_polish = par.pp > 1 and cm.ep_group == 1 and inp.singletons

    lockstep = cm.ep_group > 1 and inp.singletons

    def evaluate(m, polish_evals=120):
        bins = plan_for_count(inp, dp, m, rounds)
        if bins is not None and pipeline_polish:
            polish_pipeline(bins, inp.aligned, sq, inp.oversize, cap, cm, align, max_evals=polish_evals)
        best = order_and_time(bins, inp.aligned, sq, cm, align) if bins is not None else None
        if lockstep:  # expert-parallel ranks advance together: also try even micro-batches across ranks
            alt = plan_global_bins(inp, dp, m)
            if alt is not None:
                res = order_and_time(alt, inp.aligned, sq, cm, align)
                if best is None or res[1] < best[1]:
                    best = res
        return best

    if forced is not None:
        if forced > m_max:
            raise DynBatchConfigError("num_microbatches", forced,
                                      f"needs {forced} samples on every rank but the step has only {len(lens)} "
                                      f"samples for dp={dp}", f"use at most {m_max}")
        best = evaluate(forced)
        if best is None:
            raise DynBatchConfigError(
                "num_microbatches", forced, f"the samples do not fit {forced} micro-batches of {cap} tokens per rank",
                f"use at least {next_valid_microbatch_count(lb_m, par)} or raise --max-tokens-per-gpu")
        return best[0], lb_m

    m = next_valid_microbatch_count(lb_m, par)
    if m > m_max:
        raise _too_few_samples(par, len(lens), m, m_max, inp)
    best = None
    while m <= m_max:
        best = evaluate(m)
        if best is not None:
            break
        m = next_valid_microbatch_count(m + 1, par)
    if best is None:
        raise _too_few_samples(par, len(lens), m, m_max, inp)
    chosen = m
    for cand in _candidate_counts(m, m_max, par, cm, inp, best):
        res = evaluate(cand)
        if res is not None and res[1] < best[1] * (1 - 1e-9):
            best, chosen = res, cand
    if pipeline_polish:  # spend the larger polishing budget on the winner only
        final = evaluate(chosen, polish_evals=1500)
        if final[1] <= best[1]:
            best = final
    return best[0], lb_m


def _max_count(inp: StepInput, dp: int) -> int:
    """Most micro-batches every rank can fill: the rank with the fewest samples bounds it."""
    return int(inp.unit_count.sum() // dp)


def _too_few_samples(par, n, m, m_max, inp) -> DynBatchConfigError:
    vpp = ""
    if par.vpp > 1:
        vpp = (f" (interleaved pipeline: pp={par.pp}, vpp={par.vpp} needs M >= "
               f"microbatch_group_size_per_vp_stage={par.vp_group_size})")
    return DynBatchConfigError(
        "--max-tokens-per-gpu", inp.cap,
        f"{n} samples over dp={par.dp} ranks need {m} non-empty micro-batches per rank{vpp}, but at most {m_max} "
        f"can be filled without leaving one empty", "raise --max-tokens-per-gpu, lower dp or vpp, or pass more samples",
    )


def _candidate_counts(m: int, m_max: int, par: ParallelConfig, cm: CostModel, inp: StepInput, best) -> List[int]:
    """Extra counts worth scoring after the first feasible ``m``."""
    out: List[int] = []
    if par.pp > 1 and cm.overhead_s > 0:
        w = float(cm.work(inp.aligned, 0.0).sum()) / par.dp  # linear part is enough to locate the optimum
        bubble = (par.pp - 1) / max(1, par.vpp)
        target = int(math.ceil(math.sqrt(bubble * max(w, 1e-12) / cm.overhead_s)))
        hi = min(m_max, max(m, target))
        if hi > m:
            raw = np.unique(np.geomspace(m + 1, hi, num=min(5, hi - m)).round().astype(int))
            out = sorted({next_valid_microbatch_count(int(c), par) for c in raw})
    elif best[2] > 1.002:
        out = [next_valid_microbatch_count(m + 1, par)]
    return [c for c in out if m < c <= m_max and is_valid_microbatch_count(c, par)]
