"""The per-trainer drop-in examples (``examples/``, linked from docs/migrating.md) run on CPU and check
themselves (each asserts the cap, equal counts and order restoration, and prints ``ok``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_one_example_per_trainer():
    names = {p.stem.split("_")[0] for p in EXAMPLES}
    assert {"slime", "verl", "nemo", "roll"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path):
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1].startswith("ok:")
