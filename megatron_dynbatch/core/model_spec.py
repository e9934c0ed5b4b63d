"""The shape of the model being trained, as far as FLOPs and memory are concerned.

:class:`ModelSpec` is a frozen, validated dataclass whose field names are Megatron's (``--num-layers`` is
``num_layers``, ``--num-query-groups`` is ``num_query_groups``, ...), so a Megatron command line, a
``TransformerConfig`` and a YAML preset all describe a model with the same words. It carries only what the
FLOPs model (:mod:`megatron_dynbatch.core.flops`) and the memory model (:mod:`megatron_dynbatch.core.memory`)
need: layer count and widths, attention layout (MHA / GQA / MLA), MLP layout (dense, gated or not, MoE with a
per-layer pattern and shared experts), vocabulary, multi-token-prediction depth, and what the activations keep
beyond the shape (dropout masks, QK-layernorm inputs).

Defaults follow Megatron so that a spec read from Megatron means what Megatron means:

* ``num_query_groups=None`` -> multi-head attention (``num_attention_heads`` groups);
* ``kv_channels=None`` -> ``hidden_size // num_attention_heads`` (then the heads must divide the hidden size);
* ``padded_vocab_size=None`` -> ``vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by``
  (128). Megatron pads to ``make_vocab_size_divisible_by * tensor_model_parallel_size``; with TP > 1 and a
  vocabulary that is not already a multiple of that, pass ``padded_vocab_size`` explicitly (or build the spec
  with :meth:`ModelSpec.from_megatron`, which reads Megatron's own padded size). The memory model pads for the
  layout's TP itself (:meth:`ModelSpec.padded_vocab_for`);
* ``hidden_dropout`` / ``attention_dropout`` -> 0.1 each, Megatron's defaults for ``--hidden-dropout`` /
  ``--attention-dropout`` (the memory model counts the hidden-dropout masks; the model presets, read from Hugging
  Face configs and trained with dropout off by slime and verl, say 0.0); ``qk_layernorm`` -> False (Megatron's
  ``--qk-layernorm``; Qwen3 has it);
* ``moe_layer_freq=1`` -> every layer is MoE when ``num_experts`` is set. An integer ``N`` makes layer ``i``
  (0-based) MoE when ``i % N == 0``; a list gives one 0/1 per layer. Megatron's string form
  ``"([0]*3+[1]*58)"`` is accepted too and stored as the list it denotes.

Derived defaults are resolved at construction, so ``spec.num_query_groups``, ``spec.kv_channels`` and
``spec.padded_vocab_size`` are always integers afterwards and ``ModelSpec.from_dict(spec.to_dict()) == spec``.

This module is pure Python (+ PyYAML for presets): it never imports torch or megatron.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Protocol, Tuple, Union

from .checks import did_you_mean
from .checks import is_int as _is_int
from .errors import DynBatchConfigError
from .presets import CONFIGS_ENV, available_presets, load_model_mapping, preset_dirs, resolve_model_preset
from .model_sources import MLA_FIELDS, fields_from_hf_config, fields_from_megatron

__all__ = ["ModelSpec", "available_presets", "preset_dirs", "ModelLike", "MegatronConfigLike", "MegatronModelLike",
           "HFConfigLike", "CONFIGS_ENV"]

# Other names for our fields that users will plausibly type: TransformerConfig's spellings and a few
# Hugging Face ones whose meaning is identical.
_ALIASES: Dict[str, str] = {
    "gated_linear_unit": "swiglu",
    "num_moe_experts": "num_experts",
}

# Keys that only appear in Hugging Face config.json files: used to point at from_hf_config.
_HF_KEYS = frozenset(
    {
        "num_hidden_layers", "intermediate_size", "num_key_value_heads", "head_dim", "model_type",
        "architectures", "num_experts_per_tok", "moe_intermediate_size", "n_routed_experts",
        "qk_nope_head_dim", "qk_rope_head_dim", "hidden_act", "torch_dtype",
    }
)

_MLA_FIELDS = MLA_FIELDS
_MLA_REQUIRED = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
_MOE_FIELDS = ("moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size")


def _parse_layer_freq(value: Any) -> Union[int, Tuple[int, ...]]:
    """Normalise ``moe_layer_freq``: int stays int, a sequence becomes a tuple, and Megatron's CLI string
    form (``"([0]*3+[1]*58)"`` or ``"[1,0,1,0]"`` or ``"2"``) is evaluated with a tiny safe evaluator that
    only knows integer literals, lists, ``+`` and ``*``."""
    if _is_int(value):
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            tree = ast.parse(text, mode="eval")
            result = _eval_list_expr(tree.body)
        except (SyntaxError, ValueError) as exc:
            raise DynBatchConfigError(
                "moe_layer_freq", value, f"cannot parse this pattern ({exc})",
                "use an integer N (every N-th layer is MoE), a list of 0/1 per layer, or Megatron's "
                "string form such as '([0]*3+[1]*58)'",
            ) from None
        return _parse_layer_freq(result)
    if isinstance(value, (list, tuple)):
        out = []
        for item in value:
            if not _is_int(item) or int(item) not in (0, 1):
                raise DynBatchConfigError(
                    "moe_layer_freq", list(value), f"list entries must be 0 (dense) or 1 (MoE), got {item!r}",
                    "write one 0 or 1 per layer",
                )
            out.append(int(item))
        return tuple(out)
    try:  # numpy arrays and other sequences
        return _parse_layer_freq(list(value))
    except TypeError:
        raise DynBatchConfigError(
            "moe_layer_freq", value, "must be an int or a list of 0/1",
            "use an integer N (every N-th layer is MoE) or one 0/1 per layer",
        ) from None


def _eval_list_expr(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and _is_int(node.value):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval_list_expr(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_list_expr(node.left), _eval_list_expr(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"unsupported expression {ast.dump(node)[:60]}")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Shape of a decoder-only transformer with Megatron's field names. See the module docstring for the
    defaults; every problem found at construction raises :class:`~megatron_dynbatch.core.errors.DynBatchConfigError`
    naming the field, its value and the fix.

    Build one with :meth:`from_dict`, :meth:`from_yaml` (a file or a preset name such as ``"qwen3-8b"``),
    :meth:`from_megatron` (Megatron ``args`` or a ``TransformerConfig``), :meth:`from_hf_config` (a local
    Hugging Face ``config.json``) or :meth:`from_any`.
    """

    # --- core shape
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    swiglu: bool = False
    padded_vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    # --- mixture of experts
    num_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_topk: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_layer_freq: Union[int, Tuple[int, ...]] = 1
    # --- multi-latent attention (DeepSeek-V2/V3)
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_head_dim: Optional[int] = None
    qk_pos_emb_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    # --- multi-token prediction (extra transformer layer(s) + logits per MTP depth, as Megatron trains it)
    mtp_num_layers: Optional[int] = None
    # --- what the activations keep beyond the shape (memory model only; FLOPs ignore them)
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    qk_layernorm: bool = False
    # --- label only
    name: Optional[str] = field(default=None, compare=False)

    # ------------------------------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass

        def positive(name: str, *, allow_zero: bool = False, optional: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            lo = 0 if allow_zero else 1
            if not _is_int(value) or int(value) < lo:
                raise DynBatchConfigError(
                    name, value, f"must be an integer >= {lo}",
                    f"set {name} to a whole number >= {lo}" + (" or leave it unset (null)" if optional else ""),
                )
            set_(name, int(value))

        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                     "make_vocab_size_divisible_by"):
            positive(name)
        for name in ("num_query_groups", "kv_channels", "padded_vocab_size", "num_experts"):
            positive(name, optional=True)
        positive("mtp_num_layers", allow_zero=True, optional=True)
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) or _is_np_float(value)
            if not ok or not 0.0 <= float(value) < 1.0:
                raise DynBatchConfigError(name, value, "must be a dropout probability in [0, 1)",
                                          f"set {name} to Megatron's --{name.replace('_', '-')} (default 0.1; 0.0 "
                                          "for most fine-tuning and RL runs)")
            set_(name, float(value))
        for name in ("swiglu", "multi_latent_attention", "qk_layernorm"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                try:
                    import numpy as np

                    if isinstance(value, np.bool_):
                        set_(name, bool(value))
                        continue
                except ImportError:  # pragma: no cover
                    pass
                raise DynBatchConfigError(name, value, "must be true or false", f"set {name}: true or {name}: false")
        if self.name is not None and not isinstance(self.name, str):
            raise DynBatchConfigError("name", self.name, "must be a string", "use a label such as 'qwen3-8b'")

        heads, hidden = self.num_attention_heads, self.hidden_size

        # attention layout
        if self.kv_channels is None and self.multi_latent_attention and _is_int(self.v_head_dim):
            set_("kv_channels", int(self.v_head_dim))  # type: ignore[arg-type]  # unused by MLA
        if self.kv_channels is None:
            if hidden % heads != 0:
                raise DynBatchConfigError(
                    "num_attention_heads", heads,
                    f"does not divide hidden_size={hidden}, so the default kv_channels (hidden/heads) is undefined",
                    "choose a head count that divides hidden_size, or set kv_channels (the per-head width) "
                    "explicitly",
                )
            set_("kv_channels", hidden // heads)
        if self.multi_latent_attention:
            if self.num_query_groups is not None and self.num_query_groups != heads:
                raise DynBatchConfigError(
                    "num_query_groups", self.num_query_groups,
                    "multi-latent attention has no grouped-query layout (Megatron refuses --group-query-attention "
                    "with MLA)", "leave num_query_groups unset for an MLA model",
                )
        if self.num_query_groups is None:
            set_("num_query_groups", heads)
        groups: int = self.num_query_groups  # type: ignore[assignment]  # resolved just above
        if groups > heads or heads % groups != 0:
            raise DynBatchConfigError(
                "num_query_groups", groups, f"must divide num_attention_heads={heads}",
                f"use a divisor of {heads} (e.g. {_divisors_hint(heads)}), or leave it unset for MHA",
            )

        # MLA fields
        if self.multi_latent_attention:
            for name in _MLA_REQUIRED:
                if getattr(self, name) is None:
                    raise DynBatchConfigError(
                        name, None, "is required when multi_latent_attention is true",
                        f"set {name} (DeepSeek-V3 uses kv_lora_rank=512, qk_head_dim=128, "
                        "qk_pos_emb_head_dim=64, v_head_dim=128)",
                    )
            positive("q_lora_rank", optional=True)
            positive("kv_lora_rank")
            positive("qk_head_dim")
            positive("qk_pos_emb_head_dim", allow_zero=True)
            positive("v_head_dim")
        else:
            for name in _MLA_FIELDS:
                if getattr(self, name) is not None:
                    raise DynBatchConfigError(
                        name, getattr(self, name), "is an MLA field but multi_latent_attention is false",
                        "set multi_latent_attention: true for an MLA model, or remove the MLA fields",
                    )

        # vocabulary
        if self.padded_vocab_size is None:
            m = self.make_vocab_size_divisible_by
            set_("padded_vocab_size", -(-self.vocab_size // m) * m)
        elif self.padded_vocab_size < self.vocab_size:
            raise DynBatchConfigError(
                "padded_vocab_size", self.padded_vocab_size, f"is smaller than vocab_size={self.vocab_size}",
                "use a padded size >= vocab_size, or leave it unset to pad to a multiple of "
                "make_vocab_size_divisible_by",
            )

        # MoE
        set_("moe_layer_freq", _parse_layer_freq(self.moe_layer_freq))
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            if freq < 1:
                raise DynBatchConfigError(
                    "moe_layer_freq", freq, "must be >= 1", "use 1 (every layer is MoE) or N (every N-th layer)"
                )
        elif len(freq) != self.num_layers:
            raise DynBatchConfigError(
                "moe_layer_freq", list(freq),
                f"has {len(freq)} entries but num_layers={self.num_layers}",
                f"give exactly one 0/1 per layer ({self.num_layers} entries), or an integer frequency",
            )
        if self.num_experts is None:
            for name in _MOE_FIELDS:
                if getattr(self, name) is not None:
                    raise DynBatchConfigError(
                        name, getattr(self, name), "is an MoE field but num_experts is not set",
                        "set num_experts for an MoE model, or remove the MoE fields for a dense one",
                    )
            if freq != 1:
                raise DynBatchConfigError(
                    "moe_layer_freq", freq if isinstance(freq, int) else list(freq),
                    "is set but num_experts is not", "set num_experts for an MoE model, or remove moe_layer_freq",
                )
        else:
            for name in ("moe_ffn_hidden_size", "moe_router_topk"):
                if getattr(self, name) is None:
                    raise DynBatchConfigError(
                        name, None, f"is required when num_experts={self.num_experts} is set",
                        f"set {name} (Megatron's --{name.replace('_', '-')}; "
                        + ("Megatron defaults it to ffn_hidden_size)" if name == "moe_ffn_hidden_size"
                           else "e.g. 8 for Qwen3-MoE and DeepSeek-V3)"),
                    )
            positive("moe_ffn_hidden_size")
            positive("moe_router_topk")
            positive("moe_shared_expert_intermediate_size", optional=True)
            if int(self.moe_router_topk) > self.num_experts:  # type: ignore[arg-type]
                raise DynBatchConfigError(
                    "moe_router_topk", self.moe_router_topk, f"exceeds num_experts={self.num_experts}",
                    "route each token to at most num_experts experts",
                )

    # ------------------------------------------------------------------------------------------- helpers
    @property
    def is_moe(self) -> bool:
        """True when some layer has routed experts."""
        return self.num_experts is not None and any(self.moe_layer_pattern())

    def moe_layer_pattern(self) -> List[int]:
        """One entry per transformer layer (MTP layers excluded): 1 = MoE MLP, 0 = dense MLP.

        Megatron semantics: integer ``moe_layer_freq=N`` makes layer ``i`` (0-based) MoE when ``i % N == 0``;
        a list is used as is. A dense model (``num_experts`` unset) gives all zeros.
        """
        if self.num_experts is None:
            return [0] * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return [1 if i % freq == 0 else 0 for i in range(self.num_layers)]
        return list(freq)

    def padded_vocab_for(self, tp: int) -> int:
        """The vocabulary width Megatron gives the embedding and the LM head at tensor-parallel size ``tp``: the
        vocabulary padded to a multiple of ``make_vocab_size_divisible_by x tp`` (``_vocab_size_with_padding`` in
        Megatron-LM's ``megatron/training/tokenizer/tokenizer.py``), never below ``padded_vocab_size`` (a width read
        from the run itself is kept)."""
        multiple = self.make_vocab_size_divisible_by * max(1, int(tp))
        return max(int(self.padded_vocab_size or 0), -(-self.vocab_size // multiple) * multiple)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer_pattern())

    def to_dict(self) -> Dict[str, Any]:
        """All fields (derived defaults resolved) as plain Python values; ``moe_layer_freq`` as int or list."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if isinstance(out["moe_layer_freq"], tuple):
            out["moe_layer_freq"] = list(out["moe_layer_freq"])
        return out

    def replace(self, **changes: Any) -> "ModelSpec":
        """A copy with some fields changed (validated again). Handy for truncated test models, e.g.
        ``spec.replace(num_layers=4, moe_layer_freq=1)``."""
        return dataclasses.replace(self, **changes)

    # --------------------------------------------------------------------------------------- constructors
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelSpec":
        """Build from a mapping of Megatron field names. Unknown keys raise an error that names the key and
        lists close matches; ``gated_linear_unit`` and ``num_moe_experts`` (TransformerConfig spellings) are
        accepted as ``swiglu`` and ``num_experts``."""
        if isinstance(d, ModelSpec):
            return d
        if not isinstance(d, Mapping):
            raise DynBatchConfigError(
                "model", d, "must be a mapping of ModelSpec fields",
                "pass a dict such as {'num_layers': 28, 'hidden_size': 1024, ...} or a preset name",
            )
        known = [f.name for f in fields(cls)]
        kwargs: Dict[str, Any] = {}
        for key, value in d.items():
            canonical = _ALIASES.get(key, key)
            if canonical not in known:
                hint = did_you_mean(key, known + list(_ALIASES))
                if key in _HF_KEYS:
                    fix = ("this looks like a Hugging Face config.json; load it with ModelSpec.from_hf_config(path)"
                           " or rename the keys to Megatron's (num_layers, ffn_hidden_size, num_query_groups, ...)")
                elif hint:
                    fix = hint
                else:
                    fix = f"use only ModelSpec fields: {', '.join(known)}"
                raise DynBatchConfigError(str(key), value, "unknown model field", fix)
            if canonical in kwargs and kwargs[canonical] != value:
                raise DynBatchConfigError(
                    str(key), value, f"conflicts with {canonical}={kwargs[canonical]!r} given in the same mapping",
                    f"give only {canonical}",
                )
            kwargs[canonical] = value
        missing = [f.name for f in fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   and f.name not in kwargs]
        if missing:
            raise DynBatchConfigError(
                missing[0], None, "is required",
                f"add {', '.join(missing)} to the model config (Megatron's --{missing[0].replace('_', '-')})",
            )
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path_or_preset: Union[str, os.PathLike]) -> "ModelSpec":
        """Load a YAML file of ModelSpec fields, or a preset by name (``"qwen3-8b"`` ->
        ``configs/models/qwen3-8b.yaml``; see :func:`preset_dirs` for where presets are looked up).
        A YAML file whose only top-level key is ``model`` is read from that key. JSON files work too (JSON is
        YAML). Parsed files are cached by path and modification time."""
        path = resolve_model_preset(path_or_preset).resolve()
        data = dict(load_model_mapping(path, path.stat().st_mtime_ns))
        if set(data) == {"model"} and isinstance(data["model"], Mapping):
            data = dict(data["model"])
        if "name" not in data:
            data = {**data, "name": path.stem}
        return cls.from_dict(data)

    @classmethod
    def from_megatron(
        cls,
        obj: Union[argparse.Namespace, MegatronConfigLike, MegatronModelLike],
        *,
        vocab_size: Optional[int] = None,
        padded_vocab_size: Optional[int] = None,
        name: Optional[str] = None,
    ) -> "ModelSpec":
        """Build from Megatron's parsed ``args`` (an ``argparse.Namespace``), a megatron-core
        ``TransformerConfig`` (or ``MLATransformerConfig``) or a ``GPTModel`` (its ``.config`` and
        ``.vocab_size`` are used). Attributes are read with ``getattr``; megatron is never imported.

        Spelling differences handled: args say ``swiglu`` / ``num_experts`` where TransformerConfig says
        ``gated_linear_unit`` / ``num_moe_experts``; args only use ``num_query_groups`` when
        ``group_query_attention`` is set. A ``TransformerConfig`` has no vocabulary, so pass ``vocab_size=``
        (and ``padded_vocab_size=`` if the run pads differently). With args, ``padded_vocab_size`` (set by
        Megatron's tokenizer builder) is preferred; otherwise the vocabulary is padded like Megatron does, to a
        multiple of ``make_vocab_size_divisible_by * tensor_model_parallel_size``.
        """
        return cls.from_dict(fields_from_megatron(obj, vocab_size=vocab_size, padded_vocab_size=padded_vocab_size,
                                                  name=name))

    @classmethod
    def from_hf_config(cls, path_or_dict: Union[str, os.PathLike, Mapping[str, Any]],
                       *, name: Optional[str] = None) -> "ModelSpec":
        """Build from a local Hugging Face ``config.json`` (a file, a directory holding one, or the parsed
        dict). Nothing is downloaded.

        Supported ``model_type``: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` (dense, gated MLP),
        ``qwen2_moe``, ``qwen3_moe`` (layer ``i`` is MoE unless listed in ``mlp_only_layers`` and when
        ``(i+1) % decoder_sparse_step == 0``), ``deepseek_v2``, ``deepseek_v3`` (MLA; layer ``i`` is MoE when
        ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``; shared experts =
        ``n_shared_experts * moe_intermediate_size``). A multimodal config's ``text_config`` is used when the
        top level has no layer count. DeepSeek's MTP module (``num_nextn_predict_layers``) is not counted:
        whether MTP is trained is a Megatron flag (``--mtp-num-layers``), so set ``mtp_num_layers`` yourself.
        """
        return cls.from_dict(fields_from_hf_config(path_or_dict, name=name))

    @classmethod
    def from_any(cls, model: "ModelLike") -> "ModelSpec":
        """Accept a ``ModelSpec``; a dict of fields; a preset name (``"qwen3-8b"``); a path to a YAML file, to
        a JSON file of fields, or to a Hugging Face ``config.json`` (or its directory); or an object with
        Megatron attributes (args / TransformerConfig / GPTModel)."""
        if isinstance(model, ModelSpec):
            return model
        if isinstance(model, Mapping):
            return cls.from_dict(model)
        if isinstance(model, (str, os.PathLike)):
            p = Path(model)
            if p.is_dir() and (p / "config.json").is_file():
                return cls.from_hf_config(p)
            if p.suffix.lower() == ".json" and p.is_file():
                with open(p, encoding="utf-8") as fh:
                    data = json.load(fh)
                if isinstance(data, Mapping) and (_HF_KEYS & set(data)) and "num_layers" not in data:
                    return cls.from_hf_config(data, name=p.parent.name.lower() or None)
                return cls.from_dict({"name": p.stem, **data} if isinstance(data, Mapping) else data)
            return cls.from_yaml(model)
        if hasattr(model, "model_type") and hasattr(model, "num_hidden_layers") and hasattr(model, "to_dict"):
            return cls.from_hf_config(model.to_dict())  # a transformers PretrainedConfig object
        if isinstance(model, argparse.Namespace) or hasattr(model, "hidden_size") or hasattr(model, "config"):
            return cls.from_megatron(model)
        raise DynBatchConfigError(
            "model", model, "cannot build a ModelSpec from this",
            "pass a ModelSpec, a dict of Megatron fields, a preset name such as 'qwen3-8b', a YAML/JSON path, "
            "or Megatron args / a TransformerConfig",
        )


class MegatronConfigLike(Protocol):
    """A megatron-core ``TransformerConfig`` (or ``MLATransformerConfig``), or Megatron's parsed args under another
    type: what :meth:`ModelSpec.from_megatron` reads by attribute (megatron is never imported here)."""

    hidden_size: int


class MegatronModelLike(Protocol):
    """A megatron-core model (``GPTModel``, or a wrapper with its ``config``): its ``.config`` and ``.vocab_size``
    are read."""

    config: Any


class HFConfigLike(Protocol):
    """A ``transformers`` ``PretrainedConfig`` (read through its ``to_dict()``; transformers is never imported)."""

    model_type: str
    num_hidden_layers: int

    def to_dict(self) -> Dict[str, Any]: ...


#: What :meth:`ModelSpec.from_any` accepts: a spec, a dict of fields, a preset name or a file path, Megatron's
#: args, a ``TransformerConfig`` or model, or a Hugging Face config object (the last three matched by shape)
ModelLike = Union[ModelSpec, Mapping[str, Any], str, os.PathLike, argparse.Namespace, MegatronConfigLike,
                  MegatronModelLike, HFConfigLike]


def _is_np_float(value: Any) -> bool:
    """A NumPy floating scalar (accepted as a dropout probability)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, (np.floating, np.integer))


def _divisors_hint(n: int) -> str:
    divs = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(str(d) for d in divs[:8]) + (", ..." if len(divs) > 8 else "")
