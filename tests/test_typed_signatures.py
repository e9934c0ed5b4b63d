"""Core signatures say what they take (issue 31, item 7): a public function of ``core/`` or ``bench/`` whose
parameter is a model, a layout, a cost model, planner options or a plan is annotated with that kind -- ``ModelSpec``
/ ``ModelLike``, ``ParallelConfig`` / ``ParallelLike``, ``CostModel`` / ``CostModelLike``, ``PlanOptions``,
``PlanKind`` / ``Plan`` -- never ``Any`` and never left bare. An AST walk, so nothing is imported; the few
parameters that really take several unrelated kinds are listed below with the reason."""

from __future__ import annotations

import ast
import typing
from pathlib import Path
from typing import Dict, Iterator, Tuple

import pytest

PKG = Path(__file__).resolve().parents[1] / "megatron_dynbatch"

#: parameter names that always mean one kind of object
TYPED_NAMES = {"model", "spec", "parallel", "par", "cost_model", "cm", "options", "opts", "plan"}

#: ``(file under the package, qualified function name, parameter)`` -> why it is left as it is. An entry that no
#: longer matches an untyped parameter fails the test: remove it once the signature is typed.
ALLOWED: Dict[Tuple[str, str, str], str] = {
}


def _is_any(node: ast.expr) -> bool:
    """``Any``, or a union with ``Any`` among its members (``Optional[Any]``, ``Union[X, Any]``, ``X | Any``)."""
    if isinstance(node, ast.Name):
        return node.id == "Any"
    if isinstance(node, ast.Attribute):
        return node.attr == "Any"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _is_any(ast.parse(node.value, mode="eval").body)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _is_any(node.left) or _is_any(node.right)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in ("Optional", "Union"):
        members = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return any(_is_any(m) for m in members)
    return False


def _untyped() -> Iterator[Tuple[Tuple[str, str, str], int, str]]:
    """Every public function's parameter named in :data:`TYPED_NAMES` that is ``Any`` or bare."""
    files = sorted([*(PKG / "core").rglob("*.py"), *(PKG / "bench").rglob("*.py")])
    for path in files:
        rel = path.relative_to(PKG).as_posix()

        def walk(body, prefix: str, public: bool):
            for node in body:
                if isinstance(node, ast.ClassDef):
                    yield from walk(node.body, f"{prefix}{node.name}.", public and not node.name.startswith("_"))
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if not public or (node.name.startswith("_") and node.name != "__init__"):
                        continue
                    a = node.args
                    for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                        if arg.arg in TYPED_NAMES and (arg.annotation is None or _is_any(arg.annotation)):
                            what = "bare" if arg.annotation is None else ast.unparse(arg.annotation)
                            yield (rel, f"{prefix}{node.name}", arg.arg), node.lineno, what

        yield from walk(ast.parse(path.read_text(encoding="utf-8")).body, "", True)


def test_public_core_signatures_name_the_kind_they_take():
    found = list(_untyped())
    bad = [f"{k[0]}:{line} {k[1]}({k[2]}: {what})" for k, line, what in found if k not in ALLOWED]
    assert not bad, ("annotate these with the kind they take (ModelLike, ParallelLike, CostModelLike, PlanOptions, "
                     f"PlanKind, ...), or list them in ALLOWED with the reason: {bad}")
    stale = sorted(set(ALLOWED) - {k for k, _, _ in found})
    assert not stale, f"typed now: remove from ALLOWED: {stale}"


@pytest.mark.parametrize("source", ["def f(model: Any): ...", "def f(model: Optional[Any] = None): ...",
                                    "def f(model: Union[int, Any]): ...", "def f(model: 'Any'): ...",
                                    "def f(model: int | Any): ..."])
def test_the_walk_sees_any_however_spelled(source):
    arg = ast.parse(source).body[0].args.args[0]
    assert _is_any(arg.annotation)
    assert not _is_any(ast.parse("def f(model: Optional[ModelLike]): ...").body[0].args.args[0].annotation)


def test_model_like_lists_exact_kinds():
    """``ModelLike`` (what ``ModelSpec.from_any`` takes) is a union of named kinds, ``Any`` not among them."""
    from megatron_dynbatch.core.cost_model import CostModelLike
    from megatron_dynbatch.core.model_spec import ModelLike
    from megatron_dynbatch.core.parallel import ParallelLike

    for alias in (ModelLike, ParallelLike, CostModelLike):
        assert typing.Any not in typing.get_args(alias), alias
