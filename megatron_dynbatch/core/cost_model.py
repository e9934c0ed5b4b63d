"""Step-time model used to choose micro-batch counts, CP groups and orders, and to score plans.

One micro-batch costs, on each GPU of its model replica (forward + backward), on a group of ``g`` GPUs
(``g = cp``: the layout's own CP groups; ``[g > 1]`` is 1 for a CP member's share, else 0)::

    compute = overhead_s + linear_s_per_token * padded_tokens * cp/g * (1 + cp_linear_overhead [g > 1])
              + attention_s_per_sq_token * (sum(real_len ** 2) * cp/g + cp * cp_chunk_tokens * padded_tokens * (g-1)/g)
    t_mb    = max(min_microbatch_s + cp_min_microbatch_s [g > 1], compute) + exposed CP exchange

* ``linear_s_per_token``: the token-linear FLOPs (projections, MLP/experts, LM head), forward x3 for fwd+bwd,
  split over ``tp*cp``, at the profile's ``linear_efficiency`` of ``peak_flops``. Padding tokens cost linear work.
* ``attention_s_per_sq_token``: the causal core-attention FLOPs (half the square), likewise, at
  ``attention_efficiency``. Only real tokens attend: THD kernels skip the padding between sequences.
* ``overhead_s``: fixed GPU time per micro-batch (per layer in the fitted profile); ``min_microbatch_s``: the
  floor -- a small input is bound by issuing a layer's kernels, not by the GPU.
* a CP member's share: slower linear work, attention in the ring's chunks (``cp_chunk_tokens``: the smaller the
  chunks, the larger their cost), a higher floor.

The numbers come from a :class:`~.cost_profiles.CostProfile` (:meth:`CostModel.from_model`; ``"fitted"`` -- fitted
to H100 timings, the default -- or ``"analytic"``, the earlier assumptions) or from a calibration file.
``docs/cost_model.md`` has the fit and its errors.

A DP rank's time is the sum of its micro-batch times when ``pp == 1``; with ``pp > 1`` each micro-batch costs
``t_mb / pp`` on every stage (layers split evenly, forward one third and backward two thirds) and the rank's
time is the makespan of a simulated 1F1B schedule (:func:`.pipeline_sim.simulate_1f1b`); interleaved pipelines
(``vpp > 1``) use the closed form ``sum(stage times) + (pp - 1) / vpp * mean(stage time)``. With expert parallelism
(``ep > 1``) the ranks of one EP group exchange tokens in every MoE layer, so they advance in lockstep: the
``j``-th micro-batch costs the maximum over the group's ranks (:meth:`CostModel.step_time`). The step time is the
slowest DP rank's time (every rank waits at the gradient all-reduce); the all-reduce and optimizer are the same for
every plan and are left out.

Context-parallel exchange (dynamic CP, :mod:`megatron_dynbatch.core.planner.dyncp`): the EXPOSED part of a group's
ring-attention K/V transfers::

    comm(g)  = (g - 1) * cp_comm_s_per_step + (g - 1) / g * padded_tokens * cp_comm_s_per_token
    exposed  = max(0, comm(g) - cp_comm_overlap * attention_time(g))

``cp_comm_s_per_token``: seconds to move one token's K and V of every layer, forward + backward (3x the forward
volume); ``cp_comm_s_per_step``: latency of one ring step of every layer pass; ``cp_comm_overlap``: the share of the
group's attention that hides the exchange. A group that crosses nodes (:mod:`.topology`) uses the ``*_inter_*``
numbers. The fixed-layout planner does not use the term (its CP groups never change); the dynamic-CP planner and its
benchmark score every plan with it. ``uncertainty``: the model's measured relative error, the planner's default
decision margin.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from .checks import as_float
from .cost_profiles import CostProfile, resolve_profile
from .errors import DynBatchConfigError
from .parallel import ParallelConfig
from .pipeline_sim import simulate_1f1b, simulate_1f1b_batch
from .smallops import np_sum

if TYPE_CHECKING:
    from .model_spec import ModelLike

#: bytes per element of the exchanged K/V (bf16)
KV_BYTES_PER_ELEMENT = 2


def kv_bytes_per_token(model: ModelLike) -> float:
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


#: optional keys of a cost-model file: the CP communication term (dynamic CP) ...
CP_COMM_KEYS = ("cp_comm_s_per_token", "cp_comm_s_per_step", "cp_comm_overlap")
#: ... its inter-node numbers ...
INTER_NODE_KEYS = ("cp_comm_inter_s_per_token", "cp_comm_inter_s_per_step")
#: ... and the floor, the CP-member terms and the model's uncertainty
EXTRA_KEYS = ("min_microbatch_s", "cp_min_microbatch_s", "cp_linear_overhead", "cp_chunk_tokens", "uncertainty")
#: every number a cost-model file may hold
FILE_KEYS = ("linear_s_per_token", "attention_s_per_sq_token", "overhead_s") + CP_COMM_KEYS + INTER_NODE_KEYS + \
    EXTRA_KEYS


@dataclass(frozen=True)
class CostModel:
    """Seconds per padded token, per squared real token and per micro-batch, on one GPU, forward + backward --
    plus the floor of a micro-batch, a CP member's extra costs and the CP communication (module docstring)."""

    linear_s_per_token: float
    attention_s_per_sq_token: float
    overhead_s: float = 2.0e-3
    pp: int = 1
    vpp: int = 1
    ep_group: int = 1
    #: layout context-parallel size the two coefficients above are expressed for (work per GPU = base / cp)
    cp: int = 1
    #: CP communication inside one node (module docstring); ``None`` = not set (dynamic CP then uses the model's
    #: defaults)
    cp_comm_s_per_token: Optional[float] = None
    cp_comm_s_per_step: Optional[float] = None
    cp_comm_overlap: Optional[float] = None
    #: the least seconds a micro-batch takes (issue-bound small inputs); a CP member's share adds the second
    min_microbatch_s: float = 0.0
    cp_min_microbatch_s: float = 0.0
    #: a CP member's (``g > 1``) linear work is this much slower; its attention costs like ``cp_chunk_tokens``
    #: more keys per token of the whole micro-batch, times ``(g - 1) / g``
    cp_linear_overhead: float = 0.0
    cp_chunk_tokens: float = 0.0
    #: CP communication of groups that cross nodes; ``None`` = as inside a node
    cp_comm_inter_s_per_token: Optional[float] = None
    cp_comm_inter_s_per_step: Optional[float] = None
    #: relative error of the model's step-time predictions: the planner's default decision margin
    uncertainty: float = 0.0

    def __post_init__(self) -> None:
        for name in ("linear_s_per_token", "attention_s_per_sq_token", "overhead_s") + EXTRA_KEYS:
            top = 1.0 if name == "uncertainty" else None
            object.__setattr__(self, name, as_float(getattr(self, name), f"cost_model.{name}", minimum=0.0,
                                                    maximum=top, fix="use CostModel.from_model(...) or "
                                                    "non-negative coefficients (docs/cost_model.md)"))
        for name in CP_COMM_KEYS + INTER_NODE_KEYS:
            v = getattr(self, name)
            if v is not None:
                top = 1.0 if name == "cp_comm_overlap" else None
                object.__setattr__(self, name, as_float(v, f"cost_model.{name}", minimum=0.0, maximum=top,
                                                        fix="use CostModel.from_model(...) or fit_cp_comm(...), "
                                                        "or None"))
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
        profile: Any = "analytic",
        kv_bytes_per_token: float = 0.0,
        num_layers: int = 0,
        **overrides: Any,
    ) -> "CostModel":
        """Build from forward FLOPs coefficients of the whole model (``linear*L + quadratic*L**2``) and a cost
        profile (:mod:`.cost_profiles`; default ``"analytic"``: this constructor knows no layer count unless
        ``num_layers`` is given, and the per-layer terms of other profiles need it).

        ``kv_bytes_per_token`` (K and V of one token in ALL layers, per TP rank) and ``num_layers`` give the
        context-parallel communication term (zero when they are 0). ``overrides``: profile fields
        (``linear_efficiency=0.5``, ...) and the older names ``cp_bandwidth_Bps`` (both networks),
        ``cp_latency_s`` (both) and ``overhead_s``."""
        p = parallel or ParallelConfig()
        prof = _with_overrides(resolve_profile(profile), overrides)
        for name, v in (("kv_bytes_per_token", kv_bytes_per_token), ("num_layers", num_layers)):
            as_float(v, name, minimum=0.0, fix="use the defaults of CostModel.from_model")
        layers = float(num_layers)
        # x3: forward + backward (backward = 2 x forward). The micro-batch time is expressed for the whole
        # pipeline depth (each stage takes t_mb / pp), so here the work is divided by tp*cp only.
        lin = 3.0 * linear_flops_per_token / (p.tp * p.cp) / (prof.peak_flops * prof.linear_efficiency)
        att = 3.0 * attention_flops_per_sq_token / (p.tp * p.cp) / (prof.peak_flops * prof.attention_efficiency)
        # ring attention: K/V forward, K/V and dK/dV backward -> 3x the forward volume; 2 ring passes per layer
        kv = 3.0 * float(kv_bytes_per_token)
        return cls(lin, att, prof.overhead_s + layers * prof.overhead_per_layer_s, pp=p.pp, vpp=p.vpp,
                   ep_group=max(1, p.ep), cp=p.cp,
                   cp_comm_s_per_token=kv / prof.intra_node_bandwidth_Bps,
                   cp_comm_s_per_step=2.0 * layers * prof.intra_node_latency_s,
                   cp_comm_overlap=prof.cp_comm_overlap,
                   min_microbatch_s=layers * prof.min_per_layer_s,
                   cp_min_microbatch_s=layers * prof.cp_min_per_layer_s,
                   cp_linear_overhead=prof.cp_linear_overhead, cp_chunk_tokens=prof.cp_chunk_tokens,
                   cp_comm_inter_s_per_token=kv / prof.inter_node_bandwidth_Bps,
                   cp_comm_inter_s_per_step=2.0 * layers * prof.inter_node_latency_s,
                   uncertainty=prof.uncertainty)

    @classmethod
    def from_model(cls, model: ModelLike, parallel: Optional[ParallelConfig] = None, *,
                   profile: Union[None, str, os.PathLike, CostProfile] = None,
                   **overrides: Any) -> "CostModel":
        """Build from a ``ModelSpec`` (or anything ``ModelSpec.from_any`` accepts) and a cost profile: ``None``
        (the default, ``"fitted"``), ``"analytic"`` (the pre-measurement assumptions), a
        :class:`~.cost_profiles.CostProfile` or a cost-model JSON file with a ``"profile"`` section. Per-layer
        terms count the model's layers (MTP depths included); the CP communication term comes from the model's
        K/V width (bf16, split over TP). ``overrides`` as in :meth:`from_flops`."""
        from .flops import flops_coefficients
        from .model_spec import ModelSpec

        spec = ModelSpec.from_any(model)
        c = flops_coefficients(spec)
        p = parallel or ParallelConfig()
        overrides.setdefault("kv_bytes_per_token", kv_bytes_per_token(spec) / p.tp)
        overrides.setdefault("num_layers", spec.num_layers + (spec.mtp_num_layers or 0))
        return cls.from_flops(c.linear, c.quadratic, p, profile=resolve_profile(profile), **overrides)

    @classmethod
    def tokens_only(cls, parallel: Optional[ParallelConfig] = None, overhead_s: float = 2.0e-3) -> "CostModel":
        """A model-free cost (1 us per token, no attention term) for planning without a ``ModelSpec``."""
        p = parallel or ParallelConfig()
        return cls(1e-6 / (p.tp * p.cp), 0.0, overhead_s, pp=p.pp, vpp=p.vpp, ep_group=max(1, p.ep), cp=p.cp)

    def with_layout(self, parallel: ParallelConfig) -> "CostModel":
        d = asdict(self)
        d.update(pp=parallel.pp, vpp=parallel.vpp, ep_group=max(1, parallel.ep), cp=parallel.cp)
        return CostModel(**d)

    @property
    def has_cp_comm(self) -> bool:
        """True when the three CP communication numbers are set (see :meth:`group_microbatch_time`)."""
        return None not in (self.cp_comm_s_per_token, self.cp_comm_s_per_step, self.cp_comm_overlap)

    def with_cp_comm(self, per_token: float, per_step: float, overlap: float,
                     inter_per_token: Optional[float] = None, inter_per_step: Optional[float] = None) -> "CostModel":
        """This model with the CP communication term replaced (inter-node numbers: ``None`` = as inside a node)."""
        d = asdict(self)
        d.update(cp_comm_s_per_token=float(per_token), cp_comm_s_per_step=float(per_step),
                 cp_comm_overlap=float(overlap), cp_comm_inter_s_per_token=inter_per_token,
                 cp_comm_inter_s_per_step=inter_per_step)
        return CostModel(**d)

    def to_dict(self) -> dict:
        return asdict(self)

    # ------------------------------------------------------------------ evaluation
    def _group_compute(self, g, padded_tokens, sq_tokens) -> Tuple[np.ndarray, np.ndarray]:
        """(work without overhead, attention part) of micro-batches on groups of ``g`` GPUs, each member's share."""
        t = np.asarray(padded_tokens, dtype=np.float64)
        if np.ndim(g) == 0:  # one group size (the planner's hot path): no per-element selection
            return self._one_size_compute(float(g), t, np.asarray(sq_tokens, dtype=np.float64))
        g = np.asarray(g, dtype=np.float64)
        scale = float(self.cp) / g
        member = g > 1
        lin = self.linear_s_per_token * t * scale
        if self.cp_linear_overhead:
            lin = lin * np.where(member, 1.0 + self.cp_linear_overhead, 1.0)
        att = self.attention_s_per_sq_token * np.asarray(sq_tokens, dtype=np.float64) * scale
        work = lin + att
        if self.cp_chunk_tokens:
            work = work + self.attention_s_per_sq_token * self.cp * self.cp_chunk_tokens * t * (g - 1.0) / g
        return work, att

    def _one_size_compute(self, g: float, t, sq):
        """:meth:`_group_compute` for one group size ``g``: elementwise float64 arithmetic only, so it is the same
        on NumPy arrays and on Python floats (:meth:`microbatch_time_of`)."""
        scale = float(self.cp) / g
        lin = self.linear_s_per_token * t * scale
        if self.cp_linear_overhead and g > 1:
            lin = lin * (1.0 + self.cp_linear_overhead)
        att = self.attention_s_per_sq_token * sq * scale
        work = lin + att
        if self.cp_chunk_tokens and g > 1:
            work = work + self.attention_s_per_sq_token * self.cp * self.cp_chunk_tokens * t * (g - 1.0) / g
        return work, att

    def _floor(self, g) -> np.ndarray:
        if np.ndim(g) == 0:
            return self.min_microbatch_s + (self.cp_min_microbatch_s if g > 1 else 0.0)
        return self.min_microbatch_s + np.where(np.asarray(g) > 1, self.cp_min_microbatch_s, 0.0)

    def work(self, padded_tokens, sq_tokens):
        """Compute seconds of micro-batches on the layout's own CP groups (no overhead, no floor), vectorised."""
        return self._group_compute(self.cp, padded_tokens, sq_tokens)[0]

    def microbatch_time(self, padded_tokens, sq_tokens):
        """Seconds of whole micro-batches on the layout's own CP groups (overhead and floor, no CP
        communication), vectorised."""
        t = self.overhead_s + self.work(padded_tokens, sq_tokens)
        floor = self._layout_floor
        return np.maximum(floor, t) if floor > 0 else t

    def microbatch_time_of(self, padded_tokens: int, sq_tokens: float) -> float:
        """:meth:`microbatch_time` of ONE micro-batch, in plain Python floats: the same operations on the same
        doubles, so the same result, for the per-step fast paths (where a NumPy call per micro-batch costs more
        than its arithmetic)."""
        t = self.overhead_s + self._one_size_compute(float(self.cp), float(padded_tokens), float(sq_tokens))[0]
        floor = self._layout_floor
        return max(floor, t) if floor > 0 else t

    @functools.cached_property
    def _layout_floor(self) -> float:
        """:meth:`_floor` of the layout's own CP group, once per model (the hot scalar path skips ``np.ndim``)."""
        return float(self._floor(self.cp))

    def cp_comm_time(self, group_size, padded_tokens, attention_s, spans_nodes=False):
        """Exposed K/V-exchange seconds of micro-batches on groups of ``group_size`` GPUs (vectorised; 0 for a
        group of one GPU, and 0 when the term is not set). ``spans_nodes``: the group crosses nodes
        (:mod:`.topology`), so its ring runs at the inter-node numbers."""
        g = np.asarray(group_size, dtype=np.float64)
        if not self.has_cp_comm:
            return np.zeros(np.broadcast(g, np.asarray(padded_tokens), np.asarray(attention_s)).shape)
        per_token, per_step = self.cp_comm_s_per_token, self.cp_comm_s_per_step
        if np.any(spans_nodes):
            inter_token = per_token if self.cp_comm_inter_s_per_token is None else self.cp_comm_inter_s_per_token
            inter_step = per_step if self.cp_comm_inter_s_per_step is None else self.cp_comm_inter_s_per_step
            per_token = np.where(spans_nodes, inter_token, per_token)
            per_step = np.where(spans_nodes, inter_step, per_step)
        comm = (g - 1.0) * per_step + (g - 1.0) / g * np.asarray(padded_tokens, dtype=np.float64) * per_token
        return np.maximum(comm - self.cp_comm_overlap * np.asarray(attention_s, dtype=np.float64), 0.0)

    def group_work(self, group_size, padded_tokens, sq_tokens, spans_nodes=False):
        """:meth:`group_microbatch_time` without the overhead and the floor: what a sample adds to a group's
        micro-batch (its solo time in the dynamic-CP planner). Vectorised."""
        work, att = self._group_compute(group_size, padded_tokens, sq_tokens)
        return work + self.cp_comm_time(group_size, padded_tokens, att, spans_nodes)

    def group_microbatch_time(self, group_size, padded_tokens, sq_tokens, spans_nodes=False):
        """Seconds, on each GPU of a group of ``group_size`` GPUs, of a micro-batch of ``padded_tokens`` (its
        full packed length) and ``sq_tokens`` (sum of squared real lengths) spread over the group: the member's
        linear and attention work (the coefficients are for the layout's ``cp``; CP-member terms for ``g > 1``),
        the per-micro-batch overhead, at least the floor, plus the exposed CP communication (inter-node numbers
        where ``spans_nodes``). Equal to :meth:`microbatch_time` plus the communication when the group is the
        layout's CP group. Vectorised."""
        work, att = self._group_compute(group_size, padded_tokens, sq_tokens)
        compute = np.maximum(self._floor(group_size), self.overhead_s + work)
        return compute + self.cp_comm_time(group_size, padded_tokens, att, spans_nodes)

    def pipeline_count_target(self, work_per_rank: float, bubble: float, group_size: Optional[int] = None) -> int:
        """The micro-batch count that minimises ``(M + bubble) * max(floor, overhead + w / M)`` (a pipeline's
        equal micro-batches on groups of ``group_size`` GPUs, default the layout's ``cp``): ``sqrt(bubble * w /
        overhead)``, but never past the count whose micro-batches shrink to the floor (splitting further only
        adds floor time). At least 1."""
        w = max(float(work_per_rank), 0.0)
        target = math.sqrt(bubble * w / self.overhead_s) if self.overhead_s > 0 else math.inf
        gap = float(self._floor(self.cp if group_size is None else group_size)) - self.overhead_s
        if gap > 0:
            target = min(target, w / gap)
        return max(1, int(math.ceil(target))) if math.isfinite(target) else 1

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

    def rank_time_of(self, mb_times: Sequence[float]) -> float:
        """:meth:`rank_time` of micro-batch times given as a list of Python floats, without NumPy below
        :data:`~.smallops.SEQUENTIAL_SUM` micro-batches (:func:`~.smallops.np_sum` sums as NumPy does; the 1F1B
        simulation is plain Python either way)."""
        if len(mb_times) == 0:
            return 0.0
        if self.pp == 1:
            return np_sum(mb_times)
        return self.pipeline_time_of([t / self.pp for t in mb_times])

    def pipeline_time_of(self, stage_times: Sequence[float]) -> float:
        """:meth:`rank_time_of` with ``pp > 1`` from the per-stage times (``t / pp``, in execution order; not
        empty): callers timing several orders of the same micro-batches divide once."""
        if self.vpp > 1:
            total = np_sum(stage_times)
            return total + (self.pp - 1) / self.vpp * (total / len(stage_times))  # NumPy's mean is sum / count
        return simulate_1f1b(stage_times, self.pp)

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
                    max_microbatches: int, group_size: Optional[int] = None) -> float:
        """A step-time bound no plan can beat: perfect balance of the unavoidable work (aligned tokens and real
        attention) over ``dp`` ranks, the fewest micro-batches the budget allows (each at least the floor), and,
        with ``pp > 1``, the 1F1B bubble of equal micro-batches at the best count. A sample cannot be split, so
        the rank holding the largest one takes at least that long. ``group_size``: the smallest CP group a
        micro-batch may run on (dynamic CP: 1, whose floor has no CP member's share); default the layout's."""
        w = total_work / dp
        floor = float(self._floor(self.cp if group_size is None else group_size))
        m_lo = max(1, min_microbatches)
        m_hi = max(m_lo, max_microbatches)
        single_mb = max(floor, max_sample_work + self.overhead_s)
        if self.pp == 1:
            return max(w + m_lo * self.overhead_s, m_lo * floor, single_mb)
        bubble = (self.pp - 1) / (self.vpp if self.vpp > 1 else 1)
        ms = np.arange(m_lo, min(m_hi, m_lo + 4096) + 1, dtype=np.float64)
        mean = np.maximum(floor, w / ms + self.overhead_s)
        # interleaved: the closed form's bubble is (pp - 1) / vpp mean stage times; 1F1B: at least pp - 1 stage
        # times of the first and the last micro-batch, each no shorter than the smallest micro-batch can be
        edge = mean if self.vpp > 1 else max(floor, self.overhead_s)
        best = float(((ms * mean + bubble * edge) / self.pp).min())
        single = (single_mb + bubble * (single_mb if self.vpp > 1 else max(floor, self.overhead_s))) / self.pp
        return max(best, single)


def _with_overrides(profile: CostProfile, overrides: Dict[str, Any]) -> CostProfile:
    """``profile`` with keyword overrides (profile field names; ``cp_bandwidth_Bps`` / ``cp_latency_s`` set both
    networks, as before the topology split)."""
    if not overrides:
        return profile
    kw = dict(overrides)
    if "cp_bandwidth_Bps" in kw:
        bw = kw.pop("cp_bandwidth_Bps")
        kw.setdefault("intra_node_bandwidth_Bps", bw)
        kw.setdefault("inter_node_bandwidth_Bps", bw)
    if "cp_latency_s" in kw:
        lat = kw.pop("cp_latency_s")
        kw.setdefault("intra_node_latency_s", lat)
        kw.setdefault("inter_node_latency_s", lat)
    return profile.replace(**kw)


#: What a cost-model option accepts (:func:`~.cost_files.resolve_cost_model`): a ``CostModel``, a profile name
#: (``"fitted"``, ``"analytic"``), a cost-model JSON file, or ``None`` (the default profile)
CostModelLike = Union[CostModel, str, os.PathLike, None]
