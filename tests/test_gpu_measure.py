"""The GPU benchmark's CPU mode (benchmarks/gpu/measure.py --device cpu --tiny): the whole pipeline -- plans of
every algorithm, real megatron-core / plain-torch slices timed, steps composed, results file written -- runs on
CPU in seconds, so the GPU benchmark cannot rot. Its flags are validated like every public entry point. No
timing assertions (CPU timings on a shared machine mean nothing)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("torch")

from megatron_dynbatch.core.errors import DynBatchConfigError  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "measure.py"


@pytest.fixture(scope="module")
def measure():
    spec = importlib.util.spec_from_file_location("gpu_measure", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _finite(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


def _check_results(res, kind):
    from megatron_dynbatch.bench.measured import TINY_WORKLOADS

    for key in ("device", "kernel", "torch", "megatron_core", "method", "algorithms", "workloads", "microbatches"):
        assert key in res, key
    assert res["device"].startswith("CPU") and res["layout"]["kind"] == kind
    assert (res["megatron_core"] is not None) == (kind == "mcore")
    assert set(res["workloads"]) == {f"{n}/s0" for n in TINY_WORKLOADS}
    dyncp = res["workloads"]["tiny-dyncp-dp2-cp2/s0"]
    assert dyncp["kind"] == "dynamic-cp"
    assert {"dynbatch", "dynbatch-dyncp", "megatron-hybrid-cp"} <= set(dyncp["runs"][0])
    assert res["workloads"]["tiny-rl-dp2/s0"]["kind"] == "dp"
    for name, entry in res["workloads"].items():
        assert entry["batch_source"] and entry["widths_per_tp_rank"]["hidden_size"] == 64
        for algo, r in entry["runs"][0].items():
            assert _finite(r["step_s"]) and _finite(r["tokens_per_s"]) and r["imbalance"] >= 1.0, (name, algo)
            assert _finite(r["modelled_step_s"]) and r["microbatches"] >= 1
            tag = "vs_fixed_cp" if entry["kind"] == "dynamic-cp" else "vs_dynbatch"
            assert _finite(r[tag]) and _finite(r["modelled_" + tag])
        for g, lengths, seconds in entry["microbatches"]:
            assert g >= 1 and lengths == sorted(lengths, reverse=True) and _finite(seconds)
    for algo, a in res["algorithms"].items():
        assert _finite(a["step_s"]) and _finite(a["tokens_per_s"]) and a["imbalance"] >= 1.0, algo
    assert len(res["microbatches"]) == len(res["microbatch_slice"]) == sum(
        len(e["microbatches"]) for e in res["workloads"].values())


@pytest.mark.slow
def test_cpu_tiny_run_writes_the_results_file(measure, tmp_path, capsys):
    pytest.importorskip("megatron.core")
    out = tmp_path / "x.json"
    assert measure.main(["--device", "cpu", "--tiny", "--output", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    _check_results(res, "mcore")
    table = capsys.readouterr().out
    assert "dynbatch-dyncp" in table and "megatron-hybrid-cp" in table and str(out) in table


@pytest.mark.slow
def test_cpu_tiny_run_with_the_plain_torch_slice(measure, tmp_path):
    res = measure.run(["--device", "cpu", "--tiny", "--model-kind", "torch", "--output", str(tmp_path / "t.json"),
                       "--quiet"])
    _check_results(res, "torch")
    assert res["kernel"].startswith("reference_varlen_attn")


def test_documents_flag_draws_the_long_document_batches_from_that_file(measure, tmp_path):
    from megatron_dynbatch.bench.workloads import WORKLOADS

    path = tmp_path / "lengths.json"
    path.write_text("[1000, 2000, 3000, 30000]")
    opts = measure.parse_options(["--device", "cpu", "--documents", str(path)])
    batch = WORKLOADS["dyncp-longdoc-8b-1mb"].generate(0, documents=opts["documents"])
    assert set(batch.lengths.tolist()) <= {1000, 2000, 3000, 30000}


def test_help(measure, capsys):
    with pytest.raises(SystemExit) as exc:
        measure.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--device", "--tiny", "--output", "--workloads", "--model-kind"):
        assert flag in out


def test_default_output_names_date_and_device(measure):
    p = measure.default_output("NVIDIA H100 80GB HBM3")
    assert p.parent.name == "results" and p.name.endswith("_nvidia-h100-80gb-hbm3.json")
    assert measure.default_output("CPU AMD EPYC").name.endswith("_cpu.json")


BAD = [
    (["--device", "gpu"], "--device"), (["--device", "cuda:x"], "--device"),
    (["--model-kind", "jax"], "--model-kind"), (["--seeds", "0"], "--seeds"), (["--seeds", "two"], "--seeds"),
    (["--layers", "0"], "--layers"), (["--repeats", "0"], "--repeats"), (["--warmup", "-1"], "--warmup"),
    (["--vocab", "-2"], "--vocab"), (["--dtype", "fp8"], "--dtype"), (["--workloads", "nope"], "--workloads"),
    (["--workloads", " "], "--workloads"), (["--tiny", "--workloads", "grpo-longcot-8b"], "--workloads"),
    (["--algorithms", "nope"], "--algorithms"), (["--algorithms", ","], "--algorithms"),
    (["--documents", "/nonexistent/lengths.json"], "--documents"),
]


@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flags_name_the_flag(measure, argv, flag, capsys):
    argv = (["--device", "cpu"] if "--device" not in argv else []) + argv
    with pytest.raises(DynBatchConfigError, match=flag):
        measure.parse_options(argv)
    assert measure.main(argv) == 2
    assert flag in capsys.readouterr().err


def test_cuda_without_a_gpu_is_refused(measure):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DynBatchConfigError, match="CUDA is not available"):
        measure.parse_options(["--tiny"])
