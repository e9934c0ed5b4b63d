"""Why an optional dependency cannot be used here, in one sentence with the fix.

The planner needs only NumPy; the demo and the Megatron edge need torch and megatron-core. "Not installed" and
"installed but broken" need different fixes, and hiding the second behind the first sends users to reinstall
something that is there -- for example megatron-core, whose import crashes (``RuntimeError``, not
``ImportError``) when a half-installed Transformer Engine is present. :func:`import_problem` tells them apart
without importing anything that is not installed (``importlib.util.find_spec``) and quotes the real exception
when an installed module fails to import.

The fix it names is the project's own set-up, ``bash scripts/setup.sh --test``: a bare
``pip install megatron-core`` on a machine without torch would pull a CUDA build of torch through
megatron-core's ``torch>=2.6`` requirement.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from typing import Optional

__all__ = ["SETUP_FIX", "import_problem"]

SETUP_FIX = ("bash scripts/setup.sh --test (from the repository root; it installs torch==2.13.0 CPU, "
             "megatron-core 0.16 and Ray into .venv, or reuses an installed torch)")
_PIP_NAMES = {"torch": "torch", "megatron.core": "megatron-core", "ray": "ray", "matplotlib": "matplotlib"}


def _spec_origin(module: str) -> Optional[str]:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a parent package is missing or broken
        return None
    if spec is None:
        return None
    return spec.origin or (list(spec.submodule_search_locations or []) or ["(namespace package)"])[0]


def import_problem(*modules: str) -> Optional[str]:
    """``None`` when every module imports; otherwise ``"needs <pkg>, which ...; fix: ..."`` for the first one
    that does not (checked in the order given, so pass ``"torch", "megatron.core"``)."""
    for module in modules:
        name = _PIP_NAMES.get(module, module)
        origin = _spec_origin(module)
        if origin is None:
            return (f"needs {name}, which is not installed in this environment ({sys.prefix}). "
                    f"Fix: {SETUP_FIX}, or run it with the Python that has {name}")
        try:
            importlib.import_module(module)
        except BaseException as exc:  # noqa: BLE001 - anything an import raises is the user's answer
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            chain = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            last = f"{type(exc).__name__}: {exc}".strip()
            fix = f"python -c 'import {module}' shows the full traceback"
            if "transformer_engine" in chain:
                fix = ("an installed Transformer Engine that cannot load (no GPU / cuDNN) breaks megatron-core's "
                       "import: uninstall it on a CPU machine (pip list | grep -i transformer); " + fix)
            return f"needs {name}, which is installed ({origin}) but fails to import: {last}. Fix: {fix}"
    return None
