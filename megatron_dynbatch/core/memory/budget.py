"""The budget that chooses itself: :func:`choose_budget` -> :class:`BudgetChoice`.

The largest ``max_tokens_per_gpu`` whose predicted peak (:mod:`.peak`, reserve included) fits the card minus the
stated headroom::

    usable   = gpu_memory_gb x GiB x (1 - headroom)
    budget_s = (usable - reserve - static_s - workspace) / per_token_s        for every pipeline stage s
    budget   = min_s budget_s, rounded down to ``multiple``

(each stage's peak is linear in the tokens, so this is exact; the result is checked against
:func:`~.peak.peak_memory` once more). The optimizer step's temporaries must fit too. A card that cannot hold
the model at all -- or not ``multiple`` tokens -- raises a ``DynBatchConfigError`` naming what to change
(tensor / pipeline / expert parallelism, full recompute, the distributed optimizer, optimizer CPU offload), in
the order that applies to the settings given.

Pure and deterministic: the same inputs give the same budget on every rank, so every rank plans with the same
one. Fast (a few stage terms, no search): well under 50 ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ..checks import MAX_TOKENS, as_float, as_int
from ..errors import DynBatchConfigError
from ..model_spec import ModelLike, ModelSpec
from ..parallel import ParallelConfig
from .loss_paths import REFERENCE_BYTES, loss_path, loss_path_bytes
from .peak import MemoryBreakdown, StageTerms, breakdown_of, check_pass, stage_terms
from .settings import GiB, MemorySettings, MemorySettingsLike

if TYPE_CHECKING:
    from ..parallel import ParallelLike

#: largest card accepted (GiB): far above any accelerator, small enough that the arithmetic stays exact
MAX_GPU_MEMORY_GB = float(1 << 20)
DEFAULT_MULTIPLE = 256


@dataclass(frozen=True)
class BudgetChoice:
    """The chosen budget and why. ``tokens_per_gpu`` is the ``max_tokens_per_gpu`` to plan with (a micro-batch
    then holds at most ``tokens_per_gpu x cp`` tokens); ``breakdown`` the predicted peak there; ``exact_tokens``
    the unrounded largest fit; ``limiting_stage`` the pipeline stage that runs out first, ``limited_by`` its
    largest per-token term."""

    tokens_per_gpu: int
    pass_: str
    gpu_memory_gb: float
    usable_bytes: float
    exact_tokens: int
    multiple: int
    cp: int
    limiting_stage: int
    settings: MemorySettings
    breakdown: MemoryBreakdown
    limited_by: str
    tp: int = 1

    @property
    def tokens_per_microbatch(self) -> int:
        return self.tokens_per_gpu * self.cp

    @property
    def loss(self) -> str:
        """The loss path counted: the trainer's (:mod:`.loss_paths`) or the fp32 copies set."""
        copies = self.settings.fp32_copies(self.pass_)
        if copies is not None:
            return f"loss with {copies} fp32 logits copies (set)"
        path = loss_path(self.settings.trainer, self.pass_, self.settings.loss_options(), tp=self.tp)
        return f"{self.settings.trainer}'s loss {path.column_bytes:g} B x T x V/tp"

    def to_dict(self) -> Dict[str, Any]:
        return {"max_tokens_per_gpu": self.tokens_per_gpu, "tokens_per_microbatch": self.tokens_per_microbatch,
                "pass": self.pass_, "gpu_memory_gb": self.gpu_memory_gb, "usable_gb": self.usable_bytes / GiB,
                "headroom": self.settings.headroom, "exact_tokens": self.exact_tokens, "multiple": self.multiple,
                "limiting_stage": self.limiting_stage, "limited_by": self.limited_by, "trainer": self.settings.trainer,
                "loss_path": self.loss,
                "predicted_peak_gb": self.breakdown.peak_gb,
                "settings": self.settings.to_dict(), "breakdown": self.breakdown.to_dict()}

    def summary(self) -> str:
        """One screen: the budget, the limiting stage's static / activations / logits / workspace / reserve, the
        headroom and what limits it."""
        what = "training" if self.pass_ == "train" else "log-prob"
        st = self.settings
        b = self.breakdown
        head = (f"{what} budget: {self.tokens_per_gpu} tokens per GPU (a micro-batch holds {self.tokens_per_gpu} x "
                f"cp {self.cp} = {self.tokens_per_microbatch}); predicted peak {b.peak_gb:.1f} of "
                f"{self.gpu_memory_gb:g} GiB ({self.usable_bytes / GiB:.1f} usable, {st.headroom:.0%} headroom)")
        lines = [head] + b.lines(self.limiting_stage)[1:]
        lines.append(f"  {'headroom':<14} {(self.gpu_memory_gb * GiB - self.usable_bytes) / GiB:8.2f} GiB  "
                     "left free for allocator fragmentation")
        lines.append(f"  limited by: {self.limited_by} on stage {self.limiting_stage} (optimizer {st.optimizer}, "
                     f"recompute {st.recompute}, {self.loss}, {b.profile_source} memory profile)")
        return "\n".join(lines)


#: cards whose marketing size in GB is a round number a user may type for GiB: GB -> (card, GiB torch reports)
KNOWN_CARDS = {80: ("an H100 80GB", 79.1), 141: ("an H200", 139.8)}
#: above this many GiB a card size is taken for bytes or MiB (no accelerator has 4 TiB)
MAX_PLAUSIBLE_GB = 4096.0

#: the words of :func:`choose_budget`'s fixes (Python keywords) at the entry points: ``"cli"`` (``plan`` and
#: ``budget``) and ``"megatron"`` (a launch's flags), for :func:`~megatron_dynbatch.core.errors.trainer_terms`
FIX_WORDS = {
    "cli": {'recompute="full"': "--recompute full", 'optimizer="distributed"': "--optimizer distributed",
            'optimizer="cpu_offload"': "--optimizer cpu_offload", "parallel.tp": "--tp", "parallel.pp": "--pp",
            "parallel.cp": "--cp", "parallel.ep": "--ep", "gpu_memory_gb": "--gpu-memory-gb"},
    "megatron": {'recompute="full"': "--recompute-granularity full",
                 'optimizer="distributed"': "--use-distributed-optimizer",
                 'optimizer="cpu_offload"': "--optimizer-cpu-offload",
                 "parallel.tp": "--tensor-model-parallel-size", "parallel.pp": "--pipeline-model-parallel-size",
                 "parallel.cp": "--context-parallel-size", "parallel.ep": "--expert-model-parallel-size",
                 "gpu_memory_gb": "--dynbatch-gpu-memory-gb"},
}


def _card(gpu_memory_gb: Any) -> float:
    if gpu_memory_gb is None:
        raise DynBatchConfigError("gpu_memory_gb", None, "no card size is known",
                                  "pass the GPU's memory in GiB (torch.cuda.get_device_properties(0).total_memory "
                                  "/ 2**30; about 79.1 for an H100 80GB), e.g. gpu_memory_gb=79.1")
    if isinstance(gpu_memory_gb, (int, float)) and not isinstance(gpu_memory_gb, bool) and \
            math.isfinite(float(gpu_memory_gb)) and float(gpu_memory_gb) >= float(1 << 30):
        raise DynBatchConfigError("gpu_memory_gb", gpu_memory_gb, "is a card size in bytes, not GiB "
                                  f"({float(gpu_memory_gb):g} bytes = {float(gpu_memory_gb) / GiB:.1f} GiB)",
                                  f"pass the GiB: gpu_memory_gb={float(gpu_memory_gb) / GiB:.1f}")
    return as_float(gpu_memory_gb, "gpu_memory_gb", minimum=1e-9, maximum=MAX_GPU_MEMORY_GB,
                    fix=f"pass the GPU's memory in GiB, a number in (0, {MAX_GPU_MEMORY_GB:g}], e.g. 79.1")


def card_unit_problem(gpu_memory_gb: float) -> Optional[Tuple[str, float, str]]:
    """What is wrong with the unit of a card size a person typed, as ``(unit, GiB, card)``; ``None`` if it reads as
    GiB. ``("bytes" | "MiB", GiB, "")``: a value above :data:`MAX_PLAUSIBLE_GB` (an error at the entry points);
    ``("GB", GiB torch reports, card)``: a round number that is a known card's size in GB (:data:`KNOWN_CARDS`: 80
    for an H100 80GB), likely GB and not GiB (a warning: the budget is computed for the value typed)."""
    v = float(gpu_memory_gb)
    if v > MAX_PLAUSIBLE_GB:
        return ("bytes", v / GiB, "") if v >= 1 << 30 else ("MiB", v / 1024.0, "")
    if v in KNOWN_CARDS:
        card, gib = KNOWN_CARDS[int(v)]
        return "GB", gib, card
    return None


def _fixes(st: MemorySettings, m: ModelSpec, p: ParallelConfig, static_too_big: bool) -> str:
    """What to change, in Python keywords (:data:`FIX_WORDS` spells them at the entry points)."""
    out: List[str] = []
    if static_too_big:
        out.append("raise tensor or pipeline parallelism (parallel.tp, parallel.pp split the weights)")
        if m.num_experts:
            out.append("raise expert parallelism (parallel.ep)")
        if st.optimizer == "replicated":
            out.append('use the distributed optimizer (optimizer="distributed" shards Adam state over the '
                       "data-parallel ranks)")
        if st.optimizer != "cpu_offload":
            out.append('offload the optimizer to the CPU (optimizer="cpu_offload")')
    else:
        if st.recompute != "full":
            out.append('turn on full recompute (recompute="full")')
        out.append("raise tensor parallelism (parallel.tp divides activations and logits)")
        out.append("raise pipeline or context parallelism (parallel.pp, parallel.cp)")
        if any((c or 0) > 1 for c in (st.logits_fp32_copies, st.log_prob_fp32_copies)) or \
                loss_path_bytes(st.trainer, "train", st.loss_options(), tp=p.tp) > REFERENCE_BYTES:
            out.append(f"use a loss that keeps less over the vocabulary ({st.trainer}'s fused or chunked loss, no "
                       "entropy term: docs/tuning.md, loss paths)")
        if st.optimizer != "cpu_offload":
            out.append('offload the optimizer to the CPU (optimizer="cpu_offload" frees static memory)')
    out.append("or use a larger GPU")
    return "; ".join(out)


def _limited_by(t: StageTerms, recompute: str) -> str:
    parts = {"activations kept for backward" if recompute != "full" else "recompute checkpoints": t.kept_per_token,
             "the layer at work": t.extra_per_token if t.extra_per_token > t.logits_per_token else 0.0,
             "logits (LM head + loss)": t.logits_per_token if t.logits_per_token >= t.extra_per_token else 0.0}
    return max(parts, key=lambda k: parts[k])


def choose_budget(model: ModelLike, parallel: ParallelLike, gpu_memory_gb: Any, *, pass_: str = "train",
                  settings: MemorySettingsLike = None, profile: Any = None, multiple: Any = DEFAULT_MULTIPLE
                  ) -> BudgetChoice:
    """The largest budget (tokens per micro-batch per GPU, a multiple of ``multiple``) whose predicted peak fits
    ``gpu_memory_gb`` GiB minus ``settings.headroom`` (module docstring). ``pass_``: ``"train"`` or
    ``"log_prob"`` (forward-only log-prob / reference passes); ``settings``: a :class:`~.settings.
    MemorySettings` or mapping; ``profile``: ``None`` (analytic), a :class:`~.profile.MemoryProfile` or a
    cost-model file with a ``memory`` section."""
    card = _card(gpu_memory_gb)
    mult = as_int(multiple, "multiple", minimum=1, maximum=1 << 20, fix="pass a token multiple, e.g. 256")
    m = ModelSpec.from_any(model)
    p = ParallelConfig.from_any(parallel)
    st = MemorySettings.from_any(settings)
    pass_ = check_pass(pass_)
    terms, prof = stage_terms(m, p, pass_=pass_, settings=st, profile=profile)
    usable = card * GiB * (1.0 - st.headroom)
    fits: List[float] = []
    for t in terms:
        free = usable - t.reserve - t.static
        if free <= 0 or t.step > free:
            what = "weights, gradients and optimizer state" + (" and the optimizer step's temporaries"
                                                                if t.step > max(free, 0.0) and free > 0 else "")
            raise DynBatchConfigError(
                "gpu_memory_gb", card,
                f"{what} of stage {t.stage} ({(t.static + (t.step if free > 0 else 0.0)) / GiB:.1f} GiB) plus the "
                f"reserve ({t.reserve / GiB:.1f} GiB) do not fit the {usable / GiB:.1f} GiB usable "
                f"({pass_.replace('_', '-')} pass)", _fixes(st, m, p, True))
        slope = t.per_token
        fits.append(math.inf if slope <= 0 else (free - t.workspace) / slope)
    exact = min(fits)
    exact_int = MAX_TOKENS if exact >= MAX_TOKENS else max(0, int(math.floor(exact)))
    tokens = (exact_int // mult) * mult
    while tokens >= mult and max(x.reserve + x.allocated(tokens) for x in terms) > usable:  # float rounding
        tokens -= mult
    if tokens < mult:
        lim = terms[min(range(len(terms)), key=lambda i: fits[i])]
        raise DynBatchConfigError(
            "gpu_memory_gb", card,
            f"after the static {lim.static / GiB:.1f} GiB and reserve {lim.reserve / GiB:.1f} GiB of stage "
            f"{lim.stage}, the {usable / GiB:.1f} GiB usable hold {max(exact_int, 0)} tokens per GPU, fewer than "
            f"{mult} ({pass_.replace('_', '-')} pass)", _fixes(st, m, p, False))
    lim = min(range(len(terms)), key=lambda i: fits[i])
    return BudgetChoice(tokens, pass_, card, usable, exact_int, mult, p.cp, lim, st,
                        breakdown_of(terms, tokens, pass_, prof.source, padded_vocab_size=m.padded_vocab_for(p.tp),
                                     recompute=st.recompute), _limited_by(terms[lim], st.recompute), p.tp)


__all__ = ["BudgetChoice", "choose_budget", "MAX_GPU_MEMORY_GB", "DEFAULT_MULTIPLE", "FIX_WORDS", "KNOWN_CARDS",
           "card_unit_problem"]
