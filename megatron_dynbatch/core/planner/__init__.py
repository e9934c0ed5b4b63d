"""The planner: lengths in, :class:`Plan` out. Pure Python + NumPy (see ``api.py`` for the strategy)."""

from .api import plan_global_batch, score_assignment
from .counts import CountRule
from .dyncp import DynamicCPPlan, build_dynamic_cp_plan
from .local import local_microbatch_counts, plan_local_batch
from .options import BalanceBy, PlanOptions
from .plan import Plan
from .plan_kind import PlanKind
from .vpp import is_valid_microbatch_count, next_valid_microbatch_count

__all__ = ["BalanceBy", "CountRule", "Plan", "PlanKind", "PlanOptions", "plan_global_batch", "score_assignment",
           "is_valid_microbatch_count", "next_valid_microbatch_count", "local_microbatch_counts", "plan_local_batch",
           "DynamicCPPlan", "build_dynamic_cp_plan"]
