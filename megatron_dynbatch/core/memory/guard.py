"""The online memory guard's state: each training step's measured peak in, the next step's token budget out.

Why between steps
-----------------
A CUDA out-of-memory error in the middle of a step cannot be recovered: the other ranks are already inside the
step's collectives and would wait for the rank that left (``docs/tuning.md``, section 2). So the guard never
reacts inside a step. It watches what every step really used and chooses the budget of the NEXT step so that its
predicted peak stays under the headroom -- lowering the budget before a step whose plan would cross it, raising it
back only as far as measured steps support.

The model it refits
-------------------
One GPU of pipeline stage ``s`` running a training step holds (allocator bytes, the reserve excluded)::

    base_s + max(workspace + k_s x T x per_token_s,  optimizer step temporaries_s)

* ``base_s`` -- what is resident when the step starts (weights, gradients, optimizer state). MEASURED: the peak
  reader's ``base`` (allocated bytes before the step), the largest over the stage's ranks and the recent window;
  the memory model's static bytes (:func:`~.peak.stage_terms`) until a step has been measured;
* ``per_token_s``, ``workspace``, the optimizer step's temporaries -- the memory model's (the profile: analytic,
  or calibrated by ``megatron-dynbatch calibrate``), the same stage terms the ``auto`` budget uses;
* ``k_s`` -- the per-token scale refitted from real steps: the profile's per-token terms are replaced by ``k_s``
  times themselves. A measured step gives the reading ``k = (peak - base - workspace) / (T x per_token_s)``, with
  ``T`` the step's tokens per GPU in flight on stage ``s`` (:func:`stage_tokens`: the largest mean over the
  windows of micro-batches the stage holds at once -- never more than the step held, so a reading never
  understates the slope).

The fit and the budget
----------------------
* **Refit with a prior**: ``k_s = (prior_steps x 1 + sum of the window's readings) / (prior_steps + n)`` -- the
  profile is the prior, worth ``prior_steps`` steps, so one noisy step moves the fit by at most
  ``1 / (prior_steps + 1)`` of its deviation;
* **the budget is planned with the safe scale** ``max(k_s, the largest reading in the window)``: a measured peak
  is memory the step really used, never averaged away -- a high reading lowers the budget before the next step,
  a low one raises it only through the prior-weighted fit, slowly;
* **fit budget**: the largest ``T``, a multiple of ``multiple``, whose predicted peak on every stage is at most
  ``usable = card x (1 - headroom) - reserve`` (the settings' headroom and reserve, as for the ``auto`` budget);
* **lowering**: when the fit budget (capped by ``ceiling``) is under the current budget, the budget drops to it --
  before the next step -- never under ``floor`` (the longest sample must still fit: a budget below it would stop
  training; at the floor the guard says so in its log);
* **raising**: toward the fit budget, at most to ``(1 + max_raise)`` x the largest tokens per GPU a measured step
  ran within ``usable`` -- never above what the steps seen so far justify -- and never above ``ceiling`` (default:
  the start budget);
* a reading enters the slope only from a step that filled at least ``min_fill`` of the budget, or crossed
  ``usable`` (a small step's fixed costs would look like a huge cost per token); the first ``skip_steps`` steps
  are not observed (optimizer state is allocated lazily in the first step, the allocator warms up);
* **before the first step** the start budget is lowered if the model alone predicts it crosses ``usable``.

Every rank must decide alike: readings are merged before they are observed -- the maximum over the ranks of each
stage, one all-reduce (MAX) of the ``2 x pp`` vector of :func:`reading_vector` (:mod:`megatron_dynbatch.megatron.
memory_guard`; :func:`merge_readings` for a driver that collects them) -- so every rank sees the same merged
vector and plans the next step with the same budget, with no other communication. A reading a rank cannot trust
(not finite, negative, over :data:`~.profile.MAX_BYTES`) is sent as "not measured" by :func:`reading_vector`
instead of raised: an error on one rank before a collective would leave the others waiting in it.

Each change is one log line (:meth:`GuardChange.line`) and an entry of ``history``. The math is untouched: the
budget only regroups later batches, and the planner keeps it as a hard limit. Pure Python + NumPy, deterministic.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..checks import MAX_TOKENS, as_float, as_int
from ..errors import DynBatchConfigError
from ..model_spec import ModelLike, ModelSpec
from ..parallel import ParallelConfig, ParallelLike
from .budget import DEFAULT_MULTIPLE, MAX_GPU_MEMORY_GB
from .peak import StageTerms, _units, check_pass, stage_terms
from .profile import MAX_BYTES
from .settings import GiB, MemorySettings, MemorySettingsLike

if TYPE_CHECKING:
    from ..planner.options import PlanOptions
    from ..planner.plan_kind import PlanKind

#: what a stage's slots of a reading vector hold when none of its ranks measured
MISSING = -1.0
DEFAULT_WINDOW = 20
DEFAULT_PRIOR_STEPS = 4.0
DEFAULT_MAX_RAISE = 0.10
DEFAULT_MIN_FILL = 0.5
MAX_CARD_BYTES = MAX_GPU_MEMORY_GB * GiB

__all__ = ["MemoryGuard", "GuardChange", "reading_vector", "largest_peak", "merge_readings", "stage_tokens", "MISSING",
           "DEFAULT_WINDOW", "DEFAULT_PRIOR_STEPS", "DEFAULT_MAX_RAISE", "DEFAULT_MIN_FILL"]


def _good_bytes(value: Any) -> bool:
    """A number of bytes: an int or float (Python or NumPy; not a bool, not a string), finite, in [0, MAX_BYTES]."""
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_)):
        return False
    return math.isfinite(float(value)) and 0.0 <= float(value) <= MAX_BYTES


def reading_vector(pp: int, stage: int, base_bytes: Any, peak_bytes: Any) -> Tuple[np.ndarray, bool]:
    """One rank's reading as the ``2 x pp`` vector every rank all-reduces with MAX: ``[base_0, peak_0, base_1,
    ...]``, :data:`MISSING` except this rank's ``stage``. A reading that cannot be trusted (not finite, negative,
    over :data:`~.profile.MAX_BYTES`, a peak under the base) leaves the vector all :data:`MISSING` and returns
    ``False`` -- never raised: the other ranks are about to meet this one in the all-reduce."""
    pp = as_int(pp, "pp", minimum=1, maximum=1 << 16, fix="pass the pipeline-parallel size")
    stage = as_int(stage, "stage", minimum=0, maximum=pp - 1, fix=f"pass this rank's pipeline stage (< {pp})")
    vec = np.full(2 * pp, MISSING, dtype=np.float64)
    ok = _good_bytes(base_bytes) and _good_bytes(peak_bytes) and float(peak_bytes) >= float(base_bytes)
    if ok:
        vec[2 * stage], vec[2 * stage + 1] = float(base_bytes), float(peak_bytes)
    return vec, ok


def largest_peak(vector: Optional[np.ndarray]) -> Optional[float]:
    """The largest measured peak (bytes) in a :func:`reading_vector` -- one rank's, or a merge of several -- or
    ``None`` when no stage was measured (or no vector was given)."""
    if vector is None:
        return None
    peaks = np.asarray(vector, dtype=np.float64)[1::2]
    peaks = peaks[peaks >= 0]  # MISSING (-1): a stage not measured
    return float(peaks.max()) if peaks.size else None


def merge_readings(vectors: Sequence[Any]) -> np.ndarray:
    """The element-wise maximum of reading vectors (what the all-reduce MAX computes; for a driver that collects
    the ranks' vectors itself, e.g. a Ray trainer's). ``None`` entries are skipped; all vectors have one length."""
    arrs = [np.asarray(v, dtype=np.float64).reshape(-1) for v in vectors if v is not None]
    if not arrs:
        raise DynBatchConfigError("readings", [], "no rank sent a reading vector",
                                  "pass the reading_vector(...) of every rank (ShardResult.memory)")
    if len({a.size for a in arrs}) != 1 or arrs[0].size % 2:
        raise DynBatchConfigError("readings", sorted({a.size for a in arrs}), "the vectors differ in length or are "
                                  "not 2 x pp long", "build every rank's vector with reading_vector(pp, ...)")
    return np.max(np.stack(arrs), axis=0)


def stage_tokens(plan: PlanKind, num_layers: int, step: Optional[int] = None) -> List[int]:
    """Tokens per GPU in flight on each pipeline stage during (optimizer step ``step`` of) ``plan``: the largest
    mean, over the ranks and over every window of consecutive micro-batches, of the micro-batches stage ``s``
    holds at once (1F1B: ``pp - s`` of them; interleaved: the model's chunk count over ``vpp``) -- the ``T`` a
    measured peak is read against. Never more than the step's largest micro-batch per GPU."""
    from ..planner.plan_kind import PlanKind

    if not isinstance(plan, PlanKind):
        raise DynBatchConfigError("plan", type(plan).__name__, "is not a plan", "pass the Plan the step ran")
    par, rows = plan.parallel, plan.microbatch_tokens
    layers = as_int(num_layers, "num_layers", minimum=1, fix="pass the model's decoder layers")
    per_step = list(plan.microbatches_per_step or [len(rows[0]) if rows else 0])
    if step is None:
        start, stop = 0, sum(per_step)
    else:
        step = as_int(step, "step", minimum=0, maximum=max(0, len(per_step) - 1), fix="pass a step of the plan")
        start = sum(per_step[:step])
        stop = start + per_step[step]
    div = plan.gpus_per_entry  # a dynamic-CP plan's tokens are per GPU already
    out = []
    for s in range(par.pp):
        window = max(1, int(math.ceil(_units(par, layers, s) * par.pp / layers - 1e-9)))
        best = 0.0
        for row in rows:
            t = np.asarray(row[start:stop], dtype=np.float64) / div
            if t.size == 0:
                continue
            w = min(window, t.size)
            means = np.convolve(t, np.full(w, 1.0 / w), mode="valid")
            best = max(best, float(means.max()))
        out.append(int(math.floor(best)))
    return out


def _size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps a figure >= 1 (GiB on a GPU, MiB / KiB for tiny CPU models)."""
    for unit, scale in (("GiB", GiB), ("MiB", float(1 << 20)), ("KiB", 1024.0)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


@dataclass(frozen=True)
class GuardChange:
    """One budget change (or, ``reason == "floor"``, a change the floor stopped). ``step``: the optimizer steps
    observed when it was decided (0: before the first step); bytes are allocator bytes (reserve excluded)."""

    step: int
    old_budget: int
    new_budget: int
    reason: str                 # "lowered", "raised" or "floor"
    usable_bytes: float
    predicted_peak_bytes: float  # at the new budget, the limiting stage
    stage: int                  # the limiting stage
    scale: float                # the limiting stage's safe per-token scale (x the memory model's)
    fit_budget: int             # the largest budget whose predicted peak fits (0: none)
    measured_peak_bytes: Optional[float] = None
    measured_tokens: Optional[int] = None
    measured_stage: Optional[int] = None

    def line(self) -> str:
        """The log line, e.g. ``dynbatch memory guard | step 12 | budget 16384 -> 13824 tokens per GPU
        (lowered) | measured peak 70.1 GiB at 16384 tokens per GPU on stage 0 | ...``."""
        when = "before step 1" if self.step == 0 else f"step {self.step}"
        what = {"lowered": "lowered", "raised": "raised as far as measured steps support",
                "floor": f"at the floor, over the {self.fit_budget} that fit: the longest sample must fit"}[self.reason]
        parts = [f"dynbatch memory guard | {when} | budget {self.old_budget} -> {self.new_budget} tokens per GPU "
                 f"({what})"]
        if self.measured_peak_bytes is not None:
            parts.append(f"measured peak {_size(self.measured_peak_bytes)} at {self.measured_tokens} tokens per GPU "
                         f"on stage {self.measured_stage}")
        else:
            parts.append("no step measured yet: the memory model's prediction")
        parts.append(f"predicted peak {_size(self.predicted_peak_bytes)} of {_size(self.usable_bytes)} usable on "
                     f"stage {self.stage} | per-token slope {self.scale:.3g}x the memory model")
        return " | ".join(parts)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


class MemoryGuard:
    """The guard's state (module docstring).

    ``start_budget``: the budget the options hold (``max_tokens_per_gpu``); ``card_bytes``: the GPU's memory in
    bytes (``torch.cuda.get_device_properties(d).total_memory``); ``model`` / ``parallel``: what the planner plans;
    ``settings`` (:class:`~.settings.MemorySettings`: headroom, reserve, optimizer, recompute, ...) and ``profile``
    (``None``: analytic; a :class:`~.profile.MemoryProfile` or a cost-model file with a ``memory`` section): the
    memory model, the prior. ``floor`` (default ``multiple``): the budget never goes under it -- pass what the
    longest sample needs; ``ceiling`` (default ``start_budget``): never over it. ``log``: where change lines go
    (``None``: nowhere). ``pass_``: the memory model of a training step (``"train"``, the guard's) or of a
    forward-only log-prob pass (``"log_prob"``: what the first-step probe of :mod:`megatron_dynbatch.megatron.
    probe` refits for that pass)."""

    def __init__(self, start_budget: Any, card_bytes: Any, *, model: ModelLike, parallel: ParallelLike = None,
                 settings: MemorySettingsLike = None, profile: Any = None, floor: Any = None, ceiling: Any = None,
                 multiple: Any = DEFAULT_MULTIPLE, window: Any = DEFAULT_WINDOW,
                 prior_steps: Any = DEFAULT_PRIOR_STEPS, max_raise: Any = DEFAULT_MAX_RAISE,
                 min_fill: Any = DEFAULT_MIN_FILL, skip_steps: Any = 1,
                 log: Optional[Callable[[str], None]] = None, pass_: str = "train") -> None:
        self.start_budget = as_int(start_budget, "max_tokens_per_gpu", minimum=1,
                                   fix="start the guard from the budget the options hold (an integer >= 1)")
        self.card_bytes = as_float(card_bytes, "card_bytes", minimum=1.0, maximum=MAX_CARD_BYTES,
                                   fix="pass the GPU's memory in bytes (torch.cuda.get_device_properties(0)."
                                       "total_memory; about 8.5e10 for an H100 80GB)")
        self.model = ModelSpec.from_any(model)
        self.parallel = ParallelConfig.from_any(parallel)
        self.settings = MemorySettings.from_any(settings)
        self.multiple = as_int(multiple, "multiple", minimum=1, maximum=1 << 20, fix="pass a token multiple, e.g. 256")
        self.window = as_int(window, "window", minimum=1, maximum=10 ** 6, fix="pass the steps to remember, e.g. 20")
        self.prior_steps = as_float(prior_steps, "prior_steps", minimum=0.0, maximum=1e6,
                                    fix="pass how many steps the memory model's prior is worth, e.g. 4")
        self.max_raise = as_float(max_raise, "max_raise", minimum=0.0, maximum=10.0,
                                  fix="pass the largest raise over the measured tokens, e.g. 0.1 (10%)")
        self.min_fill = as_float(min_fill, "min_fill", minimum=0.0, maximum=1.0,
                                 fix="pass the budget share a step must fill to refit the slope, e.g. 0.5")
        self.skip_steps = as_int(skip_steps, "skip_steps", minimum=0, maximum=10 ** 9, fix="pass e.g. 1")
        self.floor = self.multiple if floor is None else as_int(
            floor, "floor", minimum=1, maximum=self.start_budget,
            fix=f"pass the budget the longest sample needs (at most the start budget {self.start_budget})")
        self.ceiling = self.start_budget if ceiling is None else as_int(
            ceiling, "ceiling", minimum=self.start_budget,
            fix=f"pass the largest budget the guard may raise to (at least the start budget {self.start_budget})")
        self.log = log
        self.pass_ = check_pass(pass_)
        terms, prof = stage_terms(self.model, self.parallel, pass_=self.pass_, settings=self.settings, profile=profile)
        self.terms: List[StageTerms] = terms
        self.profile_source = prof.source
        reserve = self.settings.reserve_gb * GiB
        self.usable_bytes = self.card_bytes * (1.0 - self.settings.headroom) - reserve
        if self.usable_bytes <= 0:
            raise DynBatchConfigError(
                "card_bytes", self.card_bytes, f"leaves nothing usable after the {self.settings.headroom:.0%} headroom "
                f"and the {self.settings.reserve_gb:g} GiB reserve", "pass the card's memory in BYTES (not GiB: 80 GiB "
                "is 80 * 2**30), or lower settings.reserve_gb / settings.headroom")
        pp = self.parallel.pp
        self._bases: List[Deque[float]] = [deque(maxlen=self.window) for _ in range(pp)]
        self._readings: List[Deque[float]] = [deque(maxlen=self.window) for _ in range(pp)]
        self.steps = 0
        self.skipped = 0
        self.unmeasured = 0
        self.seen_tokens = 0
        self.last_peak_bytes: Optional[float] = None
        self.last_stage: Optional[int] = None
        self.last_tokens: Optional[int] = None
        self.history: List[GuardChange] = []
        self.budget = self.start_budget
        self._at_floor = False
        self._decide(None)

    @classmethod
    def for_options(cls, options: PlanOptions, card_bytes: Any, **kwargs: Any) -> "MemoryGuard":
        """A guard starting from a :class:`~megatron_dynbatch.core.planner.options.PlanOptions`' budget, model
        and layout (``kwargs`` as for the constructor)."""
        model = getattr(options, "model", None)
        if model is None:
            raise DynBatchConfigError("model", None, "the memory guard needs the model's shape (its memory model)",
                                      "plan with model=ModelSpec/dict/preset name (a Megatron launch reads it from "
                                      "the model flags)")
        return cls(getattr(options, "max_tokens_per_gpu", None), card_bytes, model=model,
                   parallel=getattr(options, "parallel", None), **kwargs)

    # ------------------------------------------------------------------ the model, refitted
    def scales(self) -> np.ndarray:
        """Per stage: the refitted per-token scale (the profile's per-token terms x this; 1.0 = the model)."""
        out = np.ones(len(self.terms))
        for s, r in enumerate(self._readings):
            if r:
                out[s] = (self.prior_steps * 1.0 + float(sum(r))) / (self.prior_steps + len(r))
        return out

    def safe_scales(self) -> np.ndarray:
        """Per stage: the scale the budget is planned with -- the larger of the fit and the window's largest
        reading (module docstring)."""
        out = self.scales()
        for s, r in enumerate(self._readings):
            if r:
                out[s] = max(out[s], max(r))
        return out

    def slopes(self) -> List[float]:
        """Per stage: the refitted bytes per token (the profile's per-token bytes x :meth:`scales`)."""
        return [float(k * t.per_token) for k, t in zip(self.scales(), self.terms, strict=True)]

    def bases(self) -> List[float]:
        """Per stage: resident bytes at a step's start -- measured (the window's largest), else the model's."""
        return [max(b) if b else t.static for b, t in zip(self._bases, self.terms, strict=True)]

    def stage_peaks(self, tokens: Any) -> List[float]:
        """Per stage: the predicted allocator peak (bytes, reserve excluded) at ``tokens`` per GPU -- one number
        for every stage, or one per stage -- with the safe scales."""
        ts = self._tokens_per_stage(tokens, "tokens")
        return [b + max(t.workspace + k * n * t.per_token, t.step)
                for b, k, n, t in zip(self.bases(), self.safe_scales(), ts, self.terms, strict=True)]

    def predicted_peak_bytes(self, tokens: Any) -> float:
        """The highest stage's predicted allocator peak at ``tokens`` per GPU (:meth:`stage_peaks`)."""
        return max(self.stage_peaks(tokens))

    def predict_plan(self, plan: PlanKind, step: Optional[int] = None) -> float:
        """The predicted peak of (step ``step`` of) ``plan``: every stage at its tokens in flight."""
        return self.predicted_peak_bytes(stage_tokens(plan, self.model.num_layers, step))

    def fit_budget(self) -> Tuple[int, int]:
        """The largest budget (a multiple of ``multiple``; 0 when none fits) whose predicted peak is at most
        ``usable_bytes`` on every stage, and the limiting stage."""
        fits = []
        for b, k, t in zip(self.bases(), self.safe_scales(), self.terms, strict=True):
            free = self.usable_bytes - b
            if free <= 0 or t.step > free or free < t.workspace:
                fits.append(0.0)
                continue
            slope = k * t.per_token
            fits.append(math.inf if slope <= 0 else (free - t.workspace) / slope)
        stage = int(np.argmin(fits))
        exact = fits[stage]
        tokens = MAX_TOKENS if exact >= MAX_TOKENS else int(math.floor(exact))
        tokens = (tokens // self.multiple) * self.multiple
        while tokens > 0 and self.predicted_peak_bytes(tokens) > self.usable_bytes:  # float rounding
            tokens -= self.multiple
        return max(0, tokens), stage

    # ------------------------------------------------------------------ observing a step
    def observe(self, readings: Any, plan: Optional[PlanKind] = None, *, tokens: Any = None,
                step: Optional[int] = None) -> Optional[GuardChange]:
        """Observe one finished training step and choose the next step's budget (returned change, or ``None``).

        ``readings``: the MERGED reading vector (:func:`reading_vector` of every rank, maximum over ranks:
        ``[base_0, peak_0, ..., base_{pp-1}, peak_{pp-1}]``, :data:`MISSING` where a stage was not measured).
        The step's tokens per GPU in flight: from ``plan`` (and its optimizer ``step``; :func:`stage_tokens`),
        or ``tokens`` (one number for every stage, or one per stage). Call it on every rank with the same
        merged vector: the decision is then the same everywhere."""
        vec = self._check_vector(readings)
        if plan is not None:
            ts = stage_tokens(plan, self.model.num_layers, step)
        elif tokens is not None:
            ts = self._tokens_per_stage(tokens, "tokens")
        else:
            raise DynBatchConfigError("plan", None, "the guard needs the step's tokens per GPU",
                                      "pass the plan the step ran (or tokens=...)")
        self.steps += 1
        if self.steps <= self.skip_steps:
            self.skipped += 1
            return None
        pairs = [(s, vec[2 * s], vec[2 * s + 1]) for s in range(len(self.terms))
                 if vec[2 * s] != MISSING and vec[2 * s + 1] != MISSING]
        if not pairs:
            self.unmeasured += 1
            return None
        crossed = False
        for s, base, peak in pairs:
            t, n = self.terms[s], ts[s]
            self._bases[s].append(float(base))
            over = peak > self.usable_bytes
            crossed = crossed or over
            if n > 0 and t.per_token > 0 and (over or n >= self.min_fill * self.budget):
                self._readings[s].append(max(0.0, (peak - base - t.workspace) / (n * t.per_token)))
        s_max, _, p_max = max(pairs, key=lambda x: x[2])
        self.last_peak_bytes, self.last_stage, self.last_tokens = float(p_max), int(s_max), int(ts[s_max])
        if not crossed:
            self.seen_tokens = max(self.seen_tokens, int(max(ts)))
        return self._decide((float(p_max), int(ts[s_max]), int(s_max)))

    def _decide(self, measured: Optional[Tuple[float, int, int]]) -> Optional[GuardChange]:
        fit, stage = self.fit_budget()
        target = min(self.ceiling, fit)
        old = self.budget
        if target < old:
            new = max(self.floor, target)
            reason = "lowered" if new == target else "floor"
            if new == old and self._at_floor:  # already said so
                return None
            self._at_floor = reason == "floor"
        elif target > old and self.seen_tokens > 0:
            support = int(math.floor((1.0 + self.max_raise) * self.seen_tokens))
            new, reason = min(target, max(old, support)), "raised"
            if new == old:
                return None
            self._at_floor = False
        else:
            return None
        self.budget = int(new)
        peaks = self.stage_peaks(self.budget)
        lim = int(np.argmax(peaks))
        peak, tokens, where = measured or (None, None, None)
        change = GuardChange(self.steps, old, self.budget, reason, self.usable_bytes, float(peaks[lim]), lim,
                             float(self.safe_scales()[lim]), int(fit), peak, tokens, where)
        self.history.append(change)
        if self.log is not None:
            self.log(change.line())
        return change

    # ------------------------------------------------------------------ using it
    def options(self, options: PlanOptions) -> PlanOptions:
        """``options`` with the guard's budget: ``options.replace(max_tokens_per_gpu=budget)``."""
        if not hasattr(options, "replace"):
            raise DynBatchConfigError("options", type(options).__name__, "must be a PlanOptions",
                                      "pass the PlanOptions the step plans with")
        return options.replace(max_tokens_per_gpu=self.budget)

    def to_dict(self) -> Dict[str, Any]:
        """The state in numbers (JSON-friendly)."""
        return {"budget": self.budget, "start_budget": self.start_budget, "floor": self.floor, "ceiling": self.ceiling,
                "card_bytes": self.card_bytes, "usable_bytes": self.usable_bytes, "steps": self.steps,
                "skipped": self.skipped, "unmeasured": self.unmeasured, "seen_tokens": self.seen_tokens,
                "scales": self.scales().tolist(), "safe_scales": self.safe_scales().tolist(),
                "slopes": self.slopes(), "bases": self.bases(), "profile": self.profile_source,
                "last_peak_bytes": self.last_peak_bytes, "changes": [c.to_dict() for c in self.history]}

    # ------------------------------------------------------------------ checks
    def _check_vector(self, readings: Any) -> np.ndarray:
        pp = len(self.terms)
        try:
            vec = np.asarray(readings, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise DynBatchConfigError("readings", type(readings).__name__, "is not a vector of numbers",
                                      "pass the merged reading_vector(...) of the ranks") from None
        if vec.size != 2 * pp:
            raise DynBatchConfigError("readings", f"{vec.size} numbers", f"needs 2 x pp = {2 * pp} (base and peak "
                                      "bytes of every pipeline stage)", "build it with reading_vector(pp, ...)")
        bad = [float(v) for v in vec if v != MISSING and not _good_bytes(v)]
        if bad:
            raise DynBatchConfigError("readings", bad[0], f"must be bytes in [0, {MAX_BYTES:g}] or {MISSING:g} (not "
                                      "measured)", "send unreadable readings as MISSING (reading_vector does)")
        for s in range(pp):
            b, p = vec[2 * s], vec[2 * s + 1]
            if (b == MISSING) != (p == MISSING) or p < b:
                raise DynBatchConfigError("readings", [float(b), float(p)], f"stage {s}'s base and peak do not match "
                                          "(one missing, or a peak under the base)", "build it with reading_vector")
        return vec

    def _tokens_per_stage(self, tokens: Any, field: str) -> List[float]:
        pp = len(self.terms)
        if np.ndim(tokens) == 0:
            tokens = [tokens] * pp
        vals = list(np.asarray(tokens, dtype=object).reshape(-1))
        if len(vals) != pp:
            raise DynBatchConfigError(field, len(vals), f"needs one token count, or one per pipeline stage ({pp})",
                                      "pass tokens per GPU")
        return [as_float(v, field, minimum=0.0, maximum=float(MAX_TOKENS), fix="pass tokens per GPU, e.g. 16384")
                for v in vals]
