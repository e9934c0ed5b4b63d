"""The planner: lengths in, :class:`Plan` out. Pure Python + NumPy (see ``api.py`` for the strategy).

Modules, in the order a planning call meets them:

* :mod:`.options` -- :class:`PlanOptions`, every choice of a call (:mod:`.option_flags`: the flags built from
  its fields);
* :mod:`.api` -- :func:`plan_global_batch`, the entry point and its strategy; :mod:`.local` -- local mode (each
  DP rank plans its own samples);
* :mod:`.prepare` -- what a call derives before packing (:mod:`.inputs`: the checks and per-sample arrays;
  :mod:`.steps`: items, optimizer steps and units; :mod:`.counts` and :mod:`.vpp`: the counts a step may use);
* :mod:`.search` -- one step's micro-batch count, from the lower bounds of :mod:`.bounds`; :mod:`.packer` --
  one count's packing; :mod:`.fallback` -- feasibility-first packings before a count is refused;
  :mod:`.portfolio` -- the peers' heuristics, kept where faster;
* :mod:`.ordering` -- execution order and pipeline polishing; :mod:`.timing` -- per-rank and per-step times;
* :mod:`.plan` -- :class:`Plan` and :mod:`.plan_kind` -- :class:`PlanKind`, what every kind of plan offers;
* :mod:`.dyncp` -- dynamic context parallelism (``dynamic_cp=True``): the ``dp x cp`` GPUs as one pool.
"""

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
