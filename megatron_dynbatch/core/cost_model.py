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
optimizer are the same for every plan and are left out.

Context-parallel communication (used by dynamic CP, :mod:`megatron_dynbatch.core.planner.dyncp`). A micro-batch
spread over a group of ``g`` GPUs costs each of them ``(linear + attention work) * cp / g`` (the coefficients
above are expressed for the layout's ``cp``) plus the EXPOSED part of its K/V exchange::

    comm(g)  = (g - 1) * cp_comm_s_per_step + (g - 1) / g * padded_tokens * cp_comm_s_per_token
    exposed  = max(0, comm(g) - cp_comm_overlap * attention_time(g))

``cp_comm_s_per_token``: seconds to move one token's K and V of every layer, forward + backward (ring
attention sends K/V forward and K/V plus their gradients backward: 3x the forward volume), at
``cp_bandwidth_Bps``; ``cp_comm_s_per_step``: latency of one ring step of every layer, forward and backward;
``cp_comm_overlap``: the fraction of the group's attention time that hides the exchange (ring attention
computes on one K/V chunk while the next one arrives). :meth:`CostModel.group_microbatch_time` is the whole
formula; the fixed-layout planner does not use it (its CP groups never change, so the term does not change
its choices), the dynamic-CP planner and its benchmark score every plan with it. Calibrate the three numbers
with :func:`fit_cp_comm`. The default efficiencies describe an H100/H200 running
bf16; they only need to be right *relative to each other* to rank plans. ``CostModel`` instances with measured
coefficients (see ``fit``) replace them when calibration data exists.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import DynBatchConfigError
from .parallel import ParallelConfig

#: Default CP communication assumptions (H100/H200 inside one NVLink node; lower the bandwidth when CP groups
#: span nodes, e.g. ~25-50e9 per GPU over 200-400 Gb/s NICs): per-GPU bandwidth that ring attention's
#: point-to-point K/V transfers reach, latency of one ring step of one layer pass, and the share of the
#: attention compute that hides the transfers.
CP_BANDWIDTH_BPS = 100e9
CP_LATENCY_S = 15e-6
CP_COMM_OVERLAP = 0.8
#: bytes per element of the exchanged K/V (bf16)
KV_BYTES_PER_ELEMENT = 2


def kv_bytes_per_token(model) -> float:
    """Bytes of K and V one token holds in all layers of ``model`` (a ``ModelSpec`` or anything
    ``ModelSpec.from_any`` accepts), bf16, before tensor parallelism splits them: ``2 * num_query_groups *
    kv_channels`` per layer (GQA), or with multi-latent attention the per-head expanded K (``qk_head_dim +
    qk_pos_emb_head_dim``) and V (``v_head_dim``) that context parallelism exchanges."""
    from .model_spec import ModelSpec

    m = ModelSpec.from_any(model)
    if m.multi_latent_attention:
        per_layer = m.num_attention_heads * ((m.qk_head_dim or 0) + (m.qk_pos_emb_head_dim or 0) + (m.v_head_dim or 0))
    else:
        per_layer = 2 * m.num_query_groups * m.kv_channels
    return float(per_layer * m.num_layers * KV_BYTES_PER_ELEMENT)


@dataclass(frozen=True)
class CostModel:
    """Seconds per padded token, per squared real token and per micro-batch, on one GPU, forward + backward."""

    linear_s_per_token: float
    attention_s_per_sq_token: float
    overhead_s: float = 2.0e-3
    pp: int = 1
    vpp: int = 1
    ep_group: int = 1
    #: layout context-parallel size the two coefficients above are expressed for (work per GPU = base / cp)
    cp: int = 1
    #: CP communication (module docstring); ``None`` = not set (dynamic CP then uses the model's defaults)
    cp_comm_s_per_token: Optional[float] = None
    cp_comm_s_per_step: Optional[float] = None
    cp_comm_overlap: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("linear_s_per_token", "attention_s_per_sq_token", "overhead_s"):
            v = getattr(self, name)
            if not np.isfinite(v) or v < 0:
                raise DynBatchConfigError(f"cost_model.{name}", v, "must be a finite number >= 0",
                                          "use CostModel.from_model(...) or non-negative coefficients")
        for name in ("cp_comm_s_per_token", "cp_comm_s_per_step", "cp_comm_overlap"):
            v = getattr(self, name)
            if v is not None and (not np.isfinite(v) or v < 0 or (name == "cp_comm_overlap" and v > 1)):
                raise DynBatchConfigError(f"cost_model.{name}", v, "must be a finite number >= 0 (the overlap "
                                          "at most 1), or None", "use CostModel.from_model(...) or fit_cp_comm(...)")
        if not isinstance(self.cp, (int, np.integer)) or self.cp < 1:
            raise DynBatchConfigError("cost_model.cp", self.cp, "must be a positive integer",
                                      "pass the layout's context-parallel size")

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
        kv_bytes_per_token: float = 0.0,
        num_layers: int = 0,
        cp_bandwidth_Bps: float = CP_BANDWIDTH_BPS,
        cp_latency_s: float = CP_LATENCY_S,
        cp_comm_overlap: float = CP_COMM_OVERLAP,
    ) -> "CostModel":
        """Build from forward FLOPs coefficients of the whole model (``linear*L + quadratic*L**2``).

        ``kv_bytes_per_token`` (K and V of one token in ALL layers, per TP rank) and ``num_layers`` give the
        context-parallel communication term (zero when they are 0) at ``cp_bandwidth_Bps`` per GPU,
        ``cp_latency_s`` per ring step and layer pass, and ``cp_comm_overlap`` (module docstring)."""
        p = parallel or ParallelConfig()
        # x3: forward + backward (backward = 2 x forward). The micro-batch time is expressed for the whole
        # pipeline depth (each stage takes t_mb / pp), so here the work is divided by tp*cp only.
        lin = 3.0 * linear_flops_per_token / (p.tp * p.cp) / (peak_flops * linear_efficiency)
        att = 3.0 * attention_flops_per_sq_token / (p.tp * p.cp) / (peak_flops * attention_efficiency)
        for name, v in (("cp_bandwidth_Bps", cp_bandwidth_Bps), ("cp_latency_s", cp_latency_s),
                        ("kv_bytes_per_token", kv_bytes_per_token), ("num_layers", num_layers)):
            if not np.isfinite(v) or v < 0 or (name == "cp_bandwidth_Bps" and v <= 0):
                raise DynBatchConfigError(name, v, "must be a finite number >= 0 (bandwidth > 0)",
                                          "use the defaults of CostModel.from_model")
        # ring attention: K/V forward, K/V and dK/dV backward -> 3x the forward volume; 2 ring passes per layer
        per_token = 3.0 * float(kv_bytes_per_token) / float(cp_bandwidth_Bps)
        per_step = 2.0 * float(num_layers) * float(cp_latency_s)
        return cls(lin, att, overhead_s, pp=p.pp, vpp=p.vpp, ep_group=max(1, p.ep), cp=p.cp,
                   cp_comm_s_per_token=per_token, cp_comm_s_per_step=per_step, cp_comm_overlap=cp_comm_overlap)

    @classmethod
    def from_model(cls, model, parallel: Optional[ParallelConfig] = None, **kwargs) -> "CostModel":
        """Build from a ``ModelSpec`` (or anything ``ModelSpec.from_any`` accepts); the CP communication term
        comes from the model's K/V width (bf16, split over TP)."""
        from .flops import flops_coefficients
        from .model_spec import ModelSpec

        spec = ModelSpec.from_any(model)
        c = flops_coefficients(spec)
        p = parallel or ParallelConfig()
        kwargs.setdefault("kv_bytes_per_token", kv_bytes_per_token(spec) / p.tp)
        kwargs.setdefault("num_layers", spec.num_layers)
        return cls.from_flops(c.linear, c.quadratic, p, **kwargs)

    @classmethod
    def tokens_only(cls, parallel: Optional[ParallelConfig] = None, overhead_s: float = 2.0e-3) -> "CostModel":
        """A model-free cost (1 us per token, no attention term) for planning without a ``ModelSpec``."""
        p = parallel or ParallelConfig()
        return cls(1e-6 / (p.tp * p.cp), 0.0, overhead_s, pp=p.pp, vpp=p.vpp, ep_group=max(1, p.ep))

    def with_layout(self, parallel: ParallelConfig) -> "CostModel":
        d = asdict(self)
        d.update(pp=parallel.pp, vpp=parallel.vpp, ep_group=max(1, parallel.ep), cp=parallel.cp)
        return CostModel(**d)

    @property
    def has_cp_comm(self) -> bool:
        """True when the three CP communication numbers are set (see :meth:`group_microbatch_time`)."""
        return None not in (self.cp_comm_s_per_token, self.cp_comm_s_per_step, self.cp_comm_overlap)

    def with_cp_comm(self, per_token: float, per_step: float, overlap: float) -> "CostModel":
        """This model with the CP communication term replaced."""
        d = asdict(self)
        d.update(cp_comm_s_per_token=float(per_token), cp_comm_s_per_step=float(per_step),
                 cp_comm_overlap=float(overlap))
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

    def cp_comm_time(self, group_size, padded_tokens, attention_s):
        """Exposed K/V-exchange seconds of micro-batches on groups of ``group_size`` GPUs (vectorised; 0 for a
        group of one GPU, and 0 when the term is not set)."""
        g = np.asarray(group_size, dtype=np.float64)
        if not self.has_cp_comm:
            return np.zeros(np.broadcast(g, np.asarray(padded_tokens), np.asarray(attention_s)).shape)
        comm = (g - 1.0) * self.cp_comm_s_per_step + \
            (g - 1.0) / g * np.asarray(padded_tokens, dtype=np.float64) * self.cp_comm_s_per_token
        return np.maximum(comm - self.cp_comm_overlap * np.asarray(attention_s, dtype=np.float64), 0.0)

    def group_microbatch_time(self, group_size, padded_tokens, sq_tokens):
        """Seconds, on each GPU of a group of ``group_size`` GPUs, of a micro-batch of ``padded_tokens`` (its
        full packed length) and ``sq_tokens`` (sum of squared real lengths) spread over the group: overhead,
        linear and attention work divided by the group (the coefficients are for the layout's ``cp``) and the
        exposed CP communication. Equal to :meth:`microbatch_time` plus the communication when the group is
        the layout's CP group. Vectorised."""
        g = np.asarray(group_size, dtype=np.float64)
        scale = float(self.cp) / g
        lin = self.linear_s_per_token * np.asarray(padded_tokens, dtype=np.float64) * scale
        att = self.attention_s_per_sq_token * np.asarray(sq_tokens, dtype=np.float64) * scale
        return self.overhead_s + lin + att + self.cp_comm_time(g, padded_tokens, att)

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


def simulate_1f1b_batch(stage_times: np.ndarray, pp: int,
                        sync: Optional[Callable[[np.ndarray, int], np.ndarray]] = None) -> np.ndarray:
    """:func:`simulate_1f1b` of every row of ``stage_times`` (``[ranks, M]``) at once. ``sync(start, j)``, if
    given, moves the start times of micro-batch ``j``'s forward or backward across ranks before it runs (the
    dynamic-CP pool: the GPUs of one CP group start together, ``planner/dyncp/pool_sim.py``)."""
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
        if sync is not None:
            start = sync(start, j)
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
    c, a, b = _nnls_relative(x, y, y)
    p = parallel or ParallelConfig()
    model = CostModel(float(a), float(b), float(c), pp=p.pp, vpp=p.vpp, ep_group=max(1, p.ep), cp=p.cp)
    rel = (x @ np.array([c, a, b]) - y) / y
    return model, FitReport(int(y.size), float(np.sqrt(np.mean(rel ** 2))), float(np.max(np.abs(rel))))


def _nnls_relative(x: np.ndarray, y: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Non-negative least squares of ``x @ coef ~ y`` with each row weighted by ``1 / scale`` (relative error),
    exact over every active set of the (few) columns."""
    w = 1.0 / scale
    xw, yw = x * w[:, None], y * w
    k = x.shape[1]
    best = (float(np.sum(yw ** 2)), np.zeros(k))  # all coefficients 0
    for mask in range(1, 2 ** k):
        cols = [c for c in range(k) if mask >> c & 1]
        coef, *_ = np.linalg.lstsq(xw[:, cols], yw, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(k)
        full[cols] = coef
        err = float(np.sum((xw @ full - yw) ** 2))
        if err < best[0]:
            best = (err, full)
    return best[1]


def fit_cp_comm(base: CostModel, group_sizes: Sequence[int], padded_tokens: Sequence[float],
                sq_tokens: Sequence[float], seconds: Sequence[float]) -> "tuple[CostModel, FitReport]":
    """Calibrate the CP communication term of ``base`` from measured micro-batch times on CP groups.

    Each row is one micro-batch run on a group of ``group_sizes[k]`` GPUs (any mix of sizes; rows with
    ``g == 1`` anchor the compute part): its full packed token count, sum of squared real lengths and the
    time one GPU of the group spent on it (forward + backward). ``base`` supplies the compute part (fit it first
    with :func:`fit_cost_model` on ``g == cp`` rows, or use ``from_model``); the residual
    ``seconds - (overhead + work * cp / g)`` is fitted, relative error, non-negative coefficients, to
    ``(g - 1) * per_step + (g - 1) / g * tokens * per_token - overlap * attention_time(g)`` -- the exposed
    communication without its ``max(0, .)``, so measure groups where the exchange shows (short sequences on
    large groups) as well as long ones. The overlap is clipped to [0, 1]. Returns the model and the fit error
    of the whole formula on these rows.
    """
    g = np.asarray(group_sizes, dtype=np.float64)
    t = np.asarray(padded_tokens, dtype=np.float64)
    q = np.asarray(sq_tokens, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if not (g.shape == t.shape == q.shape == y.shape) or y.ndim != 1 or y.size < 3:
        raise DynBatchConfigError("measurements", int(y.size), "need at least 3 micro-batch timings, with a group "
                                  "size, token count and squared-length sum each", "measure several group sizes")
    if (g < 1).any() or (y <= 0).any() or not (np.isfinite(t).all() and np.isfinite(q).all() and np.isfinite(y).all()):
        raise DynBatchConfigError("measurements", "bad row", "group sizes must be >= 1 and timings positive and "
                                  "finite", "drop failed or warm-up measurements")
    if not isinstance(base, CostModel):
        raise DynBatchConfigError("base", type(base).__name__, "must be a CostModel", "fit_cost_model(...) first")
    compute = base.with_cp_comm(0.0, 0.0, 0.0).group_microbatch_time(g, t, q)
    att = base.attention_s_per_sq_token * q * base.cp / g
    x = np.column_stack([g - 1.0, (g - 1.0) / g * t, np.where(g > 1, -att, 0.0)])  # one GPU: no exchange
    step, per_token, overlap = _nnls_relative(x, y - compute, y)
    model = base.with_cp_comm(per_token, step, min(1.0, overlap))
    rel = (model.group_microbatch_time(g, t, q) - y) / y
    return model, FitReport(int(y.size), float(np.sqrt(np.mean(rel ** 2))), float(np.max(np.abs(rel))))


def save_cost_model(model: CostModel, path, report: Optional[FitReport] = None) -> None:
    """Write the per-micro-batch coefficients (and the fit report) as JSON; the layout is not stored."""
    import json

    d = {k: v for k, v in model.to_dict().items() if k in ("linear_s_per_token", "attention_s_per_sq_token",
                                                            "overhead_s") + CP_COMM_KEYS and v is not None}
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
    comm = {}
    for k in CP_COMM_KEYS:
        if d.get(k) is not None:
            if not isinstance(d[k], (int, float)) or isinstance(d[k], bool):
                raise DynBatchConfigError("--dynbatch-cost-model", str(path), f"{k} is {d[k]!r}", "write a number")
            comm[k] = float(d[k])
    return CostModel(*(float(d[k]) for k in keys), **comm)


#: optional keys of a cost-model file: the CP communication term (dynamic CP)
CP_COMM_KEYS = ("cp_comm_s_per_token", "cp_comm_s_per_step", "cp_comm_overlap")
