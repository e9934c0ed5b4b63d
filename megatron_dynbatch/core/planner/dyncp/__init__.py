"""Dynamic context parallelism: the ``dp x cp`` GPUs of a pipeline stage as one pool, a CP group per micro-batch.

Strategy and invariants: :mod:`.orchestrate` (``plan_global_batch(..., dynamic_cp=True)``); the pool's groups
:mod:`.pool`, the synchronised simulator :mod:`.pool_sim`, one step's inputs :mod:`.step`, the candidate family
:mod:`.candidates` (+ :mod:`.deal`; Megatron-LM dev's scheduler as one more candidate: :mod:`.upstream`), one
candidate as slots :mod:`.schedule`, slots -> plan :mod:`.assembly`, the plan type :mod:`.plan`. Nothing here
imports the fixed-layout entry point (``planner/api.py``); it imports this.
"""

from .assembly import build_dynamic_cp_plan, score_with_cp_comm
from .candidates import THRESHOLDS
from .orchestrate import plan_dynamic_cp
from .plan import DynamicCPPlan

__all__ = ["plan_dynamic_cp", "build_dynamic_cp_plan", "score_with_cp_comm", "DynamicCPPlan", "THRESHOLDS"]
