"""Each GPU's predicted peak memory for the real layout: :func:`peak_memory` -> :class:`MemoryBreakdown`.

One GPU of pipeline stage ``s`` (of ``pp``) running micro-batches of ``T`` tokens (per GPU: per CP rank, after
TP / SP division as the profile's bytes say) peaks at::

    reserve + static_s + max(workspace + T x per_token_s,  optimizer step temporaries_s)

* ``static_s`` -- weights, gradients, optimizer state of the stage (:mod:`.params`);
* ``per_token_s``, training, no / selective recompute: ``units_s x layer + max(backward_extra, logits)``
  (``backward_extra``: the backward's transient, the gradients alive beside the kept activations); full
  recompute: ``units_s x layer_input + max(layer_peak, logits)`` (``layer_peak``: the layer recomputed plus its
  backward's transient) -- ``logits`` (head + loss, plus the trainer's loss path's difference from Megatron's
  cross entropy -- :func:`~.loss_paths.head_terms` -- plus the MTP layers) on the last stage only, 0 elsewhere; a
  chunked loss's chunk buffers in that stage's workspace. A forward-only log-prob pass keeps nothing for backward
  (Megatron's forward-only schedule holds no micro-batch's tensors): ``layer_input + max(layer_peak -
  backward_extra, logits)`` (the stage's input, one layer's working set, the head; a fitted profile's layer peak
  is kept whole);
* ``units_s`` -- decoder layers whose activations are alive at once: 1F1B's stage ``s`` holds ``pp - s``
  micro-batches of ``L / pp`` layers (the first stage ``pp`` of them -- about all ``L`` layers' worth whatever
  ``pp`` is); interleaved (``vpp > 1``, ``N`` = Megatron's micro-batch group size per VP stage) it holds
  ``2 (pp - s - 1) + (vpp - 1) N + 1`` model chunks of ``L / (pp vpp)`` layers (Megatron's warm-up count plus
  the one in flight; with ``N = pp`` the first stage holds ``L (1 + (pp - 1) / (pp vpp))``, Korthikanti's
  factor). The count is not capped by the step's micro-batch count: the planner may put a full-budget
  micro-batch in every slot, so the budget plans for it;
* the ``max(...)`` terms are moments that do not overlap: the head's logits are freed before the last layer's
  backward (or its recompute) starts. :class:`StageMemory` shows them apart: ``activation_bytes`` (kept),
  ``transient_bytes`` (what the layer at work adds above the head's moment), ``logits_bytes``, and, as parts of
  the activations, the dropout masks, QK-layernorm inputs and routed experts' share.

Context parallelism needs nothing more: ``T`` is one CP rank's share (the CP ring's K/V buffers are transient and
left out, as are communication buffers that scale with tokens). MoE routing imbalance and expert tensor
parallelism are in the profile's layer bytes. :attr:`MemoryBreakdown.limiting_stage` is the stage whose peak is
highest. Deterministic, pure Python; the same numbers on every rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ..checks import as_int
from ..errors import DynBatchConfigError
from ..model_spec import ModelLike, ModelSpec
from ..parallel import ParallelConfig
from .loss_paths import head_terms
from .params import stage_static
from .profile import MemoryProfile, resolve_memory_profile
from .settings import GiB, MemorySettings, MemorySettingsLike

if TYPE_CHECKING:
    from ..parallel import ParallelLike

PASSES = ("train", "log_prob")


@dataclass(frozen=True)
class StageTerms:
    """The pieces of one stage's peak as a function of ``T`` (bytes; module docstring)."""

    stage: int
    static: float
    step: float
    reserve: float
    workspace: float
    kept_per_token: float      # activations kept by the layers in flight
    extra_per_token: float     # backward extra / the layer being recomputed / one layer's forward working set
    logits_per_token: float    # last stage only
    dropout_per_token: float = 0.0   # of kept_per_token: dropout masks
    qk_norm_per_token: float = 0.0   # of kept_per_token: QK-layernorm inputs
    routed_per_token: float = 0.0    # of kept_per_token: routed experts

    @property
    def per_token(self) -> float:
        return self.kept_per_token + max(self.extra_per_token, self.logits_per_token)

    def allocated(self, tokens: float) -> float:
        return self.static + max(self.workspace + tokens * self.per_token, self.step)


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's predicted peak, bytes. ``allocated_bytes`` is what the allocator holds (comparable
    with ``torch.cuda.max_memory_allocated``); ``total_bytes`` adds the reserve."""

    stage: int
    static_bytes: float
    activation_bytes: float
    logits_bytes: float
    workspace_bytes: float
    optimizer_step_bytes: float
    reserve_bytes: float
    allocated_bytes: float
    total_bytes: float
    transient_bytes: float = 0.0  # beyond activations and logits: the backward's gradients / the layer at work
    dropout_bytes: float = 0.0    # of activation_bytes: the hidden-dropout masks
    qk_norm_bytes: float = 0.0    # of activation_bytes: the QK-layernorm inputs
    routed_bytes: float = 0.0     # of activation_bytes: the routed experts' share (etp / tp of the copies)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted peak of every pipeline stage at ``tokens_per_gpu`` tokens per micro-batch per GPU."""

    tokens_per_gpu: int
    pass_: str
    stages: Tuple[StageMemory, ...]
    profile_source: str
    padded_vocab_size: Optional[int] = None  # the LM head's width: the vocabulary padded as Megatron pads it
    recompute: str = "none"

    @property
    def limiting_stage(self) -> int:
        """The stage with the highest peak (the first of equals)."""
        best = max(s.total_bytes for s in self.stages)
        return next(s.stage for s in self.stages if s.total_bytes == best)

    @property
    def peak(self) -> StageMemory:
        return self.stages[self.limiting_stage]

    @property
    def peak_bytes(self) -> float:
        """The highest stage's total (reserve included)."""
        return self.peak.total_bytes

    @property
    def allocated_bytes(self) -> float:
        """The highest stage's allocator peak (reserve excluded)."""
        return max(s.allocated_bytes for s in self.stages)

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / GiB

    def to_dict(self) -> Dict[str, Any]:
        return {"tokens_per_gpu": self.tokens_per_gpu, "pass": self.pass_, "profile": self.profile_source,
                "limiting_stage": self.limiting_stage, "peak_bytes": self.peak_bytes,
                "allocated_bytes": self.allocated_bytes, "padded_vocab_size": self.padded_vocab_size,
                "stages": [s.to_dict() for s in self.stages]}

    def lines(self, stage: Optional[int] = None) -> List[str]:
        """One stage's parts (default: the highest), one per line (GiB)."""
        s = self.peak if stage is None else self.stages[stage]
        where = f"stage {s.stage} of {len(self.stages)}" if len(self.stages) > 1 else "the GPU"
        head = "LM head and loss (last stage)" + (f", V padded to {self.padded_vocab_size}"
                                                   if self.padded_vocab_size and s.logits_bytes else "")
        kept = ("the stage's input (forward only)" if self.pass_ == "log_prob" else "recompute checkpoints"
                if self.recompute == "full" else "kept for backward")
        rows = [("static", s.static_bytes, "weights, gradients, optimizer state"),
                ("activations", s.activation_bytes, kept)]
        for name, b, what in (("dropout masks", s.dropout_bytes, "of the activations: 1 byte x h, 2 per layer"),
                              ("QK-norm inputs", s.qk_norm_bytes, "of the activations: Q and K before their norms"),
                              ("routed experts", s.routed_bytes, "of the activations: etp/tp of the routed copies")):
            if b:
                rows.append((name, b, what))
        if s.transient_bytes:
            rows.append(("transient", s.transient_bytes, "the backward's gradients beside them" if self.pass_ ==
                         "train" and self.recompute != "full" else "the layer at work (recomputed / forward)"))
        rows += [("logits", s.logits_bytes, head), ("workspace", s.workspace_bytes, "per micro-batch")]
        if s.optimizer_step_bytes:
            rows.append(("optimizer step", s.optimizer_step_bytes, "temporaries while the step runs (no activations)"))
        rows.append(("reserve", s.reserve_bytes, "CUDA context, NCCL, library workspaces"))
        out = [f"peak on {where}: {s.total_bytes / GiB:.1f} GiB at {self.tokens_per_gpu} tokens per GPU "
               f"({'training' if self.pass_ == 'train' else 'log-prob'} pass, {self.profile_source} profile)"]
        out += [f"  {name:<14} {b / GiB:8.2f} GiB  {what}" for name, b, what in rows]
        return out

    def summary(self) -> str:
        return "\n".join(self.lines())


def _units(p: ParallelConfig, layers: int, stage: int) -> float:
    """Decoder layers whose activations stage ``stage`` holds at once (module docstring)."""
    if p.vpp > 1:
        chunks = 2 * (p.pp - stage - 1) + (p.vpp - 1) * p.vp_group_size + 1
        return chunks * layers / (p.pp * p.vpp)
    return (p.pp - stage) * layers / p.pp


def check_pass(pass_: Any) -> str:
    if pass_ not in PASSES:
        raise DynBatchConfigError("pass_", pass_, "is not a pass", f"use one of {PASSES} (log_prob: forward-only "
                                  "log-prob / reference passes)")
    return str(pass_)


def stage_terms(model: ModelLike, parallel: ParallelLike, *, pass_: str = "train", settings: MemorySettingsLike = None,
                profile: Any = None) -> Tuple[List[StageTerms], MemoryProfile]:
    """Every stage's :class:`StageTerms` and the profile used (``profile``: see
    :func:`~.profile.resolve_memory_profile`)."""
    m = ModelSpec.from_any(model)
    p = ParallelConfig.from_any(parallel)
    st = MemorySettings.from_any(settings)
    pass_ = check_pass(pass_)
    if p.pp * p.vpp > m.num_layers:
        raise DynBatchConfigError("parallel.pp", p.pp, f"pp x vpp = {p.pp * p.vpp} model chunks for "
                                  f"{m.num_layers} layers: a stage without layers", "use pp x vpp <= the layers")
    prof = resolve_memory_profile(profile, m, p, st)
    static = stage_static(m, p, st, pass_)
    head = prof.head_bytes if pass_ == "train" else prof.head_forward_bytes
    # the trainer's loss path against the reference one the head counts (loss_paths.head_terms); a chunk's buffers
    # are a constant of the last stage's micro-batch
    loss, chunk, _ = head_terms(st, pass_, p.tp, prof.fp32_copy_bytes / (4.0 * (1 + int(m.mtp_num_layers or 0))),
                                prof.fp32_copy_bytes)
    logits = max(0.0, head + loss) + (prof.mtp_layer_bytes if pass_ == "train" else 0.0)
    reserve = st.reserve_gb * GiB
    # the analytic layer peak holds the backward's transient, which a forward-only pass never has; a fitted one is
    # measured as a whole and kept
    forward_less = prof.backward_extra_bytes if prof.source == "analytic" else 0.0
    out: List[StageTerms] = []
    for s in range(p.pp):
        units = _units(p, m.num_layers, s)
        last = logits if s == p.pp - 1 else 0.0
        if pass_ == "log_prob":  # forward only: one layer's working set, no backward gradients (analytic profile)
            kept, extra = prof.layer_input_bytes, prof.layer_peak_bytes - forward_less
        elif st.recompute == "full":
            kept, extra = units * prof.layer_input_bytes, prof.layer_peak_bytes
        else:
            kept, extra = units * prof.layer_bytes, prof.backward_extra_bytes
        res, step = static[s]
        n = units if pass_ == "train" and st.recompute != "full" else 0.0  # layers whose parts are kept
        out.append(StageTerms(s, res, step if pass_ == "train" else 0.0, reserve,
                              prof.workspace_bytes + (chunk if s == p.pp - 1 else 0.0), kept, extra, last,
                              n * prof.dropout_bytes, n * prof.qk_norm_bytes, n * prof.routed_bytes))
    return out, prof


def breakdown_of(terms: List[StageTerms], tokens: int, pass_: str, source: str, *,
                 padded_vocab_size: Optional[int] = None, recompute: str = "none") -> MemoryBreakdown:
    """The :class:`MemoryBreakdown` of ``terms`` at ``tokens``."""
    stages = []
    for t in terms:
        act = tokens * t.kept_per_token
        transient = tokens * max(0.0, t.extra_per_token - t.logits_per_token)
        alloc = t.allocated(tokens)
        stages.append(StageMemory(t.stage, t.static, act, tokens * t.logits_per_token, t.workspace, t.step,
                                  t.reserve, alloc, alloc + t.reserve, transient, tokens * t.dropout_per_token,
                                  tokens * t.qk_norm_per_token, tokens * t.routed_per_token))
    return MemoryBreakdown(int(tokens), pass_, tuple(stages), source, padded_vocab_size, recompute)


def peak_memory(model: ModelLike, parallel: ParallelLike, tokens_per_gpu: Any, *, pass_: str = "train",
                settings: MemorySettingsLike = None, profile: Any = None) -> MemoryBreakdown:
    """Predicted peak of every pipeline stage of one GPU at ``tokens_per_gpu`` tokens per micro-batch per GPU
    (module docstring). ``settings``: a :class:`~.settings.MemorySettings` (or mapping; default the defaults);
    ``profile``: ``None`` (analytic), a :class:`~.profile.MemoryProfile` or a cost-model file with a ``memory``
    section."""
    tokens = as_int(tokens_per_gpu, "tokens_per_gpu", minimum=0, fix="pass tokens per micro-batch per GPU, e.g. 16384")
    terms, prof = stage_terms(model, parallel, pass_=pass_, settings=settings, profile=profile)
    m, p = ModelSpec.from_any(model), ParallelConfig.from_any(parallel)
    return breakdown_of(terms, tokens, check_pass(pass_), prof.source, padded_vocab_size=m.padded_vocab_for(p.tp),
                        recompute=MemorySettings.from_any(settings).recompute)


__all__ = ["MemoryBreakdown", "StageMemory", "StageTerms", "peak_memory", "stage_terms", "breakdown_of", "PASSES"]
