"""Old module paths keep importing, with a ``DeprecationWarning`` naming the new one.

Before the package was split into ``core`` / ``megatron`` / ``integrations`` / ``bench`` its modules sat side by
side (``megatron_dynbatch.planner``, ``megatron_dynbatch.megatron_lm``, ...). Launch scripts written against
those paths keep working: a meta-path finder resolves an old name to the module that now holds the code (the
same module object, so ``isinstance`` checks and monkeypatches agree). New code should import the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Optional

#: old module (below ``megatron_dynbatch.``) -> new module; sub-modules follow their package.
MOVED = {
    "errors": "core.errors",
    "parallel": "core.parallel",
    "alignment": "core.alignment",
    "model_spec": "core.model_spec",
    "presets": "core.presets",
    "flops": "core.flops",
    "cost_model": "core.cost_model",
    "memory": "core.memory",
    "run_config": "core.run_config",
    "planner": "core.planner",
    "packing": "megatron.packing",
    "context_parallel": "megatron.context_parallel",
    "attention": "megatron.attention",
    "cpu_layers": "megatron.norms",
    "loss": "megatron.loss",
    "iterator": "megatron.iterator",
    "schedule": "megatron.schedule",
    "args": "megatron.args",
    "megatron_lm": "integrations.megatron_lm",
    "ray": "integrations.ray",
    "baselines": "bench.baselines",
    # the dynamic-CP files of core/planner/ became the core/planner/dyncp/ package
    "core.planner.dyncp_step": "core.planner.dyncp.step",
    "core.planner.dyncp_candidates": "core.planner.dyncp.candidates",
    "core.planner.dyncp_deal": "core.planner.dyncp.deal",
    "core.planner.dyncp_schedule": "core.planner.dyncp.schedule",
    "core.planner.dyncp_assembly": "core.planner.dyncp.assembly",
    "core.planner.dyncp_plan": "core.planner.dyncp.plan",
    "core.planner.pool": "core.planner.dyncp.pool",
    "core.planner.pool_sim": "core.planner.dyncp.pool_sim",
}

_PREFIX = "megatron_dynbatch."


def new_name(old: str) -> Optional[str]:
    """The current module name for an old ``megatron_dynbatch.X[.Y]`` name, else ``None``."""
    if not old.startswith(_PREFIX):
        return None
    parts = old[len(_PREFIX):].split(".")
    for n in range(len(parts), 0, -1):  # the longest moved prefix
        target = MOVED.get(".".join(parts[:n]))
        if target is not None:
            return _PREFIX + ".".join([target] + parts[n:])
    return None


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self._specs: dict = {}

    def find_spec(self, fullname, path=None, target=None):  # noqa: D401 - importlib protocol
        if new_name(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        target = new_name(spec.name)
        warnings.warn(f"{spec.name} moved to {target}; import it from there", DeprecationWarning, stacklevel=3)
        module = importlib.import_module(target)
        self._specs[module.__name__] = module.__spec__  # importlib overwrites it with the alias's spec next
        return module

    def exec_module(self, module) -> None:
        """The target module is already executed; give it its own spec back (a lazy relative import inside it
        would otherwise warn ``__package__ != __spec__.parent``)."""
        spec = self._specs.pop(module.__name__, None)
        if spec is not None:
            module.__spec__ = spec


def install_legacy_module_aliases() -> None:
    """Register the finder once (idempotent)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())  # before PathFinder: sub-modules of a moved package too
