"""calibrate measures memory: the real slices run on CPU through the reader seam (a deterministic fake reports
peaks of known coefficients), the fit recovers them, the file's memory section is written and read back, the
records refit, and a CPU run is never asked for allocator statistics it has not."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_dynbatch.cli import main  # noqa: E402
from megatron_dynbatch.core.calibration.setup import plan_calibration  # noqa: E402
from megatron_dynbatch.core.errors import DynBatchConfigError  # noqa: E402
from megatron_dynbatch.core.memory import choose_budget, load_memory_profile  # noqa: E402

COEF = {"workspace": 3e6, "layer": 5000.0, "backward_extra": 1500.0, "head": 2600.0}


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    import torch

    from megatron_dynbatch.measure.calibrate import calibrate
    from megatron_dynbatch.megatron.memory_reader import FakeMemoryReader

    torch.set_num_threads(1)
    reader = FakeMemoryReader.from_coefficients(**COEF)
    res = calibrate("tiny-gpt", device="cpu", max_tokens_per_gpu=512, memory_reader=reader)
    out = tmp_path_factory.mktemp("cal")
    res.save(str(out / "cal.json"))
    (out / "records.json").write_text(json.dumps(res.records_json()))
    return res, reader, out


def test_the_fit_of_the_real_slices_recovers_the_readers_coefficients(calibrated):
    res, reader, _ = calibrated
    assert reader.calls == len(res.memory_records) == 12
    assert {(r["layers"], r["lm_head"]) for r in res.memory_records} == {(1, False), (2, False), (1, True)}
    for k, v in COEF.items():  # only the allocator's 512-byte rounding separates the fit from the truth
        assert res.memory_fit.coefficients[k] == pytest.approx(v, rel=2e-3), k
    assert res.memory_fit.rel_rms_error < 1e-3


def test_the_file_carries_the_memory_section_that_budget_reads(calibrated):
    res, _, out = calibrated
    path = out / "cal.json"
    prof = load_memory_profile(path)
    assert prof is not None and prof.source == "fitted" and prof.fitted_on["device"].startswith("CPU")
    assert prof.fitted_on["dtype"] == "fp32" and prof.fitted_on["model"].startswith("tiny-gpt")
    c = choose_budget("tiny-gpt", None, 1.0, profile=str(path), settings={"reserve_gb": 0.1})
    assert c.breakdown.profile_source == "fitted"
    assert main(["budget", "--model", "tiny-gpt", "--gpu-memory-gb", "1", "--cost-model", str(path),
                 "--reserve-gb", "0.1"]) == 0


def test_saved_records_refit_the_memory_too(calibrated, tmp_path, capsys):
    res, _, out = calibrated
    target = tmp_path / "refit.json"
    assert main(["calibrate", "--model", "tiny-gpt", "--max-tokens-per-gpu", "512", "--device", "cpu",
                 "--from-records", str(out / "records.json"), "--output", str(target)]) == 0
    assert "memory fit (12 peaks" in capsys.readouterr().out
    assert load_memory_profile(target) == load_memory_profile(out / "cal.json")
    # records of another model are not refitted for this one
    assert main(["calibrate", "--model", "qwen3-0.6b", "--max-tokens-per-gpu", "512", "--device", "cpu",
                 "--from-records", str(out / "records.json"), "--output", str(tmp_path / "x.json")]) == 2
    assert "memory_records" in capsys.readouterr().err


def test_memory_is_on_by_default_on_a_gpu_and_refused_on_a_cpu(capsys):
    gpu = plan_calibration("qwen3-8b", parallel={"tp": 2}, max_tokens_per_gpu=16384, device="cuda")
    assert gpu.memory and gpu.memory_estimate_s > 0 and any(line.startswith("memory: 12") for line in gpu.describe())
    assert not plan_calibration("qwen3-8b", max_tokens_per_gpu=16384, device="cuda", memory=False).memory
    assert not plan_calibration("tiny-gpt", max_tokens_per_gpu=512, device="cpu").memory
    with pytest.raises(DynBatchConfigError, match="CUDA allocator"):
        plan_calibration("tiny-gpt", max_tokens_per_gpu=512, device="cpu", memory=True)
    assert main(["calibrate", "--model", "tiny-gpt", "--max-tokens-per-gpu", "512", "--device", "cpu", "--memory",
                 "--dry-run"]) == 2
    assert "--memory" in capsys.readouterr().err
