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
    step = re.search(r"step 0: loss=(\S+) tokens/s=(\S+) micro-batches/rank=(\d+) .*flops_imbalance=(\S+) "
                     r"padding=(\d+)", out)
    assert step, out
    assert 3.0 < float(step.group(1)) < 6.0  # ~ln(128) for an untrained model
    assert int(step.group(3)) >= 1 and float(step.group(4)) >= 1.0


def test_demo_rejects_bad_arguments(capsys):
    assert main(["--steps", "0"]) == 2
    with pytest.raises(SystemExit):
        main(["--loss-mode", "median"])
