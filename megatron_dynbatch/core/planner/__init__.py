"""The planner: lengths in, :class:`Plan` out. Pure Python + NumPy (see ``api.py`` for the strategy)."""

from .api import plan_global_batch, score_assignment
from .plan import Plan
from .vpp import is_valid_microbatch_count, next_valid_microbatch_count

__all__ = ["Plan", "plan_global_batch", "score_assignment", "is_valid_microbatch_count", "next_valid_microbatch_count"]
