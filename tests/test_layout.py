"""The package layout is the architecture: the planning core and the benchmark never import torch / megatron /
ray, the documented public names import, no import circle, no private name used outside its package."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import subprocess
import sys
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


def test_ray_shards_are_plain_data_and_import_no_behaviour():
    """shards.py (RankShard, RolloutPlan, ShardResult) is what the driver ships to actors: it must not import the
    actor side (which imports it), so the two never form an import circle."""
    src = PKG / "integrations" / "ray" / "shards.py"
    tree = ast.parse(src.read_text(encoding="utf-8"))
    bad = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
           and (n.module or "").split(".")[-1] in ("actor", "driver")]
    assert not bad, f"shards.py imports the actor / driver side at lines {bad}"


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


def test_warning_filters_name_third_party_warnings_only():
    """pyproject's pytest ``filterwarnings`` silence named third-party notices, never a whole category and never
    this package's own warnings (which must stay visible in the suite's summary)."""
    tomllib = pytest.importorskip("tomllib")
    filters = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"][
        "filterwarnings"]
    assert filters
    for f in filters:
        action, message, category, module = (f.split(":") + [""] * 4)[:4]
        assert action == "ignore" and message and category and module, f"{f}: name the message and the module"
        assert not re.match(module, "megatron_dynbatch") and not re.match(module, "megatron_dynbatch.core.planner"), f
        assert module.startswith(("megatron\\.core\\.", "torch\\.")), f"{f}: a third-party module, named"


def _imported_modules(path: Path, package: str):
    """Modules and names a file imports (``from .x import y``, ``from ..z import w``, ``import a.b``, absolute
    ``from megatron_dynbatch... import``; lazy imports inside functions too): each ``module`` and ``module.name``,
    so that ``from . import x`` and ``from .pkg import mod`` name the module they load."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    base = package.split(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                module = ".".join(base[:len(base) - node.level + 1] + (node.module.split(".") if node.module else []))
            else:
                module = node.module or ""
            yield module
            yield from (f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_the_package_has_no_import_cycle():
    """The whole package imports in one direction: no module reaches itself again through its imports (relative
    or absolute, lazy ones inside functions included; a module importing its own parent package does not count).
    This keeps the circles out that once tied ``cli`` and ``_cli_dyncp``, ``bench/runner`` and
    ``bench/adversarial``, the planner's ``api`` and dynamic-CP modules, ``plan`` and ``dyncp_plan``."""
    graph = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if p.name == "__init__.py" else rel.parts)
        package = name if p.name == "__init__.py" else name.rsplit(".", 1)[0]
        graph[name] = set(_imported_modules(p, package))
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
    assert not cycles, f"modules on an import cycle: {cycles}"


def _owner_package(module: str) -> str:
    """The package a module name belongs to: itself when it is a package of this repository, else its parent."""
    path = ROOT.joinpath(*module.split("."))
    return module if (path / "__init__.py").is_file() else module.rsplit(".", 1)[0]


def test_no_private_name_is_imported_from_another_package():
    """A ``_private`` name is used only inside the package that defines it: no module of the package, and no
    script, benchmark or example, imports one (``from ..x import _y``) or reads one off an imported module of
    another package (``x._y``). A helper two packages share is public, in the lower of the two."""
    files = [*sorted(PKG.rglob("*.py")), *(p for d in ("scripts", "benchmarks", "examples")
                                            for p in sorted((ROOT / d).rglob("*.py")))]
    bad = []
    for p in files:
        rel = p.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if p.name == "__init__.py" else rel.parts)
        here = name if p.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(p.read_text(encoding="utf-8"))
        modules = {}  # local name -> module of this repository it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = here.split(".")
                module = (".".join(base[:len(base) - node.level + 1] + (node.module.split(".") if node.module else []))
                          if node.level else node.module or "")
                if not module.startswith("megatron_dynbatch"):
                    continue
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__") and _owner_package(module) != here:
                        bad.append(f"{rel}:{node.lineno} imports {a.name} from {module}")
                    modules[a.asname or a.name] = f"{module}.{a.name}"
            elif isinstance(node, ast.Import):
                modules.update({a.asname: a.name for a in node.names
                                if a.asname and a.name.startswith("megatron_dynbatch")})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                    and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and (ROOT.joinpath(*modules[node.value.id].split(".")).with_suffix(".py").is_file()
                         or ROOT.joinpath(*modules[node.value.id].split("."), "__init__.py").is_file()) \
                    and _owner_package(modules[node.value.id]) != here:
                bad.append(f"{rel}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not bad, bad


#: the layers from the bottom up (docs/architecture.md, "What each layer may import"): a module imports only from
#: its own layer or one below it. ``cli``/``demo``/``_cli_*`` and the package root sit on top; ``testing`` beside it.
LAYERS = {"core": 0, "bench": 1, "megatron": 1, "measure": 2, "integrations": 2}
TOP = 9


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) < 2:
        return TOP
    return LAYERS.get(parts[1], TOP)


def _module_graph():
    graph = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if p.name == "__init__.py" else rel.parts)
        package = name if p.name == "__init__.py" else name.rsplit(".", 1)[0]
        graph[name] = {m for m in _imported_modules(p, package) if m.startswith("megatron_dynbatch.")}
    return graph


def test_no_import_from_a_lower_layer_to_a_higher_one():
    """Layers import downwards only (lazy imports inside functions included): ``core`` below ``bench`` and
    ``megatron``; ``measure`` and ``integrations`` above ``megatron``; ``bench`` and ``megatron`` never import each
    other. The memory-reader seam is in ``megatron/`` so that the guard (``megatron/``) and ``calibrate``'s memory
    grid (``measure/``) both read memory through it without ``megatron/`` reaching up into ``measure/``."""
    bad = []
    for name, imports in _module_graph().items():
        src = _layer(name)
        for m in sorted(imports):
            dst = _layer(m)
            sideways = src == dst == 1 and name.split(".")[1] != m.split(".")[1]
            if (dst > src or sideways) and src != TOP:
                bad.append(f"{name} imports {m}")
    assert not bad, bad


def test_no_shipped_module_imports_test_support():
    """``megatron_dynbatch.testing`` is test support: only the tests (and the testing package itself) import it;
    what the demo and ``calibrate`` need to run megatron-core on CPU lives in ``megatron/cpu.py`` and
    ``megatron/ranks.py``."""
    bad = [f"{name} imports {m}" for name, imports in _module_graph().items()
           if not name.startswith("megatron_dynbatch.testing")
           for m in imports if m.startswith("megatron_dynbatch.testing")]
    assert not bad, bad
