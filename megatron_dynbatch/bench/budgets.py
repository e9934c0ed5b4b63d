"""``bench --budgets``: the auto budget against typical hand-set ones, on the same batches (MODELLED).

For each workload and seed, the planner plans the same batch with several per-GPU budgets:

* ``auto`` -- :func:`~megatron_dynbatch.core.memory.choose_budget` for the workload's model and layout on a card of
  ``gpu_memory_gb`` GiB under :data:`BENCH_SETTINGS` (the shipped run presets' memory settings: full recompute,
  the distributed optimizer with CPU offload);
* ``workload`` -- the workload's own hand-set ``max_tokens_per_gpu``;
* the trainers' documented defaults (:data:`~megatron_dynbatch.core.memory.trainers.TRAINER_DEFAULTS`: verl's
  ``ppo_max_token_len_per_gpu`` 16384 per GPU, ROLL's example ``max_tokens_per_microbatch_in_train`` 8192 per
  micro-batch, i.e. ``8192 / cp`` per GPU).

Each row has the budget, the predicted peak memory at it (:func:`~megatron_dynbatch.core.memory.peak_memory`) and
whether that fits the card minus the headroom (a budget that does not would run out of memory: its step time is
not scored), the micro-batches per rank and the modelled step time (the cost model's seconds, as everywhere in
``bench``) against the auto budget's. A budget below the longest sample stops the planner (``oversize="error"``,
what every trainer does): reported as such. Dynamic-CP workloads are planned with fixed CP here. Pure Python.
"""

from __future__ import annotations

import datetime as _dt
import platform
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..core.cost_files import resolve_cost_model
from ..core.errors import DynBatchConfigError, OversizeSampleError
from ..core.memory import TRAINER_DEFAULTS, GiB, MemorySettings, choose_budget, peak_memory
from .workloads import Workload

if TYPE_CHECKING:
    from ..core.cost_model import CostModel, CostModelLike
    from ..core.planner.plan_kind import PlanKind

#: the memory settings the comparison assumes (stated in the report)
BENCH_SETTINGS = MemorySettings(recompute="full", optimizer="cpu_offload")
DEFAULT_GPU_GB = 80.0


@dataclass
class BudgetRow:
    """One (workload, seed, budget) result; ``step_time_s`` is modelled."""

    workload: str
    seed: int
    label: str
    tokens_per_gpu: int = 0
    predicted_peak_gb: float = float("nan")
    fits: bool = False
    microbatches: int = 0
    step_time_s: float = float("nan")
    vs_auto: float = float("nan")
    error: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        return {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in d.items()}


def hand_set_budgets(w: Workload) -> List[Tuple[str, int]]:
    """The hand-set budgets compared with the auto one: the workload's own, then each trainer default's."""
    out = [("workload", w.max_tokens_per_gpu)]
    for name, d in TRAINER_DEFAULTS.items():
        out.append((f"{name} default", d.tokens_per_gpu(w.parallel.cp)))
    return out


def _plan(w: Workload, lengths: np.ndarray, tokens: int, cm: CostModel) -> PlanKind:
    from ..core.planner import plan_global_batch

    plan = plan_global_batch(lengths, model=w.model, parallel=w.parallel, max_tokens_per_gpu=tokens, cost_model=cm)
    if w.dynamic_cp:
        from ..core.planner.dyncp import score_with_cp_comm

        plan = score_with_cp_comm(plan, model=w.model, cost_model=cm, lengths=lengths)
    return plan


def run_budgets(workloads: Sequence[Workload], seeds: int = 1, gpu_memory_gb: float = DEFAULT_GPU_GB,
                settings: MemorySettings = BENCH_SETTINGS, cost_model: CostModelLike = None
                ) -> Tuple[List[BudgetRow], Dict]:
    """Every workload's batch planned with the auto and the hand-set budgets (module docstring): rows, metadata."""
    rows: List[BudgetRow] = []
    for w in workloads:
        cm = resolve_cost_model(cost_model, w.model, w.parallel)
        try:
            auto = choose_budget(w.model, w.parallel, gpu_memory_gb, settings=settings)
        except DynBatchConfigError as exc:
            rows += [BudgetRow(w.name, s, "auto", error=f"cannot fit: {exc.problem}") for s in range(seeds)]
            continue
        budgets = [("auto", auto.tokens_per_gpu)] + hand_set_budgets(w)
        peaks = {t: peak_memory(w.model, w.parallel, t, settings=settings).peak_bytes for _, t in budgets}
        for seed in range(seeds):
            lengths = w.generate(seed).lengths
            auto_time = float("nan")
            for label, tokens in budgets:
                row = BudgetRow(w.name, seed, label, tokens, peaks[tokens] / GiB, peaks[tokens] <= auto.usable_bytes)
                try:
                    plan = _plan(w, lengths, tokens, cm)
                except OversizeSampleError:
                    row.error = (f"planner stops: the longest sample ({int(lengths.max())} tokens) is over "
                                 f"{tokens} x cp {w.parallel.cp}")
                    rows.append(row)
                    continue
                except DynBatchConfigError as exc:
                    row.error = f"planner stops: {exc.problem}"
                    rows.append(row)
                    continue
                row.microbatches = int(plan.num_microbatches)
                if row.fits:
                    row.step_time_s = float(plan.predicted_step_time)
                if label == "auto":
                    auto_time = row.step_time_s
                row.vs_auto = row.step_time_s / auto_time if auto_time > 0 else float("nan")
                rows.append(row)
    meta = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
            "gpu_memory_gb": gpu_memory_gb, "settings": settings.to_dict(), "seeds": seeds,
            "step_time": "modelled (cost model seconds); budgets that do not fit the card are not scored",
            "hand_set": {n: asdict(d) for n, d in TRAINER_DEFAULTS.items()}}
    return rows, meta


def format_budgets(rows: Sequence[BudgetRow], meta: Dict[str, Any]) -> str:
    """A table: per workload and budget, the mean over seeds."""
    st = meta["settings"]
    head = f"{'workload':<26} {'budget':<15} {'tokens/GPU':>10} {'peak GiB':>8} {'fits':>4} {'mb/rank':>7} " \
           f"{'step s':>8} {'vs auto':>7}  notes"
    lines = [f"Auto budget vs hand-set budgets on the same batches (MODELLED step time; memory: card "
             f"{meta['gpu_memory_gb']:g} GiB, recompute {st['recompute']}, optimizer {st['optimizer']}, "
             f"{st['headroom']:.0%} headroom)", head, "-" * len(head)]
    groups: Dict[Tuple[str, str], List[BudgetRow]] = {}
    for r in rows:
        groups.setdefault((r.workload, r.label), []).append(r)
    last = None
    for (wl, label), rs in groups.items():
        r0 = rs[0]
        name = wl if wl != last else ""
        last = wl
        if r0.tokens_per_gpu == 0:
            lines.append(f"{name:<26} {label:<15} {'-':>10} {'-':>8} {'-':>4} {'-':>7} {'-':>8} {'-':>7}  {r0.error}")
            continue
        ok = [r for r in rs if r.error is None]
        note = "" if r0.fits else "out of memory (predicted): not scored"
        if not ok:
            note = "; ".join(x for x in (note, (rs[0].error or "")[:80]) if x)
            lines.append(f"{name:<26} {label:<15} {r0.tokens_per_gpu:>10} {r0.predicted_peak_gb:>8.1f} "
                         f"{'yes' if r0.fits else 'no':>4} {'-':>7} {'-':>8} {'-':>7}  {note}")
            continue
        mb = float(np.mean([r.microbatches for r in ok]))
        t = [r.step_time_s for r in ok if np.isfinite(r.step_time_s)]
        v = [r.vs_auto for r in ok if np.isfinite(r.vs_auto)]
        step = f"{np.mean(t):8.3f}" if t else f"{'-':>8}"
        vs = f"{np.mean(v):7.3f}" if v else f"{'-':>7}"
        lines.append(f"{name:<26} {label:<15} {r0.tokens_per_gpu:>10} {r0.predicted_peak_gb:>8.1f} "
                     f"{'yes' if r0.fits else 'no':>4} {mb:>7.3g} {step} {vs}  {note}")
    return "\n".join(line.rstrip() for line in lines)


def cmd_budgets(args: Any) -> int:
    """``bench --budgets`` (the CLI's bench arguments): print the table (or JSON), write ``--output``."""
    import json
    from pathlib import Path

    from ..core.checks import as_float
    from .workloads import select_workloads

    gb = as_float(float(args.gpu_memory_gb) if _is_number(args.gpu_memory_gb) else args.gpu_memory_gb,
                  "--gpu-memory-gb", minimum=1e-9, maximum=float(1 << 20), fix="pass the card's GiB, e.g. 80")
    rows, meta = run_budgets(select_workloads(args.workloads), seeds=args.seeds, gpu_memory_gb=gb,
                             cost_model=args.cost_model)
    meta["command"] = "megatron-dynbatch " + " ".join(args.argv)
    text = json.dumps({"meta": meta, "rows": [r.to_dict() for r in rows]}, indent=1)
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    print(text if args.json else format_budgets(rows, meta))
    return 0


def _is_number(text: Any) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True


__all__ = ["BENCH_SETTINGS", "BudgetRow", "hand_set_budgets", "run_budgets", "format_budgets", "cmd_budgets"]
