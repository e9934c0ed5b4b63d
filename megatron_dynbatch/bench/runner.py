"""Benchmark runner: every algorithm on every workload, scored with one cost model.

For each workload and seed the global batch is generated once; the planner (``plan_global_batch``, in a few
variants) and every baseline of :mod:`megatron_dynbatch.bench.baselines` plan it, and each plan is scored by the
same :class:`~megatron_dynbatch.core.cost_model.CostModel` (``CostModel.from_model`` of the workload's preset and
layout). The results are :class:`Row` objects collected in a :class:`BenchResult` (JSON round-trippable).

Also here: the planning-speed micro-benchmark (:func:`run_speed`), which times ``plan_global_batch`` on
4,096 samples over 64 DP ranks and 65,536 over 1,024 (median of a few runs, single process).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .adversarial import SHAPES as ADVERSARIAL_SHAPES, adversarial_tasks, run_adversarial
from .baselines import BASELINES, BaselineContext, run_baseline, structural_problems
from .hybrid_cp import NAME as HYBRID_CP, plan_hybrid_cp
from .megatron_dynamic_cp import NAME as MEGATRON_DYNCP, plan_megatron_dynamic_cp
from .partitioning import BaselineInfeasible
from .speed import SpeedResult
from ..core.cost_model import CostModel, CostModelLike
from ..core.cost_files import resolve_cost_model
from ..core.cost_profiles import DEFAULT_PROFILE
from ..core.checks import is_int
from ..core.errors import DynBatchConfigError
from ..core.parallel import ParallelConfig
from ..core.planner.dyncp.candidates import FIXED_CP
from .workloads import Workload, grpo_lengths

if TYPE_CHECKING:
    from ..core.planner.plan_kind import PlanKind

#: Planner variants benchmarked next to the baselines: name -> (plan_global_batch kwargs, needs group ids).
#: ``dynbatch`` is the default call (with a model it balances FLOPs as the cost model's seconds);
#: ``dynbatch-flops`` balances raw FLOPs (``balance_by="flops"``), to show what the objective is worth;
#: ``dynbatch-groups`` keeps each GRPO group on one DP rank (a constraint no baseline honours).
DYNBATCH_VARIANTS: Dict[str, Tuple[Dict[str, Any], bool]] = {
    "dynbatch": ({}, False),
    "dynbatch-flops": ({"balance_by": "flops"}, False),
    "dynbatch-groups": ({}, True),
    "dynbatch-dyncp": ({"dynamic_cp": True}, False),
}
PRIMARY = "dynbatch"
#: run only on dynamic-CP workloads (``Workload.dynamic_cp``): the dynamic-CP planner and upstream's schedulers
DYNCP_ONLY = ("dynbatch-dyncp", HYBRID_CP, MEGATRON_DYNCP)
#: the row the lower bound comes from on dynamic-CP workloads (the pool bound holds for every plan)
DYNCP_PRIMARY = "dynbatch-dyncp"
ALGORITHMS: Tuple[str, ...] = tuple(DYNBATCH_VARIANTS) + tuple(BASELINES) + (HYBRID_CP, MEGATRON_DYNCP)
#: the bench's own check on dynamic-CP workloads: ``dynbatch-dyncp`` is never slower than these on any batch
#: (within the decision margin only where it kept the fixed-CP plan, :func:`dyncp_slower_than`)
DYNCP_NEVER_SLOWER_THAN: Tuple[str, ...] = (MEGATRON_DYNCP,)

#: Planning-speed targets (samples, dp) -> milliseconds.
SPEED_CASES: Tuple[Tuple[int, int, float], ...] = ((4096, 64, 20.0), (65536, 1024, 1000.0))
#: Dynamic-CP planning-speed target: (samples, dp, cp, milliseconds) -- 4,096 samples over a pool of 256 GPUs.
DYNCP_SPEED_CASE: Tuple[int, int, int, float] = (4096, 32, 8, 100.0)


@dataclass
class Row:
    """One (workload, seed, algorithm) result. Times in seconds unless named ``_ms``."""

    workload: str
    seed: int
    algorithm: str
    family: str  # "dynbatch" or "baseline"
    step_time_s: float = float("nan")
    lower_bound_s: float = float("nan")
    vs_lower_bound: float = float("nan")
    vs_best_baseline: float = float("nan")
    imbalance: float = float("nan")
    microbatches: int = 0          # most micro-batches on any rank
    microbatches_min: int = 0      # fewest (differs only for ragged plans)
    lower_bound_microbatches: int = 0
    cap_violations: int = 0
    peak_over_cap: float = float("nan")  # largest micro-batch / cap
    padding_fraction: float = float("nan")
    planning_ms: float = float("nan")
    error: Optional[str] = None
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> Dict[str, Any]:
        return _json_safe(asdict(self))

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Row":
        kw: Dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in d:
                continue
            v = d[f.name]
            if v is None and f.type == "float":  # strict JSON stores NaN as null
                v = float("nan")
            kw[f.name] = list(v) if f.name == "notes" else v
        return cls(**kw)


@dataclass
class BenchResult:
    """Everything one benchmark run produced."""

    rows: List[Row]
    speed: List[SpeedResult] = field(default_factory=list)
    workloads: List[Dict[str, Any]] = field(default_factory=list)
    meta: Dict[str, Any] = field(default_factory=dict)
    plans: Dict[Tuple[str, int, str], Any] = field(default_factory=dict, repr=False, compare=False)

    def rows_for(self, workload: str, seed: Optional[int] = None) -> List[Row]:
        return [r for r in self.rows if r.workload == workload and (seed is None or r.seed == seed)]

    @property
    def dynbatch_cap_violations(self) -> int:
        """Over-budget micro-batches in any planner plan (the planner guarantees none)."""
        return sum(r.cap_violations for r in self.rows if r.family == "dynbatch")

    @property
    def dynbatch_errors(self) -> List[Row]:
        return [r for r in self.rows if r.family == "dynbatch" and (r.error or r.notes)]

    def to_dict(self) -> Dict[str, Any]:
        return {"meta": _json_safe(self.meta), "workloads": _json_safe(self.workloads),
                "rows": [r.to_dict() for r in self.rows], "speed": [s.to_dict() for s in self.speed]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "BenchResult":
        return cls(rows=[Row.from_dict(r) for r in d.get("rows", [])],
                   speed=[SpeedResult.from_dict(s) for s in d.get("speed", [])],
                   workloads=list(d.get("workloads", [])), meta=dict(d.get("meta", {})))

    @classmethod
    def from_json(cls, text: str) -> "BenchResult":
        return cls.from_dict(json.loads(text))


def _json_safe(obj: Any) -> Any:
    """NaN/inf -> None and numpy scalars -> Python, so the JSON is strict."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        return v if np.isfinite(v) else None
    return obj


# ============================================================================================ one workload
def _row_from_plan(w: Workload, seed: int, name: str, family: str, plan: PlanKind, planning_s: float,
                   notes: List[str]) -> Row:
    counts = [len(r) for r in plan.micro_batches]
    total = plan.real_tokens + plan.padding_tokens
    return Row(
        workload=w.name, seed=seed, algorithm=name, family=family,
        step_time_s=plan.predicted_step_time, imbalance=plan.imbalance,
        microbatches=max(counts), microbatches_min=min(counts),
        cap_violations=plan.cap_violations, peak_over_cap=plan.max_microbatch_tokens / plan.cap,
        padding_fraction=plan.padding_tokens / total if total else 0.0,
        planning_ms=1e3 * planning_s, notes=list(notes),
    )


def run_workload(w: Workload, seed: int = 0, algorithms: Optional[Sequence[str]] = None,
                 keep_plans: bool = False, cost_model: CostModelLike = None, gpus_per_node: Optional[int] = None,
                 decision_margin: Optional[float] = None, documents: Optional[Sequence[int]] = None,
                 ) -> Tuple[List[Row], Dict[Tuple[str, int, str], Any]]:
    """Plan and score one workload's batch of ``seed`` with every requested algorithm. ``cost_model``: a
    ``CostModel``, profile name or file (default: the default profile); ``gpus_per_node`` replaces the
    workload's; ``decision_margin`` goes to the planner; ``documents``: see :meth:`Workload.generate`."""
    from ..core.planner import plan_global_batch
    from ..core.planner.api import executed_shapes
    from ..core.planner.dyncp import score_with_cp_comm

    algos = list(algorithms) if algorithms else list(ALGORITHMS)
    if gpus_per_node is not None:
        w = dataclasses.replace(w, parallel=dataclasses.replace(w.parallel, gpus_per_node=gpus_per_node))
    batch = w.generate(seed, documents=documents)
    lengths = batch.lengths
    cm = resolve_cost_model(cost_model, w.model, w.parallel)
    dyncp = bool(getattr(w, "dynamic_cp", False))
    kept_fixed = False  # whether the dynamic-CP plan kept the fixed-CP plan in every step
    rows: List[Row] = []
    plans: Dict[Tuple[str, int, str], Any] = {}
    for name in algos:
        if name in DYNCP_ONLY and not dyncp:
            continue
        if name == HYBRID_CP:
            t0 = time.perf_counter()
            try:
                plan = plan_hybrid_cp(lengths, w.parallel, w.max_tokens_per_gpu, cm)
            except BaselineInfeasible as exc:
                rows.append(Row(w.name, seed, name, "baseline", error=str(exc),
                                planning_ms=1e3 * (time.perf_counter() - t0)))
                continue
            notes = (["pp>1 modelled: a 1F1B flush per round (upstream 0.16.1 is PP=1 only)"] if w.parallel.pp > 1
                     else [])
            counts = {len(r) for r in plan.micro_batches}
            if len(counts) > 1:
                notes.append(f"ragged micro-batch counts {min(counts)}..{max(counts)} (upstream runs one per sample)")
            row = _row_from_plan(w, seed, name, "baseline", plan, plan.planning_time_s, notes)
        elif name == MEGATRON_DYNCP:
            t0 = time.perf_counter()
            try:
                plan = plan_megatron_dynamic_cp(lengths, w.parallel, w.max_tokens_per_gpu, model=w.model,
                                                cost_model=cm)
            except BaselineInfeasible as exc:
                rows.append(Row(w.name, seed, name, "baseline", error=str(exc),
                                planning_ms=1e3 * (time.perf_counter() - t0)))
                continue
            notes = ([f"pp={w.parallel.pp}: its micro-batches modelled under Megatron's 1F1B schedule (every stage "
                      "the same groups)"] if w.parallel.pp > 1 else [])
            row = _row_from_plan(w, seed, name, "baseline", plan, plan.planning_time_s, notes)
        elif name in DYNBATCH_VARIANTS:
            kwargs, needs_groups = DYNBATCH_VARIANTS[name]
            if needs_groups and (batch.group_ids is None or np.unique(batch.group_ids).size < w.parallel.dp):
                continue  # no groups, or fewer groups than ranks: the constraint cannot be met
            t0 = time.perf_counter()
            try:
                plan = plan_global_batch(lengths, model=w.model, parallel=w.parallel,
                                         max_tokens_per_gpu=w.max_tokens_per_gpu, cost_model=cm,
                                         group_ids=batch.group_ids if needs_groups else None,
                                         decision_margin=decision_margin, **kwargs)
            except DynBatchConfigError as exc:
                rows.append(Row(w.name, seed, name, "dynbatch", error=str(exc),
                                planning_ms=1e3 * (time.perf_counter() - t0)))
                continue
            problems = [] if name == "dynbatch-dyncp" else structural_problems(plan, lengths.size)
            if name == "dynbatch-dyncp":
                try:
                    plan.validate(lengths.size)
                except AssertionError as exc:
                    problems = [f"invalid dynamic-CP plan: {exc}"]
            elif dyncp:
                plan = score_with_cp_comm(plan, model=w.model, cost_model=cm, lengths=lengths)
            row = _row_from_plan(w, seed, name, "dynbatch", plan, plan.planning_time_s, problems)
            if name == DYNCP_PRIMARY:
                kept_fixed = set(str(plan.candidate).split(",")) == {FIXED_CP}
            row.lower_bound_microbatches = plan.lower_bound_microbatches
            row.lower_bound_s = plan.lower_bound_step_time
        elif name in BASELINES:
            ctx = BaselineContext.build(w.parallel, w.max_tokens_per_gpu, w.model)
            res = run_baseline(name, lengths, ctx, cm)
            if res.error is not None:
                rows.append(Row(w.name, seed, name, "baseline", error=res.error,
                                planning_ms=1e3 * res.planning_time_s))
                continue
            if dyncp:  # the exchange hides behind the attention the baseline runs (padded rows, full-width bins)
                base = BASELINES[name]
                _, sqs = executed_shapes(res.plan.micro_batches, lengths, res.plan.alignment, base.pad_to_longest,
                                         res.plan.cap if base.fixed_bins else None)
                plan = score_with_cp_comm(res.plan, model=w.model, cost_model=cm, sq_tokens=sqs)
            else:
                plan = res.plan
            row = _row_from_plan(w, seed, name, "baseline", plan, res.planning_time_s, res.notes)
            row.lower_bound_microbatches = plan.lower_bound_microbatches
            row.lower_bound_s = plan.lower_bound_step_time
        else:
            raise DynBatchConfigError("--algorithms", name, "unknown algorithm", f"use a subset of {list(ALGORITHMS)}")
        rows.append(row)
        if keep_plans:
            plans[(w.name, seed, name)] = plan
    if dyncp:
        margin = decision_margin if decision_margin is not None else float(cm.uncertainty)
        for row in rows:
            if row.algorithm == DYNCP_PRIMARY and row.ok:
                row.notes += dyncp_slower_than(rows, margin if kept_fixed else 0.0)
    _relate(rows, DYNCP_PRIMARY if dyncp else PRIMARY)
    return rows, plans


def dyncp_slower_than(rows: Sequence[Row], margin: float, names: Sequence[str] = DYNCP_NEVER_SLOWER_THAN) -> List[str]:
    """The bench's own check on one dynamic-CP batch: where ``dynbatch-dyncp`` is slower than one of ``names``
    by more than ``margin`` (relative). The bench passes 0 -- never slower -- unless the plan kept the fixed-CP
    plan in every step: the planner leaves that default only for a modelled gain above its decision margin
    (``dyncp/orchestrate.py::choose``), so there it may trail by up to the margin. Upstream's schedule is one of
    the planner's own candidates (``dyncp/upstream.py``), which is what makes the strict check hold elsewhere.
    Each break is one note on the ``dynbatch-dyncp`` row, so ``bench`` exits with an error."""
    mine = next((r for r in rows if r.algorithm == DYNCP_PRIMARY and r.ok), None)
    if mine is None:
        return []
    out = []
    for r in rows:
        if r.algorithm in names and r.ok and mine.step_time_s > r.step_time_s * (1 + margin + 1e-9):
            out.append(f"slower than {r.algorithm}: {mine.step_time_s:.4f} s vs {r.step_time_s:.4f} s "
                       f"(beyond the decision margin {margin:g})")
    return out


def _relate(rows: List[Row], primary_name: str = PRIMARY) -> None:
    """Fill the ratios: vs the planner's lower bound (shared by all rows of the batch) and vs the best
    baseline that ran (including baselines that broke the cap: the conservative comparison)."""
    primary = [r for r in rows if r.algorithm == primary_name and r.ok]
    lb = primary[0].lower_bound_s if primary else min((r.lower_bound_s for r in rows if r.ok), default=float("nan"))
    lb_m = primary[0].lower_bound_microbatches if primary else 0
    best = min((r.step_time_s for r in rows if r.family == "baseline" and r.ok), default=float("nan"))
    for r in rows:
        r.lower_bound_s = lb
        if lb_m:
            r.lower_bound_microbatches = lb_m
        if r.ok:
            r.vs_lower_bound = r.step_time_s / lb if lb and lb > 0 else float("nan")
            r.vs_best_baseline = r.step_time_s / best if best and best > 0 else float("nan")


# ============================================================================================ speed
def run_speed(cases: Sequence[Tuple[int, int, float]] = SPEED_CASES, repeats: int = 3,
              model: str = "qwen3-8b", max_tokens_per_gpu: int = 32768) -> List[SpeedResult]:
    """Median planning time (CPU time of this process) of ``plan_global_batch`` (GRPO-like lengths, groups of 8,
    16k max response, ``tp=2``) for each ``(samples, dp, target_ms)`` case; one warm-up call first, then
    ``repeats`` timed."""
    from ..core.planner import plan_global_batch

    out = []
    for samples, dp, target in cases:
        batch = grpo_lengths(np.random.default_rng(samples), prompts=samples // 8, group=8, max_response=16384,
                             median_response=3000)
        par = ParallelConfig(dp=dp, tp=2)
        cm = CostModel.from_model(model, par)

        def once() -> Any:
            return plan_global_batch(batch.lengths, model=model, parallel=par,
                                     max_tokens_per_gpu=max_tokens_per_gpu, cost_model=cm)

        plan = once()
        runs = []
        for _ in range(repeats):
            t0 = time.process_time()  # CPU time: a busy machine does not turn a met target into a miss
            once()
            runs.append(1e3 * (time.process_time() - t0))
        out.append(SpeedResult(samples, dp, runs, target, plan.num_microbatches, clock="cpu"))
    return out


def run_speed_dyncp(case: Tuple[int, int, int, float] = DYNCP_SPEED_CASE, repeats: int = 3,
                    model: str = "qwen3-8b", max_tokens_per_gpu: int = 8192) -> SpeedResult:
    """CPU time of ``plan_global_batch(..., dynamic_cp=True)`` on GRPO lengths (16k max response, groups of 8)
    over a pool of ``dp * cp`` GPUs (``tp=2``); one warm-up call, then the median of ``repeats``."""
    from ..core.planner import plan_global_batch

    samples, dp, cp, target = case
    batch = grpo_lengths(np.random.default_rng(samples), prompts=samples // 8, group=8, max_response=16384,
                         median_response=3000)
    par = ParallelConfig(dp=dp, tp=2, cp=cp)
    cm = CostModel.from_model(model, par)

    def once() -> Any:
        return plan_global_batch(batch.lengths, model=model, parallel=par, max_tokens_per_gpu=max_tokens_per_gpu,
                                 cost_model=cm, dynamic_cp=True)

    plan = once()
    runs = []
    for _ in range(repeats):
        t0 = time.process_time()
        once()
        runs.append(1e3 * (time.process_time() - t0))
    return SpeedResult(samples, dp * cp, runs, target, plan.num_microbatches,
                       shape=f"dynamic CP dp{dp} x cp{cp}", clock="cpu")


# ============================================================================================ everything
def run_bench(workloads: Sequence[Workload], seeds: int = 1, algorithms: Optional[Sequence[str]] = None,
              speed: bool = True, speed_repeats: int = 3, progress: Optional[bool] = None,
              keep_plans: bool = False, argv: Optional[Sequence[str]] = None,
              adversarial_sizes: Sequence[int] = (), cost_model: CostModelLike = None,
              gpus_per_node: Optional[int] = None,
              decision_margin: Optional[float] = None) -> BenchResult:
    """Run every workload for seeds ``0..seeds-1`` (and the speed micro-benchmark when ``speed``, with the
    adversarial input shapes of :mod:`.adversarial` at ``adversarial_sizes`` samples). ``cost_model``,
    ``gpus_per_node``, ``decision_margin``: as :func:`run_workload` (``bench --cost-model`` ...).

    ``progress``: show a tqdm bar on stderr (default: only when stderr is a terminal).
    """
    if not is_int(seeds) or seeds < 1:
        raise DynBatchConfigError("--seeds", seeds, "must be a positive integer", "use e.g. --seeds 3")
    if algorithms:
        bad = [a for a in algorithms if a not in ALGORITHMS]
        if bad:
            raise DynBatchConfigError("--algorithms", bad[0], "unknown algorithm",
                                      f"use a subset of {list(ALGORITHMS)}")
    tasks: List[Tuple[str, Any]] = [("workload", (w, s)) for w in workloads for s in range(seeds)]
    if speed:
        tasks += [("speed", case) for case in SPEED_CASES]
        if any(getattr(w, "dynamic_cp", False) for w in workloads):
            tasks.append(("speed-dyncp", DYNCP_SPEED_CASE))
        tasks += [("adversarial", task) for task in adversarial_tasks(adversarial_sizes, ADVERSARIAL_SHAPES)]
    show = sys.stderr.isatty() if progress is None else progress
    bar = _progress(len(tasks), show)
    load_start = _load_average()
    result = BenchResult(rows=[], workloads=[w.to_dict() for w in workloads])
    t_start = time.perf_counter()
    for kind, task in tasks:
        if kind == "workload":
            w, s = task
            bar.set_description(f"{w.name} seed {s}")
            rows, plans = run_workload(w, s, algorithms, keep_plans, cost_model=cost_model,
                                       gpus_per_node=gpus_per_node, decision_margin=decision_margin)
            result.rows += rows
            result.plans.update(plans)
            for wd in result.workloads:
                if wd["name"] == w.name and "source" not in wd:
                    wd["source"] = w.generate(s).source
        elif kind == "speed-dyncp":
            bar.set_description("dynamic-CP planning speed")
            result.speed.append(run_speed_dyncp(task, repeats=speed_repeats))
        elif kind == "adversarial":
            bar.set_description(f"adversarial {task[1].name} n={task[0]}")
            result.speed += run_adversarial([task[0]], repeats=1, shapes=[task[1]])
        else:
            bar.set_description(f"planning speed {task[0]}/{task[1]}")
            result.speed += run_speed([task], repeats=speed_repeats)
        bar.update(1)
    bar.close()
    result.meta = {
        "command": "megatron-dynbatch " + " ".join(argv) if argv is not None else None,
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(), "numpy": np.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "seeds": seeds, "wall_s": time.perf_counter() - t_start,
        # the busier of start and end: contention slows planning times (report.format_speed says so on a miss)
        "load_avg": max(load_start, _load_average()) if load_start is not None else None,
        "cpus": os.cpu_count(),
        "cost_model": str(cost_model) if cost_model is not None else f"{DEFAULT_PROFILE} (default profile)",
        "gpus_per_node": gpus_per_node, "decision_margin": decision_margin,
    }
    return result


def _load_average() -> Optional[float]:
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):  # not on every platform
        return None


class _NoBar:
    def set_description(self, *_: Any) -> None: ...
    def update(self, *_: Any) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, show: bool) -> Any:
    if not show:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a core dependency
        return _NoBar()
    return tqdm(total=total, file=sys.stderr, leave=False, dynamic_ncols=True)


def iter_algorithms(spec: Optional[str]) -> Optional[List[str]]:
    """Parse a comma-separated ``--algorithms`` value (``None`` or empty: all)."""
    if not spec:
        return None
    return [a.strip() for a in spec.split(",") if a.strip()]


__all__ = ["ALGORITHMS", "BenchResult", "DYNBATCH_VARIANTS", "DYNCP_NEVER_SLOWER_THAN", "Row", "SpeedResult",
           "dyncp_slower_than", "run_bench",
           "run_speed", "run_speed_dyncp", "run_workload", "iter_algorithms"]
