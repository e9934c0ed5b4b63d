"""The per-trainer drop-in examples (``examples/``, linked from docs/migrating.md) run on CPU and check
themselves (each asserts the cap, equal counts and order restoration, and prints ``ok``)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _integration_imports(text: str) -> dict:
    """``{module: {names}}`` of every ``from megatron_dynbatch.integrations.X import ...`` in ``text``."""
    out: dict = {}
    for mod, names in re.findall(r"from (megatron_dynbatch\.integrations\.\w+) import (\([^)]*\)|[^\n]+)", text):
        names = re.sub(r"#[^\n]*", "", names.strip("()"))
        out.setdefault(mod, set()).update(n.strip() for n in names.replace("\n", " ").split(",") if n.strip())
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_shows_the_imports_migrating_md_shows(path):
    """The import change an example's docstring shows is the one docs/migrating.md tells users to make."""
    shown = _integration_imports(ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "")
    documented = _integration_imports((ROOT / "docs" / "migrating.md").read_text(encoding="utf-8"))
    assert shown, f"{path.name}: its docstring shows no drop-in import"
    for module, names in shown.items():
        assert names == documented.get(module), (path.name, module, sorted(names), sorted(documented.get(module, ())))


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
