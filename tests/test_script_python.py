"""Every script that starts Python picks the interpreter the same way (``scripts/_env.sh``): ``$PYTHON``, the
active virtual environment, the project's ``.venv``, then ``python3`` -- so documented script commands work
after ``bash scripts/setup.sh`` without activating anything."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV_SH = ROOT / "scripts" / "_env.sh"
SCRIPTS = sorted([*ROOT.glob("scripts/*.sh"), *ROOT.glob("scripts/sbatch/*.sbatch"), *ROOT.glob("benchmarks/*.sh")])


def _pick(repo: Path, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    res = subprocess.run(["bash", "-c", f'REPO_ROOT="$1"; source "{ENV_SH}"; echo "$PYTHON|$PYTHON_SOURCE"',
                          "_", str(repo)], capture_output=True, text=True, env={**base, **env}, timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def _fake_python(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_order_python_then_active_venv_then_project_venv_then_python3(tmp_path):
    repo = tmp_path / "repo"
    assert _pick(repo).startswith("python3|PATH")
    project = _fake_python(repo / ".venv" / "bin" / "python")
    assert _pick(repo) == f"{project}|the project's .venv"
    active = _fake_python(tmp_path / "other" / "bin" / "python")
    assert _pick(repo, VIRTUAL_ENV=str(active.parents[1])) == f"{active}|the active virtual environment"
    assert _pick(repo, VIRTUAL_ENV=str(active.parents[1]), PYTHON="/opt/py") == "/opt/py|$PYTHON"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_python_starting_script_uses_the_shared_choice(script):
    text = script.read_text()
    if script.name in ("setup.sh", "_env.sh"):  # setup.sh makes .venv (from $PYTHON or python3), then uses it
        return
    assert re.search(r'^source "?\$REPO_ROOT/scripts/_env\.sh"?|^source scripts/_env\.sh', text, flags=re.M), \
        f"{script.name} starts Python but does not source scripts/_env.sh"
    assert not re.search(r"\$\{PYTHON:-|^\s*PY=\$\{", text, flags=re.M), f"{script.name} has its own default"
    assert not re.search(r'"\$\{TORCHRUN:-torchrun\}"', text)


def test_sbatch_smoke_finds_the_project_venv_without_activation(tmp_path):
    """A dry run shows which interpreter the CPU smoke test would use: the repository's .venv."""
    venv = ROOT / ".venv" / "bin" / "python"
    if not venv.exists():
        pytest.skip("no .venv in this checkout (bash scripts/setup.sh makes one)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV") and not k.startswith("SLURM_")}
    res = subprocess.run(["bash", str(ROOT / "scripts/sbatch/llama70b_longcot.sbatch")], capture_output=True,
                         text=True, env={**env, "DYNBATCH_CPU_SMOKE": "1", "DRY_RUN": "1"}, timeout=30)
    assert res.returncode == 0, res.stderr
    assert f"python={venv} (from the project's .venv)" in res.stderr
