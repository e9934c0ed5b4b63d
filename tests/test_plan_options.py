"""PlanOptions: one options object, validated at construction, that reaches the planner whole from every entry
point (core/planner/options.py).

The reach test is table-driven: ``VALUES`` holds a non-default value of every option and must name every
field, so a new option fails here until it has one; each entry point's spelling of the options is read from
the field's own metadata (the launch flag, the ``plan`` flag) or is one of the entry point's documented
exceptions below. The planner's ``prepare`` (and ``plan_dynamic_cp``) is replaced by a recorder, so the test
sees exactly the options object the planner would have planned with.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import numpy as np
import pytest

from megatron_dynbatch import (BalanceBy, DynBatchConfigError, ModelSpec, ParallelConfig, PlanOptions, RunConfig,
                               UnknownOptionError, plan_global_batch)
from megatron_dynbatch.core.memory import MemorySettings, choose_budget
from megatron_dynbatch.core.planner import api
from megatron_dynbatch.core.planner.options import ResolvedOptions
from megatron_dynbatch.core.run_config import OPTION_KEYS

BASE = {"max_tokens_per_gpu": 2048, "model": "qwen3-0.6b", "parallel": {"dp": 2}}

#: a non-default value of every option
VALUES = {
    "max_tokens_per_gpu": 4096,
    "model": "qwen3-4b",
    "parallel": {"dp": 2, "tp": 2},
    "balance_by": "flops",
    "cost_model": "analytic",
    "decision_margin": 0.07,
    "oversize": "alone",
    "fp8_alignment": "mxfp8",
    "samples_per_step": 4,
    "rollouts_per_step": 2,
    "dynamic_cp": True,
    "min_cp_size": 2,
    "num_microbatches": 3,
    "refine_rounds": 5,
    "equal_samples_per_rank": True,
    "min_num_microbatches": 2,
    "num_microbatches_multiple": 2,
    "sequence_pad_multiple": 8,
    "microbatch_pad_multiple": 16,
    "gpu_memory_gb": 79.1,
    "memory": {"recompute": "full"},
    "forward_only": True,
    "memory_probe": True,
}

#: the plan command's tokens for each value (fields whose metadata names a ``plan`` flag)
CLI_TOKENS = {
    "max_tokens_per_gpu": ["--max-tokens-per-gpu", "4096"],
    "model": ["--model", "qwen3-4b"],
    "parallel": ["--dp", "2", "--tp", "2"],
    "balance_by": ["--balance-by", "flops"],
    "cost_model": ["--cost-model", "analytic"],
    "decision_margin": ["--decision-margin", "0.07"],
    "oversize": ["--oversize", "alone"],
    "fp8_alignment": ["--fp8", "mxfp8"],
    "samples_per_step": ["--samples-per-step", "4"],
    "dynamic_cp": ["--dynamic-cp"],
    "min_cp_size": ["--min-cp-size", "2"],
    "num_microbatches": ["--num-microbatches", "3"],
    "gpu_memory_gb": ["--gpu-memory-gb", "79.1"],
    "memory": ["--recompute", "full"],
}
#: options valid only together with others: what each door adds for it (Python keywords, ``plan`` tokens, launch
#: flags and Megatron's own args, run-preset fields)
NEEDS = {
    # a dynamic-CP pool must hold more than one GPU, also in local mode (which cuts the layout to dp=1)
    "dynamic_cp": {"python": {"parallel": {"dp": 2, "cp": 2}}},
    "min_cp_size": {"python": {"dynamic_cp": True, "parallel": {"dp": 2, "cp": 2}},
                    "cli": ["--dynamic-cp", "--cp", "2"],
                    "launch": ["--dynbatch-dynamic-cp", "--balance-by-flops"],
                    "megatron": {"context_parallel_size": 2, "world_size": 4},
                    "preset": {"dynamic_cp": True, "parallel": {"world_size": 4, "cp": 2}}},
}


def needs(name, door):
    return NEEDS.get(name, {}).get(door, {} if door in ("python", "megatron", "preset") else [])


#: options a Megatron launch does not set, and why (every other option has a launch flag)
NOT_LAUNCH_OPTIONS = {
    "rollouts_per_step": "counts rollouts of a trainer's batch (slime); a launch steps by samples",
    "num_microbatches": "Megatron's own count is what dynamic batching replaces",
    "refine_rounds": "a search bound for experiments",
    "equal_samples_per_rank": "a trainer drop-in's knob",
    "min_num_microbatches": "a trainer drop-in's knob",
    "num_microbatches_multiple": "a trainer drop-in's knob",
    "sequence_pad_multiple": "a trainer drop-in's knob (its own padding)",
    "microbatch_pad_multiple": "a trainer drop-in's knob (its own padding)",
    "forward_only": "a launch plans both passes (plan_options_from_args(args, forward_only=True))",
}
#: options a launch reads from Megatron's own flags, not a flag of ours (tested one by one below)
FROM_MEGATRONS_FLAGS = ("model", "parallel", "memory")
#: options the plan command does not set, and why
NOT_CLI_OPTIONS = {name: why for name, why in NOT_LAUNCH_OPTIONS.items() if name != "num_microbatches"}
NOT_CLI_OPTIONS["memory_probe"] = "the plan command runs no step to probe"


def expected(name):
    """What the options hold for ``VALUES[name]``."""
    value = VALUES[name]
    if name == "model":
        return ModelSpec.from_any(value)
    if name == "parallel":
        return ParallelConfig.from_any(value)
    if name == "balance_by":
        return BalanceBy(value)
    if name == "memory":
        return MemorySettings.from_any(value)
    return value


class Recorded(Exception):
    """Raised by the recorder once the planner has its options (nothing is planned)."""


@pytest.fixture
def recorder(monkeypatch):
    seen = []

    def record(lengths, options, **batch):
        seen.append(options)
        raise Recorded()

    from megatron_dynbatch.core.planner import local

    monkeypatch.setattr(api, "prepare", record)
    monkeypatch.setattr(api, "plan_dynamic_cp", record)
    monkeypatch.setattr(local, "prepare", record)
    return seen


def received(recorder, call):
    """The one resolved options object the planner was called with (every door resolves once, at its boundary)."""
    with pytest.raises(Recorded):
        call()
    assert len(recorder) == 1 and isinstance(recorder[0], ResolvedOptions)
    return recorder.pop()


def arrived(got, name):
    """What reached the planner for option ``name``: the field of the options resolved (a preset name stays as
    given there, so ``model`` is read from the resolution: the ``ModelSpec``)."""
    return got.model if name == "model" else getattr(got.options, name)


def test_every_option_has_a_test_value_and_a_documented_spelling():
    names = set(PlanOptions.names())
    assert set(VALUES) == names, "add the new option to VALUES (and CLI_TOKENS / the exceptions)"
    assert set(PlanOptions.spellings("megatron")) == names - set(NOT_LAUNCH_OPTIONS) - set(FROM_MEGATRONS_FLAGS)
    assert set(CLI_TOKENS) == {f.name for f in dataclasses.fields(PlanOptions) if f.init and f.metadata["cli"]}
    assert set(CLI_TOKENS) == names - set(NOT_CLI_OPTIONS)
    # a preset's key is the field's own name: every option a launch sets by a flag is a preset key, routed into
    # RunConfig.options -- and RunConfig mirrors no option in a field of its own (model and memory are the
    # preset's source forms, which the options hold resolved)
    assert set(PlanOptions.spellings("megatron")) | {"parallel"} == set(OPTION_KEYS) <= set(RunConfig.yaml_keys())
    assert {f.name for f in dataclasses.fields(RunConfig)} & set(names) == {"model", "memory"}
    # ... and every field states its spelling at each door: a flag, the door's own words "(...)", or a reason above
    for door, exempt in (("megatron", NOT_LAUNCH_OPTIONS), ("cli", NOT_CLI_OPTIONS)):
        for f in dataclasses.fields(PlanOptions):
            if f.init and f.name not in exempt:
                assert str(f.metadata.get(door) or "").startswith(("--", "(")), (door, f.name)
    lines = inspect.getsource(PlanOptions).splitlines()
    for name in names:  # every option is documented where it is defined: a "#:" comment right above the field
        at = next(i for i, line in enumerate(lines) if line.startswith(f"    {name}:"))
        assert lines[at - 1].strip().startswith("#:"), name


@pytest.mark.parametrize("name", sorted(VALUES))
def test_python_api_and_the_options_object(name, recorder):
    base = {**BASE, **needs(name, "python")}
    got = received(recorder, lambda: plan_global_batch([100] * 8, **{**base, name: VALUES[name]}))
    assert arrived(got, name) == expected(name)
    opts = PlanOptions(**{**base, name: VALUES[name]})
    assert received(recorder, lambda: plan_global_batch([100] * 8, opts)).options == opts
    assert received(recorder, lambda: plan_global_batch([100] * 8, PlanOptions(**base),
                                                        **{name: VALUES[name]})).options == opts


@pytest.mark.parametrize("name", sorted(VALUES))
def test_local_mode(name, recorder):
    from megatron_dynbatch.core.planner.local import local_microbatch_counts, plan_local_batch

    base = {**BASE, **needs(name, "python")}
    if name != "num_microbatches":
        got = received(recorder, lambda: local_microbatch_counts([100] * 8, **{**base, name: VALUES[name]}))
        assert arrived(got, name) == (expected(name) if name != "parallel" else
                                      dataclasses.replace(expected(name), dp=1))
    if name != "num_microbatches":
        got = received(recorder,
                       lambda: plan_local_batch([100] * 8, num_microbatches=2, **{**base, name: VALUES[name]}))
        if name != "parallel":
            assert arrived(got, name) == expected(name)


@pytest.mark.parametrize("name", sorted(VALUES))
def test_iterator(name, recorder):
    torch = pytest.importorskip("torch")
    from megatron_dynbatch.megatron.iterator import DynamicBatchIterator

    samples = [{"tokens": torch.arange(30 + i)} for i in range(8)]
    base = {**BASE, **needs(name, "python")}
    got = received(recorder, lambda: DynamicBatchIterator(samples, **{**base, name: VALUES[name]}))
    assert arrived(got, name) == expected(name)
    opts = PlanOptions(**{**base, name: VALUES[name]})
    assert received(recorder, lambda: DynamicBatchIterator(samples, options=opts)).options == opts


@pytest.mark.parametrize("name", sorted(VALUES))
def test_ray_driver(name, recorder):
    pytest.importorskip("torch")
    from megatron_dynbatch.integrations.ray import plan_rollout

    samples = [{"tokens": list(range(30 + i))} for i in range(8)]
    got = received(recorder, lambda: plan_rollout(samples, put=False,
                                                  **{**BASE, **needs(name, "python"), name: VALUES[name]}))
    assert arrived(got, name) == expected(name)


def launch_args(flags, **megatron):
    """Megatron-style parsed args: the layout and model flags Megatron owns, plus ours."""
    from megatron_dynbatch.megatron.args import add_dynamic_batch_args

    ns = add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(flags)
    spec = ModelSpec.from_any(megatron.pop("model", "qwen3-0.6b"))
    for key, value in spec.to_dict().items():
        setattr(ns, key, value)
    ns.num_experts = spec.num_experts
    ns.group_query_attention = True
    ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size, ns.context_parallel_size = 1, 1, 1
    ns.world_size = 2
    for key, value in megatron.items():
        setattr(ns, key, value)
    return ns


LAUNCH_TOKENS = {  # a launch's flags for each value
    "max_tokens_per_gpu": ["--max-tokens-per-gpu", "4096"],
    "balance_by": ["--dynbatch-balance-by", "flops"],
    "cost_model": ["--dynbatch-cost-model", "analytic"],
    "decision_margin": ["--dynbatch-decision-margin", "0.07"],
    "oversize": ["--dynbatch-oversize", "alone"],
    "fp8_alignment": ["--dynbatch-fp8-alignment", "mxfp8"],
    "samples_per_step": ["--dynbatch-samples-per-step", "4"],
    "dynamic_cp": ["--dynbatch-dynamic-cp"],  # a launch balances time by default: dynamic CP's only mode
    "min_cp_size": ["--dynbatch-min-cp-size", "2"],
    "gpu_memory_gb": ["--dynbatch-gpu-memory-gb", "79.1"],
    "memory_probe": ["--dynbatch-memory-probe"],
}


def test_launch_tokens_use_each_fields_own_flag():
    assert {name: tokens[0] for name, tokens in LAUNCH_TOKENS.items()} == PlanOptions.spellings("megatron")


@pytest.mark.parametrize("name", sorted(set(VALUES) - set(NOT_LAUNCH_OPTIONS) - {"memory"}))
def test_megatron_launch_flags_and_the_hook(name, recorder):
    pytest.importorskip("torch")
    from megatron_dynbatch.integrations.megatron_lm import DynamicForwardBackward
    from megatron_dynbatch.megatron.args import plan_options_from_args, validate_dynamic_batch_args

    megatron = dict(needs(name, "megatron"))
    if name == "model":
        megatron["model"] = VALUES["model"]
    if name == "parallel":
        megatron.update(tensor_model_parallel_size=2, world_size=4)
    flags = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "2048"] + LAUNCH_TOKENS.get(name, []) + \
        needs(name, "launch")
    args = validate_dynamic_batch_args(launch_args(flags, **megatron))
    opts = plan_options_from_args(args)
    if name == "samples_per_step":  # the hook runs one optimizer step per Megatron iteration: dropped there
        assert opts.samples_per_step == 4 and plan_options_from_args(args, forward_only=True).samples_per_step is None
        return
    assert getattr(opts, name) == expected(name)
    def run_step(model, samples, options, **kw):  # the Megatron-LM hook plans with exactly these options
        recorder.append(options)
        raise Recorded()

    hook = DynamicForwardBackward(object(), args, run_step=run_step,  # forced on without a GPU: a clear error
                                  memory_probe=False if name == "memory_probe" else None)  # (test_memory_probe.py)
    with pytest.raises(Recorded):
        hook(data_iterator=iter([[{"tokens": [1, 2, 3]}] * 4]), model=None, num_microbatches=1)
    assert getattr(recorder.pop().options, name) == expected(name)  # resolved once per run: its options


@pytest.mark.parametrize("name", sorted(set(VALUES) - set(NOT_LAUNCH_OPTIONS) - {"memory"}))
def test_run_presets_and_their_megatron_flags(name):
    pytest.importorskip("torch")
    from megatron_dynbatch.megatron.args import plan_options_from_args, validate_dynamic_batch_args

    data = {"name": "t", "model": "qwen3-0.6b", "parallel": {"world_size": 2}, "max_tokens_per_gpu": 2048}
    if name == "parallel":
        data["parallel"] = {"world_size": 4, "tp": 2}
    elif name == "balance_by":
        data["balance_by"] = "flops"
    else:
        data[name] = VALUES[name]
    data.update(needs(name, "preset"))
    rc = RunConfig.from_dict(data)
    assert getattr(rc.plan_options(), name) == expected(name)
    argv = rc.to_megatron_args()
    megatron = {"model": data["model"], **needs(name, "megatron")}
    if name == "parallel":
        megatron.update(tensor_model_parallel_size=2, world_size=4)
    known = [a for a in argv if a.startswith("--use") or a.startswith("--max-tokens") or a.startswith("--dynbatch")
             or a.startswith("--balance") or a.startswith("--log-probs")]
    flags = [a for i, a in enumerate(argv) if a in known or (i and argv[i - 1] in known and not a.startswith("--"))]
    args = validate_dynamic_batch_args(launch_args(flags, **megatron))
    assert getattr(plan_options_from_args(args), name) == expected(name)


@pytest.mark.parametrize("name", sorted(CLI_TOKENS))
def test_plan_command(name, recorder, tmp_path):
    from megatron_dynbatch.cli import main

    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(str(50 + i) for i in range(16)))
    base = {"max_tokens_per_gpu": ["--max-tokens-per-gpu", "2048"], "model": ["--model", "qwen3-0.6b"],
            "parallel": ["--dp", "2"]}
    tokens = [t for key, toks in {**base, name: CLI_TOKENS[name]}.items() for t in toks] + needs(name, "cli")
    with pytest.raises(Recorded):
        main(["plan", "--lengths", str(lengths), *tokens])
    got = recorder.pop()
    assert arrived(got, name) == expected(name)


def test_upstream_packing_seat_reads_the_launch_flags():
    from megatron_dynbatch.integrations.megatron_packing import scheduler_plan_options

    flags = ["--dynbatch-cost-model", "analytic", "--dynbatch-decision-margin", "0.07", "--dynbatch-oversize",
             "alone", "--dynbatch-fp8-alignment", "mxfp8", "--dynbatch-balance-by", "flops"]
    args = launch_args(flags)
    args.padded_vocab_size = args.padded_vocab_size or 151936
    opts = scheduler_plan_options(max_seqlen_per_dp_cp_rank=4096, dp=2, cp=1, args=args)
    assert (opts.cost_model, opts.decision_margin, opts.oversize, opts.fp8_alignment, opts.balance_by) == (
        "analytic", 0.07, "alone", "mxfp8", BalanceBy.FLOPS)
    assert opts.max_tokens_per_gpu == 4096 and opts.parallel.dp == 2


# ------------------------------------------------------------------------------ issue 28.4: the margin
def test_decision_margin_reaches_the_planner_through_the_iterator_end_to_end():
    torch = pytest.importorskip("torch")
    from megatron_dynbatch.megatron.iterator import DynamicBatchIterator

    samples = [{"tokens": torch.arange(10 + 3 * i)} for i in range(8)]
    it = DynamicBatchIterator(samples, max_tokens_per_gpu=64, decision_margin=0.05)  # refused before
    it.plan.validate(num_samples=8)
    assert it.plan.num_samples == 8


# ------------------------------------------------------------------------------ construction and hostile input
def test_unknown_keyword_is_a_clear_error_and_a_type_error():
    with pytest.raises(UnknownOptionError) as info:
        plan_global_batch([10, 20], max_token_per_gpu=64)
    assert isinstance(info.value, TypeError) and isinstance(info.value, DynBatchConfigError)
    assert info.value.field == "max_token_per_gpu" and "did you mean 'max_tokens_per_gpu'" in info.value.fix
    with pytest.raises(TypeError):
        PlanOptions(max_tokens_per_gpu=64, decison_margin=0.1)  # the dataclass itself: a plain TypeError


def test_python_errors_name_the_keyword_not_a_flag():
    with pytest.raises(DynBatchConfigError) as info:
        plan_global_batch([10, 20], max_tokens_per_gpu=4096.5)
    assert info.value.field == "max_tokens_per_gpu" and "--max-tokens-per-gpu" not in str(info.value)


@pytest.mark.parametrize("field,value", [
    ("max_tokens_per_gpu", 0), ("max_tokens_per_gpu", -5), ("max_tokens_per_gpu", 2.5), ("max_tokens_per_gpu", "big"),
    ("max_tokens_per_gpu", True), ("max_tokens_per_gpu", 10 ** 30), ("max_tokens_per_gpu", float("nan")),
    ("balance_by", "raw"), ("balance_by", 3), ("oversize", "skip"), ("oversize", None), ("decision_margin", 1.5),
    ("decision_margin", float("inf")), ("decision_margin", "0.1"), ("samples_per_step", 0), ("refine_rounds", -1),
    ("num_microbatches", [1, 0]), ("num_microbatches", "3"), ("dynamic_cp", "yes"), ("equal_samples_per_rank", 1),
    ("fp8_alignment", "fp9"), ("parallel", {"dp": 0}), ("cost_model", 3), ("model", 3),
    ("min_num_microbatches", 0), ("sequence_pad_multiple", 2 ** 40),
])
def test_bad_options_are_refused_at_construction_naming_the_field(field, value):
    with pytest.raises(DynBatchConfigError) as info:
        PlanOptions(**{**BASE, field: value})
    assert info.value.field.split(".")[0].split("[")[0] in (field, "parallel", "model") and "Fix:" in str(info.value)


@pytest.mark.parametrize("field,value", [("cost_model", "fitted-v2"), ("model", "no-such-model"),
                                         ("cost_model", "/no/such/cost_model.json")])
def test_what_must_be_read_is_refused_by_resolve_naming_the_field(field, value):
    """A name or file is read by ``resolve()``, not by the constructor: the options build, and resolving them
    raises the error construction raised before (same field, a fix); every door resolves at once, so a user
    meets it at the same call."""
    opts = PlanOptions(**{**BASE, field: value})
    with pytest.raises(DynBatchConfigError) as info:
        opts.resolve()
    assert info.value.field == field and "Fix:" in str(info.value)
    with pytest.raises(DynBatchConfigError) as door:
        plan_global_batch([100] * 8, **{**BASE, field: value})
    assert door.value.field == field


def test_numpy_scalars_and_tensors_are_plain_values():
    opts = PlanOptions(max_tokens_per_gpu=np.int64(4096), samples_per_step=np.int32(8),
                       decision_margin=np.float32(0.25), num_microbatches=np.array([2, 3]),
                       parallel={"dp": np.int64(2)})
    assert type(opts.max_tokens_per_gpu) is int and type(opts.samples_per_step) is int
    assert opts.num_microbatches == (2, 3) and opts.parallel.dp == 2 and isinstance(opts.decision_margin, float)
    hash(opts)  # frozen and hashable: a plan's options can key a cache


def test_cross_field_rules_live_in_the_options():
    with pytest.raises(DynBatchConfigError, match="rollouts_per_step"):
        PlanOptions(max_tokens_per_gpu=64, samples_per_step=4, rollouts_per_step=2)
    with pytest.raises(DynBatchConfigError, match="dynamic_cp"):
        PlanOptions(max_tokens_per_gpu=64, dynamic_cp=True, equal_samples_per_rank=True)
    with pytest.raises(DynBatchConfigError, match="parallel.vpp"):
        PlanOptions(max_tokens_per_gpu=64, dynamic_cp=True, parallel={"dp": 2, "pp": 2, "vpp": 2})
    with pytest.raises(DynBatchConfigError, match="one GPU") as err:  # as a preset, the CLI and a launch refuse
        PlanOptions(max_tokens_per_gpu=64, dynamic_cp=True)
    assert err.value.field == "parallel"
    with pytest.raises(DynBatchConfigError, match="model"):
        PlanOptions(max_tokens_per_gpu=64, balance_by="flops")


def test_one_vocabulary_for_balancing():
    assert PlanOptions(max_tokens_per_gpu=64).balance_by is None  # the default, made explicit by resolve():
    assert PlanOptions(max_tokens_per_gpu=64).resolve().balance_by is BalanceBy.TOKENS  # no model: tokens
    assert PlanOptions(max_tokens_per_gpu=64, model="qwen3-0.6b").resolve().balance_by is BalanceBy.TIME
    assert PlanOptions.from_kwargs({"max_tokens_per_gpu": 64, "balance_by_flops": False}).balance_by is BalanceBy.TOKENS
    with pytest.raises(DynBatchConfigError, match="balance_by_flops=False"):  # the flag's switch needs a model
        PlanOptions.from_kwargs({"max_tokens_per_gpu": 64, "balance_by_flops": True})
    assert RunConfig.from_yaml("qwen3-8b-grpo").plan_options().resolve().balance_by is BalanceBy.TIME
    assert str(BalanceBy.FLOPS) == "flops" and BalanceBy.parse("Tokens") is BalanceBy.TOKENS


def test_a_default_balance_stays_the_default_when_the_options_change():
    opts = PlanOptions(max_tokens_per_gpu=4096)
    assert opts.resolve().balance_by is BalanceBy.TOKENS
    assert opts.replace(model="qwen3-0.6b").resolve().balance_by is BalanceBy.TIME
    chosen = PlanOptions(max_tokens_per_gpu=4096, balance_by="tokens")
    assert chosen.replace(model="qwen3-0.6b").resolve().balance_by is BalanceBy.TOKENS


def test_replace_and_forward_only():
    opts = PlanOptions(**BASE, samples_per_step=8)
    assert opts.replace(oversize="alone").oversize == "alone" and opts.oversize == "error"
    fwd = opts.for_forward_only(8192)
    assert fwd.max_tokens_per_gpu == 8192 and fwd.samples_per_step is None and fwd.model == opts.model
    assert PlanOptions(**opts.to_kwargs()) == opts


def test_signature_lists_every_option():
    params = inspect.signature(plan_global_batch).parameters
    assert set(PlanOptions.names()) | {"balance_by_flops", "group_ids", "microbatch_group_ids", "rollout_ids"} \
        <= set(params)


# ------------------------------------------------------------------------------ issue 27: the budget chooses itself
AUTO_BASE = {"model": "qwen3-8b", "parallel": {"dp": 8}, "gpu_memory_gb": 79.1,
             "memory": {"optimizer": "cpu_offload", "recompute": "full"}}


def test_auto_budget_is_the_memory_models_choice_and_the_planner_keeps_it():
    opts = PlanOptions(max_tokens_per_gpu="auto", **AUTO_BASE)
    want = choose_budget("qwen3-8b", {"dp": 8}, 79.1, settings=AUTO_BASE["memory"])
    res = opts.resolve()
    assert opts.auto_budget and opts.max_tokens_per_gpu == "auto"  # chosen by resolve(), not by the constructor
    assert res.auto_budget and res.max_tokens_per_gpu == want.tokens_per_gpu > 0
    assert "limited by" in res.budget_choice.summary() and "static" in res.budget_choice.summary()
    plan = plan_global_batch(np.random.default_rng(0).integers(100, 16000, 64), opts)
    assert plan.cap == res.max_tokens_per_gpu and plan.max_microbatch_tokens <= plan.cap
    assert PlanOptions(max_tokens_per_gpu="AUTO ", **AUTO_BASE) == opts  # every rank, every spelling: one budget
    assert PlanOptions(**opts.to_kwargs()) == opts and opts.to_kwargs()["max_tokens_per_gpu"] == "auto"


def test_auto_is_chosen_again_when_the_options_change_and_per_pass():
    res = PlanOptions(max_tokens_per_gpu="auto", **AUTO_BASE).resolve()
    wider = res.replace(parallel={"dp": 4, "tp": 2})
    assert wider.auto_budget and wider.max_tokens_per_gpu > res.max_tokens_per_gpu  # TP splits the logits
    bigger = res.replace(gpu_memory_gb=139.8)
    assert bigger.max_tokens_per_gpu > res.max_tokens_per_gpu
    log_prob = res.options.for_forward_only().resolve()
    assert log_prob.options.forward_only and log_prob.auto_budget and log_prob.max_tokens_per_gpu >= \
        res.max_tokens_per_gpu
    assert res.replace(max_tokens_per_gpu=4096).max_tokens_per_gpu == 4096  # a number stops being automatic
    assert not res.replace(max_tokens_per_gpu=4096).auto_budget and not res.options.replace(
        max_tokens_per_gpu=4096).auto_budget


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens_per_gpu": "auto"}, "max_tokens_per_gpu"),                                  # no model
    ({"max_tokens_per_gpu": "auto", "model": "qwen3-8b"}, "gpu_memory_gb"),                  # no card
    ({**AUTO_BASE, "max_tokens_per_gpu": "auto", "gpu_memory_gb": 0}, "gpu_memory_gb"),
    ({**AUTO_BASE, "max_tokens_per_gpu": "auto", "gpu_memory_gb": float("nan")}, "gpu_memory_gb"),
    ({**AUTO_BASE, "max_tokens_per_gpu": "auto", "gpu_memory_gb": 1e30}, "gpu_memory_gb"),
    ({**AUTO_BASE, "max_tokens_per_gpu": "auto", "gpu_memory_gb": 16}, "gpu_memory_gb"),    # cannot fit at all
    ({**AUTO_BASE, "max_tokens_per_gpu": "automatic"}, "max_tokens_per_gpu"),
    ({**AUTO_BASE, "max_tokens_per_gpu": "auto", "memory": {"recompute": "most"}}, "settings.recompute"),
])
def test_auto_budget_hostile_input_is_a_clear_error(kwargs, field):
    with pytest.raises(DynBatchConfigError) as info:
        PlanOptions(**kwargs).resolve()  # at construction, or (a card too small: the memory model) at resolve()
    assert info.value.field == field and "Fix:" in str(info.value)


def test_a_model_that_cannot_fit_says_what_to_change():
    with pytest.raises(DynBatchConfigError) as info:
        PlanOptions(max_tokens_per_gpu="auto", model="qwen3-30b-a3b", parallel={"dp": 8, "ep": 8},
                    gpu_memory_gb=40).resolve()
    assert "do not fit" in info.value.problem and 'optimizer="cpu_offload"' in info.value.fix  # Python's keywords


def test_auto_run_preset_and_its_launch_plan_with_the_same_budget():
    pytest.importorskip("torch")
    from megatron_dynbatch.megatron.args import plan_options_from_args, validate_dynamic_batch_args

    rc = RunConfig.from_yaml("qwen3-8b-grpo")
    assert rc.budget_as_written() == "auto" and rc.plan_options().auto_budget
    argv = rc.to_megatron_args()
    assert argv[argv.index("--max-tokens-per-gpu") + 1] == "auto"
    megatron = {"recompute_granularity": "full", "use_distributed_optimizer": True, "optimizer_cpu_offload": True,
                "untie_embeddings_and_output_weights": True, "world_size": 8, "model": "qwen3-8b"}
    flags = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "auto", "--log-probs-max-tokens-per-gpu", "auto",
             "--dynbatch-gpu-memory-gb", "79.1"]
    args = validate_dynamic_batch_args(launch_args(flags, **megatron))
    for forward_only in (False, True):
        got = plan_options_from_args(args, forward_only=forward_only)
        assert got.resolve().max_tokens_per_gpu == rc.budget(forward_only=forward_only)
        assert got.memory == rc.memory_settings()


def test_auto_launch_without_a_card_names_the_flag(monkeypatch):
    pytest.importorskip("torch")
    from megatron_dynbatch.megatron import device
    from megatron_dynbatch.megatron.args import validate_dynamic_batch_args

    monkeypatch.setattr(device, "device_memory_gb", lambda d=None: None)  # a CPU machine
    megatron = {"model": "qwen3-8b", "world_size": 8, "optimizer_cpu_offload": True, "recompute_granularity": "full"}
    args = launch_args(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "auto"], **megatron)
    with pytest.raises(DynBatchConfigError) as info:
        validate_dynamic_batch_args(args)
    assert info.value.field == "--dynbatch-gpu-memory-gb"
    monkeypatch.setattr(device, "device_memory_gb", lambda d=None: 79.1)  # read from the device on a GPU
    args = validate_dynamic_batch_args(launch_args(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "auto"],
                                                   **megatron))
    from megatron_dynbatch.megatron.args import plan_options_from_args

    assert plan_options_from_args(args).gpu_memory_gb == 79.1


def test_plan_command_prints_the_auto_budgets_breakdown(tmp_path, capsys):
    from megatron_dynbatch.cli import main

    assert main(["plan", "--lengths", "examples/grpo_lengths.txt", "--model", "qwen3-8b", "--dp", "8",
                 "--max-tokens-per-gpu", "auto", "--gpu-memory-gb", "79.1", "--recompute", "full", "--optimizer",
                 "cpu_offload"]) == 0
    out = capsys.readouterr().out
    budget = choose_budget("qwen3-8b", {"dp": 8}, 79.1, settings={"recompute": "full",
                                                                  "optimizer": "cpu_offload"}).tokens_per_gpu
    assert f"max_tokens_per_gpu={budget}" in out and f"training budget: {budget} tokens per GPU" in out
    assert main(["plan", "--lengths", "examples/grpo_lengths.txt", "--model", "qwen3-8b", "--dp", "8",
                 "--max-tokens-per-gpu", "auto"]) == 2
    assert "--gpu-memory-gb" in capsys.readouterr().err


def test_auto_in_a_trainers_own_budget_setting_says_how_to_get_the_number():
    """'auto' is this package's options' word; a trainer's own setting (read by the trainer too) needs a number."""
    pytest.importorskip("torch")
    from megatron_dynbatch.integrations import nemo_rl, verl

    for call, field in ((lambda: verl.check_budget("auto", 100), "max_token_len"),
                        (lambda: nemo_rl.get_packer("modified_first_fit_decreasing", bin_capacity="auto"),
                         "bin_capacity")):
        with pytest.raises(DynBatchConfigError) as info:
            call()
        assert info.value.field == field and "megatron-dynbatch budget" in info.value.fix


# ------------------------------------------------------------------------------ issue 31.1: one resolution step
def _no_io(monkeypatch):
    """Every reader the resolution uses raises: a preset's YAML, a cost-model file, the memory model, any open()."""
    import builtins

    from megatron_dynbatch.core.planner import options as options_mod

    def refuse(*a, **k):
        raise AssertionError("constructing PlanOptions read a file or ran a model")

    monkeypatch.setattr(options_mod, "resolve_cost_model", refuse)
    monkeypatch.setattr(options_mod, "choose_budget", refuse)
    monkeypatch.setattr(ModelSpec, "from_yaml", classmethod(refuse))
    monkeypatch.setattr(builtins, "open", refuse)


def test_constructing_options_does_no_io(monkeypatch, tmp_path):
    path = tmp_path / "cost.json"  # never created: nothing may look at it
    _no_io(monkeypatch)
    opts = PlanOptions(max_tokens_per_gpu="auto", model="qwen3-8b", parallel={"dp": 8}, gpu_memory_gb=79.1,
                       cost_model=str(path), memory={"recompute": "full"})
    assert opts.model == "qwen3-8b" and opts.cost_model == str(path) and opts.max_tokens_per_gpu == "auto"
    assert opts.balance_by is None and opts.auto_budget
    changed = opts.replace(parallel={"dp": 4, "tp": 2}).for_forward_only()  # building more options: no I/O either
    assert changed.forward_only and changed.max_tokens_per_gpu == "auto"
    assert PlanOptions(**opts.to_kwargs()) == opts


def test_resolve_reads_once_and_says_what_it_chose():
    opts = PlanOptions(max_tokens_per_gpu="auto", **AUTO_BASE)
    res = opts.resolve()
    assert isinstance(res, ResolvedOptions) and res.options is opts
    assert res.model == ModelSpec.from_any("qwen3-8b") and res.balance_by is BalanceBy.TIME
    assert res.max_tokens_per_gpu == choose_budget("qwen3-8b", {"dp": 8}, 79.1,
                                                   settings=AUTO_BASE["memory"]).tokens_per_gpu
    assert res.cap == res.max_tokens_per_gpu and res.margin == res.cost_model.uncertainty
    assert res.alignment.seq_multiple >= 1 and res.parallel is opts.parallel
    with pytest.raises(DynBatchConfigError, match="PlanOptions"):
        ResolvedOptions(options="not options", model=None, cost_model=res.cost_model, max_tokens_per_gpu=64,
                        alignment=res.alignment, balance_by=BalanceBy.TOKENS)


def test_a_lowered_budget_reresolves_nothing_else(monkeypatch):
    """The memory guard and the first-step probe lower the budget of resolved options every step: the model,
    the cost model (file) and the memory model are not read or run again."""
    res = PlanOptions(max_tokens_per_gpu="auto", **AUTO_BASE).resolve()
    _no_io(monkeypatch)
    monkeypatch.setattr(ModelSpec, "from_any", classmethod(lambda *a: (_ for _ in ()).throw(AssertionError())))
    lower = res.replace(max_tokens_per_gpu=res.max_tokens_per_gpu // 2)
    assert lower.max_tokens_per_gpu == res.max_tokens_per_gpu // 2 and not lower.auto_budget
    assert lower.model is res.model and lower.cost_model is res.cost_model
    again = res.replace(decision_margin=0.1)  # an automatic budget stays the same choice, not chosen again
    assert again.budget_choice is res.budget_choice and again.margin == 0.1


def test_the_hook_resolves_its_options_once_per_run(monkeypatch):
    pytest.importorskip("torch")
    import types

    from megatron_dynbatch.integrations.megatron_lm import DynamicForwardBackward

    calls = {"resolve": 0, "build": 0}
    real = PlanOptions.resolve

    def counting(self, reuse=None):
        calls["resolve"] += reuse is None  # a fresh resolution (reuse: a change applied on top, nothing re-read)
        return real(self, reuse)

    monkeypatch.setattr(PlanOptions, "resolve", counting)
    seen = []

    def run_step(model, samples, options, **kw):
        seen.append(options)
        return types.SimpleNamespace(loss=0.5, num_microbatches=1)

    def build(args):
        calls["build"] += 1
        return {"max_tokens_per_gpu": 64, "model": "tiny-gpt", "samples_per_step": 2}

    args = types.SimpleNamespace(eval_iters=0)
    hook = DynamicForwardBackward(object(), args, run_step=run_step, plan_options=build, memory_probe=False)
    batch = [{"tokens": [1, 2, 3]}] * 2
    for _ in range(3):
        hook(data_iterator=iter([batch]), model=None, num_microbatches=1)
    assert calls == {"resolve": 1, "build": 1} and len(seen) == 3
    assert seen[0] is seen[1] is seen[2] and isinstance(seen[0], ResolvedOptions)
    assert seen[0].model == ModelSpec.from_any("tiny-gpt") and seen[0].options.samples_per_step is None


def test_dynamic_forward_backward_plans_with_resolved_options_as_given(monkeypatch):
    """The hook hands its once-resolved options to ``dynamic_forward_backward``: its door takes them as they are
    (no second resolution) and the iterator plans with exactly them."""
    torch = pytest.importorskip("torch")
    from megatron_dynbatch.megatron.schedule import batch_iterator
    from megatron_dynbatch.megatron.step_config import StepConfig, StepHooks

    res = PlanOptions(max_tokens_per_gpu=64, model="tiny-gpt", parallel={"dp": 1}).resolve()
    monkeypatch.setattr(PlanOptions, "resolve", lambda *a, **k: (_ for _ in ()).throw(AssertionError("resolved")))
    samples = [{"tokens": torch.arange(10 + 3 * i)} for i in range(6)]
    it, used = batch_iterator(samples, res, StepConfig(device=torch.device("cpu")), StepHooks(), None)
    assert used is res and it.plan.cap == res.cap and it.plan.num_samples == 6
