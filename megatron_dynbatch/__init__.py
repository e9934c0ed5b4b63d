"""megatron-dynbatch: FLOPs-balanced dynamic micro-batching for Megatron-Core.

The package's folders are its architecture (``docs/architecture.md``):

* :mod:`megatron_dynbatch.core` -- the planning core: pure Python + NumPy, never imports torch (a test checks);
* :mod:`megatron_dynbatch.megatron` -- the torch / megatron-core edge: THD packing, CP slicing, the data
  iterator, loss normalisation, the ``forward_backward_func`` wrapper, launch flags;
* :mod:`megatron_dynbatch.integrations` -- trainers: the Megatron-LM hook, Ray, and drop-ins for RL trainers;
* :mod:`megatron_dynbatch.bench` -- the benchmark and the baselines it compares against;
* :mod:`megatron_dynbatch.measure` -- measured times and memory on a real device (``calibrate``'s timing and
  memory grids, the GPU benchmarks' whole model);
* :mod:`megatron_dynbatch.testing` -- test support (references and stand-ins), never imported by the library;
* :mod:`megatron_dynbatch.cli` (with ``_cli_*``, ``_argparse``, :mod:`megatron_dynbatch.demo`) -- the
  ``megatron-dynbatch`` command on top of them all; :mod:`megatron_dynbatch.requirements` says why an optional
  dependency cannot be used, with the fix.

``import megatron_dynbatch`` stays light: the planning names below are imported eagerly, the edge names
(``DynamicBatchIterator``, ``dynamic_forward_backward``, ...) on first use, so planning works without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from .core.alignment import Alignment
from .core.cost_model import CostModel
from .core.cost_fit import fit_cost_model, fit_cp_comm
from .core.cost_files import load_cost_model
from .core.errors import (BudgetWarning, DropinAssertionError, DynBatchConfigError, OversizeAssertionError,
                          OversizeSampleError, OversizeSampleWarning, UnknownOptionError)
from .core.flops import FlopsCoefficients, calculate_fwd_flops, flops_coefficients, per_gpu_flops
from .core.memory import BudgetChoice, MemorySettings, choose_budget, estimate_max_tokens_per_gpu, peak_memory
from .core.model_spec import ModelSpec
from .core.parallel import ParallelConfig
from .core.planner import (BalanceBy, DynamicCPPlan, Plan, PlanKind, PlanOptions, build_dynamic_cp_plan,
                           local_microbatch_counts, plan_global_batch, plan_local_batch, score_assignment)
from .core.run_config import RunConfig
from .core.startup import check_max_seq_len_fits

__version__ = "0.1.0"

#: Edge names exported lazily: name -> module that defines it (imported on first attribute access).
_LAZY = {
    "DynamicBatchIterator": "megatron_dynbatch.megatron.iterator",
    "dynamic_forward_backward": "megatron_dynbatch.megatron.schedule",
    "forward_log_probs": "megatron_dynbatch.megatron.schedule",
    "pack_microbatch": "megatron_dynbatch.megatron.packing",
    "PackedMicroBatch": "megatron_dynbatch.megatron.packing",
    "LossNormalizer": "megatron_dynbatch.megatron.loss",
    "add_dynamic_batch_args": "megatron_dynbatch.megatron.args",
    "plan_rollout": "megatron_dynbatch.integrations.ray",
    "gather_in_order": "megatron_dynbatch.integrations.ray",
    "setup_dynamic_cp_groups": "megatron_dynbatch.megatron.dynamic_cp",
    "microbatch_cp_group": "megatron_dynbatch.megatron.dynamic_cp",
}

__all__ = [
    "Alignment",
    "BalanceBy",
    "BudgetChoice",
    "BudgetWarning",
    "CostModel",
    "DropinAssertionError",
    "DynBatchConfigError",
    "DynamicCPPlan",
    "FlopsCoefficients",
    "MemorySettings",
    "ModelSpec",
    "OversizeAssertionError",
    "OversizeSampleError",
    "OversizeSampleWarning",
    "ParallelConfig",
    "Plan",
    "PlanKind",
    "PlanOptions",
    "RunConfig",
    "UnknownOptionError",
    "__version__",
    "build_dynamic_cp_plan",
    "calculate_fwd_flops",
    "check_max_seq_len_fits",
    "choose_budget",
    "estimate_max_tokens_per_gpu",
    "fit_cost_model",
    "fit_cp_comm",
    "flops_coefficients",
    "load_cost_model",
    "peak_memory",
    "per_gpu_flops",
    "local_microbatch_counts",
    "plan_global_batch",
    "plan_local_batch",
    "score_assignment",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_dynbatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))

