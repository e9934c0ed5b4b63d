"""``megatron-dynbatch budget``: the training and log-prob budgets with their breakdowns and each trainer's lines,
from flags or a run preset (whose Megatron flags set the memory settings), as text or JSON; every bad flag exits 2
naming it; and the figures docs/tuning.md quotes are this command's output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_dynbatch.core.run_config import RunConfig

from megatron_dynbatch.cli import main
from megatron_dynbatch.core.memory import MemorySettings, choose_budget

ROOT = Path(__file__).resolve().parents[1]


def _run(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_flags_print_both_budgets_their_breakdowns_and_every_trainers_line(capsys):
    rc, out, _ = _run(capsys, ["budget", "--model", "qwen3-8b", "--dp", "4", "--tp", "2", "--cp", "2",
                               "--gpu-memory-gb", "80", "--recompute", "full"])
    assert rc == 0
    par = {"dp": 4, "tp": 2, "cp": 2}
    mem = MemorySettings(recompute="full")
    train = choose_budget("qwen3-8b", par, 80, settings=mem).tokens_per_gpu
    lp = choose_budget("qwen3-8b", par, 80, settings=mem, pass_="log_prob").tokens_per_gpu
    assert f"training budget: {train} tokens per GPU" in out and f"log-prob budget: {lp} tokens per GPU" in out
    assert f"--max-tokens-per-gpu {train} --log-probs-max-tokens-per-gpu {lp}" in out
    assert f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={train}" in out
    assert f"actor_train.max_tokens_per_microbatch_in_train={train * 2}" in out  # ROLL: per micro-batch, x cp
    assert f"policy.sequence_packing.logprob_mb_tokens={lp * 2}" in out
    for word in ("static", "activations", "logits", "workspace", "reserve", "headroom", "limited by"):
        assert word in out


def test_json_has_train_and_log_prob_entries(capsys):
    rc, out, _ = _run(capsys, ["budget", "--model", "llama-3.1-70b", "--tp", "8", "--pp", "2", "--dp", "2",
                               "--gpu-memory-gb", "141", "--recompute", "full", "--json"])
    assert rc == 0
    d = json.loads(out)
    assert d["train"]["pass"] == "train" and d["log_prob"]["pass"] == "log_prob"
    assert d["log_prob"]["max_tokens_per_gpu"] >= d["train"]["max_tokens_per_gpu"] > 0
    assert d["train"]["limiting_stage"] in (0, 1) and len(d["train"]["breakdown"]["stages"]) == 2
    assert set(d["trainers"]) == {"megatron-lm", "slime", "verl", "roll", "nemo-rl"}
    assert "configured" not in d


def test_a_run_preset_brings_its_memory_settings_and_its_budgets_are_judged(capsys):
    rc, out, _ = _run(capsys, ["budget", "--run", "qwen3-30b-a3b-grpo", "--gpu-memory-gb", "80", "--json"])
    assert rc == 0
    d = json.loads(out)
    run = RunConfig.from_yaml("qwen3-30b-a3b-grpo")
    assert d["train"]["settings"]["recompute"] == "full" and d["train"]["settings"]["optimizer"] == "cpu_offload"
    assert d["train"]["max_tokens_per_gpu"] == choose_budget(
        run.model_spec(), run.parallel(), 80, settings=run.memory_settings()).tokens_per_gpu
    c = d["configured"]["max_tokens_per_gpu"]
    assert c["tokens"] == 16384 and c["fits"] and 0 < c["of_auto"] <= 1
    rc, text, _ = _run(capsys, ["budget", "--run", "qwen3-30b-a3b-grpo", "--gpu-memory-gb", "80"])
    assert rc == 0 and "the preset's max_tokens_per_gpu 16384: predicted peak" in text
    # a preset whose budgets are auto has nothing configured to judge: its budgets are the command's own
    rc, out, _ = _run(capsys, ["budget", "--run", "qwen3-8b-grpo", "--gpu-memory-gb", "79.1", "--json"])
    d = json.loads(out)
    assert rc == 0 and d["configured"] == {}
    assert d["train"]["max_tokens_per_gpu"] == RunConfig.from_yaml("qwen3-8b-grpo").budget()


@pytest.mark.parametrize("argv, flag", [
    (["--model", "qwen3-8b"], "--gpu-memory-gb"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "eighty"], "--gpu-memory-gb"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "0"], "gpu_memory_gb"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "-3"], "gpu_memory_gb"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "nan"], "gpu_memory_gb"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "1e30"], "gpu_memory_gb"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "16"], "gpu_memory_gb"),  # cannot fit at all
    (["--gpu-memory-gb", "80"], "--model"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "80", "--recompute", "most"], "settings.recompute"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "80", "--headroom", "lots"], "--headroom"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "80", "--multiple", "0"], "multiple"),
    (["--run", "qwen3-8b-grpo", "--gpu-memory-gb", "80", "--recompute", "none"], "--recompute"),
    (["--run", "qwen3-8b-grpo", "--gpu-memory-gb", "80", "--tp", "2"], "--tp"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "80", "--cost-model", "/nonexistent/x.json"], "--cost-model"),
])
def test_every_bad_flag_names_the_flag_and_a_fix(capsys, argv, flag):
    rc, _, err = _run(capsys, ["budget"] + argv)
    assert rc == 2 and flag in err and "Fix:" in err and "Traceback" not in err


def test_a_model_that_cannot_fit_says_what_to_change(capsys):
    rc, _, err = _run(capsys, ["budget", "--model", "qwen3-30b-a3b", "--dp", "8", "--ep", "8", "--gpu-memory-gb", "80"])
    assert rc == 2 and "do not fit" in err and "--optimizer-cpu-offload" in err and "--ep" in err


# ------------------------------------------------------------------------------------------- docs figures
def _doc_blocks():
    """(command argv, expected output) of every ```bash block with one `megatron-dynbatch budget` command that is
    followed by a ```text block in docs/tuning.md."""
    text = (ROOT / "docs" / "tuning.md").read_text(encoding="utf-8")
    pat = re.compile(r"```bash\n(megatron-dynbatch budget [^\n]+)\n```\n\n```text\n(.*?)```", re.S)
    return [(cmd.split()[1:], out) for cmd, out in pat.findall(text)]


def test_tuning_md_quotes_the_budget_commands_output_exactly(capsys):
    blocks = _doc_blocks()
    assert len(blocks) >= 2
    for argv, expected in blocks:
        rc, out, _ = _run(capsys, argv)
        assert rc == 0 and out == expected, " ".join(argv)
