"""Reading a model's shape from other formats into :class:`~megatron_dynbatch.core.model_spec.ModelSpec` fields.

Two sources, each a pure function returning a dict of ModelSpec field names (validated afterwards by
``ModelSpec.from_dict``): Megatron's own objects (parsed ``args``, ``TransformerConfig``, ``GPTModel``; read with
``getattr``, megatron is never imported) and a local Hugging Face ``config.json`` (nothing is downloaded).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from .errors import DynBatchConfigError

__all__ = ["fields_from_megatron", "fields_from_hf_config", "MLA_FIELDS"]

#: The multi-latent-attention fields of ModelSpec (read from Megatron objects when MLA is on).
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def fields_from_megatron(obj: Any, *, vocab_size: Optional[int] = None, padded_vocab_size: Optional[int] = None,
                         name: Optional[str] = None) -> Dict[str, Any]:
    """ModelSpec fields of Megatron args / a TransformerConfig / a GPTModel (see ``ModelSpec.from_megatron``)."""
    model_vocab = None
    if getattr(obj, "num_layers", None) is None and getattr(obj, "config", None) is not None:
        model_vocab = getattr(obj, "vocab_size", None)
        obj = obj.config

    def get(attr: str, default: Any = None) -> Any:
        value = getattr(obj, attr, default)
        return default if value is None else value

    d: Dict[str, Any] = {}
    for attr in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels"):
        d[attr] = get(attr)
    if d["num_layers"] is None or d["hidden_size"] is None or d["num_attention_heads"] is None:
        raise DynBatchConfigError(
            "model", type(obj).__name__,
            "has no num_layers / hidden_size / num_attention_heads attributes",
            "pass Megatron's parsed args, a TransformerConfig or a GPTModel",
        )
    if d["ffn_hidden_size"] is None:  # same default as TransformerConfig.__post_init__
        d["ffn_hidden_size"] = 4 * d["hidden_size"]
    if getattr(obj, "group_query_attention", True) is False:
        d["num_query_groups"] = None  # args carry num_query_groups=1 even without GQA
    else:
        d["num_query_groups"] = get("num_query_groups")
    swiglu = getattr(obj, "swiglu", None)
    d["swiglu"] = bool(swiglu if swiglu is not None else get("gated_linear_unit", False))

    num_experts = get("num_experts", get("num_moe_experts"))
    if num_experts:
        d["num_experts"] = num_experts
        d["moe_ffn_hidden_size"] = get("moe_ffn_hidden_size", d["ffn_hidden_size"])
        d["moe_router_topk"] = get("moe_router_topk", 2)  # Megatron's default
        d["moe_shared_expert_intermediate_size"] = get("moe_shared_expert_intermediate_size") or None
        d["moe_layer_freq"] = get("moe_layer_freq", 1)
    if getattr(obj, "multi_latent_attention", False):
        d["multi_latent_attention"] = True
        d["num_query_groups"] = None
        for attr in MLA_FIELDS:
            d[attr] = get(attr)
    mtp = get("mtp_num_layers")
    if mtp:
        d["mtp_num_layers"] = mtp
    for attr in ("hidden_dropout", "attention_dropout"):  # args and TransformerConfig: the same names, 0.1 default
        if isinstance(getattr(obj, attr, None), (int, float)):
            d[attr] = getattr(obj, attr)
    if getattr(obj, "qk_layernorm", None) is not None:
        d["qk_layernorm"] = bool(getattr(obj, "qk_layernorm"))

    divisible = get("make_vocab_size_divisible_by", 128)
    vocab = vocab_size if vocab_size is not None else get("vocab_size", model_vocab)
    padded = padded_vocab_size if padded_vocab_size is not None else get("padded_vocab_size")
    if padded is None and vocab_size is None and model_vocab is not None and vocab == model_vocab:
        padded = model_vocab  # a GPTModel's vocab_size is the width its output layer really has
    if vocab is None:
        vocab = padded
    if vocab is None:
        raise DynBatchConfigError(
            "vocab_size", None, f"{type(obj).__name__} carries no vocabulary size",
            "pass ModelSpec.from_megatron(config, vocab_size=...) (TransformerConfig has no vocab)",
        )
    if padded is None:  # Megatron's _vocab_size_with_padding
        multiple = int(divisible) * int(get("tensor_model_parallel_size", 1))
        padded = -(-int(vocab) // multiple) * multiple
    d["vocab_size"] = vocab
    d["padded_vocab_size"] = padded
    d["make_vocab_size_divisible_by"] = divisible
    d["name"] = name
    return d


def fields_from_hf_config(path_or_dict: Union[str, os.PathLike, Mapping[str, Any]], *,
                          name: Optional[str] = None) -> Dict[str, Any]:
    """ModelSpec fields of a local Hugging Face config (see ``ModelSpec.from_hf_config``)."""
    if isinstance(path_or_dict, Mapping):
        cfg = dict(path_or_dict)
        src = "config"
    else:
        p = Path(path_or_dict)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise DynBatchConfigError(
                "path", str(path_or_dict), "no Hugging Face config.json there",
                "pass the path of a local config.json or of the model directory holding it (nothing is "
                "downloaded)",
            )
        with open(p, encoding="utf-8") as fh:
            cfg = json.load(fh)
        src = str(p)
        if name is None:
            name = p.parent.name.lower() or None
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    model_type = cfg.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        raise DynBatchConfigError(
            "model_type", model_type, f"unsupported Hugging Face model type in {src}",
            f"supported: {', '.join(sorted(_HF_MODEL_TYPES))}; for another family write a YAML file with "
            "Megatron field names (see configs/models/)",
        )

    def req(key: str) -> Any:
        if cfg.get(key) is None:
            raise DynBatchConfigError(
                key, None, f"missing from the {model_type} config {src}",
                "use the model's original config.json",
            )
        return cfg[key]

    num_layers = int(req("num_hidden_layers"))
    hidden = int(req("hidden_size"))
    heads = int(req("num_attention_heads"))
    d: Dict[str, Any] = {
        "name": name,
        "num_layers": num_layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "ffn_hidden_size": int(req("intermediate_size")),
        "vocab_size": int(req("vocab_size")),
        "swiglu": True,  # every supported family uses a gated (SiLU) MLP: gate_proj, up_proj, down_proj
        # Hugging Face configs carry attention_dropout (0.0 for these families) and no hidden dropout; verl's
        # Megatron config converter passes them on the same way (hidden dropout 0 unless the config says)
        "attention_dropout": float(cfg.get("attention_dropout") or 0.0),
        "hidden_dropout": float(cfg.get("hidden_dropout") or 0.0),
        "qk_layernorm": model_type in _QK_NORM_TYPES,
    }
    family = _HF_MODEL_TYPES[model_type]
    if family == "mla":
        d["multi_latent_attention"] = True
        d["q_lora_rank"] = cfg.get("q_lora_rank")
        d["kv_lora_rank"] = int(req("kv_lora_rank"))
        d["qk_head_dim"] = int(req("qk_nope_head_dim"))
        d["qk_pos_emb_head_dim"] = int(req("qk_rope_head_dim"))
        d["v_head_dim"] = int(req("v_head_dim"))
        d["kv_channels"] = int(req("v_head_dim"))
    else:
        kv_heads = cfg.get("num_key_value_heads")
        d["num_query_groups"] = int(kv_heads) if kv_heads is not None else None
        head_dim = cfg.get("head_dim")
        if head_dim is not None:
            d["kv_channels"] = int(head_dim)

    if family == "qwen_moe" and cfg.get("num_experts"):
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense_only = set(cfg.get("mlp_only_layers") or [])
        pattern = [0 if (i in dense_only or (i + 1) % step != 0) else 1 for i in range(num_layers)]
        d.update(num_experts=int(cfg["num_experts"]), moe_router_topk=int(req("num_experts_per_tok")),
                 moe_ffn_hidden_size=int(req("moe_intermediate_size")), moe_layer_freq=_compact(pattern))
        shared = cfg.get("shared_expert_intermediate_size")
        if shared:
            d["moe_shared_expert_intermediate_size"] = int(shared)
    elif family == "mla" and cfg.get("n_routed_experts"):
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        freq = int(cfg.get("moe_layer_freq") or 1)
        pattern = [1 if (i >= first_dense and i % freq == 0) else 0 for i in range(num_layers)]
        moe_ffn = int(req("moe_intermediate_size"))
        d.update(num_experts=int(cfg["n_routed_experts"]), moe_router_topk=int(req("num_experts_per_tok")),
                 moe_ffn_hidden_size=moe_ffn, moe_layer_freq=_compact(pattern))
        n_shared = cfg.get("n_shared_experts")
        if n_shared:
            d["moe_shared_expert_intermediate_size"] = int(n_shared) * moe_ffn
    return d


#: Hugging Face families that normalise queries and keys (Qwen3: per head; DeepSeek MLA: the compressed latents)
_QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3"})

_HF_MODEL_TYPES = {
    "llama": "dense", "mistral": "dense", "qwen2": "dense", "qwen3": "dense",
    "qwen2_moe": "qwen_moe", "qwen3_moe": "qwen_moe",
    "deepseek_v2": "mla", "deepseek_v3": "mla",
}


def _compact(pattern: Sequence[int]) -> Union[int, List[int]]:
    """All-MoE patterns are written as ``1`` (Megatron's default); anything else stays a list."""
    return 1 if all(pattern) else list(pattern)


