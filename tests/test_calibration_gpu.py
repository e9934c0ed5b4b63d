"""On a GPU (skipped elsewhere -- every CPU machine of this project): calibration's CUDA paths (issue 18 item 4).

* ``calibrate(..., device="cuda")`` times a megatron-core slice with CUDA events and fits it (torch's varlen flash
  kernel inside with the local spec; Transformer Engine's layer spec where TE is installed);
* online calibration's timer records CUDA events around each micro-batch's forward and backward and reads them
  once after the step: one record per micro-batch, positive seconds, and the same loss and gradients as without
  it.

Their logic runs on CPU in tests/test_calibrate_cli.py and tests/test_online_calibration.py (``perf_counter``).
How to run this on a lent GPU: benchmarks/gpu/README.md (megatron-core's cp312 wheel installed with
``pip install --no-deps --target``), then ``python3 -m pytest -q -p no:cacheprovider tests/test_calibration_gpu.py``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: no CUDA device here")


def test_calibrate_times_a_slice_on_the_gpu_and_writes_the_file(cuda_world1, tmp_path):
    from megatron_dynbatch.core.cost_files import load_cost_model
    from megatron_dynbatch.measure.calibrate import calibrate

    res = calibrate("qwen3-0.6b", parallel={"dp": 8}, max_tokens_per_gpu=4096, device="cuda", layers=1,
                    group_sizes=[1, 2], spec="local", max_seconds=300)
    assert len(res.records) >= 6 and set(res.report.per_group) <= {1, 2}
    assert "varlen" in res.environment["kernel"], res.environment  # the flash path was taken
    assert all(s > 0 for _, _, s in res.records)
    res.save(str(tmp_path / "cm.json"))
    assert load_cost_model(str(tmp_path / "cm.json")).linear_s_per_token > 0


def test_calibrate_with_transformer_engine_where_installed(cuda_world1):
    from megatron_dynbatch.measure.calibrate import calibrate, te_available

    if not te_available():
        pytest.skip("Transformer Engine is not installed here")
    res = calibrate("qwen3-0.6b", max_tokens_per_gpu=4096, device="cuda", layers=1, group_sizes=[1], spec="auto",
                    max_seconds=300)
    assert res.spec == "te" and "Transformer Engine" in res.environment["kernel"]
    assert len(res.records) >= 6


def test_online_timer_reads_cuda_events_once_per_step(cuda_world1):
    from megatron_dynbatch.core.model_spec import ModelSpec
    from megatron_dynbatch.demo import synthetic_rl_batch
    from megatron_dynbatch.megatron.online_calibration import OnlineCalibrator
    from megatron_dynbatch.megatron.schedule import dynamic_forward_backward
    from megatron_dynbatch.megatron import cpu as megatron_cpu

    config = megatron_cpu.tiny_gpt_config(hidden_size=256, num_attention_heads=4, num_query_groups=2,
                                          kv_channels=64, ffn_hidden_size=512, use_cpu_initialization=False,
                                          deterministic_mode=False)
    torch.manual_seed(0)
    model = megatron_cpu.build_tiny_gpt(config, vocab_size=256, max_seq_len=2048, thd=True).cuda()
    ddp = megatron_cpu.wrap_ddp(config, model)
    spec = ModelSpec.from_megatron(config, vocab_size=256)
    kwargs = {"model": spec, "parallel": {"dp": 1}, "max_tokens_per_gpu": 512}
    cal = OnlineCalibrator(spec, {"dp": 1}, interval=1, skip_steps=0, log=None)
    for step in range(3):
        samples = synthetic_rl_batch(24, seed=step, vocab=256, max_len=400)
        out = {}
        for name, calibrator in (("on", cal), ("off", None)):
            ddp.zero_grad_buffer()
            res = dynamic_forward_backward(ddp, samples, kwargs, calibrator=calibrator)
            out[name] = (res.loss, [p.main_grad.clone() for p in ddp.module.parameters()], res.num_microbatches)
        assert out["on"][0] == pytest.approx(out["off"][0], rel=1e-5)
        for a, b in zip(out["on"][1], out["off"][1]):
            assert float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))
        records = cal.recorder.records
        assert len(records) == out["on"][2] and all(r[2] > 0 for r in records)
    assert cal.history and cal.history[-1].profile is not None
