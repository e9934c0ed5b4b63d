"""Megatron-LM's training package, found and imported only where it is needed.

Megatron-LM's ``megatron.training`` (its ``pretrain()`` loop and ``get_args()``) is not part of the megatron-core
wheel. The integration imports it lazily: only :func:`~.hook.install` without a module, the datasets providers
(:mod:`.sources`) and the model-provider check (:func:`~.flags.checked_model_provider`) need it; when it is
missing they raise :class:`MegatronLMNotFoundError` saying what to install (:data:`MISSING_MEGATRON_LM`).
Everything else (flags, batch sources, the wrapper) works without it and is unit-tested in
``tests/test_scripts.py``. ``$MEGATRON_LM_DIR``, when set, is put on ``sys.path`` first.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Tuple

__all__ = ["MISSING_MEGATRON_LM", "MegatronLMNotFoundError", "import_megatron_training", "megatron_args",
           "megatron_writers"]

MISSING_MEGATRON_LM = (
    "the Megatron-LM integration (megatron_dynbatch.integrations.megatron_lm, scripts/pretrain_gpt_dynbatch.py) needs "
    "Megatron-LM's training package (megatron.training), which the megatron-core wheel does not contain. Clone "
    "Megatron-LM at the tag matching your megatron-core (e.g. core_v0.16.1) and put it on PYTHONPATH, or set "
    "MEGATRON_LM_DIR=/path/to/Megatron-LM. The planner, the CLI and the CPU demo (`megatron-dynbatch demo`) work "
    "without it."
)


class MegatronLMNotFoundError(ImportError):
    """``megatron.training`` (Megatron-LM, not the megatron-core wheel) cannot be imported."""


def import_megatron_training() -> Any:
    """``megatron.training`` (with ``$MEGATRON_LM_DIR`` put on ``sys.path`` first when set), or
    :class:`MegatronLMNotFoundError` with :data:`MISSING_MEGATRON_LM`."""
    root = os.environ.get("MEGATRON_LM_DIR")
    if root and root not in sys.path:
        sys.path.insert(0, root)
    try:
        import megatron.training as training
        import megatron.training.training  # noqa: F401  (the module install() patches)
    except ImportError as exc:
        raise MegatronLMNotFoundError(f"{MISSING_MEGATRON_LM} (import failed: {exc})") from exc
    return training


def megatron_args() -> Any:
    """Megatron-LM's parsed arguments (``megatron.training.get_args()``)."""
    return import_megatron_training().get_args()


def megatron_writers() -> Tuple[Any, Any]:
    """Megatron-LM's TensorBoard and W&B writers (``megatron.training.global_vars.get_tensorboard_writer()`` /
    ``get_wandb_writer()``), each ``None`` where it does not exist: logging off, a rank that does not write
    (Megatron-LM makes them on the last rank only), a Megatron-LM without that getter, or no Megatron-LM at all."""
    try:
        from megatron.training import global_vars
    except ImportError:
        return None, None
    out = []
    for name in ("get_tensorboard_writer", "get_wandb_writer"):
        getter = getattr(global_vars, name, None)
        out.append(getter() if callable(getter) else None)
    return out[0], out[1]
