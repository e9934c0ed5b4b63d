"""A cost-model file used for a model it was not fitted for is never used silently (issue 28 item 13).

``plan --model qwen3-8b --tp 2 --dp 8 --cost-model tiny_cpu_cost_model.json`` predicted 957,873 s without a word.
``calibrate`` now records what it timed (``"fit": {"fitted_for": ...}``: model widths, device); applying the file's
profile to other widths warns, naming both (a profile transfers by design); using its bare coefficients for
another model is refused (per-token seconds of one model mean nothing for another). Same widths, or a file
without the record (hand-written, older): silent, as before. No torch: the records are a profile's predictions."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from megatron_dynbatch import plan_global_batch
from megatron_dynbatch.cli import main
from megatron_dynbatch.core.cost_fit import predict_records
from megatron_dynbatch.core.cost_model import CostModel
from megatron_dynbatch.core.cost_files import CostModelMismatchWarning, fitted_for, resolve_cost_model, save_cost_model
from megatron_dynbatch.core.cost_fit import FitReport
from megatron_dynbatch.core.cost_profiles import CostProfile
from megatron_dynbatch.core.errors import DynBatchConfigError
from megatron_dynbatch.core.parallel import ParallelConfig

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "grpo_lengths.txt")
CPU = CostProfile(name="calibrated on CPU Test", linear_efficiency=6e-6, attention_efficiency=9e-6,
                  overhead_per_layer_s=1.5e-3, min_per_layer_s=5e-3)
DEVICE = "CPU Test Processor @ 2.50GHz"


def _file(tmp_path, *, profile=True, record=True, name="cm.json") -> str:
    """A file as ``calibrate --device cpu`` of tiny-gpt writes it (profile, fit report, fitted_for)."""
    cm = CostModel.from_model("tiny-gpt", ParallelConfig(dp=2), profile=CPU)
    report = FitReport(20, 0.1, 0.3, {1: {"n": 20}}, 0.1, CPU.to_dict(),
                       fitted_for("tiny-gpt", device=DEVICE, device_type="cpu", dtype="fp32", tp=1) if record else None)
    path = tmp_path / name
    save_cost_model(cm, path, report)
    if not profile:
        data = json.loads(path.read_text())
        data.pop("profile")
        data["fit"].pop("profile")
        path.write_text(json.dumps(data))
    return str(path)


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error", CostModelMismatchWarning)
        return fn()


def test_the_file_records_what_it_was_fitted_for(tmp_path):
    record = json.loads(Path(_file(tmp_path)).read_text())["fit"]["fitted_for"]
    assert record["model"] == "tiny-gpt" and record["device"] == DEVICE and record["device_type"] == "cpu"
    assert record["widths"]["hidden_size"] == 64 and record["widths"]["ffn_hidden_size"] == 128


def test_a_profile_fitted_for_another_model_warns_naming_both(tmp_path):
    path = _file(tmp_path)
    with pytest.warns(CostModelMismatchWarning) as caught:
        resolve_cost_model(path, "qwen3-8b", ParallelConfig(dp=8, tp=2))
    text = str(caught[0].message)
    assert "fitted for tiny-gpt (hidden 64, 4 heads, FFN 128) on " + DEVICE in text
    assert "not for qwen3-8b (hidden 4096" in text and "speed of a CPU" in text
    assert "calibrate --model qwen3-8b" in text
    with pytest.warns(CostModelMismatchWarning):  # the planner's own cost_model= goes the same way
        plan_global_batch([100, 2000, 300, 4000], model="qwen3-8b", parallel={"dp": 2}, max_tokens_per_gpu=8192,
                          cost_model=path)


def test_the_model_it_was_fitted_for_and_unrecorded_files_stay_silent(tmp_path):
    path = _file(tmp_path)
    for par in (ParallelConfig(dp=2), ParallelConfig(dp=4, pp=2)):  # the layout transfers: no warning
        _quiet(lambda: resolve_cost_model(path, "tiny-gpt", par))
    same_widths = {"num_layers": 6, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
                   "ffn_hidden_size": 128, "swiglu": True, "vocab_size": 512, "name": "deeper"}
    _quiet(lambda: resolve_cost_model(path, same_widths, ParallelConfig(dp=2)))  # per-layer numbers: depth is fine
    old = _file(tmp_path, record=False, name="old.json")
    _quiet(lambda: resolve_cost_model(old, "qwen3-8b", ParallelConfig(dp=8)))
    _quiet(lambda: resolve_cost_model(path, None, ParallelConfig(dp=2)))  # no model: the file's own coefficients


def test_bare_coefficients_of_another_model_are_refused(tmp_path):
    path = _file(tmp_path, profile=False)
    with pytest.raises(DynBatchConfigError) as err:
        resolve_cost_model(path, "qwen3-8b", ParallelConfig(dp=8))
    assert err.value.field == "cost_model" and "per-token seconds of tiny-gpt" in err.value.problem
    assert "calibrate qwen3-8b" in err.value.fix
    _quiet(lambda: resolve_cost_model(path, "tiny-gpt", ParallelConfig(dp=2)))


def test_plan_cli_prints_the_mismatch_as_one_warning_line(tmp_path, capsys):
    path = _file(tmp_path)
    assert main(["plan", "--lengths", EXAMPLE, "--model", "qwen3-8b", "--tp", "2", "--dp", "8",
                 "--max-tokens-per-gpu", "16384", "--cost-model", path]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("megatron-dynbatch: warning: cost_model=") and "tiny-gpt" in err[0]


def test_calibrate_from_records_writes_the_record(tmp_path, capsys):
    """``calibrate --from-records`` (no timing) writes fitted_for from the records' slice and environment."""
    records = [[1, [n] * k, 1.0] for n in (32, 64, 128, 256) for k in (1, 2, 4) if n * k <= 512]
    seconds = predict_records(CPU, records, "tiny-gpt", measured_layers=2)
    data = {"environment": {"device": DEVICE, "layout": {"device": "cpu"}}, "spec": "local",
            "slice": {"model": "tiny-gpt", "measured_layers": 2, "tp": 1, "lm_head": False},
            "records": [[g, lens, float(s)] for (g, lens, _), s in zip(records, seconds)]}
    (tmp_path / "rec.json").write_text(json.dumps(data))
    out = tmp_path / "out.json"
    assert main(["calibrate", "--model", "tiny-gpt", "--max-tokens-per-gpu", "512", "--from-records",
                 str(tmp_path / "rec.json"), "--output", str(out)]) == 0
    record = json.loads(out.read_text())["fit"]["fitted_for"]
    assert (record["model"], record["device"], record["device_type"]) == ("tiny-gpt", DEVICE, "cpu")


@pytest.mark.parametrize("fit", [None, [], "x", {"fitted_for": None}, {"fitted_for": []}, {"fitted_for": {"widths": 3}},
                                 {"fitted_for": {"widths": {"hidden_size": "wide"}, "model": ["x"], "device": None}},
                                 {"fitted_for": {"widths": {}}}])
def test_a_garbled_record_never_breaks_loading(tmp_path, fit):
    """A hand-edited ``fitted_for`` is checked as far as it goes: no crash, at most the mismatch warning."""
    path = Path(_file(tmp_path))
    data = json.loads(path.read_text())
    data["fit"] = fit
    path.write_text(json.dumps(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CostModelMismatchWarning)
        assert isinstance(resolve_cost_model(str(path), "qwen3-8b", ParallelConfig(dp=8)), CostModel)
