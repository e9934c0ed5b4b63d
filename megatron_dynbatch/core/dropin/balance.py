"""What the Megatron RL and NeMo-RL drop-ins balance by (one rule for both; torch-free like the rest of ``core/``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:
    from ..cost_model import CostModelLike
    from ..model_spec import ModelLike

__all__ = ["balance_kwargs"]


def balance_kwargs(model: Optional[ModelLike], cost_model: CostModelLike) -> Dict[str, Any]:
    """The planner's balance arguments: the model's modelled time when ``model`` is given (with ``cost_model``),
    else ``cost_model``'s time when only it is given, else plain tokens."""
    if model is not None:
        return {"model": model, "cost_model": cost_model}
    if cost_model is not None:
        return {"balance_by": "time", "cost_model": cost_model}
    return {"balance_by": "tokens"}
