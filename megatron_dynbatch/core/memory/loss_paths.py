"""Each trainer's loss path: the bytes per token per vocabulary column (``V/tp``) its LM-head loss keeps alive at
the peak, read from the trainer's own code -- :func:`loss_path` -> :class:`LossPath`, :func:`loss_path_bytes`.

The memory model's LM head + loss term (:mod:`.analytic`) counts Megatron's vocab-parallel cross entropy:
bf16 logits plus one fp32 copy, ``6 x T x V/tp`` bytes (:data:`REFERENCE_BYTES`; a calibrated profile measures
that path too). A trainer whose loss keeps more (an fp32 softmax beside an fp32 copy, a clone for entropy) or
less (a fused or chunked kernel) differs from it by ``(bytes - 6) x T x V/tp`` on the last pipeline stage:
:func:`head_terms` is that difference, which :mod:`.peak` adds to the head. The MTP heads (Megatron's own cross
entropy inside the model) keep the reference path whatever the trainer.

How the tensors were counted: every ``T x V/tp`` tensor alive at the same moment, in the forward of the loss and
in its backward, the larger of the two (forward only for a log-prob / reference pass: no graph is kept). The
logits a trainer's loss receives are fp32 wherever the model is wrapped in Megatron's ``Float16Module``
(``megatron/core/transformer/module.py`` ``Float16Module.forward``: ``float16_to_fp32`` on the last stage, the bf16
logits freed right after -- a 6-byte moment) unless the trainer asks for ``fp32_output=False``. Sources read (file,
function, commit):

======================  ==========================================================================================
Megatron-LM             ``megatron/core/tensor_parallel/cross_entropy.py`` ``_VocabParallelCrossEntropy.forward``
(and this package)      (``calculate_logits_max``: one fp32 copy; exp and softmax in place; softmax saved);
                        ``megatron/core/fusions/fused_cross_entropy.py`` (``--cross-entropy-loss-fusion``, impl
                        ``native``: the same tensors, the gradient cast to bf16); Transformer Engine's
                        ``parallel_cross_entropy`` (impl ``te``: an fp32 gradient buffer beside the bf16 logits);
                        ``models/common/language_module/language_module.py`` ``compute_language_model_loss``
                        (NVIDIA/Megatron-LM@d98e8a64, TransformerEngine@d0067d0d). This package's loss
                        (``megatron_dynbatch/megatron/loss.py`` ``make_loss_func``) weights the per-token cross
                        entropy ``GPTModel(labels=...)`` returns: the same path. 6 bytes in every variant.
slime                   ``slime/utils/ppo_utils.py`` ``_VocabParallelLogProbEntropy.forward/backward`` and
                        ``calculate_log_probs_and_entropy`` (``chunk_size``); ``slime/backends/megatron_utils/
                        loss.py`` ``get_log_probs_and_entropy`` (``rollout_temperature``, ``log_probs_chunk_size``,
                        ``entropy_coef``) (THUDM/slime@624b824a). fp32 logits (4) + an fp32 softmax (``logits -
                        max``, not in place: 4) = 8; a temperature other than 1 divides into a new fp32 copy (+4);
                        an entropy coefficient other than 0 keeps the fp32 logits for backward, whose entropy
                        gradient is one more fp32 buffer: 12. ``--log-probs-chunk-size C`` bounds the softmax to C
                        tokens at a time in a log-prob pass; in training each chunk's softmax is saved, so it
                        saves nothing there.
verl (Megatron)         ``verl/workers/actor/megatron_actor.py`` ``MegatronPPOActor.forward_backward_batch``
                        ``logits_processor`` and ``verl/workers/engine/megatron/transformer_impl.py``
                        ``MegatronEngineWithLMHead.forward_step`` (same processor); ``verl/utils/megatron/
                        tensor_parallel.py`` ``_VocabParallelEntropy`` (volcengine/verl@b178a3cd). Without entropy:
                        temperature divides in place and Megatron's cross entropy works in place on the fp32
                        logits (``.float()`` of fp32 is no copy): 6 (the upcast). With entropy: ``logits.clone()``
                        (4) + the fp32 logits (4) + the entropy's softmax (4) = 12. The training pass computes
                        entropy when ``entropy_coeff != 0``; the actor's log-prob pass always does
                        (``compute_log_prob(calculate_entropy=True)``), the ref's never: the log-prob budget, shared
                        by both, is sized for 12. ``use_fused_kernels`` (legacy actor; the new engine raises
                        ``NotImplementedError``): ``verl/utils/kernel/kernels.py`` never builds the logits; its
                        backward's bf16 ``d_logits`` split is ``T x 9504`` (a width fixed in the kernel, not V/tp).
                        ``entropy_from_logits_with_chunking`` is an FSDP (``dp_actor``) option: no effect here.
ROLL                    ``roll/distributed/strategy/megatron_strategy.py`` ``op_compute_log_probs`` /
                        ``op_compute_entropy``; ``mcore_adapter/.../parallel_functions/vocab_parallel.py``
                        ``_VocabParallelLogProbs``; ``roll/third_party/megatron/tensor_parallel.py``
                        ``_VocabParallelEntropy`` (alibaba/ROLL@8eb27cc2). No ``Float16Module``: bf16 logits (2) +
                        the log-prob's fp32 copy (4) = 6; entropy (``entropy_loss_coef > 0``, bf16 by default:
                        ``logits_in_fp32`` false) adds a bf16 softmax: 8. ``cross_entropy_loss_fusion`` at TP 1:
                        fused kernels that keep the bf16 logits and write the gradient in place: 2 (4 with entropy).
NeMo-RL (Megatron)      ``nemo_rl/distributed/model_utils.py`` ``DistributedLogprob`` and
                        ``ChunkedDistributedLogprob``; ``nemo_rl/models/megatron/train.py`` (``logprob_chunk_size``,
                        ``defer_fp32_logits``) (NVIDIA-NeMo/RL@7ea279ab). Unchunked: the fp32 logits, ``logits -
                        max``, its ``exp`` and the log-softmax -- 12, 14 with ``defer_fp32_logits`` (bf16 logits +
                        an fp32 copy), counted as 14. ``logprob_chunk_size C`` (needs ``defer_fp32_logits``): the
                        bf16 logits (+ their bf16 gradient in training: 4 per token) and per chunk of C tokens the
                        fp32 copy, shifted logits and softmax (12; in backward an int64 one-hot and an fp32
                        gradient too: 20).
======================  ==========================================================================================

A chunk's buffers are a constant per micro-batch (``C x bytes x V/tp``), counted on the last stage beside the
per-token part -- an upper bound when the micro-batch is shorter than a chunk. Options that change a path are the
fields of :class:`LossOptions` (``MemorySettings.loss_options()`` builds them): ``entropy``, ``temperature``,
``fused``, ``chunk_tokens``. Pure Python, deterministic.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Tuple, Union

from ..checks import as_bool, as_float, as_int, did_you_mean
from ..errors import DynBatchConfigError

#: the trainers whose loss paths are known (the names ``megatron-dynbatch budget`` prints lines for)
TRAINERS = ("megatron-lm", "slime", "verl", "roll", "nemo-rl")
#: bytes per token per V/tp column the LM-head term of the profile counts: Megatron's cross entropy
REFERENCE_BYTES = 6.0
#: verl's fused kernel: width of its backward's bf16 ``d_logits`` split (``kernels.py`` ``_Split_Dlogits_N``)
VERL_FUSED_SPLIT = 9504
#: the largest chunk accepted (tokens)
MAX_CHUNK = 1 << 24
PASSES = ("train", "log_prob")

_SOURCES = {
    "megatron-lm": "NVIDIA/Megatron-LM@d98e8a64 megatron/core/tensor_parallel/cross_entropy.py "
                   "_VocabParallelCrossEntropy; megatron/core/fusions/fused_cross_entropy.py; "
                   "megatron_dynbatch/megatron/loss.py make_loss_func",
    "slime": "THUDM/slime@624b824a slime/utils/ppo_utils.py _VocabParallelLogProbEntropy, "
             "calculate_log_probs_and_entropy; slime/backends/megatron_utils/loss.py get_log_probs_and_entropy",
    "verl": "volcengine/verl@b178a3cd verl/workers/actor/megatron_actor.py forward_backward_batch "
            "(logits_processor), verl/workers/engine/megatron/transformer_impl.py forward_step; "
            "verl/utils/megatron/tensor_parallel.py _VocabParallelEntropy; verl/utils/kernel/kernels.py",
    "roll": "alibaba/ROLL@8eb27cc2 roll/distributed/strategy/megatron_strategy.py op_compute_log_probs, "
            "op_compute_entropy; mcore_adapter parallel_functions/vocab_parallel.py; "
            "roll/third_party/megatron/tensor_parallel.py _VocabParallelEntropy",
    "nemo-rl": "NVIDIA-NeMo/RL@7ea279ab nemo_rl/distributed/model_utils.py DistributedLogprob, "
               "ChunkedDistributedLogprob; nemo_rl/models/megatron/train.py (logprob_chunk_size)",
}


def check_trainer(trainer: Any, field: str = "trainer") -> str:
    """``trainer`` if it is one of :data:`TRAINERS`, else a ``DynBatchConfigError`` with the close match."""
    if isinstance(trainer, str) and trainer in TRAINERS:
        return trainer
    hint = did_you_mean(str(trainer), TRAINERS) if isinstance(trainer, str) else ""
    raise DynBatchConfigError(field, trainer, "is not a trainer whose loss path is known",
                              (hint + " " if hint else "") + f"use one of {', '.join(TRAINERS)}")


@dataclass(frozen=True)
class LossOptions:
    """The trainer options that change its loss path (module docstring). ``entropy``: the training loss has an
    entropy term (slime ``--entropy-coef``, verl ``entropy_coeff``, ROLL ``entropy_loss_coef`` not 0);
    ``temperature``: the log-prob temperature (slime ``--rollout-temperature``; verl divides in place);
    ``fused``: the trainer's fused loss kernel (Megatron ``--cross-entropy-loss-fusion``, verl
    ``use_fused_kernels``, ROLL ``cross_entropy_loss_fusion``); ``chunk_tokens``: the log-prob chunk (slime
    ``--log-probs-chunk-size``, NeMo-RL ``logprob_chunk_size``; ``None`` = unchunked)."""

    entropy: bool = False
    temperature: float = 1.0
    fused: bool = False
    chunk_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "entropy", as_bool(self.entropy, "loss_entropy"))
        s(self, "fused", as_bool(self.fused, "loss_fused"))
        s(self, "temperature", as_float(self.temperature, "loss_temperature", minimum=1e-6, maximum=1e6,
                                        fix="pass the sampling temperature the loss divides by, e.g. 1.0"))
        if self.chunk_tokens is not None:
            s(self, "chunk_tokens", as_int(self.chunk_tokens, "loss_chunk_tokens", minimum=1, maximum=MAX_CHUNK,
                                           fix="pass the trainer's log-prob chunk in tokens, e.g. 1024, or leave "
                                               "it unset (no chunking)"))


@dataclass(frozen=True)
class LossPath:
    """One trainer's loss on one pass. ``column_bytes``: bytes per token per V/tp column alive at the peak for
    every token of the micro-batch; ``chunk_tokens`` x ``chunk_column_bytes``: per V/tp column, buffers of one
    chunk (a constant per micro-batch); ``token_bytes``: per token, whatever the vocabulary (verl's fused kernel);
    ``tensors``: what is alive at the peak; ``source``: where it was read."""

    trainer: str
    pass_: str
    column_bytes: float
    tensors: Tuple[str, ...]
    source: str
    chunk_tokens: Optional[int] = None
    chunk_column_bytes: float = 0.0
    token_bytes: float = 0.0

    def bytes_per_token(self, vocab_columns: float) -> float:
        """Bytes per token of the micro-batch for ``vocab_columns`` (V/tp) columns."""
        return self.column_bytes * vocab_columns + self.token_bytes

    def chunk_bytes(self, vocab_columns: float) -> float:
        """Bytes of one chunk's buffers (0 without chunking)."""
        return float(self.chunk_tokens or 0) * self.chunk_column_bytes * vocab_columns

    def describe(self) -> str:
        """One line: the bytes and what they are."""
        chunk = (f" + a chunk of {self.chunk_tokens} tokens x {self.chunk_column_bytes:g} B x V/tp"
                 if self.chunk_tokens else "")
        fixed = f" + {self.token_bytes:g} B per token" if self.token_bytes else ""
        return f"{self.column_bytes:g} B x T x V/tp{fixed}{chunk} ({', '.join(self.tensors)})"

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "tensors": list(self.tensors)}


def _megatron(pass_: str, o: LossOptions, tp: int) -> LossPath:
    what = ("bf16 logits", "fp32 copy (softmax in place)" + (", fused kernel: same tensors" if o.fused else ""))
    return LossPath("megatron-lm", pass_, 6.0, what, _SOURCES["megatron-lm"])


def _slime(pass_: str, o: LossOptions, tp: int) -> LossPath:
    temp = o.temperature != 1.0
    src = _SOURCES["slime"]
    if pass_ == "log_prob":
        base = ("fp32 logits (Float16Module)",) + (("fp32 logits / temperature",) if temp else ())
        if o.chunk_tokens:
            return LossPath("slime", pass_, 4.0 + 4.0 * temp, base, src, o.chunk_tokens, 4.0)
        return LossPath("slime", pass_, 8.0 + 4.0 * temp, base + ("fp32 softmax",), src)
    forward = 8.0 + 4.0 * temp
    if o.entropy:  # backward: softmax, the fp32 logits kept for the entropy gradient, that gradient
        return LossPath("slime", pass_, max(forward, 12.0), ("fp32 logits", "fp32 softmax",
                                                             "fp32 entropy gradient (backward)")
                        + (("fp32 logits / temperature",) if temp else ()), src)
    return LossPath("slime", pass_, forward, ("fp32 logits (Float16Module)", "fp32 softmax")
                    + (("fp32 logits / temperature",) if temp else ()), src)


def _verl(pass_: str, o: LossOptions, tp: int) -> LossPath:
    src = _SOURCES["verl"]
    if o.fused:  # no logits: per-split fp32 statistics (3 x V/1024 per token); backward's bf16 d_logits split
        return LossPath("verl", pass_, 12.0 / 1024, ("fused kernel: per-split fp32 statistics",)
                        + (("bf16 d_logits split of 9504 columns (backward)",) if pass_ == "train" else ()), src,
                        token_bytes=2.0 * VERL_FUSED_SPLIT if pass_ == "train" else 0.0)
    entropy = o.entropy if pass_ == "train" else True  # the actor's log-prob pass computes entropy
    if entropy:
        return LossPath("verl", pass_, 12.0, ("fp32 logits", "logits.clone()", "fp32 entropy softmax"), src)
    return LossPath("verl", pass_, 6.0, ("bf16 logits", "fp32 logits (Float16Module); cross entropy in place"),
                    src)


def _roll(pass_: str, o: LossOptions, tp: int) -> LossPath:
    src = _SOURCES["roll"]
    entropy = o.entropy and pass_ == "train"
    if o.fused and tp == 1:
        return LossPath("roll", pass_, 4.0 if entropy else 2.0, ("bf16 logits (gradient in place)",)
                        + (("bf16 entropy gradient",) if entropy else ()), src)
    return LossPath("roll", pass_, 8.0 if entropy else 6.0, ("bf16 logits", "fp32 log-prob copy")
                    + (("bf16 entropy softmax",) if entropy else ()), src)


def _nemo_rl(pass_: str, o: LossOptions, tp: int) -> LossPath:
    src = _SOURCES["nemo-rl"]
    if o.chunk_tokens:
        train = pass_ == "train"
        return LossPath("nemo-rl", pass_, 4.0 if train else 2.0,
                        ("bf16 logits (defer_fp32_logits)",) + (("bf16 gradient",) if train else ()), src,
                        o.chunk_tokens, 20.0 if train else 12.0)
    return LossPath("nemo-rl", pass_, 14.0, ("bf16 logits", "fp32 copy", "logits - max", "exp / log-softmax"),
                    src)


_PATHS = {"megatron-lm": _megatron, "slime": _slime, "verl": _verl, "roll": _roll, "nemo-rl": _nemo_rl}


def loss_path(trainer: str, pass_: str = "train", options: Union[LossOptions, Dict[str, Any], None] = None, *,
              tp: int = 1) -> LossPath:
    """``trainer``'s :class:`LossPath` on ``pass_`` (``"train"`` or ``"log_prob"``) with ``options`` (a
    :class:`LossOptions`, a mapping of its fields, or ``None``: the defaults); ``tp``: the tensor-parallel size
    (ROLL's fused kernels run at TP 1 only)."""
    t = check_trainer(trainer)
    if pass_ not in PASSES:
        raise DynBatchConfigError("pass_", pass_, "is not a pass", f"use one of {PASSES}")
    if options is None:
        o = LossOptions()
    elif isinstance(options, LossOptions):
        o = options
    elif isinstance(options, dict):
        o = LossOptions(**options)
    else:
        raise DynBatchConfigError("options", type(options).__name__, "must be LossOptions or a mapping",
                                  "pass LossOptions(entropy=..., temperature=..., fused=..., chunk_tokens=...)")
    return _PATHS[t](pass_, o, int(tp))


def loss_path_bytes(trainer: str, pass_: str = "train", options: Union[LossOptions, Dict[str, Any], None] = None,
                    *, tp: int = 1) -> float:
    """Bytes per token per V/tp column ``trainer``'s loss keeps at the peak of ``pass_`` (chunks and
    vocabulary-independent parts aside: :class:`LossPath`)."""
    return loss_path(trainer, pass_, options, tp=tp).column_bytes


def head_terms(settings: Any, pass_: str, tp: int, vocab_columns: float,
               fp32_copy_bytes: float) -> Tuple[float, float, str]:
    """What the trainer's path adds to the profile's LM-head term (which counts :data:`REFERENCE_BYTES`):
    ``(bytes per token, bytes per micro-batch, description)``. ``settings``: a ``MemorySettings``; an explicit
    ``logits_fp32_copies`` / ``log_prob_fp32_copies`` overrides the path (``copies - 1`` more fp32 copies of
    every head: ``fp32_copy_bytes`` each). ``vocab_columns``: V/tp of the main head."""
    copies = settings.fp32_copies(pass_)
    if copies is not None:
        return (copies - 1) * fp32_copy_bytes, 0.0, f"{copies} fp32 logits copies (set)"
    path = loss_path(settings.trainer, pass_, settings.loss_options(), tp=tp)
    delta = path.bytes_per_token(vocab_columns) - REFERENCE_BYTES * vocab_columns
    chunk = path.chunk_bytes(vocab_columns)
    assert math.isfinite(delta) and math.isfinite(chunk)
    return delta, chunk, f"{settings.trainer}'s loss: {path.describe()}"


__all__ = ["TRAINERS", "REFERENCE_BYTES", "LossOptions", "LossPath", "loss_path", "loss_path_bytes", "head_terms",
           "check_trainer"]
