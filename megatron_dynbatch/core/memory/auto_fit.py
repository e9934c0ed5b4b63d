"""When ``auto`` cannot place a sample: what limits the budget the memory model chose, and the ways out that fit.

A hand-set budget too small for a sample is fixed by raising it. An ``auto`` budget is already the largest the
memory model says this card holds, so "raise the budget" would promise an out-of-memory error. When a sample
(or ``--seq-length`` / ``max_seq_len`` at start-up) is longer than what ``auto`` chose, :func:`auto_cannot_place`
says that ``auto`` chose ``N`` on this card and what limits it (the :class:`~.budget.BudgetChoice`: the limiting
stage and its largest per-token term), and lists the ways out, each checked against the same memory model:

* **full recompute** (when not on already): the budget ``auto`` would choose with it;
* **twice the tensor parallelism** (when the heads and query groups divide) and **twice the context
  parallelism**: the budget per GPU ``auto`` would choose, against the tokens per GPU the sample then needs (CP
  splits a sample over its GPUs; TP splits activations and logits); on the same GPUs (``dp`` halved) when ``dp``
  is even, else on twice the GPUs;
* ``oversize="alone"``: such a sample runs alone in a micro-batch over the budget (only where such samples are
  rare and the headroom covers them: the memory model did not size it);
* **a larger card**: the smallest card (GiB) whose ``auto`` budget holds the sample (offered up to
  :data:`LARGER_CARD` times this one; beyond, named as not enough).

A way that does not make the sample fit is named as not enough (with its number), never offered as a fix. Pure
Python, deterministic.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from ..errors import DynBatchConfigError
from ..model_spec import ModelSpec
from ..parallel import ParallelConfig
from .peak import stage_terms
from .settings import GiB

if TYPE_CHECKING:
    from ..model_spec import ModelLike
    from .budget import BudgetChoice
    from ..parallel import ParallelLike

__all__ = ["auto_cannot_place", "limit_words", "LARGER_CARD"]

#: a larger card is offered as a way out only up to this many times the card (H100 80GB -> B200 192GB: 2.4x)
LARGER_CARD = 2.5


def limit_words(choice: BudgetChoice) -> str:
    """``auto, limited by <term> on stage <s> (<card> GiB card, <h>% headroom)``: what a plan's summary and the
    ``plan`` header say about an automatic budget."""
    return (f"auto, limited by {choice.limited_by} on stage {choice.limiting_stage} ({choice.gpu_memory_gb:g} GiB "
            f"card, {choice.settings.headroom:.0%} headroom, {choice.pass_.replace('_', '-')} pass)")


def _need_per_gpu(slot_tokens: int, par: ParallelConfig, align_kwargs: dict) -> int:
    from ..alignment import Alignment

    align = Alignment.for_layout(par, **align_kwargs)
    return int(align.budget_for(int(align.seq_len(int(slot_tokens))), par.cp))


def _auto_budget(model: ModelSpec, par: ParallelConfig, card: float, pass_: str, settings: Any,
                 profile: Any) -> Optional[int]:
    from .budget import choose_budget

    try:
        return int(choose_budget(model, par, card, pass_=pass_, settings=settings, profile=profile).tokens_per_gpu)
    except DynBatchConfigError:  # the model does not fit at all there
        return None


def _smallest_card(model: ModelSpec, par: ParallelConfig, need: int, pass_: str, settings: Any,
                   profile: Any) -> Optional[float]:
    try:
        terms, _ = stage_terms(model, par, pass_=pass_, settings=settings, profile=profile)
    except DynBatchConfigError:  # pragma: no cover - the choice was made with these settings
        return None
    peak = max(t.reserve + t.allocated(need) for t in terms)
    return peak / (1.0 - settings.headroom) / GiB


def auto_cannot_place(choice: Any, slot_tokens: int, *, model: ModelLike, parallel: ParallelLike, profile: Any = None,
                      fp8_alignment: Any = None, sequence_pad_multiple: Optional[int] = None,
                      microbatch_pad_multiple: Optional[int] = None, what: str = "a sample",
                      budget_field: str = "max_tokens_per_gpu") -> Tuple[str, str]:
    """``(problem, fix)`` for a ``DynBatchConfigError`` when ``what`` (``slot_tokens`` after per-sequence padding)
    does not fit the automatic budget of ``choice`` (module docstring)."""
    m = ModelSpec.from_any(model)
    par = ParallelConfig.from_any(parallel)
    st, card, pass_ = choice.settings, float(choice.gpu_memory_gb), choice.pass_
    align_kwargs = {"fp8": fp8_alignment, "sequence_multiple": sequence_pad_multiple,
                    "microbatch_multiple": microbatch_pad_multiple}
    need = _need_per_gpu(slot_tokens, par, align_kwargs)
    problem = (f"{what} needs {need} tokens per GPU, but auto chose {choice.tokens_per_gpu} on this "
               f"{card:g} GiB card -- the largest the memory model says fits ({choice.usable_bytes / GiB:.1f} GiB "
               f"usable after {st.headroom:.0%} headroom), limited by {choice.limited_by} on stage "
               f"{choice.limiting_stage}; a larger {budget_field} would run out of memory")
    ways: List[str] = []
    short: List[str] = []

    def judge(label: str, budget: Optional[int], needed: int) -> None:
        if budget is not None and budget >= needed:
            ways.append(f"{label} (auto then chooses {budget} tokens per GPU, {what} needs {needed})")
        else:
            short.append(f"{label} ({'the model does not fit' if budget is None else f'auto: {budget}'}, "
                         f"needs {needed})")

    if pass_ == "train" and st.recompute != "full":
        judge("turn on full recompute (--recompute-granularity full --recompute-method uniform, or "
              "memory={'recompute': 'full'})", _auto_budget(m, par, card, pass_, st.replace(recompute="full"),
                                                            profile), need)
    for name, factor_ok in (("tp", m.num_attention_heads % (2 * par.tp) == 0
                             and m.num_query_groups % (2 * par.tp) == 0), ("cp", True)):
        if not factor_ok:
            continue
        where = "on the same GPUs (dp halved)" if par.dp % 2 == 0 else "on twice the GPUs"
        try:
            bigger = dataclasses.replace(par, **{name: getattr(par, name) * 2, "dp": max(1, par.dp // 2)})
            needed = _need_per_gpu(slot_tokens, bigger, align_kwargs)
        except DynBatchConfigError:
            continue
        judge(f"{name}={getattr(bigger, name)} {where}", _auto_budget(m, bigger, card, pass_, st, profile), needed)
    ways.append(f"oversize='alone' (--dynbatch-oversize alone): such samples run alone in a micro-batch over "
                f"the budget -- only where they are rare and the {st.headroom:.0%} headroom covers them")
    card_need = _smallest_card(m, par, need, pass_, st, profile)
    if card_need is not None and math.isfinite(card_need) and card_need <= LARGER_CARD * card:
        ways.append(f"a larger card: at least {math.ceil(card_need * 10) / 10:g} GiB holds {need} tokens per GPU")
    elif card_need is not None and math.isfinite(card_need):
        short.append(f"a larger card (it would take {math.ceil(card_need):g} GiB)")
    fix = "; ".join(ways)
    if short:
        fix += ". Not enough alone: " + "; ".join(short)
    return problem, fix
