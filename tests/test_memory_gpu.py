"""On a GPU (skipped elsewhere -- every CPU machine of this project): the CUDA side of the memory seam (issue 27).

* the CUDA peak reader sees a known allocation, and the resident state as its base;
* ``calibrate`` measures memory on real slices by default on a GPU and fits it (a small error: peaks of one
  forward + backward are close to linear in the tokens);
* the whole-model pipeline of ``benchmarks/gpu/memory.py`` runs on the GPU for a small model (the full check, with
  its 85% / 5% criteria, is the script's run in benchmarks/gpu/README.md section 6).

Their logic runs on CPU through the fake reader in tests/test_memory_calibrate.py and tests/test_gpu_memory.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: no CUDA device here")


def test_cuda_reader_sees_a_known_allocation():
    from megatron_dynbatch.megatron.memory_reader import CudaPeakReader

    keep = torch.empty(1 << 20, device="cuda")  # resident: in the base, not the increment
    r = CudaPeakReader("cuda").measure(lambda: torch.empty(4 << 20, dtype=torch.uint8, device="cuda"))
    assert r.base >= keep.numel() * 4 and 4 << 20 <= r.increment < (4 << 20) + (1 << 20)


def test_calibrate_measures_memory_on_the_gpu(cuda_world1, tmp_path):
    from megatron_dynbatch.core.memory import load_memory_profile
    from megatron_dynbatch.measure.calibrate import calibrate

    res = calibrate("qwen3-0.6b", max_tokens_per_gpu=8192, device="cuda", layers=1, group_sizes=[1], spec="local",
                    max_seconds=400)
    assert res.memory_fit is not None and len(res.memory_records) == 12
    assert res.memory_fit.rel_rms_error < 0.05 and res.memory_fit.coefficients["layer"] > 0
    res.save(str(tmp_path / "cm.json"))
    assert load_memory_profile(tmp_path / "cm.json").fitted_on["dtype"] == "bf16"


def test_the_whole_model_check_runs_on_the_gpu(cuda_world1, tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "memory.py"
    spec = importlib.util.spec_from_file_location("gpu_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "m.json"
    # a small card so the search is short: the model's resident state plus a few GiB
    assert mod.main(["--model", "qwen3-0.6b", "--gpu-memory-gb", "24", "--seq-len", "2048", "--max-attempts", "6",
                     "--output", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert res["records"][0]["tokens"] == res["auto_budget"] and all(
        r["measured_peak_bytes"] > 0 for r in res["records"] if r["fits"])
