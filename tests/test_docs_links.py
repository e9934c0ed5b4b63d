"""Links inside the docs resolve: every ``[text](#anchor)`` and ``[text](file.md#anchor)`` of README.md and docs/*.md
names a heading that exists (GitHub's anchor rule: lower case, punctuation dropped, spaces to hyphens), and every
linked file exists. docs/benchmarks.md opens with a contents list built from such links."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Set

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")))]
LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: str) -> Set[str]:
    text = re.sub(r"```.*?```", "", (ROOT / doc).read_text(encoding="utf-8"), flags=re.S)
    seen: Dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M):
        a = anchor(m.group(1))
        out.add(a if a not in seen else f"{a}-{seen[a]}")
        seen[a] = seen.get(a, 0) + 1
    return out


def test_anchor_rule():
    assert anchor("Against Megatron-LM's own packing") == "against-megatron-lms-own-packing"
    assert anchor("Modelled vs measured: the dynamic-CP / fixed-CP ratio") == \
        "modelled-vs-measured-the-dynamic-cp--fixed-cp-ratio"


@pytest.mark.parametrize("doc", DOCS)
def test_links_resolve(doc):
    text = re.sub(r"```.*?```", "", (ROOT / doc).read_text(encoding="utf-8"), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, frag = target.partition("#")
        linked = (ROOT / doc).parent / path if path else ROOT / doc
        assert linked.exists(), f"{doc}: link to {target!r}: no file {linked.relative_to(ROOT)}"
        if frag and linked.suffix == ".md":
            rel = str(linked.resolve().relative_to(ROOT))
            assert frag in anchors(rel), f"{doc}: link to {target!r}: {rel} has no heading with that anchor"


def test_benchmarks_md_opens_with_a_contents_list_of_its_own_sections():
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    head = text[:text.index("\n## ")]
    assert "**Contents**" in head
    own = set(re.findall(r"\]\(#([\w-]+)\)", head))
    sections = {anchor(h) for h in re.findall(r"^##+ (.+)$", text, flags=re.M)}
    assert own <= sections and {anchor(h) for h in re.findall(r"^## (.+)$", text, flags=re.M)} <= own
