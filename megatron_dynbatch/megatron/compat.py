"""Every difference between the megatron-core / Megatron-LM versions this package runs on, in ONE module.

Supported: megatron-core >= 0.15 with no upper cap (``pyproject.toml``). CI runs the test suite on the newest
release pip offers on Python 3.11 (0.16.1) and ``megatron-dynbatch demo --check`` on the oldest supported
(0.15.3); 0.17.1, 0.18.2 and 0.19.2 (Python >= 3.12 wheels) were checked by hand (docs/integration.md,
"megatron-core versions").

The rule is: probe for the feature, never compare version numbers (NGC containers and source checkouts carry
versions pip never saw). What differs, and where it is handled:

* the packing-scheduler extension point (``megatron.core.datasets.data_schedule.scheduler_map`` keyed by the
  name ``--sequence-packing-scheduler`` takes; Megatron-LM dev, Aug 2026) -- :func:`packing_scheduler_point`,
  used by :mod:`megatron_dynbatch.integrations.megatron_packing`;
* upstream's own cross-rank rerouting of samples for context parallelism, named ``hybrid_context_parallel``
  (megatron-core 0.16-0.19) and ``dynamic_context_parallel`` (Megatron-LM dev) --
  :func:`upstream_cp_rerouting`, which the ``pretrain()`` hook refuses to combine with its own plan;
* CPU-only test shims differ too (0.19 synchronises a CUDA stream in the DDP grad sync): those live with the
  other shims in :mod:`megatron_dynbatch.testing.megatron_cpu`, selected by the same kind of probing.

Nothing here imports megatron-core at module import; every probe does it lazily and answers "absent" when the
import fails.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

__all__ = [
    "UPSTREAM_CP_REROUTING_FLAGS",
    "megatron_core_version",
    "packing_scheduler_point",
    "upstream_cp_rerouting",
]

#: Megatron's flags that let upstream reroute samples between DP x CP ranks itself, old name first.
UPSTREAM_CP_REROUTING_FLAGS = ("hybrid_context_parallel", "dynamic_context_parallel")


def megatron_core_version() -> Optional[str]:
    """The installed megatron-core's version string, for messages and reports only (never for decisions)."""
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # noqa: BLE001 - a source checkout has no distribution metadata
        try:
            import megatron.core as mc

            return str(getattr(mc, "__version__", None) or "") or None
        except Exception:  # noqa: BLE001
            return None


def packing_scheduler_point() -> Tuple[Any, str]:
    """``(data_schedule_module, "")`` when megatron-core has a string-keyed packing-scheduler map with
    ``DpBalancedScheduler.get_groups_and_subsamples`` to build on, else ``(None, why)``."""
    try:
        from megatron.core.datasets import data_schedule
    except Exception:  # noqa: BLE001 - absent, or not importable here
        return None, "megatron.core.datasets.data_schedule is not importable"
    smap = getattr(data_schedule, "scheduler_map", None)
    base = getattr(data_schedule, "DpBalancedScheduler", None)
    if not isinstance(smap, dict) or base is None or not hasattr(base, "get_groups_and_subsamples"):
        return None, ("this megatron-core has no packing-scheduler map (data_schedule.scheduler_map + "
                      "DpBalancedScheduler); use the pretrain() hook (install())")
    if smap and not all(isinstance(k, str) for k in smap):
        return None, ("this megatron-core's scheduler map is keyed by an enum and no flag selects it; use the "
                      "pretrain() hook (install())")
    return data_schedule, ""


def upstream_cp_rerouting(args_or_config: Any) -> List[str]:
    """The upstream rerouting flags switched on in Megatron ``args`` or a ``ModelParallelConfig``
    (``--hybrid-context-parallel`` / ``--dynamic-context-parallel``), as command-line spellings."""
    return ["--" + name.replace("_", "-") for name in UPSTREAM_CP_REROUTING_FLAGS
            if bool(getattr(args_or_config, name, False))]
