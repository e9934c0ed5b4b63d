"""Step-time model used to choose micro-batch counts and to score plans.

One micro-batch of a DP rank costs, on each GPU of its model replica (forward + backward)::

    t_mb = overhead + linear_s_per_token * padded_tokens + attention_s_per_sq_token * sum(real_len ** 2)

* ``linear_s_per_token``: the token-linear FLOPs (projections, MLP/experts, LM head), forward x3 for fwd+bwd,
  split over the ``tp*pp*cp`` GPUs of the replica, at ``linear_efficiency`` of ``peak_flops``. Padding tokens
  cost linear work, which is why padded tokens are counted here.
* ``attention_s_per_sq_token``: the causal core-attention FLOPs (half the square), likewise, at
  ``attention_efficiency`` (varlen flash/fused attention runs well below GEMM efficiency). Only real tokens
  attend: THD kernels skip the padding between sequences.
* ``overhead``: a fixed per-micro-batch cost (kernel launches, pipeline p2p, data movement) that makes many
  tiny micro-batches slower than few large ones.

A DP rank's time is the sum of its micro-batch times when ``pp == 1``; with ``pp > 1`` each micro-batch costs
``t_mb / pp`` on every stage (layers split evenly, forward one third and backward two thirds) and the rank's
time is the makespan of a simulated 1F1B schedule (:func:`simulate_1f1b`); interleaved pipelines (``vpp > 1``)
use the closed form ``sum(stage times) + (pp - 1) / vpp * mean(stage time)``. With expert parallelism
(``ep > 1``) the ranks of one EP group exchange tokens in every MoE layer, so they advance in lockstep: the
``j``-th micro-batch costs the maximum over the group's ranks (:meth:`CostModel.step_time`).

The step time is the slowest DP rank's time (every rank waits at the gradient all-reduce); the all-reduce and
optimizer are the same for every plan and are left out. The default efficiencies describe an H100/H200 running
bf16; they only need to be right *relative to each other* to rank plans. ``CostModel`` instances with measured
coefficients (see ``fit``) replace them when calibration data exists.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import DynBatchConfigError
from .parallel import ParallelConfig


@dataclass(frozen=True)
class CostModel:
    """Seconds per padded token, per squared real token and per micro-batch, on one GPU, forward + backward."""

    linear_s_per_token: float
    attention_s_per_sq_token: float
    overhead_s: float = 2.0e-3
    pp: int = 1
    vpp: int = 1
    ep_group: int = 1

    def __post_init__(self) -> None:
        for name in ("linear_s_per_token", "attention_s_per_sq_token", "overhead_s"):
            v = getattr(self, name)
            if not np.isfinite(v) or v < 0:
                raise DynBatchConfigError(f"cost_model.{name}", v, "must be a finite number >= 0",
                                          "use CostModel.from_model(...) or non-negative coefficients")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_flops(
        cls,
        linear_flops_per_token: float,
        attention_flops_per_sq_token: float,
        parallel: Optional[ParallelConfig] = None,
        *,
        peak_flops: float = 989e12,
        linear_efficiency: float = 0.55,
        attention_efficiency: float = 0.35,
        overhead_s: float = 2.0e-3,
    ) -> "CostModel":
        """Build from forward FLOPs coefficients of the whole model (``linear*L + quadratic*L**2``)."""
        p = parallel or ParallelConfig()
        # x3: forward + backward (backward = 2 x forward). The micro-batch time is expressed for the whole
        # pipeline depth (each stage takes t_mb / pp), so here the work is divided by tp*cp only.
        lin = 3.0 * linear_flops_per_token / (p.tp * p.cp) / (peak_flops * linear_efficiency)
        att = 3.0 * attention_flops_per_sq_token / (p.tp * p.cp) / (peak_flops * attention_efficiency)
        return cls(lin, att, overhead_s, pp=p.pp, vpp=p.vpp, ep_group=max(1, p.ep))

    @classmethod
    def from_model(cls, model, parallel: Optional[ParallelConfig] = None, **kwargs) -> "CostModel":
        """Build from a ``ModelSpec`` (or anything ``ModelSpec.from_any`` accepts)."""
        from .flops import flops_coefficients
        from .model_spec import ModelSpec

        c = flops_coefficients(ModelSpec.from_any(model))
        return cls.from_flops(c.linear, c.quadratic, parallel, **kwargs)

    @classmethod
    def tokens_only(cls, parallel: Optional[ParallelConfig] = None, overhead_s: float = 2.0e-3) -> "CostModel":
        """A model-free cost (1 us per token, no attention term) for planning without a ``ModelSpec``."""
        p = parallel or ParallelConfig()
        return cls(1e-6 / (p.tp * p.cp), 0.0, overhead_s, pp=p.pp, vpp=p.vpp, ep_group=max(1, p.ep))

    def with_layout(self, parallel: ParallelConfig) -> "CostModel":
        d = asdict(self)
        d.update(pp=parallel.pp, vpp=parallel.vpp, ep_group=max(1, parallel.ep))
        return CostModel(**d)

    def to_dict(self) -> dict:
        return asdict(self)

    # ------------------------------------------------------------------ evaluation
    def work(self, padded_tokens, sq_tokens):
        """Compute seconds of micro-batches (no overhead), vectorised."""
        return self.linear_s_per_token * np.asarray(padded_tokens, dtype=np.float64) + \
            self.attention_s_per_sq_token * np.asarray(sq_tokens, dtype=np.float64)

    def microbatch_time(self, padded_tokens, sq_tokens):
        """Seconds of whole micro-batches (overhead included), vectorised."""
        return self.overhead_s + self.work(padded_tokens, sq_tokens)

    def rank_time(self, mb_times: Sequence[float]) -> float:
        """Time of one DP rank running these micro-batch times in this order."""
        t = np.asarray(mb_times, dtype=np.float64)
        if t.size == 0:
            return 0.0
        if self.pp == 1:
            return float(t.sum())
        stage = t / self.pp
        if self.vpp > 1:
            return float(stage.sum() + (self.pp - 1) / self.vpp * stage.mean())
        return simulate_1f1b(stage, self.pp)

    def rank_times(self, mb_times: np.ndarray) -> np.ndarray:
        """:meth:`rank_time` of every row of ``mb_times`` (``[ranks, M]``, each row in execution order)."""
        t = np.asarray(mb_times, dtype=np.float64)
        if t.ndim != 2 or t.shape[1] == 0:
            return np.zeros(t.shape[0] if t.ndim == 2 else 0)
        if self.pp == 1:
            return t.sum(axis=1)
        stage = t / self.pp
        if self.vpp > 1:
            return stage.sum(axis=1) + (self.pp - 1) / self.vpp * stage.mean(axis=1)
        return simulate_1f1b_batch(stage, self.pp)

    def step_time(self, per_rank_mb_times: Sequence[Sequence[float]]) -> np.ndarray:
        """Per-rank times for a whole plan (EP groups in lockstep); the step time is their maximum."""
        ranks = [np.asarray(t, dtype=np.float64) for t in per_rank_mb_times]
        same_size = bool(ranks) and len({r.size for r in ranks}) == 1
        if self.ep_group > 1 and same_size:
            out = np.empty(len(ranks))
            for g in range(0, len(ranks), self.ep_group):
                lock = np.max(np.stack(ranks[g:g + self.ep_group]), axis=0)
                out[g:g + self.ep_group] = self.rank_time(lock)
            return out
        if same_size and self.pp > 1:
            return self.rank_times(np.stack(ranks))
        return np.array([self.rank_time(r) for r in ranks])

    def lower_bound(self, total_work: float, max_sample_work: float, dp: int, min_microbatches: int,
                    max_microbatches: int) -> float:
        """A step-time bound no plan can beat: perfect balance of the unavoidable work (aligned tokens and real
        attention) over ``dp`` ranks, the fewest micro-batches the budget allows, and, with ``pp > 1``, the
        1F1B bubble of equal micro-batches at the best count. A sample cannot be split, so the rank holding the
        largest one takes at least that long."""
        w = total_work / dp
        m_lo = max(1, min_microbatches)
        m_hi = max(m_lo, max_microbatches)
        if self.pp == 1:
            return max(w + m_lo * self.overhead_s, max_sample_work + self.overhead_s)
        bubble = (self.pp - 1) / (self.vpp if self.vpp > 1 else 1)
        ms = np.arange(m_lo, min(m_hi, m_lo + 4096) + 1, dtype=np.float64)
        t = (ms + bubble) * (w / ms + self.overhead_s) / self.pp
        best = float(t.min())
        single = (1 + bubble) * (max_sample_work + self.overhead_s) / self.pp
        return max(best, single)


def simulate_1f1b(stage_times: Sequence[float], pp: int) -> float:
    """Makespan of Megatron's non-interleaved 1F1B schedule.

    ``stage_times[j]`` is micro-batch ``j``'s forward+backward time on one stage (the same on every stage);
    forward takes one third and backward two thirds. Stage ``s`` runs ``min(pp - s - 1, M)`` warm-up forwards,
    then alternates one forward / one backward, then drains the remaining backwards; forward ``j`` on stage
    ``s`` waits for forward ``j`` on stage ``s-1``, backward ``j`` on stage ``s`` for backward ``j`` on
    stage ``s+1``. Returns the time the first stage finishes its last backward (the step's compute end).

    The dependency graph depends only on ``(M, pp)``, so it is built once (:func:`_schedule_1f1b`) and each
    call is one pass of max-plus arithmetic over it; :func:`simulate_1f1b_batch` does many ranks at once.
    """
    t = [float(x) for x in stage_times]
    m = len(t)
    if m == 0:
        return 0.0
    order = _schedule_1f1b(m, pp)
    end = [0.0] * len(order)
    for k, (j, is_b, prev, dep) in enumerate(order):
        start = end[prev] if prev >= 0 else 0.0
        if dep >= 0 and end[dep] > start:
            start = end[dep]
        end[k] = start + (t[j] - t[j] / 3.0 if is_b else t[j] / 3.0)
    return max(end)


def simulate_1f1b_batch(stage_times: np.ndarray, pp: int) -> np.ndarray:
    """:func:`simulate_1f1b` of every row of ``stage_times`` (``[ranks, M]``) at once."""
    times = np.asarray(stage_times, dtype=np.float64)
    if times.ndim != 2 or times.shape[1] == 0:
        return np.zeros(times.shape[0] if times.ndim == 2 else 0)
    fwd = times / 3.0
    bwd = times - fwd
    order = _schedule_1f1b(times.shape[1], pp)
    end = np.zeros((len(order), times.shape[0]))
    zero = np.zeros(times.shape[0])
    for k, (j, is_b, prev, dep) in enumerate(order):
        start = end[prev] if prev >= 0 else zero
        if dep >= 0:
            start = np.maximum(start, end[dep])
        end[k] = start + (bwd[:, j] if is_b else fwd[:, j])
    return end.max(axis=0)


@functools.lru_cache(maxsize=64)
def _schedule_1f1b(m: int, pp: int) -> Tuple[Tuple[int, bool, int, int], ...]:
    """The 1F1B operations in a dependency-respecting order: ``(microbatch, is_backward, previous op on the
    same stage, op it waits for on a neighbouring stage)`` (indices into the order; -1 for none)."""
    orders = []
    for s in range(pp):
        warm = min(pp - s - 1, m)
        ops = [(False, j) for j in range(warm)]
        for i in range(m - warm):
            ops.append((False, warm + i))
            ops.append((True, i))
        ops.extend((True, j) for j in range(m - warm, m))
        orders.append(ops)
    index: Dict[Tuple[int, bool, int], int] = {}
    out: List[Tuple[int, bool, int, int]] = []
    pos = [0] * pp
    last = [-1] * pp
    while len(out) < 2 * m * pp:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                is_b, j = orders[s][pos[s]]
                if is_b:
                    dep_key = (s, False, j) if s == pp - 1 else (s + 1, True, j)
                else:
                    dep_key = None if s == 0 else (s - 1, False, j)
                if dep_key is not None and dep_key not in index:
                    break
                dep = index[dep_key] if dep_key is not None else -1
                index[(s, is_b, j)] = len(out)
                out.append((j, is_b, last[s], dep))
                last[s] = len(out) - 1
                pos[s] += 1
                progressed = True
        if not progressed:  # pragma: no cover - the schedule is deadlock-free by construction
            raise RuntimeError("1F1B schedule deadlocked")
    return tuple(out)


# ---------------------------------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class FitReport:
    """How well a fitted ``CostModel`` reproduces the measurements it was fitted on."""

    num_measurements: int
    rel_rms_error: float
    max_rel_error: float

    def to_dict(self) -> dict:
        return asdict(self)


def fit_cost_model(padded_tokens: Sequence[float], sq_tokens: Sequence[float], seconds: Sequence[float],
                   parallel: Optional[ParallelConfig] = None) -> "tuple[CostModel, FitReport]":
    """Fit ``seconds ~ overhead + a * padded_tokens + b * sq_tokens`` to measured micro-batch times.

    Each row is one measured micro-batch on one GPU (forward + backward): its padded token count, the sum of
    its sequences' squared real lengths, and its time. The fit minimises *relative* squared error (small
    micro-batches matter as much as large ones) with every coefficient kept >= 0 (an exact non-negative least
    squares over the 8 active sets of three unknowns). Returns the model and its fit error on these rows.
    """
    x = np.column_stack([np.ones(len(seconds)), np.asarray(padded_tokens, float), np.asarray(sq_tokens, float)])
    y = np.asarray(seconds, dtype=np.float64)
    if y.ndim != 1 or x.shape[0] != y.size or y.size < 3:
        raise DynBatchConfigError("measurements", int(y.size), "need at least 3 micro-batch timings of equal length",
                                  "measure micro-batches of several sizes and lengths")
    if (y <= 0).any() or not np.isfinite(x).all() or not np.isfinite(y).all():
        raise DynBatchConfigError("measurements.seconds", "non-positive or non-finite value",
                                  "every timing must be a positive, finite number of seconds",
                                  "drop failed or warm-up measurements")
    w = 1.0 / y
    xw, yw = x * w[:, None], y * w
    best = None
    for mask in range(1, 8):
        cols = [c for c in range(3) if mask >> c & 1]
        coef, *_ = np.linalg.lstsq(xw[:, cols], yw, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(3)
        full[cols] = coef
        err = float(np.sum((xw @ full - yw) ** 2))
        if best is None or err < best[0]:
            best = (err, full)
    _, (c, a, b) = best
    p = parallel or ParallelConfig()
    model = CostModel(float(a), float(b), float(c), pp=p.pp, vpp=p.vpp, ep_group=max(1, p.ep))
    rel = (x @ np.array([c, a, b]) - y) / y
    return model, FitReport(int(y.size), float(np.sqrt(np.mean(rel ** 2))), float(np.max(np.abs(rel))))


def save_cost_model(model: CostModel, path, report: Optional[FitReport] = None) -> None:
    """Write the per-micro-batch coefficients (and the fit report) as JSON; the layout is not stored."""
    import json

    d = {k: v for k, v in model.to_dict().items() if k in ("linear_s_per_token", "attention_s_per_sq_token",
                                                            "overhead_s")}
    if report is not None:
        d["fit"] = report.to_dict()
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(d, fh, indent=2)


def load_cost_model(path) -> CostModel:
    """Read a cost-model JSON file written by :func:`save_cost_model` (or by hand)."""
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            d = json.load(fh)
    except (OSError, ValueError) as exc:
        raise DynBatchConfigError("--dynbatch-cost-model", str(path), f"cannot be read as JSON ({exc})",
                                  "pass a file written by save_cost_model / the calibration script") from None
    keys = ("linear_s_per_token", "attention_s_per_sq_token", "overhead_s")
    missing = [k for k in keys if k not in d]
    if missing:
        raise DynBatchConfigError("--dynbatch-cost-model", str(path), f"is missing {missing}",
                                  f"write the keys {list(keys)} (seconds per token, per squared token, per micro-batch)")
    return CostModel(*(float(d[k]) for k in keys))
