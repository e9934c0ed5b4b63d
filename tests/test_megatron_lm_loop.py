"""Megatron-LM's REAL ``pretrain()`` loop driven by ``scripts/pretrain_gpt_dynbatch.py`` under torchrun on CPU.

Runs only when ``MEGATRON_LM_DIR`` points at a Megatron-LM checkout (CI has none: the megatron-core wheel holds
no ``megatron.training``) and this interpreter can import ``megatron.training`` from it. Each case runs the
script twice on the same mock samples -- with ``--use-dynamic-batch-size --balance-by-flops`` (the hook) and
without (plain fixed micro-batches, Megatron-LM's own ``forward_step``, ``--calculate-per-token-loss``) -- and
checks, from Megatron's own iteration log lines: the loss goes down, every step's loss and grad norm agree
between the two batchings, consumed samples advance by the global batch, the hook's token counts are the
batch's real token counts; and that ``--save``/``--load`` resumes with the same next-step loss.

Dynamic context parallelism (``--dynbatch-dynamic-cp``) runs on 4 ranks, dp=2 x cp=2, with a length profile
whose plan puts micro-batches on single GPUs, CP groups of 2 and the whole pool of 4 in the same step (read
from the hook's ``dynbatch plan`` log line); its losses and grad norms equal the fixed-CP plan's, Megatron's own
fixed micro-batches at cp=2 and at cp=1 on the same samples.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRY = ROOT / "scripts" / "pretrain_gpt_dynbatch.py"
MLM = os.environ.get("MEGATRON_LM_DIR")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

GBS, ITERS, VOCAB = 16, 4, 127
TINY_GPT = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
            "--ffn-hidden-size 128 --swiglu --normalization RMSNorm --position-embedding-type rope "
            "--disable-bias-linear --seq-length 128 --max-position-embeddings 128 --attention-dropout 0 "
            "--hidden-dropout 0 --micro-batch-size 1 --lr 1e-3 --lr-decay-style constant --lr-decay-iters 100 "
            f"--clip-grad 0 --tokenizer-type NullTokenizer --vocab-size {VOCAB} --make-vocab-size-divisible-by 64 "
            "--seed 1234 --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
            "--no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm "
            "--use-cpu-initialization --distributed-backend gloo --dataloader-type external --eval-iters 0 "
            f"--log-interval 1 --global-batch-size {GBS} --dynbatch-mock-data").split()
DYNAMIC = "--use-dynamic-batch-size --balance-by-flops --max-tokens-per-gpu 256".split()
PLAIN = ["--calculate-per-token-loss"]
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*?lm loss: ([0-9.E+-]+) \|"
                  r"(?:.*?dynbatch tokens: ([0-9.E+-]+) \|)?(?:.*?dynbatch padded tokens: ([0-9.E+-]+) \|)?"
                  r".*?grad norm: ([0-9.]+) \|")
PLAN_LINE = re.compile(r"dynbatch plan \| iteration\s+(\d+) \| micro-batches per GPU: (\d+) \| cp groups "
                       r"\(size: count\): ([0-9:, ]+)")


def _skip_reason() -> str:
    if not MLM:
        return ("MEGATRON_LM_DIR is not set: this test runs Megatron-LM's real pretrain() loop and needs a "
                "Megatron-LM checkout (tag matching megatron-core, e.g. core_v0.16.1); see docs/integration.md")
    code = f"import sys; sys.path.insert(0, {MLM!r}); import megatron.training.training, gpt_builders, pretrain_gpt"
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    if res.returncode:
        return (f"megatron.training from MEGATRON_LM_DIR={MLM} does not import in this interpreter "
                f"({res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}); Megatron-LM "
                "needs e.g. pydantic and triton on top of megatron-core")
    helpers = Path(MLM) / "megatron" / "core" / "datasets" / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not helpers.exists():
        try:
            import pybind11  # noqa: F401
        except ImportError:
            return (f"Megatron-LM compiles its dataset helpers at start-up; {helpers.name} is missing and pybind11 "
                    "is not installed (pip install pybind11, or run make in megatron/core/datasets)")
    return ""


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    # Megatron-LM's start-up runs `make` on its dataset helpers with `python3` / `python3-config` from PATH:
    # point both at this interpreter.
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "python3").symlink_to(sys.executable)
    cfg = bin_dir / "python3-config"
    cfg.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"import sysconfig; print(sysconfig.get_config_var("
                   f"'EXT_SUFFIX'))\"\n")
    cfg.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYENV_VERSION", "MASTER_", "RANK", "WORLD"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT), MEGATRON_LM_DIR=MLM,
               CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

    def run(*flags: str, nproc: int = 2, iters: int = ITERS) -> dict:
        from megatron_dynbatch.megatron.ranks import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(free_port()), str(ENTRY), *TINY_GPT, "--train-iters", str(iters), *flags]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(bin_dir), timeout=400)
        out = res.stdout + res.stderr
        assert res.returncode == 0, out[-6000:]
        steps = {}
        for m in LINE.finditer(out):
            steps[int(m.group(1))] = dict(samples=int(m.group(2)), loss=float(m.group(3)),
                                          tokens=float(m.group(4)) if m.group(4) else None,
                                          padded=float(m.group(5)) if m.group(5) else None,
                                          grad_norm=float(m.group(6)))
        for m in PLAN_LINE.finditer(out):  # the hook's plan of each logged iteration
            sizes = dict(tuple(int(x) for x in pair.split(":")) for pair in m.group(3).split(","))
            steps.setdefault(int(m.group(1)), {}).update(microbatches=int(m.group(2)), groups=sizes)
        run.last_refits = [int(m.group(1)) for m in CALIBRATION_LINE.finditer(out)]
        return steps

    return run


def _batch_tokens(k: int) -> int:
    from megatron_dynbatch.integrations.megatron_lm import MockGlobalBatches

    batches = MockGlobalBatches(GBS, vocab_size=128, max_length=128, seed=1234, start_batch=k, as_torch=False)
    return sum(len(s["tokens"]) for s in next(batches))


def _as_logged(per_iteration: dict, first: int) -> dict:
    """What Megatron's iteration lines show for per-iteration values: its first line after start-up (or a
    resume) does not reset the interval accumulators, so the second line is the mean of the first two
    iterations (a megatron.training logging quirk; --log-interval 1)."""
    out = dict(per_iteration)
    out[first + 1] = (per_iteration[first] + per_iteration[first + 1]) / 2
    return out


CALIBRATION_LINE = re.compile(r"dynbatch calibration \| step (\d+) \|")


@pytest.mark.parametrize("layout", [[], ["--pipeline-model-parallel-size", "2"]], ids=["dp2", "pp2"])
def test_online_calibration_in_the_real_loop_keeps_the_losses(launcher, layout):
    """--dynbatch-online-calibration in Megatron-LM's own loop: the first step is not recorded (warm-up), then
    every 2 recorded steps each rank refits on its timings and the ranks agree on one model (the plans may change
    from then on); losses and grad norms stay those of plain Megatron batching on the same samples."""
    iters = 5
    dyn = launcher(*layout, *DYNAMIC, "--dynbatch-online-calibration", "--dynbatch-calibration-interval", "2",
                   iters=iters)
    refits = launcher.last_refits  # the refit line, printed on rank 0
    plain = launcher(*layout, *PLAIN, iters=iters)
    assert sorted(dyn) == sorted(plain) == list(range(1, iters + 1))
    for it in dyn:
        assert dyn[it]["loss"] == pytest.approx(plain[it]["loss"], rel=2e-6)
        assert dyn[it]["grad_norm"] == pytest.approx(plain[it]["grad_norm"], abs=1.5e-3)
    assert refits == [3, 5], refits


@pytest.mark.parametrize("layout", [[], ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]],
                         ids=["dp2", "tp2", "pp2"])
def test_hook_in_the_real_loop_matches_plain_megatron_batching(launcher, layout):
    dyn = launcher(*layout, *DYNAMIC)
    plain = launcher(*layout, *PLAIN)
    assert sorted(dyn) == sorted(plain) == list(range(1, ITERS + 1))
    tokens = _as_logged({it: _batch_tokens(it - 1) for it in dyn}, first=1)
    for it in dyn:
        assert dyn[it]["samples"] == plain[it]["samples"] == it * GBS   # consumed samples: exact
        assert dyn[it]["loss"] == pytest.approx(plain[it]["loss"], rel=2e-6)  # same samples, same math
        assert dyn[it]["grad_norm"] == pytest.approx(plain[it]["grad_norm"], abs=1.5e-3)
        assert dyn[it]["tokens"] == tokens[it]                         # the hook logs the batch's real tokens
    assert dyn[ITERS]["loss"] < dyn[1]["loss"] - 0.05                 # it learns


def test_save_and_load_resume_gives_the_uninterrupted_next_step(launcher, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    whole = launcher(*DYNAMIC)
    first = launcher(*DYNAMIC, "--save", ckpt, "--save-interval", "100", "--exit-interval", "2",
                     "--ckpt-format", "torch")
    assert sorted(first) == [1, 2] and (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"
    resumed = launcher(*DYNAMIC, "--load", ckpt, "--ckpt-format", "torch")
    assert sorted(resumed) == [3, 4]
    assert resumed[3]["samples"] == whole[3]["samples"] == 3 * GBS
    assert resumed[3]["loss"] == pytest.approx(whole[3]["loss"], rel=1e-6)
    assert resumed[3]["grad_norm"] == pytest.approx(whole[3]["grad_norm"], abs=1e-3)
    # the line after a resume is logged like the line after start-up (see _as_logged)
    true_loss = {1: whole[1]["loss"], 3: whole[3]["loss"], 4: whole[4]["loss"]}
    true_loss[2] = 2 * whole[2]["loss"] - whole[1]["loss"]  # undo the mean in the uninterrupted run's 2nd line
    assert resumed[4]["loss"] == pytest.approx(_as_logged(true_loss, first=3)[4], rel=1e-5)


#: Dynamic CP: one sample per CP-group size of a dp=2 x cp=2 pool at --max-tokens-per-gpu 64 (128 tokens need
#: a group of 2 at least; the short ones fit one GPU) ...
DYNCP_LENGTHS = "128,120,100,40,36,32,30,28,24,20,20,18,16,16,12,12"
#: ... and a cost model (--dynbatch-cost-model) in which, as for long sequences on GPUs, attention dominates and
#: the K/V exchange is partly hidden behind it, so that the planner spreads the longest sample over all 4 GPUs
#: and keeps the short ones on single GPUs (with the tiny model's own FLOPs the per-micro-batch overhead
#: dominates and every plan is the fixed one).
DYNCP_COST = {"linear_s_per_token": 1e-5, "attention_s_per_sq_token": 2e-7, "overhead_s": 1e-4,
              "cp_comm_s_per_token": 2e-6, "cp_comm_s_per_step": 2e-4, "cp_comm_overlap": 0.5}


def test_dynamic_cp_in_the_real_loop_matches_fixed_cp_and_plain_batching(launcher, tmp_path):
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps(DYNCP_COST))
    data = ["--dynbatch-mock-lengths", DYNCP_LENGTHS]
    hook = ["--use-dynamic-batch-size", "--balance-by-flops", "--max-tokens-per-gpu", "64",
            "--dynbatch-cost-model", str(cost), "--context-parallel-size", "2", *data]
    dyn = launcher(*hook, "--dynbatch-dynamic-cp", nproc=4)
    fixed = launcher(*hook, nproc=4)
    plain_cp = launcher("--context-parallel-size", "2", *data, *PLAIN, nproc=4)  # Megatron's own batches, cp=2
    plain = launcher(*data, *PLAIN, nproc=2)  # and without context parallelism (dp=2)
    iters = list(range(1, ITERS + 1))
    assert sorted(dyn) == sorted(fixed) == sorted(plain_cp) == sorted(plain) == iters
    tokens = sum(int(n) for n in DYNCP_LENGTHS.split(","))
    for it in iters:
        sizes = dyn[it]["groups"]
        assert 1 in sizes and len(sizes) >= 2, sizes  # single GPUs and wider groups in ONE step
        assert fixed[it]["groups"] == {2: 2 * fixed[it]["microbatches"]}  # the fixed layout: CP groups of 2
        for other in (fixed, plain_cp, plain):
            assert other[it]["samples"] == dyn[it]["samples"] == it * GBS
            assert dyn[it]["loss"] == pytest.approx(other[it]["loss"], rel=2e-6)
            assert dyn[it]["grad_norm"] == pytest.approx(other[it]["grad_norm"], abs=1.5e-3)
        assert dyn[it]["tokens"] == fixed[it]["tokens"] == tokens  # every batch holds the profile's lengths
        assert dyn[it]["padded"] >= tokens and fixed[it]["padded"] >= tokens
    assert dyn[ITERS]["loss"] < dyn[1]["loss"] - 0.05  # it learns
