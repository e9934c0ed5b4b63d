"""``megatron-dynbatch demo``: a tiny GPT trained with real megatron-core on 2 CPU ranks; ``--check`` compares
the first step's gradients with the unpacked reference."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_dynbatch.demo import main  # noqa: E402


@pytest.mark.multiprocess
def test_demo_check_one_step(capsys):
    status = main(["--steps", "1", "--check"])
    out = capsys.readouterr().out
    assert status == 0, out
    m = re.search(r"max_grad_diff=(\S+)", out)
    assert m, out
    assert float(m.group(1)) <= 1e-5
    assert re.search(r"^check: PASS \(max_grad_diff \S+ <= 1e-05\)", out, flags=re.M), out  # verdict + threshold
    step = re.search(r"step 0: loss=(\S+) tokens/s=(\S+) micro-batches/rank=(\d+) .*flops_imbalance=(\S+) "
                     r"padding=(\d+)", out)
    assert step, out
    assert 3.0 < float(step.group(1)) < 6.0  # ~ln(128) for an untrained model
    assert int(step.group(3)) >= 1 and float(step.group(4)) >= 1.0


def test_demo_rejects_bad_arguments(capsys):
    assert main(["--steps", "0"]) == 2
    with pytest.raises(SystemExit):
        main(["--loss-mode", "median"])


def test_demo_torchrun_launcher_needs_torchrun_env_and_matching_dp(monkeypatch, capsys):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert main(["--launcher", "torchrun"]) == 2
    assert "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in capsys.readouterr().err
    for var, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29500")):
        monkeypatch.setenv(var, value)
    assert main(["--launcher", "torchrun", "--dp", "4"]) == 2
    assert "--dp=4 disagrees with WORLD_SIZE=2" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "2")
    assert main(["--launcher", "torchrun"]) == 2
    assert "inconsistent" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_demo_torchrun_mode_single_rank_check():
    """``--launcher torchrun`` in one process with torchrun's variables (world of one): runs in-process, --dp
    defaults to WORLD_SIZE, the check passes and the rank reports that it finished."""
    import os
    import subprocess
    import sys

    from megatron_dynbatch.megatron.ranks import free_port

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "megatron_dynbatch.demo", "--launcher", "torchrun", "--steps", "1",
                          "--samples", "6", "--check"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "dp=1 (torchrun)" in res.stdout
    assert float(re.search(r"max_grad_diff=(\S+)", res.stdout).group(1)) <= 1e-5
    assert res.stdout.rstrip().splitlines()[-1] == "demo rank 0/1 finished"


def test_demo_dp_default_is_two_and_explicit_dp_is_recorded():
    from megatron_dynbatch.demo import _parser

    assert _parser().get_default("dp") == 2  # the spawn default (configs/runs/tiny-cpu-demo.yaml agrees)
    assert not getattr(_parser().parse_args([]), "dp_given", False)
    args = _parser().parse_args(["--dp", "2"])
    assert args.dp == 2 and args.dp_given
