"""The benchmark: workloads, runner, report and plot on the tiny ``smoke`` workload (fast)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_dynbatch.bench import (
    ALGORITHMS,
    WORKLOADS,
    BenchResult,
    default_workloads,
    format_report,
    format_table,
    run_bench,
    run_speed,
    run_workload,
    select_workloads,
    verdicts,
)
from megatron_dynbatch.bench import workloads as wl
from megatron_dynbatch.bench.runner import DYNCP_ONLY
from megatron_dynbatch.core.errors import DynBatchConfigError

SMOKE = WORKLOADS["smoke"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke_result() -> BenchResult:
    return run_bench([SMOKE], seeds=2, speed=False, progress=False, keep_plans=True)


def test_smoke_rows_for_every_algorithm(smoke_result):
    for seed in (0, 1):
        names = [r.algorithm for r in smoke_result.rows_for("smoke", seed)]
        # smoke has 8 GRPO groups >= dp=2, so dynbatch-groups runs too; it is no dynamic-CP workload
        assert names == [a for a in ALGORITHMS if a not in DYNCP_ONLY]
    for r in smoke_result.rows:
        assert r.ok, r.error
        assert r.vs_lower_bound >= 1 - 1e-9  # the lower bound is a bound
        assert r.microbatches >= 1 and r.step_time_s > 0


def test_dynbatch_never_breaks_the_cap(smoke_result):
    assert smoke_result.dynbatch_cap_violations == 0
    assert smoke_result.dynbatch_errors == []
    for r in smoke_result.rows:
        if r.family == "dynbatch":
            assert r.cap_violations == 0 and r.peak_over_cap <= 1.0 and r.notes == []


def test_ratios_relate_rows_of_one_batch(smoke_result):
    rows = smoke_result.rows_for("smoke", 0)
    best = min(r.step_time_s for r in rows if r.family == "baseline")
    for r in rows:
        assert math.isclose(r.vs_best_baseline, r.step_time_s / best)
        assert r.lower_bound_s == rows[0].lower_bound_s


def test_json_round_trip(smoke_result):
    text = smoke_result.to_json()
    json.loads(text)  # strict JSON (no NaN)
    again = BenchResult.from_json(text)
    assert again.to_dict() == smoke_result.to_dict()
    assert [r.algorithm for r in again.rows] == [r.algorithm for r in smoke_result.rows]


def test_report_mentions_every_algorithm_and_verdict(smoke_result):
    table = format_table(smoke_result)
    for name in ALGORITHMS:
        assert name in table or name in DYNCP_ONLY  # the dynamic-CP algorithms run on dynamic-CP workloads only
    header = table.splitlines()[0]
    assert "x LB" in header and "cap viol" in header and "plan ms" in header
    lines = verdicts(smoke_result)
    assert lines[-1] == "planner cap violations: 0"
    assert "smoke" in format_report(smoke_result)


def test_plot_writes_png(smoke_result, tmp_path):
    pytest.importorskip("matplotlib")
    from megatron_dynbatch.bench.plot import plot_timelines

    plans = {k[2]: v for k, v in smoke_result.plans.items() if k[1] == 0}
    out = plot_timelines(plans, str(tmp_path / "t.png"), title="smoke")
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_algorithm_filter_and_unknown_names():
    rows, _ = run_workload(SMOKE, 0, ["dynbatch", "verl"])
    assert [r.algorithm for r in rows] == ["dynbatch", "verl"]
    with pytest.raises(DynBatchConfigError, match="algorithm"):
        run_bench([SMOKE], algorithms=["nope"], speed=False, progress=False)
    with pytest.raises(DynBatchConfigError, match="--workloads"):
        select_workloads("smoke,nope")
    assert select_workloads(None) == default_workloads()
    assert SMOKE not in default_workloads()


def test_speed_runner_tiny_case():
    res = run_speed([(64, 4, 1e9)], repeats=1)
    assert res[0].samples == 64 and len(res[0].runs_ms) == 1 and res[0].microbatches >= 1
    assert res[0].to_dict()["meets_target"] is True


# ----------------------------------------------------------------------------------------- workloads
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workloads_are_seeded_and_well_formed(name):
    w = WORKLOADS[name]
    a, b, c = w.generate(0), w.generate(0), w.generate(1)
    assert np.array_equal(a.lengths, b.lengths) and not np.array_equal(a.lengths, c.lengths)
    assert a.lengths.dtype == np.int64 and a.lengths.min() >= 1
    assert a.lengths.size % w.parallel.dp == 0  # equal-size DP splits (verl, slime) need it
    if a.group_ids is not None:
        assert a.group_ids.size == a.lengths.size


def test_grpo_lengths_have_a_truncation_spike():
    batch = wl.grpo_lengths(np.random.default_rng(0), prompts=64, group=8, max_response=4096, median_response=1000,
                            prompt_range=(100, 100))
    assert batch.group_ids.tolist()[:9] == [0] * 8 + [1]
    assert batch.lengths.max() == 100 + 4096
    assert (batch.lengths == 100 + 4096).mean() >= 0.08  # the truncated generations pile up at the limit


REAL_DOCUMENTS = ROOT.parent / "shared" / "data" / wl.DOCUMENT_LENGTHS_FILE  # this project's copy; a clone has none


def test_bundled_document_lengths_are_close_to_the_real_distribution():
    """The shipped quantiles (bench/data/) against the real file's statistics stored next to them by
    benchmarks/derive_document_lengths.py: what docs/benchmarks.md quotes, recomputed here."""
    meta = json.loads(wl.BUNDLED_DOCUMENTS.read_text(encoding="utf-8"))
    docs = wl.bundled_document_lengths()
    assert docs.size == wl.BUNDLED_QUANTILES and np.all(np.diff(docs) >= 0) and docs.min() >= 1
    assert not docs.flags.writeable  # one cached array shared by every workload
    ours, real = wl.document_statistics(docs), meta["statistics"]["real"]
    assert ours == meta["statistics"]["bundled"], "rerun benchmarks/derive_document_lengths.py"
    assert meta["documents"] == 99519 and real["max"] == 124913
    tolerance = {"mean": 0.001, "median": 0.001, "p99": 0.01, "max": 0.005, "share over 8k tokens": 0.005,
                 "share of sum of squares over 8k": 0.001}
    for key, rel in tolerance.items():
        assert abs(ours[key] / real[key] - 1) <= rel, (key, ours[key], real[key])
    assert "DistCA" in meta["source"] and meta["derived_by"] == "benchmarks/derive_document_lengths.py"


@pytest.mark.skipif(not REAL_DOCUMENTS.is_file(), reason="the real file is not next to this checkout (../shared)")
def test_bundled_document_lengths_are_what_the_real_file_gives():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "derive_document_lengths.py"), str(REAL_DOCUMENTS),
                          "--check"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_load_document_lengths_reads_a_list_or_an_object(tmp_path):
    (tmp_path / "a.json").write_text("[5, 7, 9]")
    (tmp_path / "b.json").write_text('{"lengths": [3, 4], "source": "x"}')
    assert wl.load_document_lengths(tmp_path / "a.json").tolist() == [5, 7, 9]
    assert wl.load_document_lengths(str(tmp_path / "b.json")).dtype == np.int64
    assert np.array_equal(wl.load_document_lengths(wl.BUNDLED_DOCUMENTS), wl.bundled_document_lengths())


@pytest.mark.parametrize("text", ["", "[1, 2", "{}", '{"lengths": 5}', "[]", "[[1, 2]]", "[0, 3]", "[-4]",
                                  "[1.5]", '["12"]', "[true, 2]", "[1e400]", "null"])
def test_load_document_lengths_refuses_what_is_not_document_lengths(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(DynBatchConfigError,
                       match=r"bad\.json.*(cannot be read|not a non-empty list|not a document length)") as err:
        wl.load_document_lengths(path)
    assert "Fix" in str(err.value) or "fix" in str(err.value)


def test_load_document_lengths_names_a_missing_file(tmp_path):
    with pytest.raises(DynBatchConfigError, match="missing.json.*cannot be read"):
        wl.load_document_lengths(tmp_path / "missing.json")


def test_documents_override_the_bundled_distribution_in_every_long_document_workload():
    docs = np.array([100, 2000, 40000, 70000])
    for name, w in WORKLOADS.items():
        default, given = w.generate(3), w.generate(3, documents=docs)
        assert np.array_equal(default.lengths, w.generate(3, documents=None).lengths)
        if "document" not in default.source:  # GRPO workloads draw no documents: unchanged
            assert np.array_equal(default.lengths, given.lengths), name
            continue
        assert "bundled document lengths" in default.source and "given document lengths (4)" in given.source
        # each drawn document is one of ``docs``, truncated to the workload's maximum (32k or 64k); the chats of
        # sft-mix stay below 32k, and documents_by_tokens cuts its last document to fit
        drawn = given.lengths[:-1] if "<=" in given.source else given.lengths
        if name.startswith("sft-mix"):
            drawn = drawn[np.isin(drawn, [40000, 70000, 32768])]
            assert drawn.size == 256, name  # the 256 long documents: those of ``docs`` above 4k, truncated
        assert set(drawn.tolist()) <= {100, 2000, 40000, 70000, 32768, 65536}, (name, sorted(set(drawn.tolist())))
    with pytest.raises(DynBatchConfigError, match="documents"):
        WORKLOADS["sft-longctx-70b-cp8"].generate(0, documents=[])



_AUDIT = r"""
import json, os, sys
opened = []
sys.addaudithook(lambda event, args: opened.append(os.path.abspath(os.fsdecode(args[0])))
                 if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) else None)
from megatron_dynbatch.cli import main
rc = main(sys.argv[2:])
seen = list(opened)
with open(sys.argv[1], "w") as fh:
    json.dump(seen, fh)
sys.exit(rc)
"""


def test_bench_reads_nothing_outside_the_repository(tmp_path):
    """The default workloads and every long-document one, run as a user runs them, open no file outside the
    repository except Python's own (the interpreter's prefixes and the import path) and /dev/null: no ../shared, no
    environment variable, no note on stderr. In this project's checkouts ../shared exists, so reading it would
    show here."""
    log = tmp_path / "opened.json"
    docs = [n for n, w in WORKLOADS.items() if "document" in w.generate(0).source]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_DYNBATCH")}
    res = subprocess.run([sys.executable, "-c", _AUDIT, str(log), "bench", "--no-speed", "--no-progress", "--workloads",
                          ",".join(dict.fromkeys([w.name for w in default_workloads()] + docs))],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr == "", res.stderr  # no "note: ... not found"
    allowed = [str(ROOT), "/dev"] + [os.path.realpath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix}] + \
        [os.path.realpath(p) for p in sys.path
         if p and os.path.isdir(p) and not str(ROOT).startswith(os.path.realpath(p))]
    opened = {os.path.realpath(p) for p in json.loads(log.read_text())}
    outside = sorted(p for p in opened if not any(p == a or p.startswith(a.rstrip(os.sep) + os.sep) for a in allowed))
    assert not outside, f"bench opened files outside the repository: {outside}"
    assert str(wl.BUNDLED_DOCUMENTS) in opened  # the audit sees the reads it must see
