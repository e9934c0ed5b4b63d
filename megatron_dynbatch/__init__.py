"""megatron-dynbatch: FLOPs-balanced dynamic micro-batching for Megatron-Core.

The planning core (``plan_global_batch``, ``ModelSpec``, ``calculate_fwd_flops``) is pure Python + NumPy;
torch and megatron-core are imported only by the integration modules that need them.
"""

from .alignment import Alignment
from .errors import DynBatchConfigError, OversizeSampleError, OversizeSampleWarning
from .cost_model import CostModel
from .parallel import ParallelConfig
from .planner import Plan, plan_global_batch
from .model_spec import ModelSpec
from .flops import FlopsCoefficients, calculate_fwd_flops, flops_coefficients, per_gpu_flops

__version__ = "0.1.0"

__all__ = [
    "Alignment",
    "DynBatchConfigError",
    "OversizeSampleError",
    "OversizeSampleWarning",
    "ParallelConfig",
    "CostModel",
    "Plan",
    "plan_global_batch",
    "__version__",
    "ModelSpec",
    "FlopsCoefficients",
    "calculate_fwd_flops",
    "flops_coefficients",
    "per_gpu_flops",
]
