"""The package layout is the architecture: the planning core and the benchmark never import torch / megatron /
ray, the documented public names import, and the old flat module paths still resolve (with a warning)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import megatron_dynbatch

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megatron_dynbatch"
HEAVY = ("torch", "megatron", "ray", "transformer_engine", "flash_attn")
TORCH_FREE = ("core", "bench")


def _imported_roots(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0], node.lineno


@pytest.mark.parametrize("sub", TORCH_FREE)
def test_torch_free_packages_never_import_heavy_frameworks(sub):
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}"
           for p in sorted((PKG / sub).rglob("*.py")) for mod, line in _imported_roots(p) if mod in HEAVY]
    assert not bad, bad


def test_torch_free_packages_import_without_torch_in_a_fresh_interpreter():
    mods = [m.name for sub in TORCH_FREE
            for m in pkgutil.walk_packages([str(PKG / sub)], prefix=f"megatron_dynbatch.{sub}.")]
    code = ("import sys, importlib\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "import megatron_dynbatch, megatron_dynbatch.cli\n"
            f"bad = sorted(k for k in sys.modules if k.split('.')[0] in {HEAVY!r})\n"
            "print(bad); sys.exit(1 if bad else 0)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr


def test_no_import_cycle_between_attention_and_norms():
    for name in ("attention", "norms"):
        other = {"attention": "norms", "norms": "attention"}[name]
        src = (PKG / "megatron" / f"{name}.py").read_text(encoding="utf-8")
        assert not re.search(rf"from \.{other} import|from \.\.megatron\.{other} import", src), name


def _documented_imports():
    """Every ``from megatron_dynbatch... import a, b`` written in README.md, docs/ and scripts/."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "scripts").rglob("*.py"))]
    out = set()
    pat = re.compile(r"from (megatron_dynbatch[\w.]*) import \(?([\w ,]+)\)?")
    for f in files:
        for mod, names in pat.findall(f.read_text(encoding="utf-8")):
            for n in names.split(","):
                n = n.strip().split(" as ")[0].strip()
                if n:
                    out.add((mod, n))
    return sorted(out)


DOCUMENTED = _documented_imports()


def test_documentation_has_imports_to_check():
    assert len(DOCUMENTED) > 20


@pytest.mark.parametrize("module,name", DOCUMENTED, ids=[f"{m}:{n}" for m, n in DOCUMENTED])
def test_documented_name_imports(module, name):
    pytest.importorskip("torch") if module.startswith(("megatron_dynbatch.megatron.", "megatron_dynbatch.testing")) \
        else None
    mod = importlib.import_module(module)
    assert hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}") is not None, f"{module}.{name}"


def test_top_level_exports_resolve():
    for name in megatron_dynbatch.__all__:
        assert getattr(megatron_dynbatch, name) is not None, name
    with pytest.raises(AttributeError):
        megatron_dynbatch.no_such_name  # noqa: B018


def test_old_module_paths_resolve_to_the_new_modules():
    from megatron_dynbatch import _legacy

    for old, new in _legacy.MOVED.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mod = importlib.import_module(f"megatron_dynbatch.{old}")
        assert mod is importlib.import_module(f"megatron_dynbatch.{new}")
    from megatron_dynbatch.planner.vpp import is_valid_microbatch_count  # a sub-module of a moved package
    from megatron_dynbatch.core.planner.vpp import is_valid_microbatch_count as current
    assert is_valid_microbatch_count is current


def _relative_imports(path: Path, package: str):
    """Modules a file imports relatively (``from .x import``, ``from ..y import``; inside functions too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    base = package.split(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            stem = base[:len(base) - node.level + 1]
            yield ".".join(stem + (node.module.split(".") if node.module else []))


def test_the_planner_has_no_import_cycle():
    """``core/planner`` (the dynamic-CP package included) imports in one direction: no module reaches itself
    again through relative imports, lazy ones inside functions included."""
    root = PKG / "core" / "planner"
    graph = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if p.name == "__init__.py" else rel.parts)
        package = name if p.name == "__init__.py" else name.rsplit(".", 1)[0]
        graph[name] = set(_relative_imports(p, package))
    for name in graph:
        graph[name] = {m for m in graph[name] if m in graph and m != name and not name.startswith(m + ".")}

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted(n for n in graph if n in reach(n))
    assert not cycles, cycles
