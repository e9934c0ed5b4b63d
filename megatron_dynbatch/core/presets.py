"""Finding and reading YAML presets (``configs/models/*.yaml``, ``configs/runs/*.yaml``).

One lookup rule for every kind of preset: an existing file path is used as is; a bare name is looked up
(case-insensitively, ``.yaml`` or ``.yml``) in an ordered list of directories; anything else raises a
``DynBatchConfigError`` that lists the available names and the closest matches.

Where presets live: each directory in ``$MEGATRON_DYNBATCH_CONFIGS`` (``os.pathsep``-separated; model presets
in the directory itself or its ``models/`` sub-directory, run presets in its ``runs/`` sub-directory), then the
repository's ``configs/`` next to the package (a source checkout or an editable install).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

from .checks import did_you_mean
from .errors import DynBatchConfigError

#: Environment variable with extra preset directories (``os.pathsep``-separated). Each directory may hold the
#: ``<name>.yaml`` model files itself or in a ``models/`` sub-directory, and run presets in ``runs/``.
CONFIGS_ENV = "MEGATRON_DYNBATCH_CONFIGS"

#: The repository's ``configs/`` directory (``megatron_dynbatch/core/presets.py`` -> ``<repo>/configs``).
REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


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
    hint = did_you_mean(key, names, cutoff=0.5)
    hint = hint + " " if hint else ""
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


# ------------------------------------------------------------------------------------------ model presets
def preset_dirs() -> List[Path]:
    """Where model preset names are looked up, in order: each directory in ``$MEGATRON_DYNBATCH_CONFIGS`` (its
    ``models/`` sub-directory, then the directory itself), then the repository's ``configs/models``."""
    dirs: List[Path] = []
    for entry in os.environ.get(CONFIGS_ENV, "").split(os.pathsep):
        if entry.strip():
            base = Path(entry.strip()).expanduser()
            dirs += [base / "models", base]
    dirs.append(REPO_CONFIGS / "models")
    return dirs


def available_presets() -> List[str]:
    """Names of every model preset found in :func:`preset_dirs` (sorted)."""
    return available(preset_dirs())


def resolve_model_preset(path_or_preset: Union[str, os.PathLike]) -> Path:
    """The YAML/JSON file of a model preset name or path."""
    return resolve(path_or_preset, preset_dirs(), field="model", kind="model preset",
                   suffixes=(".yaml", ".yml", ".json"),
                   extra_fix=f"; or add {str(path_or_preset).lower()}.yaml to a directory in ${CONFIGS_ENV}")


@functools.lru_cache(maxsize=64)
def load_model_mapping(path: Path, mtime_ns: int) -> Dict[str, Any]:
    """Parse a YAML/JSON mapping of model fields (``mtime_ns`` is only a cache key). Callers copy the result."""
    return load_mapping(path, field="model", what="ModelSpec fields",
                        example="'num_layers: ...', 'hidden_size: ...' lines")


# -------------------------------------------------------------------------------------------- run presets
def run_preset_dirs() -> List[Path]:
    """Where run preset names are looked up: the ``runs/`` sibling of every ``models/`` directory that
    :func:`preset_dirs` lists (``$MEGATRON_DYNBATCH_CONFIGS/runs``, then the repository's ``configs/runs``)."""
    out: List[Path] = []
    for d in preset_dirs():
        if d.name == "models":
            cand = d.parent / "runs"
            if cand not in out:
                out.append(cand)
    return out


def available_run_presets() -> List[str]:
    """Names of every run preset found in :func:`run_preset_dirs` (sorted)."""
    return available(run_preset_dirs())


def resolve_run_preset(path_or_name: Union[str, os.PathLike]) -> Path:
    """The YAML file of a run preset name or path (a model preset's name gets a hint)."""
    key = str(path_or_name).strip().lower()
    model_hint = (f"{key!r} is a MODEL preset; a run preset names one in its 'model:' field. "
                  if key in available_presets() else "")
    return resolve(path_or_name, run_preset_dirs(), field="run", kind="run preset", extra_hint=model_hint)


def load_run_mapping(path: Path) -> Dict[str, Any]:
    """Parse a run preset's YAML mapping."""
    return load_mapping(path, field="run", what="run fields",
                        example="'model: ...', 'parallel: {...}', 'max_tokens_per_gpu: ...'")
