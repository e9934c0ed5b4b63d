#!/usr/bin/env python
"""Every message the package raises, listed in docs/troubleshooting.md ("Every message, by module").

Walks the package's raise sites -- every ``DynBatchConfigError`` (and its kinds: ``OversizeSampleError``,
``UnknownOptionError``, ``DropinAssertionError``, ``OversizeAssertionError``) built anywhere in
``megatron_dynbatch/`` -- and renders each as ``field``: problem -- fix, with the values only known at run time shown
as ``…``. The list lives between the ``<!-- messages -->`` markers of docs/troubleshooting.md;
``tests/test_messages_index.py`` fails until a new raise site is listed there.

    python scripts/messages_index.py           # print the list
    python scripts/messages_index.py --write   # rewrite it in docs/troubleshooting.md
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megatron_dynbatch"
DOC = ROOT / "docs" / "troubleshooting.md"
ERRORS = ("DynBatchConfigError", "OversizeSampleError", "UnknownOptionError", "DropinAssertionError",
          "OversizeAssertionError")
BEGIN, END = "<!-- messages -->", "<!-- /messages -->"
HOLE = "…"


def _text(node: Optional[ast.AST]) -> str:
    """The literal text of a message argument; what only run time knows is ``…``."""
    if node is None:
        return HOLE
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else HOLE for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left) + _text(node.right)
    if isinstance(node, ast.IfExp):
        return f"{_text(node.body)} / {_text(node.orelse)}"
    return HOLE


def _argument(call: ast.Call, index: int, name: str) -> Optional[ast.AST]:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return call.args[index] if len(call.args) > index else None


def _clean(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return re.sub(f"(?:{HOLE}\\s*)+", HOLE + " ", text).replace(f"{HOLE} ,", f"{HOLE},").strip()


def raise_sites() -> Dict[str, List[Tuple[str, str, str]]]:
    """``module path -> [(field, problem, fix), ...]`` in source order, duplicates within a module dropped."""
    out: Dict[str, List[Tuple[str, str, str]]] = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("megatron_dynbatch/testing/"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and (getattr(n.func, "id", None) or getattr(n.func, "attr", None)) in ERRORS]
        seen: List[Tuple[str, str, str]] = []
        for call in sorted(calls, key=lambda c: (c.lineno, c.col_offset)):
            if call.args and isinstance(call.args[0], ast.Starred):
                continue  # a re-raise of another error's parts
            entry = (_clean(_text(_argument(call, 0, "field"))), _clean(_text(_argument(call, 2, "problem"))),
                     _clean(_text(_argument(call, 3, "fix"))))
            if entry not in seen:
                seen.append(entry)
        if seen:
            out[rel] = seen
    return out


def render() -> str:
    lines = [BEGIN, ""]
    for rel, entries in raise_sites().items():
        lines.append(f"**`{rel}`**")
        lines.append("")
        for field, problem, fix in entries:
            lines.append(f"* `{field}`: {problem} -- Fix: {fix}".replace("\n", " "))
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def current() -> Optional[str]:
    doc = DOC.read_text(encoding="utf-8")
    if BEGIN not in doc or END not in doc:
        return None
    return doc[doc.index(BEGIN):doc.index(END) + len(END)]


def write() -> None:
    doc = DOC.read_text(encoding="utf-8")
    block = current()
    new = doc.replace(block, render()) if block is not None else doc.rstrip() + "\n\n" + render() + "\n"
    DOC.write_text(new, encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the list in docs/troubleshooting.md")
    args = ap.parse_args()
    if args.write:
        write()
        print(f"wrote {sum(len(v) for v in raise_sites().values())} messages into {DOC.relative_to(ROOT)}")
    else:
        print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
