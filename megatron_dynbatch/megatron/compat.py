"""Every difference between the megatron-core / Megatron-LM versions this package runs on, in ONE module.

Supported: megatron-core >= 0.15 with no upper cap (``pyproject.toml``). CI runs the test suite on the newest
release pip offers on Python 3.11 (0.16.1) and ``megatron-dynbatch demo --check`` on the oldest supported
(0.15.3); 0.17.1, 0.18.2 and 0.19.2 (Python >= 3.12 wheels) were checked by hand (docs/integration.md,
"megatron-core versions").

The rule is: probe for the feature, never compare version numbers (NGC containers and source checkouts carry
versions pip never saw). What differs, and where it is handled:

* Megatron-Core's sequence-packing schedulers (``datasets/data_schedule.py``): whether ``DpBalancedScheduler``
  exists at all, whether the scheduler map is keyed by names (Megatron-LM dev, where
  ``--sequence-packing-scheduler`` selects an entry) or by an enum (Megatron-LM main: nothing can be added, our
  own ``wrap_data_iterator`` is the way in), and whether schedulers take ``max_num_seqs`` (dev) --
  :func:`packing_scheduler_api` / :func:`packing_scheduler_point`, used by
  :mod:`megatron_dynbatch.integrations.megatron_packing`;
* upstream's own cross-rank rerouting of samples for context parallelism, named ``hybrid_context_parallel``
  (megatron-core 0.16-0.19) and ``dynamic_context_parallel`` (Megatron-LM dev) --
  :func:`upstream_cp_rerouting`, which the ``pretrain()`` hook refuses to combine with its own plan;
* the per-micro-batch step functions of the pipeline schedules (``forward_step`` / ``backward_step`` in
  ``pipeline_parallel/schedules.py``, looked up by name at every call in 0.15-0.19) that online calibration
  wraps to time each micro-batch -- :func:`schedule_step_functions`;
* CPU-only test shims differ too (0.19 synchronises a CUDA stream in the DDP grad sync): those live with the
  other shims in :mod:`megatron_dynbatch.megatron.cpu`, selected by the same kind of probing.

Nothing here imports megatron-core at module import; every probe does it lazily and answers "absent" when the
import fails.
"""

from __future__ import annotations

import inspect
from typing import Any, List, NamedTuple, Optional, Tuple

__all__ = [
    "UPSTREAM_CP_REROUTING_FLAGS",
    "megatron_core_version",
    "PackingSchedulerAPI",
    "packing_scheduler_api",
    "packing_scheduler_point",
    "scheduler_takes_max_num_seqs",
    "upstream_cp_rerouting",
    "schedule_step_functions",
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


class PackingSchedulerAPI(NamedTuple):
    """What the installed megatron-core offers for sequence-packing schedulers (all found by probing)."""

    module: Any                 # megatron.core.datasets.data_schedule, or None
    base: Any                   # its DpBalancedScheduler, or None
    map_keys: Optional[str]     # "names" (a flag can select a new entry), "enum" (fixed entries) or None
    takes_max_num_seqs: bool    # schedulers accept max_num_seqs (a cap on sequences per micro-batch)
    why: str                    # "" when base is usable, else what is missing


def packing_scheduler_api() -> PackingSchedulerAPI:
    """Probe ``megatron.core.datasets.data_schedule`` for the packing-scheduler interface (never raises)."""
    try:
        from megatron.core.datasets import data_schedule
    except Exception:  # noqa: BLE001 - absent, or not importable here
        return PackingSchedulerAPI(None, None, None, False, "megatron.core.datasets.data_schedule is not importable")
    base = getattr(data_schedule, "DpBalancedScheduler", None)
    if base is None or not hasattr(base, "get_groups_and_subsamples") or not hasattr(base, "run"):
        return PackingSchedulerAPI(data_schedule, None, None, False,
                                   "this megatron-core has no DpBalancedScheduler to build on; use the pretrain() "
                                   "hook (install())")
    smap = getattr(data_schedule, "scheduler_map", None)
    keys = None
    if isinstance(smap, dict):
        keys = "names" if all(isinstance(k, str) for k in smap) else "enum"
    return PackingSchedulerAPI(data_schedule, base, keys, scheduler_takes_max_num_seqs(base), "")


def scheduler_takes_max_num_seqs(base: type) -> bool:
    """Whether a packing-scheduler class (or any class in its MRO) accepts ``max_num_seqs`` in ``__init__``."""
    return any("max_num_seqs" in _parameters(cls.__init__) for cls in base.__mro__)


def _parameters(fn: Any) -> Any:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def packing_scheduler_point() -> Tuple[Any, str]:
    """``(data_schedule_module, "")`` when megatron-core has a NAME-keyed packing-scheduler map (a flag selects
    entries) with ``DpBalancedScheduler`` to build on, else ``(None, why)``."""
    api = packing_scheduler_api()
    if api.base is None:
        return None, api.why
    if api.map_keys != "names":
        return None, ("this megatron-core's scheduler map is keyed by an enum and no flag selects it; pass our "
                      "scheduler through megatron_dynbatch.integrations.megatron_packing.wrap_data_iterator, or "
                      "use the pretrain() hook (install())")
    return api.module, ""


def upstream_cp_rerouting(args_or_config: Any) -> List[str]:
    """The upstream rerouting flags switched on in Megatron ``args`` or a ``ModelParallelConfig``
    (``--hybrid-context-parallel`` / ``--dynamic-context-parallel``), as command-line spellings."""
    return ["--" + name.replace("_", "-") for name in UPSTREAM_CP_REROUTING_FLAGS
            if bool(getattr(args_or_config, name, False))]


def schedule_step_functions() -> Optional[Any]:
    """megatron-core's ``pipeline_parallel.schedules`` module when its schedules run every micro-batch through the
    module-level ``forward_step`` and ``backward_step`` (what online calibration wraps), else ``None``."""
    try:
        from megatron.core.pipeline_parallel import schedules
    except ImportError:
        return None
    ok = all(callable(getattr(schedules, name, None)) for name in ("forward_step", "backward_step"))
    return schedules if ok else None
