"""A layout key or flag under another name gets the field the user means (issue 28 item 12).

``parallel: {tensor_parallel_size: 2}`` used to suggest ``expert_tensor_parallel_size`` (the nearest string);
the suggestion now comes from the words of the key (:func:`~megatron_dynbatch.core.parallel.layout_key_meaning`),
over a list of the names other trainers and Megatron's own flags use, with and without typos."""

from __future__ import annotations

import pytest

from megatron_dynbatch.cli import main
from megatron_dynbatch.core.errors import DynBatchConfigError
from megatron_dynbatch.core.parallel import ParallelConfig, layout_key_meaning, parallel_from_mapping
from megatron_dynbatch.core.run_config import RunConfig

MEANT = [  # (key a user writes, the field meant)
    ("tensor_parallel_size", "tp"), ("tensor_parallel", "tp"), ("tensor_parallelism", "tp"), ("tp_size", "tp"),
    ("tp_degree", "tp"), ("TP", "tp"), ("TensorParallelSize", "tp"), ("tensor-model-parallel-size", "tp"),
    ("tensor_model_parallel", "tp"), ("tensor_modle_parallel_size", "tp"), ("tensor_model_paralel_size", "tp"),
    ("tensr_paralel_size", "tp"), ("model_parallel_size", "tp"), ("num_tensor_parallel", "tp"),
    ("pipeline_parallel_size", "pp"), ("pipline_parallel", "pp"), ("pp_size", "pp"), ("pipe_parallel_size", "pp"),
    ("context_parallel", "cp"), ("contex_parallel_size", "cp"), ("cp_size", "cp"), ("ctx_parallel_size", "cp"),
    ("ulysses_sequence_parallel_size", "cp"), ("sequence_parallel_size", "cp"),
    ("expert_parallel_size", "ep"), ("ep_size", "ep"), ("moe_parallel_size", "ep"), ("expert_paralel", "ep"),
    ("expert_tensor_parallel", "etp"), ("etp_size", "etp"), ("expert_tp", "etp"),
    ("data_parallel", "dp"), ("dp_size", "dp"), ("data_parallelism", "dp"),
    ("virtual_pipeline_size", "vpp"), ("vpp_size", "vpp"), ("virtual_pipeline_parallel_size", "vpp"),
    ("sequence_parallelism", "sequence_parallel"), ("seq_parallel", "sequence_parallel"), ("sp", "sequence_parallel"),
    ("num_gpus", "world_size"), ("gpus", "world_size"), ("world", "world_size"), ("word_size", "world_size"),
    ("gpu_per_node", "gpus_per_node"), ("nproc_per_node", "gpus_per_node"), ("devices_per_node", "gpus_per_node"),
    ("microbatch_group_size", "microbatch_group_size_per_vp_stage"),
]


@pytest.mark.parametrize("key, meant", MEANT)
def test_a_layout_key_under_another_name_suggests_the_field_meant(key, meant):
    assert layout_key_meaning(key)[0] == meant
    with pytest.raises(DynBatchConfigError) as err:
        parallel_from_mapping({key: 2})
    fix = err.value.fix
    assert fix.startswith(f"did you mean {meant!r}"), fix
    if meant != "etp":
        assert "expert_tensor_parallel_size" not in fix, fix


def test_the_suggestion_names_megatrons_spelling_too_and_both_are_accepted():
    with pytest.raises(DynBatchConfigError) as err:
        ParallelConfig.from_any({"tensor_parallel_size": 2})
    assert err.value.fix == "did you mean 'tp' (Megatron: 'tensor_model_parallel_size')?"
    assert ParallelConfig.from_any({"tp": 2}) == ParallelConfig.from_any({"tensor_model_parallel_size": 2})


def test_keys_that_name_no_dimension_keep_the_closest_spellings():
    assert layout_key_meaning("max_seq_len") == [] and layout_key_meaning(3) == []
    with pytest.raises(DynBatchConfigError, match="did you mean 'tp'"):
        parallel_from_mapping({"tpp": 2})
    with pytest.raises(DynBatchConfigError, match="use only"):
        parallel_from_mapping({"xyzzy": 2})
    # a node count: the layout takes GPUs, so both fields that can say it
    assert layout_key_meaning("num_nodes") == ["world_size", "gpus_per_node"]


def test_run_preset_yaml_says_what_the_user_meant(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: qwen3-8b\nparallel: {dp: 4, tensor_parallel_size: 2}\nmax_tokens_per_gpu: 8192\n")
    with pytest.raises(DynBatchConfigError) as err:
        RunConfig.from_yaml(str(path))
    assert err.value.field == "parallel.tensor_parallel_size" and "'tp'" in err.value.fix
    assert "expert_tensor_parallel_size" not in err.value.fix
    # at the top level: the layout key belongs under parallel:, by the name it has there
    base = {"name": "t", "model": "qwen3-8b", "parallel": {"dp": 4}, "max_tokens_per_gpu": 8192}
    for key in ("tensor_parallel_size", "tensor_model_parallel_size", "tp_size"):
        with pytest.raises(DynBatchConfigError) as err:
            RunConfig.from_dict({**base, key: 2})
        assert err.value.fix == "layout keys go under 'parallel:' (parallel: {tp: 2})", key
    # run fields that merely contain a dimension's word keep their own suggestion
    for key, field in (("max_seq_lenn", "max_seq_len"), ("moe_token_dispatcher", "moe_token_dispatcher_type"),
                       ("max_tokens_per_gpus", "max_tokens_per_gpu")):
        with pytest.raises(DynBatchConfigError) as err:
            RunConfig.from_dict({**base, key: 2})
        assert err.value.fix == f"did you mean {field!r}?", key


@pytest.mark.parametrize("flag, meant", [("--tensor-parallel-size", "--tp"), ("--tensor-model-parallel-size", "--tp"),
                                         ("--pipeline-parallel-size", "--pp"), ("--context-parallel-size", "--cp"),
                                         ("--expert-model-parallel-size", "--ep"), ("--tp-size", "--tp")])
def test_a_megatron_style_flag_suggests_the_cli_flag(flag, meant, capsys):
    assert main(["plan", "--lengths", "x.txt", "--model", "qwen3-8b", flag, "2"]) == 2
    assert f"did you mean {meant}?" in capsys.readouterr().err


def test_hostile_keys_never_break_the_suggestion():
    import random

    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_-. 0123456789/\\\u00e9\u4e2d"
    keys = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(300)]
    keys += [None, 3, 2.5, (1, 2), b"tp", "_" * 1000, "tensor" * 200]
    for key in keys:
        meant = layout_key_meaning(key)
        assert isinstance(meant, list) and all(isinstance(m, str) for m in meant)
        if isinstance(key, str) and key not in ("dp", "tp", "pp", "cp", "ep", "vpp", "etp", "world_size"):
            try:
                parallel_from_mapping({key: 2})
            except DynBatchConfigError as exc:
                assert exc.fix
