"""Finding and reading YAML presets (``configs/models/*.yaml``, ``configs/runs/*.yaml``).

One lookup rule for every kind of preset: an existing file path is used as is; a bare name is looked up
(case-insensitively, ``.yaml`` or ``.yml``) in an ordered list of directories; anything else raises a
``DynBatchConfigError`` that lists the available names and the closest matches.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

from .errors import DynBatchConfigError


def available(dirs: Sequence[Path]) -> List[str]:
    """Names (file stems) of every ``*.yaml`` preset in ``dirs`` (sorted)."""
    names: set = set()
    for d in dirs:
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def resolve(path_or_name: Union[str, os.PathLike], dirs: Sequence[Path], *, field: str, kind: str,
            suffixes: Tuple[str, ...] = (".yaml", ".yml"), extra_hint: str = "", extra_fix: str = "") -> Path:
    """The file for ``path_or_name``: a path, or a preset name looked up in ``dirs``.

    ``field`` names the argument in errors, ``kind`` the preset kind ("model preset", "run preset").
    ``extra_hint`` is prepended to the fix of an unknown name, ``extra_fix`` appended.
    """
    p = Path(path_or_name).expanduser()
    if p.is_file():
        return p
    text = str(path_or_name)
    looks_like_path = p.suffix.lower() in suffixes or os.sep in text or "/" in text
    names = available(dirs)
    if looks_like_path:
        raise DynBatchConfigError(field, text, "file not found",
                                  f"check the path, or use a {kind} name ({', '.join(names)})")
    key = text.strip().lower()
    for d in dirs:
        for cand in (d / f"{key}.yaml", d / f"{key}.yml"):
            if cand.is_file():
                return cand
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise DynBatchConfigError(field, text, f"unknown {kind}",
                              f"{extra_hint}{hint}available {kind}s: {', '.join(names) or '(none found)'}{extra_fix}")


def load_mapping(path: Path, *, field: str, what: str, example: str) -> Dict[str, Any]:
    """Parse a YAML (or JSON) file that must hold a mapping of ``what``; errors name the file and the fix."""
    import yaml

    with open(path, encoding="utf-8") as fh:
        try:
            data = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise DynBatchConfigError(field, str(path), f"is not valid YAML ({exc})", "fix the file syntax") from None
    if not isinstance(data, Mapping):
        raise DynBatchConfigError(field, str(path), f"must contain a mapping of {what}",
                                  f"write {example} at the top level")
    return dict(data)
