"""Flags generated from the options' fields (core/planner/option_flags.py): one source for the ``plan`` command's
and a Megatron launch's flags, their help, their choices, the docs' flag tables -- and the rules that hold from
every door: the one ``balance_by`` default, dynamic CP's balancing verdict, one case rule for choices, one
``add_dynamic_batch_args``.

A new ``PlanOptions`` field with a ``--`` spelling gets its flag for free; these tests fail until it also has its
row in ``docs/quickstart.md`` (every field) and ``docs/integration.md`` (every launch flag) -- and
``tests/test_plan_options.py`` until it has a spelling, or a stated reason for none, at every door.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from megatron_dynbatch import BalanceBy, DynBatchConfigError, PlanOptions, RunConfig, plan_global_batch
from megatron_dynbatch.core.planner.option_flags import (DOORS, add_option_flags, choice, field_docs, option_flags,
                                                         option_values)

ROOT = Path(__file__).resolve().parents[1]


def _plan_parser() -> argparse.ArgumentParser:
    from megatron_dynbatch.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return sub.choices["plan"]


def _launch_parser() -> argparse.ArgumentParser:
    from megatron_dynbatch.megatron.args import add_dynamic_batch_args

    return add_dynamic_batch_args(argparse.ArgumentParser())


PARSERS = {"cli": _plan_parser, "megatron": _launch_parser}


def _spelled(door):
    return {f.name: f.metadata[door] for f in dataclasses.fields(PlanOptions)
            if f.init and str(f.metadata.get(door) or "").startswith("--")}


# ------------------------------------------------------------------------------------------ generation
def test_every_field_is_documented_where_it_is_defined():
    docs = field_docs()
    assert set(PlanOptions.names()) <= set(docs), "write a '#:' docstring above the new field"
    assert all(docs[name] for name in PlanOptions.names())
    assert "``" not in "".join(docs.values()) and ":class:" not in "".join(docs.values())  # plain text for --help


@pytest.mark.parametrize("door", DOORS)
def test_every_spelled_field_has_exactly_its_generated_flag_at_its_door(door):
    parser = PARSERS[door]()
    actions = {s: a for a in parser._actions for s in a.option_strings}  # noqa: SLF001
    assert {f.field: f.flag for f in option_flags(door)} == _spelled(door)
    for spec in option_flags(door):
        action = actions[spec.flag]
        assert action.dest == spec.dest and action.help.startswith(spec.help) and spec.help
        assert sum(spec.flag in a.option_strings for a in parser._actions) == 1  # noqa: SLF001


def test_help_speaks_the_doors_words():
    cli = {f.field: f.help for f in option_flags("cli")}
    launch = {f.field: f.help for f in option_flags("megatron")}
    assert "--gpu-memory-gb" in cli["max_tokens_per_gpu"] and "--dynbatch-gpu-memory-gb" in launch["max_tokens_per_gpu"]
    assert "docs/cost_model.md" in cli["cost_model"]  # a path is not a word to rename


def test_kinds_come_from_the_annotation_or_the_metadata():
    kinds = {f.field: (f.kind, f.choices) for f in option_flags("cli")}
    assert kinds["balance_by"] == ("choice", tuple(m.value for m in BalanceBy))  # an Enum: its values
    assert kinds["oversize"] == ("choice", ("error", "alone"))                    # metadata choices
    assert kinds["dynamic_cp"][0] == "switch" and kinds["samples_per_step"][0] == "int"
    assert kinds["gpu_memory_gb"][0] == "float" and kinds["max_tokens_per_gpu"][0] == "budget"


def test_a_new_field_gets_its_flags_for_free(monkeypatch):
    """What a helper adding ``min_cp_size: Optional[int] = _option(None, megatron=..., cli=...)`` gets: both flags,
    their help from the ``#:`` docstring, and their values back as options."""
    from megatron_dynbatch.core.planner import option_flags as mod

    extra = mod.OptionFlag("samples_per_step", "--dynbatch-new-knob", "megatron", "int", None, None, "a new knob",
                           None)
    monkeypatch.setattr(mod, "option_flags", lambda door: (extra,) if door == "megatron" else ())
    parser = argparse.ArgumentParser()
    add_option_flags(parser, "megatron")
    args = parser.parse_args(["--dynbatch-new-knob", "3"])
    assert option_values(args, "megatron") == {"samples_per_step": 3} and "a new knob" in parser.format_help()


@pytest.mark.parametrize("door", DOORS)
def test_parsed_flags_come_back_as_options(door):
    parser = argparse.ArgumentParser()
    add_option_flags(parser, door)
    tokens = {"cli": ["--balance-by", "FLOPS", "--oversize", "Alone", "--samples-per-step", "4", "--dynamic-cp",
                      "--max-tokens-per-gpu", "AUTO", "--fp8", "32"],
              "megatron": ["--dynbatch-balance-by", "FLOPS", "--dynbatch-oversize", "Alone",
                           "--dynbatch-samples-per-step", "4", "--dynbatch-dynamic-cp", "--max-tokens-per-gpu", "AUTO"]}
    got = option_values(parser.parse_args(tokens[door]), door)
    assert got["balance_by"] == "flops" and got["oversize"] == "alone" and got["samples_per_step"] == 4
    assert got["dynamic_cp"] is True and got["max_tokens_per_gpu"] == "auto"
    assert option_values(parser.parse_args([]), door) == ({} if door == "cli" else {"oversize": "error"})


# ------------------------------------------------------------------------------------------ choices
@pytest.mark.parametrize("argv, meant", [
    (["--balance-by", "flop"], "did you mean 'flops'?"),
    (["--oversize", "alon"], "did you mean 'alone'?"),
    (["--recompute", "FULL", "--oversize", "ALONE"], None),  # any case is the choice itself
])
def test_plan_command_choices_ignore_case_and_name_the_close_match(argv, meant, tmp_path, capsys):
    from megatron_dynbatch.cli import main

    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(["100"] * 8))
    rc = main(["plan", "--lengths", str(lengths), "--max-tokens-per-gpu", "4096", "--json", *argv])
    err = capsys.readouterr().err
    if meant is None:
        assert rc == 0, err
    else:
        assert rc == 2 and meant in err and err.count("did you mean") == 1


def test_launch_choices_ignore_case_and_name_the_close_match(capsys):
    args = _launch_parser().parse_args(["--dynbatch-balance-by", "TOKENS", "--dynbatch-loss-mode", "Group_Mean"])
    assert (args.dynbatch_balance_by, args.dynbatch_loss_mode) == ("tokens", "group_mean")
    with pytest.raises(SystemExit):
        _launch_parser().parse_args(["--dynbatch-loss-mode", "token_men"])
    assert "did you mean 'token_mean'?" in capsys.readouterr().err


def test_memory_setting_choices_ignore_case_and_their_errors_name_the_close_match(capsys):
    from megatron_dynbatch.cli import main

    assert main(["budget", "--model", "qwen3-0.6b", "--gpu-memory-gb", "80", "--recompute", "FULL", "--json"]) == 0
    capsys.readouterr()
    assert main(["budget", "--model", "qwen3-0.6b", "--gpu-memory-gb", "80", "--recompute", "ful"]) == 2
    err = capsys.readouterr().err
    assert "--recompute='ful'" in err and "did you mean 'full'?" in err and "Fix:" in err  # the flag typed


def test_choice_type_alone():
    parse = choice(("none", "selective", "full"))
    assert parse(" Full ") == "full"
    with pytest.raises(argparse.ArgumentTypeError, match="did you mean 'full'"):
        parse("ful")
    assert choice(("a", "b"), strict=False)("zzz") == "zzz"


# ------------------------------------------------------------------------------------------ docs tables
def _cell(f, door):
    value = str(f.metadata.get(door) or "")
    if not value:
        return "—"
    if not value.startswith("--"):
        return value.strip("()")
    spec = next(s for s in option_flags(door) if s.field == f.name)
    metavar = spec.argparse_kwargs().get("metavar")
    return ("`" + value + (f" {metavar}" if metavar else "") + "`").replace("|", "\\|")


def test_quickstart_table_lists_every_option_with_its_flags():
    text = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*\|$", text, re.M)}
    for f in dataclasses.fields(PlanOptions):
        if not f.init:
            continue
        cli, launch = _cell(f, "cli"), _cell(f, "megatron")
        if cli == launch == "—":
            continue
        assert rows.get(f.name) == f"| `{f.name}` | {cli} | {launch} |", f"docs/quickstart.md: the row of {f.name}"


def test_integration_table_lists_every_launch_flag():
    text = (ROOT / "docs" / "integration.md").read_text(encoding="utf-8")
    section = text[text.index("## Command-line flags"):text.index("Validation errors (`DynBatchConfigError`")]
    firsts = [re.split(r"(?<!\\)\|", line)[1].strip() for line in section.splitlines() if line.startswith("| `--")]
    for spec in option_flags("megatron"):
        metavar = spec.argparse_kwargs().get("metavar")
        want = ("`" + spec.flag + (f" {metavar}" if metavar else "") + "`").replace("|", "\\|")
        assert want in firsts, f"docs/integration.md: a row for {want}"
    flags = {s for a in _launch_parser()._actions for s in a.option_strings}  # noqa: SLF001
    named = set(re.findall(r"--[a-z0-9-]+", " ".join(firsts)))
    assert flags - {"-h", "--help"} == named, "every launch flag has a row, and every row a flag"


# ------------------------------------------------------------------------------------------ one provider
def test_one_add_dynamic_batch_args():
    import megatron_dynbatch
    from megatron_dynbatch.integrations import megatron_lm
    from megatron_dynbatch.megatron import args as args_mod

    assert megatron_dynbatch.add_dynamic_batch_args is args_mod.add_dynamic_batch_args is \
        megatron_lm.add_dynamic_batch_args
    parsed = args_mod.add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(["--dynbatch-mock-data"])
    assert parsed.dynbatch_mock_data and parsed.use_dynamic_batch_size is False


# ------------------------------------------------------------------------------------------ balance_by rules
def _launch(*flags, dynamic=False):
    from megatron_dynbatch.megatron.args import plan_options_from_args, validate_dynamic_batch_args

    ns = _launch_parser().parse_args(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", *flags]
                                     + (["--dynbatch-dynamic-cp"] if dynamic else []))
    from megatron_dynbatch import ModelSpec

    for key, value in ModelSpec.from_any("qwen3-0.6b").to_dict().items():
        setattr(ns, key, value)
    ns.group_query_attention, ns.world_size = True, 2
    return plan_options_from_args(validate_dynamic_batch_args(ns))


def test_one_default_for_balance_by_at_every_door():
    """Unset, ``balance_by`` is ``time`` whenever the model is known -- a launch included (it balanced tokens
    before unless --balance-by-flops was given); --balance-by-flops stays the legacy switch for time."""
    assert PlanOptions(max_tokens_per_gpu=4096, model="qwen3-0.6b").resolve().balance_by is BalanceBy.TIME
    assert PlanOptions(max_tokens_per_gpu=4096).resolve().balance_by is BalanceBy.TOKENS
    assert _launch().resolve().balance_by is BalanceBy.TIME
    assert _launch("--balance-by-flops").resolve().balance_by is BalanceBy.TIME
    assert _launch("--dynbatch-balance-by", "tokens").resolve().balance_by is BalanceBy.TOKENS
    assert RunConfig.from_dict({"name": "t", "model": "qwen3-0.6b", "parallel": {"world_size": 2},
                                "max_tokens_per_gpu": 4096}).plan_options().resolve().balance_by is BalanceBy.TIME


def test_a_token_balanced_preset_launches_token_balanced():
    rc = RunConfig.from_dict({"name": "t", "model": "qwen3-0.6b", "parallel": {"world_size": 2},
                              "max_tokens_per_gpu": 4096, "balance_by": "tokens"})
    argv = rc.to_megatron_args()
    assert argv[argv.index("--dynbatch-balance-by") + 1] == "tokens"
    assert _launch("--dynbatch-balance-by", "tokens").resolve().balance_by is rc.plan_options().resolve().balance_by


@pytest.mark.parametrize("mode", ["flops", "tokens"])
def test_dynamic_cp_refuses_a_balancing_it_would_ignore_from_every_door(mode, tmp_path, capsys):
    from megatron_dynbatch.cli import main

    base = {"max_tokens_per_gpu": 4096, "model": "qwen3-0.6b", "parallel": {"dp": 2}, "dynamic_cp": True}
    calls = [lambda: PlanOptions(**base, balance_by=mode),
             lambda: plan_global_batch([100] * 8, **base, balance_by=mode),
             lambda: RunConfig.from_dict({"name": "t", "model": "qwen3-0.6b", "parallel": {"world_size": 2},
                                          "max_tokens_per_gpu": 4096, "dynamic_cp": True, "balance_by": mode})]
    if mode == "tokens":
        calls.append(lambda: plan_global_batch([100] * 8, **base, balance_by_flops=False))
    for call in calls:
        with pytest.raises(DynBatchConfigError) as info:
            call()
        err = info.value
        assert err.field == "balance_by" and "silently ignored" in err.problem and "time" in err.fix
    with pytest.raises(DynBatchConfigError) as info:
        _launch("--dynbatch-balance-by", mode, dynamic=True)
    assert info.value.field == "--dynbatch-balance-by" and "--dynbatch-dynamic-cp" in str(info.value)
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(["100"] * 8))
    assert main(["plan", "--lengths", str(lengths), "--dp", "2", "--max-tokens-per-gpu", "4096", "--dynamic-cp",
                 "--balance-by", mode]) == 2
    assert f"--balance-by {mode}" in capsys.readouterr().err


def test_dynamic_cp_takes_time_or_the_default():
    base = {"max_tokens_per_gpu": 4096, "parallel": {"dp": 2}, "dynamic_cp": True}
    assert PlanOptions(**base, model="qwen3-0.6b", balance_by="time").dynamic_cp
    assert PlanOptions(**base).resolve().balance_by is BalanceBy.TOKENS  # no model: the default, as before
    assert _launch(dynamic=True).dynamic_cp and _launch("--balance-by-flops", dynamic=True).dynamic_cp
