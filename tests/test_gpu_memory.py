"""benchmarks/gpu/memory.py on the CPU (``--device cpu --tiny``): the whole pipeline -- calibrated memory profile
from real slices, the whole tiny model trained for real (Megatron DDP and optimizer), the auto budget, the upward
search by attempts that "run out of memory" -- through the reader seam (a deterministic fake reader), so the GPU
check cannot rot; the search itself; and the flags' errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_dynbatch.core.errors import DynBatchConfigError
from megatron_dynbatch.measure.budget_search import search_largest_fit

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "memory.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("gpu_memory", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_cpu_tiny_run_writes_the_results_file(script, tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    out = tmp_path / "m.json"
    assert script.main(["--device", "cpu", "--tiny", "--output", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    for key in ("device", "model", "auto_budget", "largest_fitting_budget", "records", "checks", "settings"):
        assert key in res, key
    assert res["model"] == "tiny-gpt" and res["device"].startswith("CPU") and res["profile"]["source"] == "fitted"
    recs = res["records"]
    assert recs[0]["tokens"] == res["auto_budget"] and recs[0]["fits"]
    for r in recs:
        assert set(r) >= {"tokens", "measured_peak_bytes", "predicted_peak_bytes"}
        assert (r["measured_peak_bytes"] is not None) == r["fits"]
    largest, fail = res["largest_fitting_budget"], res["smallest_failing_budget"]
    assert largest >= res["auto_budget"] and fail > largest and fail - largest <= max(16, 0.02 * largest)
    c = res["checks"]
    assert c["auto_fits"] and c["auto_at_least_85pct_of_largest"] and c["within_5pct"]
    pr = res["probe"]  # the first-step probe at the auto budget, against the whole step's peak there
    assert pr["tokens"] == res["auto_budget"] and not pr["oom"] and pr["decision"] == "kept"
    assert pr["step_peak_bytes"] == recs[0]["measured_peak_bytes"] and pr["probe_over_step"] == pytest.approx(1.0)
    assert c["probe_within_5pct_of_step"] and pr["line"].startswith("dynbatch memory probe | training pass")
    out = capsys.readouterr().out
    assert "auto budget" in out and "first-step probe at" in out


def test_search_brackets_the_largest_fit_by_attempts():
    limit = 10_000
    seen = []

    def attempt(t):
        seen.append(t)
        return t <= limit

    r = search_largest_fit(attempt, 4096, multiple=16, resolution=0.01)
    assert r.largest_fit <= limit < r.smallest_fail and r.smallest_fail - r.largest_fit <= max(16, 100)
    assert r.attempts[0] == (4096, True) and [t for t, _ in r.attempts] == seen
    down = search_largest_fit(attempt, 40_000, multiple=16)
    assert down.attempts[0] == (40_000, False) and down.largest_fit <= limit < down.smallest_fail
    capped = search_largest_fit(lambda t: True, 1000, multiple=10, max_tokens=1500, max_attempts=50)
    assert capped.largest_fit == 1500 and capped.smallest_fail is None
    nothing = search_largest_fit(lambda t: False, 64, multiple=16)
    assert nothing.largest_fit is None
    assert len(search_largest_fit(lambda t: True, 16, multiple=16, max_attempts=5).attempts) == 5


@pytest.mark.parametrize("argv, flag", [
    (["--device", "tpu", "--tiny"], "--device"),
    (["--device", "cpu"], "--device"),
    (["--device", "cpu", "--tiny", "--model", "qwen3-30b-a3b"], "--model"),
    (["--device", "cpu", "--tiny", "--seq-len", "0"], "--seq-len"),
    (["--device", "cpu", "--tiny", "--headroom", "x"], "--headroom"),
    (["--device", "cpu", "--tiny", "--gpu-memory-gb", "-1"], "--gpu-memory-gb"),
])
def test_bad_flags_name_the_flag(script, argv, flag):
    with pytest.raises(DynBatchConfigError) as exc:
        script.parse_options(argv)
    assert exc.value.field == flag
