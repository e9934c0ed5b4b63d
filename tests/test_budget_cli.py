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
    # every trainer's line from its own loss path (core/memory/loss_paths.py)
    own = {t: (choose_budget("qwen3-8b", par, 80, settings=mem.replace(trainer=t)).tokens_per_gpu,
               choose_budget("qwen3-8b", par, 80, settings=mem.replace(trainer=t), pass_="log_prob").tokens_per_gpu)
           for t in ("verl", "roll", "nemo-rl")}
    assert f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={own['verl'][0]}" in out
    assert f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={own['verl'][1]}" in out
    assert f"actor_train.max_tokens_per_microbatch_in_train={own['roll'][0] * 2}" in out  # per micro-batch, x cp
    assert f"policy.sequence_packing.logprob_mb_tokens={own['nemo-rl'][1] * 2}" in out
    assert own["nemo-rl"][1] < lp  # NeMo-RL's unchunked log-prob keeps 14 bytes per V/tp column, Megatron's 6
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
    rc, text, _ = _run(capsys, ["budget", "--run", "qwen3-30b-a3b-grpo", "--gpu-memory-gb", "79.1"])
    assert rc == 0
    for name in ("Megatron-LM", "slime", "verl", "ROLL", "NeMo-RL"):  # every trainer the preset names, each judged
        assert f"the preset's max_tokens_per_gpu 16384 with {name}'s loss: predicted peak" in text
    assert set(c["trainers"]) == set(run.trainers) and all(v["fits"] for v in c["trainers"].values())
    assert d["named_trainers"] == list(run.trainers)
    # a preset whose budgets are auto has nothing configured to judge: its budgets are the command's own
    rc, out, _ = _run(capsys, ["budget", "--run", "qwen3-8b-grpo", "--gpu-memory-gb", "79.1", "--json"])
    d = json.loads(out)
    assert rc == 0 and d["configured"] == {}
    assert d["train"]["max_tokens_per_gpu"] == RunConfig.from_yaml("qwen3-8b-grpo").budget()


@pytest.mark.parametrize("argv, flag", [
    (["--model", "qwen3-8b"], "--gpu-memory-gb"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "eighty"], "--gpu-memory-gb"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "0"], "--gpu-memory-gb"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "-3"], "--gpu-memory-gb"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "nan"], "--gpu-memory-gb"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "1e30"], "--gpu-memory-gb"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "8.5e10"], "--gpu-memory-gb"),  # bytes
    (["--model", "qwen3-8b", "--gpu-memory-gb", "81559"], "--gpu-memory-gb"),  # MiB
    (["--model", "qwen3-8b", "--gpu-memory-gb", "16"], "--gpu-memory-gb"),  # cannot fit at all
    (["--gpu-memory-gb", "80"], "--model"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "80", "--recompute", "most"], "--recompute"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "80", "--tp", "3"], "--tp"),  # heads not divisible, as plan says
    (["--model", "qwen3-8b", "--gpu-memory-gb", "80", "--trainer", "slmie"], "--trainer"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "80", "--loss-chunk-tokens", "0"], "--loss-chunk-tokens"),
    (["--model", "qwen3-8b", "--gpu-memory-gb", "80", "--loss-temperature", "0"], "--loss-temperature"),
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
    assert rc == 2 and "do not fit" in err and "--optimizer cpu_offload" in err and "--ep" in err
    assert "--optimizer-cpu-offload" not in err  # only flags `budget` accepts


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


# ------------------------------------------------------------------------------- strict as plan (issue 32.6)
def test_the_run_presets_card_is_used_and_json_has_every_trainers_own_numbers(capsys):
    rc, out, _ = _run(capsys, ["budget", "--run", "qwen3-8b-grpo", "--json"])  # the preset says 79.1 GiB
    assert rc == 0
    d = json.loads(out)
    assert d["gpu_memory_gb"] == 79.1
    t = d["trainers"]
    assert t["megatron-lm"]["train"]["max_tokens_per_gpu"] == d["train"]["max_tokens_per_gpu"]
    assert t["slime"]["train"]["max_tokens_per_gpu"] < t["megatron-lm"]["train"]["max_tokens_per_gpu"]
    assert t["verl"]["log_prob"]["max_tokens_per_gpu"] < t["verl"]["train"]["max_tokens_per_gpu"]
    for name, e in t.items():
        assert e["train"]["predicted_peak_gb"] <= d["train"]["usable_gb"], name
        assert e["log_prob"]["predicted_peak_gb"] <= d["train"]["usable_gb"], name
    assert f"ppo_max_token_len_per_gpu={t['verl']['train']['max_tokens_per_gpu']}" in t["verl"]["line"]
    # the trainer loss options change the lines: slime chunked log-probs hold more
    rc, out, _ = _run(capsys, ["budget", "--run", "qwen3-8b-grpo", "--json", "--loss-chunk-tokens", "1024"])
    assert json.loads(out)["trainers"]["slime"]["log_prob"]["max_tokens_per_gpu"] > \
        t["slime"]["log_prob"]["max_tokens_per_gpu"]


def test_a_card_in_gb_warns_and_in_bytes_is_refused(capsys):
    rc, out, err = _run(capsys, ["budget", "--model", "qwen3-8b", "--dp", "8", "--gpu-memory-gb", "80"])
    assert rc == 0 and "warning: --gpu-memory-gb 80: an H100 80GB is sold as 80 GB, and torch reports 79.1 GiB" in err
    assert "80 GiB card" in out
    rc, _, err = _run(capsys, ["budget", "--model", "qwen3-8b", "--gpu-memory-gb", "8.5e10"])
    assert rc == 2 and "reads as a card size in bytes" in err and "--gpu-memory-gb 79.2" in err


def test_a_cost_model_fitted_for_another_model_warns_as_plan_does(capsys, tmp_path):
    from megatron_dynbatch.core.cost_files import fitted_for

    path = tmp_path / "cm.json"
    record = fitted_for("llama-3.1-8b", device="H100", device_type="cuda", dtype="bf16", tp=1)
    path.write_text(json.dumps({"profile": "fitted", "fit": {"fitted_for": record}}))
    rc, _, err = _run(capsys, ["budget", "--model", "qwen3-8b", "--dp", "8", "--gpu-memory-gb", "79.1",
                               "--cost-model", str(path)])
    assert rc == 0 and "warning: --cost-model=" in err and "was fitted for" in err


def test_troubleshooting_quotes_the_budget_messages(capsys):
    """docs/troubleshooting.md carries every message of the card-unit, layout, trainer and loss-option checks."""
    from megatron_dynbatch import DynBatchConfigError
    from megatron_dynbatch.core.memory import MemorySettings

    doc = " ".join((ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8").split())
    msgs = []
    for argv in (["--model", "qwen3-8b", "--gpu-memory-gb", "8.5e10"],
                 ["--model", "qwen3-8b", "--gpu-memory-gb", "81559"],
                 ["--model", "qwen3-8b", "--dp", "8", "--gpu-memory-gb", "80"],
                 ["--model", "qwen3-8b", "--gpu-memory-gb", "80", "--tp", "3"],
                 ["--model", "qwen3-8b", "--gpu-memory-gb", "79.1", "--trainer", "slmie"],
                 ["--run", "qwen3-30b-a3b-grpo"],
                 ["--model", "qwen3-30b-a3b", "--dp", "8", "--ep", "8", "--gpu-memory-gb", "79.1"]):
        _, _, err = _run(capsys, ["budget"] + argv)
        msgs.append(err.strip().splitlines()[-1] if "error" in err else err.strip())
    tiny = RunConfig.from_yaml("tiny-cpu-demo").to_dict()
    for call in (lambda: MemorySettings(trainer="slmie"), lambda: MemorySettings(loss_chunk_tokens=0),
                 lambda: choose_budget("qwen3-8b", {"dp": 8}, 8.5e10),
                 lambda: RunConfig.from_dict({**tiny, "trainers": ["slmie"]})):
        with pytest.raises(DynBatchConfigError) as exc:
            call()
        msgs.append(f"DynBatchConfigError: {exc.value}")
    for m in msgs:
        assert " ".join(m.split()) in doc, m
