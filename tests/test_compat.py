"""megatron_dynbatch.megatron.compat: the one place version differences live, and the supported range."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from megatron_dynbatch import DynBatchConfigError
from megatron_dynbatch.integrations import megatron_lm as ml
from megatron_dynbatch.megatron import compat

ROOT = Path(__file__).resolve().parents[1]


def test_supported_range_has_no_upper_cap_and_ci_checks_its_lower_bound():
    spec = re.search(r'"megatron-core([^"]*)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert spec.startswith(">=") and "<" not in spec, spec
    lower = spec[2:]
    oldest = re.search(r"MEGATRON_CORE_OLDEST:-([0-9.]+)", (ROOT / "scripts" / "check_oldest_megatron.sh").read_text())
    assert oldest and oldest.group(1).startswith(lower + "."), (lower, oldest)
    assert "scripts/check_oldest_megatron.sh" in (ROOT / ".ci" / "run").read_text()
    assert f">= {lower}" in compat.__doc__


def test_version_probe_is_for_reports_only():
    version = compat.megatron_core_version()
    assert version is None or re.match(r"\d+\.\d+", version)
    code = (ROOT / "megatron_dynbatch").rglob("*.py")
    callers = [p for p in code if "megatron_core_version(" in p.read_text() and p.name != "compat.py"]
    assert callers == [], callers  # no decision anywhere depends on the version number


def test_upstream_cp_rerouting_flags_are_refused_by_the_hook():
    assert compat.upstream_cp_rerouting(argparse.Namespace()) == []
    assert (compat.upstream_cp_rerouting(argparse.Namespace(hybrid_context_parallel=True))
            == ["--hybrid-context-parallel"])
    args = ml.add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"])
    args.dataloader_type, args.eval_iters, args.micro_batch_size = "external", 0, 1
    for flag in compat.UPSTREAM_CP_REROUTING_FLAGS:
        bad = argparse.Namespace(**{**vars(args), flag: True})
        with pytest.raises(DynBatchConfigError) as exc:
            ml.check_megatron_lm_args(bad)
        assert exc.value.field == "--" + flag.replace("_", "-") and "dynamic_cp.md" in exc.value.fix
    ml.check_megatron_lm_args(args)


def test_packing_point_probe_answers_without_raising():
    module, why = compat.packing_scheduler_point()
    assert (module is None) == bool(why)
