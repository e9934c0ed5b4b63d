"""The drop-in comparison: per trainer, its own batching algorithm against our drop-in for it, on the bench
workloads, scored with one cost model (``megatron-dynbatch bench --dropins``; recorded in docs/benchmarks.md).

For each workload and seed, each trainer's own algorithm (re-implemented in :mod:`.baselines`: ``slime``,
``verl``, ``nemo_rl``, ``roll``, ``megatron-rl-packing`` for Megatron RL) and the drop-in's planning half
(:mod:`megatron_dynbatch.core.dropin`) plan the
same batch. Drop-ins run twice where the trainer's call carries no model: as a one-line import change
(``drop-in``: slime reads the model from its args; verl falls back to its own workload estimate, NeMo-RL and
ROLL to tokens) and with ``model=`` passed (``drop-in+model``). Everything is scored by
:func:`~megatron_dynbatch.core.planner.score_assignment` with ``CostModel.from_model`` of the workload, under the
trainer's own padding convention (slime: each CP rank's share to ``tp*128``; verl: each sequence to
``tp*cp*2``, or ``tp`` without CP; NeMo-RL and ROLL: the layout's), so a cap violation is a micro-batch over
``max_tokens_per_gpu * cp`` with the padding that trainer really adds. ROLL runs padded ``[b, s]``
micro-batches cut to one shared length per index: it is scored on those padded lengths (``pad_to_longest``).
Megatron RL runs every bin as a ``[1, seq_length]`` row, ours too (``fixed_microbatch_tokens``: the budget).

The step time is MODELLED (the cost model's seconds), not measured. A trainer algorithm that would stop
(assertion, unequal counts Megatron refuses) is reported as such, not scored.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..core.cost_model import CostModel
from ..core.dropin.megatron_rl import plan_rl_bins
from ..core.dropin.nemo_rl import get_packer
from ..core.dropin.roll import roll_shard
from ..core.dropin.slime import slime_schedule
from ..core.dropin.verl import (balance_partitions, local_count, local_partitions, verl_sequence_pad_multiple)
from ..core.errors import DynBatchConfigError, OversizeSampleWarning
from ..core.parallel import ParallelConfig
from ..core.planner import score_assignment
from .baselines import BaselineContext, BaselineInfeasible, get_baseline, roll_layout, structural_problems
from .table import aligned
from .workloads import Workload

if TYPE_CHECKING:
    from ..core.model_spec import ModelLike

__all__ = ["DROPIN_TRAINERS", "DropinRow", "format_dropins", "run_dropins"]

#: slime's default ``data_pad_size_multiplier``
SLIME_PAD = 128
#: ROLL's default ``sequence_length_round_in_train``
ROLL_ROUND = 64

MicroBatches = List[List[List[int]]]


@dataclass
class DropinRow:
    """One (workload, seed, trainer, algorithm) result."""

    workload: str
    seed: int
    trainer: str
    algorithm: str          # the trainer's own name, "drop-in" or "drop-in+model"
    step_time_s: float = float("nan")
    vs_own: float = float("nan")   # step time / the trainer's own algorithm's (same batch)
    cap_violations: int = 0
    microbatches: int = 0
    imbalance: float = float("nan")
    planning_ms: float = float("nan")
    error: Optional[str] = None
    notes: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        return {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in d.items()}


@dataclass
class _Trainer:
    """How to run one trainer's own algorithm and its drop-in, and the padding it scores under."""

    name: str
    own: str
    padding: Callable[[ParallelConfig, int], Dict[str, Any]]  # (layout, cap) -> score_assignment padding
    dropin: Callable[[np.ndarray, Workload, Any], Tuple[MicroBatches, Optional[np.ndarray]]]
    model_variant: bool = True


def _slime_padding(par: ParallelConfig, cap: int) -> Dict[str, Any]:
    return {"microbatch_pad_multiple": par.tp * SLIME_PAD}


def _verl_padding(par: ParallelConfig, cap: int) -> Dict[str, Any]:
    return {"sequence_pad_multiple": verl_sequence_pad_multiple(par.tp, par.cp)}


def _no_padding(par: ParallelConfig, cap: int) -> Dict[str, Any]:
    return {}


def _row_padding(par: ParallelConfig, cap: int) -> Dict[str, Any]:
    return {"fixed_microbatch_tokens": cap}  # Megatron RL: every bin is a full --seq-length row


def _slime_dropin(lengths: np.ndarray, w: Workload, model: Optional[ModelLike]):
    sched = slime_schedule(lengths, rollout_indices=list(range(lengths.size)), global_batch_size=lengths.size,
                           parallel=w.parallel, max_tokens_per_gpu=w.max_tokens_per_gpu, model=w.model,
                           data_pad_size_multiplier=SLIME_PAD, oversize="alone")
    return sched.plan.micro_batches, None


def _verl_dropin(lengths: np.ndarray, w: Workload, model: Optional[ModelLike]):
    par = w.parallel
    cap = w.max_tokens_per_gpu * par.cp
    div = par.vp_group_size if par.vpp > 1 else None
    parts = balance_partitions(lengths, par.dp, max_token_len=cap, tp=par.tp, cp=par.cp, pp=par.pp, model=model)
    layout = dict(tp=par.tp, cp=par.cp, pp=par.pp, model=model, num_batches_divided_by=div)
    count = max(local_count(lengths[p], cap, **layout) for p in parts)  # the all-reduce MAX
    return [[[p[i] for i in mb] for mb in local_partitions(lengths[p], cap, count, **layout)] for p in parts], None


def _nemo_rl_dropin(lengths: np.ndarray, w: Workload, model: Optional[ModelLike]):
    par = w.parallel
    cap = w.max_tokens_per_gpu * par.cp
    aligned = BaselineContext.build(par, w.max_tokens_per_gpu).alignment.seq_len(lengths)
    packer = get_packer("modified_first_fit_decreasing", cap, min_bin_count=par.dp, bin_count_multiple=par.dp,
                        parallel={**par.to_dict(), "dp": 1}, model=model)
    bins = packer.pack(aligned)
    return [bins[r::par.dp] for r in range(par.dp)], None


def _roll_padded(lengths: np.ndarray, mbs: MicroBatches, padded: Sequence[int]) -> np.ndarray:
    """Each sample at the shared padded length of its micro-batch index (ROLL cuts every shard's j-th
    micro-batch to ``padded[j]``)."""
    out = lengths.copy()
    for rank in mbs:
        for j, mb in enumerate(rank):
            out[mb] = padded[j]
    return out


def _roll_dropin(lengths: np.ndarray, w: Workload, model: Optional[ModelLike]):
    par = w.parallel
    shard = roll_shard(lengths, par.dp, w.max_tokens_per_gpu * par.cp, ROLL_ROUND, par.pp,
                       par.vpp if par.vpp > 1 else None, par.microbatch_group_size_per_vp_stage, model=model)
    mbs = shard.rank_micro_batches()
    return mbs, _roll_padded(lengths, mbs, shard.micro_batch_lengths)


def _megatron_rl_dropin(lengths: np.ndarray, w: Workload, model: Optional[ModelLike]):
    par = w.parallel
    res = plan_rl_bins(lengths, bin_size=w.max_tokens_per_gpu * par.cp, dp=par.dp,
                       seq_length_multiple=2 * par.cp if par.cp > 1 else 1, parallel=par.to_dict(), model=w.model)
    return [res.rank_bins(r) for r in range(par.dp)], None


DROPIN_TRAINERS: Dict[str, _Trainer] = {
    "slime": _Trainer("slime", "slime", _slime_padding, _slime_dropin, model_variant=False),
    "verl": _Trainer("verl", "verl", _verl_padding, _verl_dropin),
    "nemo_rl": _Trainer("nemo_rl", "nemo_rl", _no_padding, _nemo_rl_dropin),
    "roll": _Trainer("roll", "roll", _no_padding, _roll_dropin),
    # the drop-in reads the model from Megatron's args, like slime's
    "megatron_rl": _Trainer("megatron_rl", "megatron-rl-packing", _row_padding, _megatron_rl_dropin,
                            model_variant=False),
}


def _score(mbs: MicroBatches, lengths: np.ndarray, w: Workload, cm: CostModel, padding: Dict[str, Any],
           padded_lengths: Optional[np.ndarray]):
    plan = score_assignment(mbs, lengths if padded_lengths is None else padded_lengths, model=w.model,
                            parallel=w.parallel, max_tokens_per_gpu=w.max_tokens_per_gpu, cost_model=cm,
                            pad_to_longest=padded_lengths is not None, **padding)
    return plan, structural_problems(plan, lengths.size)


def _own(trainer: _Trainer, lengths: np.ndarray, w: Workload, ctx: BaselineContext):
    if trainer.name == "roll":
        mbs, padded = roll_layout(lengths, ctx, ROLL_ROUND)
        return mbs, _roll_padded(lengths, mbs, padded)
    return get_baseline(trainer.own)(lengths, ctx), None


def run_dropins(workloads: Sequence[Workload], seeds: int = 1,
                trainers: Optional[Sequence[str]] = None) -> Tuple[List[DropinRow], Dict[str, Any]]:
    """Every trainer's own algorithm and its drop-in(s) on every workload and seed: rows and run metadata."""
    names = list(trainers) if trainers else list(DROPIN_TRAINERS)
    for n in names:
        if n not in DROPIN_TRAINERS:
            raise DynBatchConfigError("--trainers", n, "unknown trainer", f"use a subset of {list(DROPIN_TRAINERS)}")
    rows: List[DropinRow] = []
    t_start = time.perf_counter()
    for w in workloads:
        cm = CostModel.from_model(w.model, w.parallel)
        ctx = BaselineContext.build(w.parallel, w.max_tokens_per_gpu, w.model)
        for seed in range(seeds):
            lengths = w.generate(seed).lengths
            for name in names:
                trainer = DROPIN_TRAINERS[name]
                padding = trainer.padding(w.parallel, w.max_tokens_per_gpu * w.parallel.cp)
                variants = [(trainer.own, None)]
                variants.append(("drop-in", None))
                if trainer.model_variant:
                    variants.append(("drop-in+model", w.model))
                own_time = float("nan")
                for algo, model in variants:
                    row = DropinRow(w.name, seed, name, algo)
                    t0 = time.perf_counter()
                    try:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore", OversizeSampleWarning)
                            if algo == trainer.own:
                                mbs, padded = _own(trainer, lengths, w, ctx)
                            else:
                                mbs, padded = trainer.dropin(lengths, w, model)
                    except (BaselineInfeasible, DynBatchConfigError) as exc:
                        row.error = str(exc)
                        rows.append(row)
                        continue
                    row.planning_ms = 1e3 * (time.perf_counter() - t0)
                    plan, notes = _score(mbs, lengths, w, cm, padding, padded)
                    counts = [len(r) for r in plan.micro_batches]
                    row.step_time_s, row.cap_violations = plan.predicted_step_time, plan.cap_violations
                    row.microbatches, row.imbalance, row.notes = max(counts), plan.imbalance, notes
                    if algo == trainer.own:
                        own_time = row.step_time_s
                    row.vs_own = row.step_time_s / own_time if own_time > 0 else float("nan")
                    rows.append(row)
    meta = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
            "numpy": np.__version__, "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "seeds": seeds, "wall_s": time.perf_counter() - t_start, "step_time": "modelled (cost model seconds)"}
    return rows, meta


def format_dropins(rows: Sequence[DropinRow]) -> str:
    """A table: mean over seeds of the modelled step time, the ratio to the trainer's own algorithm and the cap
    violations (summed), per workload, trainer and algorithm (columns as wide as their widest cell)."""
    groups: Dict[Tuple[str, str, str], List[DropinRow]] = {}
    for r in rows:
        groups.setdefault((r.workload, r.trainer, r.algorithm), []).append(r)
    cells = [["workload", "trainer", "algorithm", "step s", "vs own", "over cap", "mbs", "imbal", "notes"]]
    for (wl, tr, algo), rs in groups.items():
        ok = [r for r in rs if r.error is None]
        if not ok:
            cells.append([wl, tr, algo, "--", "", "", "", "", f"stops: {rs[0].error[:70]}"])
            continue
        t = float(np.mean([r.step_time_s for r in ok]))
        v = [r.vs_own for r in ok if np.isfinite(r.vs_own)]
        notes = sorted({n for r in ok for n in r.notes})
        cells.append([wl, tr, algo, f"{t:.3f}", f"{(np.mean(v) if v else float('nan')):.3f}",
                      str(sum(r.cap_violations for r in ok)), str(max(r.microbatches for r in ok)),
                      f"{np.mean([r.imbalance for r in ok]):.3f}", "; ".join(notes)])
    lines = ["Drop-ins vs each trainer's own batching (MODELLED step time, same cost model; over cap = micro-batches "
             "over max_tokens_per_gpu x cp with the trainer's own padding)",
             *aligned(cells, "<<<>>>>><", rule=True)]
    lines.append("")
    lines.append(_summary(rows))
    return "\n".join(lines)


def _summary(rows: Sequence[DropinRow]) -> str:
    """Per trainer and algorithm: geometric mean of ``vs own`` over the workloads where both ran, and totals."""
    out = ["Per trainer (geometric mean of step time vs the trainer's own algorithm, where both ran):"]
    keys = sorted(dict.fromkeys((r.trainer, r.algorithm) for r in rows),
                  key=lambda k: list(DROPIN_TRAINERS).index(k[0]))  # stable: own algorithm first
    cells = []
    for tr, algo in keys:
        rs = [r for r in rows if r.trainer == tr and r.algorithm == algo]
        ratios = [r.vs_own for r in rs if r.error is None and np.isfinite(r.vs_own) and r.vs_own > 0]
        gm = float(np.exp(np.mean(np.log(ratios)))) if ratios else float("nan")
        stops = sum(1 for r in rs if r.error is not None)
        cells.append([tr, algo, f"vs own {gm:.3f}", f"over {len(ratios)} batches;",
                      f"over-cap micro-batches {sum(r.cap_violations for r in rs)};", f"stopped {stops}"])
    out += ["  " + ln for ln in aligned(cells, "<<<<<<", gap=" ")]
    return "\n".join(out)


def dropins_json(rows: Sequence[DropinRow], meta: Dict[str, Any]) -> str:
    return json.dumps({"meta": meta, "rows": [r.to_dict() for r in rows]}, indent=1)
