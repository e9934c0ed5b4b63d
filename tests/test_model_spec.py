"""ModelSpec: presets, validation errors (field, value, fix), and the Megatron / Hugging Face constructors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dynbatch import DynBatchConfigError, ModelSpec
from megatron_dynbatch.core.model_spec import available_presets, preset_dirs

PRESETS = ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b", "qwen3-235b-a22b",
           "llama-3.1-8b", "llama-3.1-70b", "deepseek-v3", "tiny-gpt"]

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=128)


# ------------------------------------------------------------------------------------------------ presets
def test_all_presets_present():
    assert set(PRESETS) <= set(available_presets())


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_validates_and_round_trips(name):
    spec = ModelSpec.from_yaml(name)
    assert spec.name == name
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert ModelSpec.from_any(name) == spec
    assert ModelSpec.from_yaml(name.upper()) == spec  # case-insensitive names
    assert spec.padded_vocab_size % 128 == 0
    assert len(spec.moe_layer_pattern()) == spec.num_layers


def test_preset_shapes():
    q = ModelSpec.from_yaml("qwen3-0.6b")
    assert (q.num_layers, q.hidden_size, q.num_attention_heads, q.num_query_groups, q.kv_channels,
            q.ffn_hidden_size, q.vocab_size, q.swiglu) == (28, 1024, 16, 8, 128, 3072, 151936, True)
    moe = ModelSpec.from_yaml("qwen3-30b-a3b")
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size, moe.num_moe_layers) == (128, 8, 768, 48)
    ds = ModelSpec.from_yaml("deepseek-v3")
    assert ds.moe_layer_pattern() == [0, 0, 0] + [1] * 58
    assert (ds.q_lora_rank, ds.kv_lora_rank, ds.qk_head_dim, ds.qk_pos_emb_head_dim, ds.v_head_dim) == \
        (1536, 512, 128, 64, 128)
    assert (ds.num_experts, ds.moe_router_topk, ds.moe_shared_expert_intermediate_size, ds.ffn_hidden_size) == \
        (256, 8, 2048, 18432)
    assert ds.multi_latent_attention and ds.mtp_num_layers is None


def test_presets_resolve_from_env_dir(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "my-model.yaml").write_text("num_layers: 3\nhidden_size: 32\nnum_attention_heads: 2\n"
                                                       "ffn_hidden_size: 64\nvocab_size: 50\n")
    monkeypatch.setenv("MEGATRON_DYNBATCH_CONFIGS", str(tmp_path))
    spec = ModelSpec.from_any("my-model")
    assert spec.name == "my-model" and spec.num_layers == 3 and spec.padded_vocab_size == 128
    assert preset_dirs()[0] == tmp_path / "models"
    assert "qwen3-8b" in available_presets()  # the repository presets stay visible


def test_yaml_file_path_and_model_key(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("model:\n  num_layers: 2\n  hidden_size: 64\n  num_attention_heads: 4\n  ffn_hidden_size: 128\n"
                 "  vocab_size: 128\n")
    spec = ModelSpec.from_yaml(f)
    assert spec.name == "run" and spec == ModelSpec(**TINY)
    assert ModelSpec.from_any(str(f)) == spec


# ------------------------------------------------------------------------------------------- defaults
def test_megatron_defaults():
    s = ModelSpec(**TINY)
    assert s.num_query_groups == 4 and s.kv_channels == 16 and s.padded_vocab_size == 128
    assert s.moe_layer_pattern() == [0, 0] and not s.is_moe
    assert ModelSpec(**{**TINY, "vocab_size": 129}).padded_vocab_size == 256
    assert ModelSpec(**{**TINY, "vocab_size": 129, "make_vocab_size_divisible_by": 64}).padded_vocab_size == 192


def test_moe_layer_freq_forms():
    kw = dict(TINY, num_layers=6, num_experts=4, moe_router_topk=1, moe_ffn_hidden_size=32)
    assert ModelSpec(**kw, moe_layer_freq=1).moe_layer_pattern() == [1] * 6
    assert ModelSpec(**kw, moe_layer_freq=3).moe_layer_pattern() == [1, 0, 0, 1, 0, 0]  # i % 3 == 0
    assert ModelSpec(**kw, moe_layer_freq=[0, 1, 0, 1, 1, 1]).moe_layer_pattern() == [0, 1, 0, 1, 1, 1]
    s = ModelSpec(**kw, moe_layer_freq="([0]*2+[1]*4)")
    assert s.moe_layer_pattern() == [0, 0, 1, 1, 1, 1] and s.to_dict()["moe_layer_freq"] == [0, 0, 1, 1, 1, 1]
    assert hash(s) == hash(ModelSpec(**kw, moe_layer_freq=(0, 0, 1, 1, 1, 1)))


# --------------------------------------------------------------------------------------------- errors
def test_unknown_field_names_close_matches():
    with pytest.raises(ValueError, match=r"hiden_size=64: unknown model field\. Fix: did you mean 'hidden_size'"):
        ModelSpec.from_dict({**TINY, "hiden_size": 64})


def test_hf_keys_in_from_dict_point_to_from_hf_config():
    with pytest.raises(ValueError, match=r"num_hidden_layers=2: unknown model field.*from_hf_config"):
        ModelSpec.from_dict({"num_hidden_layers": 2, "hidden_size": 64})


def test_missing_required_field():
    d = dict(TINY)
    del d["ffn_hidden_size"]
    with pytest.raises(DynBatchConfigError, match=r"ffn_hidden_size=None: is required\. Fix: add ffn_hidden_size"):
        ModelSpec.from_dict(d)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(num_attention_heads=5), r"num_attention_heads=5: does not divide hidden_size=64.*Fix: .*kv_channels"),
        (dict(num_query_groups=3), r"num_query_groups=3: must divide num_attention_heads=4\. Fix: use a divisor"),
        (dict(num_layers=0), r"num_layers=0: must be an integer >= 1\. Fix:"),
        (dict(hidden_size=64.0), r"hidden_size=64\.0: must be an integer"),
        (dict(swiglu="yes"), r"swiglu='yes': must be true or false"),
        (dict(padded_vocab_size=64), r"padded_vocab_size=64: is smaller than vocab_size=128"),
        (dict(num_experts=8), r"moe_ffn_hidden_size=None: is required when num_experts=8 is set"),
        (dict(num_experts=8, moe_ffn_hidden_size=32), r"moe_router_topk=None: is required when num_experts=8"),
        (dict(num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=9), r"moe_router_topk=9: exceeds num_experts=8"),
        (dict(num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2, moe_layer_freq=[1, 0, 1]),
         r"moe_layer_freq=\[1, 0, 1\]: has 3 entries but num_layers=2\. Fix: give exactly one 0/1 per layer"),
        (dict(num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2, moe_layer_freq=[1, 2]),
         r"moe_layer_freq=\[1, 2\]: list entries must be 0 \(dense\) or 1 \(MoE\)"),
        (dict(num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2, moe_layer_freq="[1]*2 - 1"),
         r"moe_layer_freq='\[1\]\*2 - 1': cannot parse"),
        (dict(moe_router_topk=2), r"moe_router_topk=2: is an MoE field but num_experts is not set"),
        (dict(multi_latent_attention=True), r"kv_lora_rank=None: is required when multi_latent_attention is true"),
        (dict(q_lora_rank=16), r"q_lora_rank=16: is an MLA field but multi_latent_attention is false\. Fix: set"),
        (dict(multi_latent_attention=True, num_query_groups=2, kv_lora_rank=8, qk_head_dim=8,
              qk_pos_emb_head_dim=4, v_head_dim=8), r"num_query_groups=2: multi-latent attention has no grouped"),
    ],
)
def test_validation_errors_name_field_value_fix(changes, match):
    with pytest.raises(ValueError, match=match) as info:
        ModelSpec(**{**TINY, **changes})
    assert isinstance(info.value, DynBatchConfigError) and "Fix:" in str(info.value)


def test_unknown_preset_suggests_close_names():
    with pytest.raises(ValueError, match=r"model='qwen3-8': unknown model preset\. Fix: did you mean 'qwen3-8b'"):
        ModelSpec.from_yaml("qwen3-8")
    with pytest.raises(ValueError, match=r"file not found"):
        ModelSpec.from_yaml("does/not/exist.yaml")
    with pytest.raises(ValueError, match=r"model=3.5: cannot build a ModelSpec"):
        ModelSpec.from_any(3.5)


def test_non_mapping_yaml(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must contain a mapping"):
        ModelSpec.from_yaml(f)


# ------------------------------------------------------------------------------------------ Megatron
def test_from_megatron_args_namespace():
    args = argparse.Namespace(
        num_layers=28, hidden_size=1024, num_attention_heads=16, group_query_attention=True, num_query_groups=8,
        kv_channels=128, ffn_hidden_size=3072, swiglu=True, vocab_size=151936, padded_vocab_size=151936,
        num_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None, multi_latent_attention=False,
        q_lora_rank=None, kv_lora_rank=32, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
        moe_layer_freq=1, mtp_num_layers=None, make_vocab_size_divisible_by=128, tensor_model_parallel_size=2,
        hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=True,  # as slime launches Qwen3
    )
    assert ModelSpec.from_megatron(args) == ModelSpec.from_yaml("qwen3-0.6b")
    assert ModelSpec.from_any(args) == ModelSpec.from_yaml("qwen3-0.6b")
    # without --group-query-attention Megatron ignores num_query_groups (its default is 1)
    mha = ModelSpec.from_megatron(argparse.Namespace(**{**vars(args), "group_query_attention": False,
                                                        "num_query_groups": 1}))
    assert mha.num_query_groups == 16
    # no padded size: pad like Megatron, to make_vocab_size_divisible_by * tp
    padded = ModelSpec.from_megatron(argparse.Namespace(**{**vars(args), "padded_vocab_size": None,
                                                           "vocab_size": 50257}))
    assert padded.padded_vocab_size == 50432 and padded.padded_vocab_size % 256 == 0


def test_from_megatron_args_moe_mla():
    args = argparse.Namespace(
        num_layers=61, hidden_size=7168, num_attention_heads=128, group_query_attention=False,
        num_query_groups=1, kv_channels=128, ffn_hidden_size=18432, swiglu=True, padded_vocab_size=129280,
        vocab_size=None, num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
        moe_shared_expert_intermediate_size=2048, moe_layer_freq=[0] * 3 + [1] * 58, multi_latent_attention=True,
        q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
        mtp_num_layers=None, hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=True,
    )
    assert ModelSpec.from_megatron(args) == ModelSpec.from_yaml("deepseek-v3")
    with_mtp = ModelSpec.from_megatron(argparse.Namespace(**{**vars(args), "mtp_num_layers": 1}))
    assert with_mtp.mtp_num_layers == 1


def test_from_megatron_transformer_config():
    pytest.importorskip("megatron.core")
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=128, gated_linear_unit=True, activation_func=F.silu,
                            hidden_dropout=0.0, attention_dropout=0.0)  # as tiny_gpt_config() builds it
    with pytest.raises(ValueError, match=r"vocab_size=None: TransformerConfig carries no vocabulary size"):
        ModelSpec.from_megatron(cfg)
    spec = ModelSpec.from_megatron(cfg, vocab_size=128, name="tiny-gpt")
    assert spec == ModelSpec.from_yaml("tiny-gpt")

    moe_cfg = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32,
                                moe_shared_expert_intermediate_size=64, moe_layer_freq=[0, 1, 1, 1],
                                add_bias_linear=False)
    moe = ModelSpec.from_megatron(moe_cfg, vocab_size=1000)
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size,
            moe.moe_shared_expert_intermediate_size) == (8, 2, 32, 64)
    assert moe.moe_layer_pattern() == [0, 1, 1, 1] and not moe.swiglu and moe.padded_vocab_size == 1024

    mla_cfg = MLATransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                   q_lora_rank=32, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                                   v_head_dim=8)
    mla = ModelSpec.from_megatron(mla_cfg, vocab_size=128)
    assert mla.multi_latent_attention and (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim,
                                           mla.qk_pos_emb_head_dim, mla.v_head_dim) == (32, 16, 8, 4, 8)


# -------------------------------------------------------------------------------------- Hugging Face
HF_CONFIGS = {
    # the published config.json values relevant to FLOPs (other keys omitted)
    "qwen3-0.6b": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 28,
                   "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "intermediate_size": 3072, "vocab_size": 151936, "hidden_act": "silu",
                   "tie_word_embeddings": True},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                      "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "vocab_size": 151936, "hidden_act": "silu"},
    "llama-3.1-8b": {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                     "vocab_size": 128256, "hidden_act": "silu", "head_dim": 128},
    "deepseek-v3": {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
                    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "vocab_size": 129280, "num_nextn_predict_layers": 1},
}


@pytest.mark.parametrize("preset", list(HF_CONFIGS))
def test_from_hf_config_matches_preset(tmp_path, preset):
    d = tmp_path / preset
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF_CONFIGS[preset]))
    from_file = ModelSpec.from_hf_config(d / "config.json")
    assert from_file == ModelSpec.from_yaml(preset)
    assert from_file.name == preset
    assert ModelSpec.from_hf_config(d) == from_file  # a model directory works too
    assert ModelSpec.from_any(str(d / "config.json")) == from_file
    assert ModelSpec.from_any(d) == from_file


def test_from_hf_config_qwen3_moe_sparse_step_and_dense_layers():
    cfg = {**HF_CONFIGS["qwen3-30b-a3b"], "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    spec = ModelSpec.from_hf_config(cfg)
    # HF: layer i is sparse when (i+1) % step == 0 and i not in mlp_only_layers
    assert spec.moe_layer_pattern() == [0, 1, 0, 0, 0, 1]


def test_from_hf_config_deepseek_without_q_lora_and_text_config():
    cfg = {**HF_CONFIGS["deepseek-v3"], "model_type": "deepseek_v2", "q_lora_rank": None, "n_shared_experts": 2,
           "num_hidden_layers": 4, "first_k_dense_replace": 1}
    spec = ModelSpec.from_hf_config({"model_type": "wrapper", "text_config": cfg})
    assert spec.q_lora_rank is None and spec.moe_shared_expert_intermediate_size == 4096
    assert spec.moe_layer_pattern() == [0, 1, 1, 1]


def test_from_hf_config_errors(tmp_path):
    with pytest.raises(ValueError, match=r"model_type='gpt2': unsupported Hugging Face model type"):
        ModelSpec.from_hf_config({"model_type": "gpt2", "n_layer": 12})
    bad = dict(HF_CONFIGS["llama-3.1-8b"])
    del bad["intermediate_size"]
    with pytest.raises(ValueError, match=r"intermediate_size=None: missing from the llama config"):
        ModelSpec.from_hf_config(bad)
    with pytest.raises(ValueError, match=r"no Hugging Face config.json there"):
        ModelSpec.from_hf_config(tmp_path / "nothing")


# ---------------------------------------------------------------------------------------- purity
def test_planning_core_modules_do_not_import_torch_or_megatron():
    code = ("import sys; import megatron_dynbatch.core.model_spec, megatron_dynbatch.core.flops; "
            "bad = [m for m in ('torch', 'megatron') if m in sys.modules]; print(bad); assert not bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stdout + out.stderr


def test_from_any_accepts_a_transformers_config_object():
    class FakePretrainedConfig:  # duck-typed like transformers.PretrainedConfig
        def __init__(self, d):
            self.__dict__.update(d)

        def to_dict(self):
            return dict(self.__dict__)

    obj = FakePretrainedConfig(HF_CONFIGS["llama-3.1-8b"])
    assert ModelSpec.from_any(obj) == ModelSpec.from_yaml("llama-3.1-8b")
