"""Aligned plain-text tables and the one rule for "level": shared by every table and verdict the CLI prints.

:func:`aligned` sizes every column to its widest cell (header included), so a long name (``megatron-rl-packing-rr``,
``one giant group (refused)``) never pushes the rest of its row out of line; the last column (notes) is left
unpadded and trailing blanks are stripped. :func:`standing` is how the benchmark words one step time against
another: ``ahead`` (not slower), ``level`` (slower by at most :data:`LEVEL`, 0.01% -- the same rule the headline
and README use for "level with the fastest"), ``behind`` (slower by more); :func:`gap_text` prints the gap.
Pure Python.
"""

from __future__ import annotations

from typing import List, Sequence

#: a step time at most this much above another's is "level" with it (0.01%), not behind it
LEVEL = 1e-4
#: float noise: a step time within this of another's is not slower at all
_TIE = 1e-9


def aligned(rows: Sequence[Sequence[str]], aligns: Sequence[str], *, rule: bool = False, gap: str = "  ",
            pad_last: bool = False) -> List[str]:
    """``rows`` (the first one the header) as lines with every column as wide as its widest cell; ``aligns``: one
    ``"<"`` / ``">"`` per column; ``rule``: a line of dashes under the header; the last column is not padded
    unless ``pad_last``."""
    n = len(aligns)
    if any(len(r) != n for r in rows):
        raise ValueError(f"every row needs {n} cells")
    widths = [max((len(str(r[i])) for r in rows), default=0) for i in range(n)]

    def line(cells: Sequence[str]) -> str:
        last = n - 1
        parts = [str(c) if i == last and not pad_last and a == "<" else f"{str(c):{a}{widths[i]}}"
                 for i, (c, a) in enumerate(zip(cells, aligns, strict=True))]
        return gap.join(parts).rstrip()

    out = [line(r) for r in rows]
    if rule and out:
        dashes = ["-" * w for w in widths]
        if not pad_last and aligns[-1] == "<":
            dashes[-1] = "-" * len(str(rows[0][-1]))  # as wide as the header of the unpadded last column
        out.insert(1, line(dashes))
    return out


def standing(mine_s: float, theirs_s: float) -> str:
    """``"ahead"``, ``"level"`` or ``"behind"``: step time ``mine_s`` against ``theirs_s`` (module docstring)."""
    if mine_s <= theirs_s * (1 + _TIE):
        return "ahead"
    return "level" if mine_s <= theirs_s * (1 + LEVEL) else "behind"


def gap_text(mine_s: float, theirs_s: float) -> str:
    """How much slower ``mine_s`` is than ``theirs_s``, in percent with enough digits to be non-zero."""
    pct = 100.0 * (mine_s / theirs_s - 1.0) if theirs_s > 0 else float("inf")
    return f"{pct:.3f}%" if abs(pct) < 0.01 else f"{pct:.2f}%"


__all__ = ["LEVEL", "aligned", "gap_text", "standing"]
