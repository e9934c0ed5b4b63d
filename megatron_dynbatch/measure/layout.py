"""What gets timed: a :class:`SliceLayout` (layers, TP width split, dtype, device, model kind) and the per-TP-rank
widths of a model (:class:`SliceWidths`) that a slice is built with.

A *slice* is ``num_layers`` decoder layers of ONE tensor-parallel rank's shapes: heads, query groups, FFN width
and (optionally) vocabulary divided by ``tp``, hidden size and head dim kept. Timing it on one GPU measures a TP
rank's compute without the TP collectives; ``tp=1`` is the whole layer. Dense decoder models only (GQA/MHA/MQA,
SwiGLU or a plain GELU MLP, RMSNorm): MoE and multi-latent attention are refused with a clear error.

Pure Python (no torch): validation happens before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict

from ..core.checks import is_int
from ..core.errors import DynBatchConfigError

KINDS = ("mcore", "torch")
DTYPES = ("bf16", "fp16", "fp32")
#: layer specs of the megatron-core slice: this package's local THD spec, or Transformer Engine's
SPECS = ("local", "te")


@dataclass(frozen=True)
class SliceLayout:
    """How to build a slice: ``num_layers`` decoder layers of the per-TP-rank widths at ``tp``, parameters and
    activations in ``dtype`` on ``device`` (``"cuda"``, ``"cuda:N"`` or ``"cpu"``); ``kind`` ``"mcore"`` (a
    megatron-core ``GPTModel`` with this package's THD attention) or ``"torch"`` (a plain-torch decoder of the
    same widths, no megatron-core needed); ``vocab_size`` > 0 adds the embedding and LM head + cross-entropy of
    that (per-TP-rank) vocabulary, 0 leaves them out (decoder layers only); ``seed`` initialises the weights;
    ``spec`` (``kind="mcore"`` only) the layer spec: ``"local"`` (this package's THD spec, every CP share) or
    ``"te"`` (Transformer Engine's, CUDA and whole micro-batches only: its CP attention needs the group's GPUs)."""

    num_layers: int = 2
    tp: int = 1
    dtype: str = "bf16"
    device: str = "cuda"
    kind: str = "mcore"
    vocab_size: int = 0
    seed: int = 1234
    spec: str = "local"

    def __post_init__(self) -> None:
        for name, low in (("num_layers", 1), ("tp", 1), ("vocab_size", 0), ("seed", 0)):
            v = getattr(self, name)
            if not is_int(v) or v < low:
                raise DynBatchConfigError(f"layout.{name}", v, f"must be an integer >= {low}",
                                          f"pass e.g. {name}={max(low, 1) if name != 'seed' else 0}")
        if self.dtype not in DTYPES:
            raise DynBatchConfigError("layout.dtype", self.dtype, "unknown dtype", f"use one of {DTYPES}")
        if self.kind not in KINDS:
            raise DynBatchConfigError("layout.kind", self.kind, "unknown model kind", f"use one of {KINDS}")
        if self.spec not in SPECS or (self.spec == "te" and self.kind != "mcore"):
            raise DynBatchConfigError("layout.spec", self.spec, "unknown layer spec (or 'te' without kind='mcore')",
                                      f"use one of {SPECS}; 'te' needs kind='mcore'")
        dev = self.device
        if not isinstance(dev, str) or not (dev == "cpu" or dev == "cuda" or
                                            (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise DynBatchConfigError("layout.device", dev, "must be 'cpu', 'cuda' or 'cuda:N'",
                                      "pass device='cuda' on a GPU machine, 'cpu' elsewhere")
        if self.spec == "te" and dev == "cpu":
            raise DynBatchConfigError("layout.spec", self.spec, "Transformer Engine runs on CUDA only",
                                      "pass spec='local' on a CPU")

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SliceWidths:
    """One TP rank's widths: ``heads`` and ``groups`` (query groups, at least 1) per rank, ``kv`` the head dim,
    ``ffn`` per rank, ``vocab`` per rank (0: no embedding / LM head), ``swiglu`` the gated MLP."""

    hidden_size: int
    heads: int
    groups: int
    kv: int
    ffn: int
    swiglu: bool
    vocab: int = 0

    @classmethod
    def of(cls, model: Any, layout: SliceLayout) -> "SliceWidths":
        """The widths of ``model`` (a ``ModelSpec`` or anything ``ModelSpec.from_any`` takes) at ``layout.tp``."""
        from ..core.model_spec import ModelSpec

        spec = ModelSpec.from_any(model)
        if spec.num_experts:
            raise DynBatchConfigError("model.num_experts", spec.num_experts, "MoE layers are not implemented in the "
                                      "timing slices", "time a dense model of the same attention widths")
        if spec.multi_latent_attention:
            raise DynBatchConfigError("model.multi_latent_attention", True, "MLA is not implemented in the timing "
                                      "slices", "time a GQA model of similar widths")
        tp = layout.tp
        if spec.num_attention_heads % tp or spec.ffn_hidden_size % tp:
            raise DynBatchConfigError("layout.tp", tp, f"does not divide the heads ({spec.num_attention_heads}) and "
                                      f"the FFN width ({spec.ffn_hidden_size}) of {spec.name or 'the model'}",
                                      "use the model's tensor-parallel size")
        groups = spec.num_query_groups
        if groups % tp and tp % groups:
            raise DynBatchConfigError("layout.tp", tp, f"and the {groups} query groups do not divide each other",
                                      "use the model's tensor-parallel size")
        return cls(hidden_size=spec.hidden_size, heads=spec.num_attention_heads // tp, groups=max(1, groups // tp),
                   kv=spec.kv_channels, ffn=spec.ffn_hidden_size // tp, swiglu=bool(spec.swiglu),
                   vocab=layout.vocab_size)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


__all__ = ["SliceLayout", "SliceWidths", "KINDS", "DTYPES", "SPECS"]
