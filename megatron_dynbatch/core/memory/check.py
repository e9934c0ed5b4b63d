"""Is a trainer's configured token budget what fits the card? :func:`check_configured_budget` -> :class:`BudgetVerdict`.

The drop-ins' start-up memory check (slime, verl, ROLL, NeMo-RL). One setting of one trainer, in that trainer's own
units (verl's ``ppo_max_token_len_per_gpu``, ROLL's ``max_tokens_per_microbatch_in_train``, ...), is judged against
the memory model (:func:`~.budget.choose_budget`, :func:`~.peak.peak_memory`) for that pass:

* ``"over"`` -- the predicted peak at the configured value is above the usable memory (``card x (1 - headroom)``),
  or the model does not fit the card at all: **out of memory ahead**. The message names the setting, its value,
  the predicted peak against the card and the value to use;
* ``"far_under"`` -- the configured value holds fewer than :data:`FAR_UNDER` (60%) of the tokens per GPU that fit:
  **speed left behind** (fewer, larger micro-batches would run the GEMMs more efficiently and pay the
  per-micro-batch floor fewer times). The message gives the value ``megatron-dynbatch budget`` prints;
* ``"fits"`` -- anything in between (no message to show).

Why 60%: between 60% and 100% of what fits, a hand-set budget is usually a deliberate margin (a memory profile not
yet calibrated, a co-located inference engine's share, fragmentation seen on this cluster) and the step time it
costs is small (modelled: the cost model's per-micro-batch floor is a few percent of a full micro-batch); below
it a batch whose micro-batches are budget-bound runs about 1/0.6 = 1.67x or more of them. It is 15 points under
the 75% at which ``megatron-dynbatch budget`` calls a run preset's own budget "speed left behind", so a start-up
warning is rarer than that note. ``far_under=`` changes it (0 turns the "far under" verdict off).

**One conversion.** The setting's value is turned into per-GPU tokens, and the value to use written in the
trainer's units, by :func:`~.trainers.trainer_settings` itself -- the function ``megatron-dynbatch budget`` prints
its lines with: the factor is that function's value of the setting for one token per GPU (``cp`` for ROLL and
NeMo-RL, whose budgets are per micro-batch; 1 for slime and verl), and the pass is the budget (training or
log-prob) that function writes into the setting. So the check and the ``budget`` command can never disagree.

Pure and deterministic (no torch: the drop-ins in :mod:`megatron_dynbatch.integrations` read the card). Bad input
-- no card size, a card of 0 or NaN GiB, no model, a budget of 0, a setting the trainer does not have -- raises a
``DynBatchConfigError`` naming it; a card that cannot hold the model is an ``"over"`` verdict, not an error.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from ..checks import MAX_TOKENS, as_float, as_int, did_you_mean
from ..errors import DynBatchConfigError
from ..model_spec import ModelSpec
from ..parallel import ParallelConfig
from .budget import DEFAULT_MULTIPLE, MAX_GPU_MEMORY_GB, _card, choose_budget
from .peak import check_pass, peak_memory
from .settings import GiB, MemorySettings, MemorySettingsLike
from .trainers import trainer_settings

if TYPE_CHECKING:
    from ..model_spec import ModelLike
    from ..parallel import ParallelLike

#: below this fraction of the tokens per GPU that fit, a configured budget leaves speed behind (module docstring)
FAR_UNDER = 0.6
VERDICTS = ("over", "far_under", "fits")
_PASS = {"train": "training", "log_prob": "log-prob"}


@dataclass(frozen=True)
class BudgetVerdict:
    """The verdict on one configured budget. ``tokens_per_gpu``: what the configured ``value`` means per GPU;
    ``recommended``: the value ``megatron-dynbatch budget`` gives for the setting, in the trainer's units (``None``
    when no budget fits the card); ``fit_tokens_per_gpu``: :func:`~.budget.choose_budget`'s budget; peaks in GiB
    (``predicted_peak_gb`` at the configured value); ``message``: what a warning says (empty for ``"fits"``)."""

    verdict: str
    trainer: str
    setting: str
    value: int
    pass_: str
    tokens_per_gpu: int
    recommended: Optional[int]
    fit_tokens_per_gpu: Optional[int]
    predicted_peak_gb: float
    recommended_peak_gb: Optional[float]
    gpu_memory_gb: float
    usable_gb: float
    message: str

    @property
    def warn(self) -> bool:
        """Whether the start-up check warns (``"over"`` or ``"far_under"``)."""
        return self.verdict != "fits"

    @property
    def of_fit(self) -> Optional[float]:
        """The configured tokens per GPU over what fits (``None`` when nothing fits)."""
        return None if not self.fit_tokens_per_gpu else self.tokens_per_gpu / self.fit_tokens_per_gpu

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "of_fit": self.of_fit}


def _norm(name: str) -> str:
    """A setting's last component, flag dashes as underscores: ``--log-probs-max-tokens-per-gpu`` ->
    ``log_probs_max_tokens_per_gpu``, ``actor_rollout_ref.actor.ppo_max_token_len_per_gpu`` -> ``ppo_max_...``."""
    return name.rsplit(".", 1)[-1].lstrip("-").replace("-", "_")


def _setting_key(trainer: str, setting: Any, parallel: ParallelConfig) -> Tuple[str, int, str]:
    """``(key, factor, pass)`` of ``setting`` in :func:`~.trainers.trainer_settings`'s line for ``trainer``: the
    factor and the pass are read off that function (one token per GPU; a training budget of 1 and a log-prob budget
    of 2 against the other way round), never restated here."""
    lines = {x.trainer: x for x in trainer_settings(1, 2, parallel)}
    flipped = {x.trainer: x for x in trainer_settings(2, 1, parallel)}
    if trainer not in lines:
        hint = did_you_mean(trainer, sorted(lines))
        raise DynBatchConfigError("trainer", trainer, "is not a trainer the memory check knows",
                                  (hint + " " if hint else "") + f"use one of {', '.join(sorted(lines))}")
    if not isinstance(setting, str) or not setting.strip("-. "):
        raise DynBatchConfigError("setting", setting, f"must name one of {trainer}'s budget settings",
                                  f"pass one of {', '.join(lines[trainer].settings)}")
    keys = [k for k in lines[trainer].settings if k == setting] or \
        [k for k in lines[trainer].settings if _norm(k) == _norm(setting)]
    if not keys:
        known = list(lines[trainer].settings)
        hint = did_you_mean(_norm(setting), sorted({_norm(k) for k in known}))
        raise DynBatchConfigError("setting", setting, f"is not one of {trainer}'s token-budget settings",
                                  (hint + " " if hint else "") + f"use one of {', '.join(known)}")
    key = keys[0]
    a, b = lines[trainer].settings[key], flipped[trainer].settings[key]
    return key, min(a, b), "train" if a < b else "log_prob"


def _share(ratio: float) -> str:
    return f"{ratio:.0%}" if ratio >= 0.01 else "under 1%"


def _layout(p: ParallelConfig) -> str:
    return (f"dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp}" + (f" ep={p.ep}" if p.ep > 1 else "")
            + (f" vpp={p.vpp}" if p.vpp > 1 else ""))


def check_configured_budget(setting: str, value: Any, model: Optional[ModelLike], parallel: ParallelLike,
                            gpu_memory_gb: Any, *, trainer: str, pass_: Optional[str] = None,
                            settings: MemorySettingsLike = None, profile: Any = None,
                            multiple: Any = DEFAULT_MULTIPLE, far_under: Any = FAR_UNDER,
                            note: str = "") -> BudgetVerdict:
    """The verdict on ``setting = value`` of ``trainer`` (``"slime"``, ``"verl"``, ``"roll"``, ``"nemo-rl"`` or
    ``"megatron-lm"``) for ``model`` on ``parallel`` with a card of ``gpu_memory_gb`` GiB (module docstring).

    ``setting``: the trainer's name for it, in full (``actor_rollout_ref.actor.ppo_max_token_len_per_gpu``) or its
    last part (``ppo_max_token_len_per_gpu``, ``--max-tokens-per-gpu``); ``pass_``: ``"train"`` or ``"log_prob"``,
    default the pass the setting budgets (an explicit pass that contradicts it is refused); ``settings`` /
    ``profile`` / ``multiple``: as :func:`~.budget.choose_budget` takes them; ``far_under``: the fraction below which
    the verdict is ``"far_under"``; ``note``: a note on the setting appended to the message (e.g. that it is unset
    and another setting stands in)."""
    par = ParallelConfig.from_any(parallel)
    key, factor, own_pass = _setting_key(trainer, setting, par)
    if pass_ is not None and check_pass(pass_) != own_pass:
        raise DynBatchConfigError("pass_", pass_, f"{key} budgets the {_PASS[own_pass]} pass",
                                  f"pass pass_={own_pass!r} or leave it out")
    name = setting if isinstance(setting, str) else key
    val = as_int(value, name, minimum=1, maximum=MAX_TOKENS,
                 fix=f"set {name} to a positive token count (megatron-dynbatch budget prints the one that fits)")
    card = _card(gpu_memory_gb)
    if model is None:
        raise DynBatchConfigError("model", None, "no model is known, so no memory can be predicted",
                                  "pass the model (a preset name, a config.json path or a ModelSpec)")
    m = ModelSpec.from_any(model)
    st = MemorySettings.from_any(settings)
    frac = as_float(far_under, "far_under", minimum=0.0, maximum=1.0,
                    fix="pass a fraction in [0, 1], e.g. 0.6 (0 turns the far-under verdict off)")
    per_gpu = val // factor
    usable = card * GiB * (1.0 - st.headroom)
    peak = peak_memory(m, par, per_gpu, pass_=own_pass, settings=st, profile=profile).peak_bytes
    what = (f"{m.name or 'the model'} on {_layout(par)}, optimizer {st.optimizer}, recompute {st.recompute}, "
            f"{st.trainer}'s loss path")
    note = f"; {note}" if note else ""
    head = (f"{name}={val}" + (f" ({per_gpu} tokens per GPU)" if factor != 1 else "")
            + f": predicted peak {peak / GiB:.1f} GiB on a {card:g} GiB card ({usable / GiB:.1f} usable, "
            f"{st.headroom:.0%} headroom) for the {_PASS[own_pass]} pass")
    try:
        choice = choose_budget(m, par, card, pass_=own_pass, settings=st, profile=profile, multiple=multiple)
    except DynBatchConfigError as err:  # the card cannot hold the model (or one `multiple` of tokens)
        if err.field != "gpu_memory_gb":
            raise
        msg = (f"{head}: out of memory ahead -- no token budget fits ({err.problem}). Fix: {err.fix} "
               f"(predicted for {what}{note})")
        return BudgetVerdict("over", trainer, name, val, own_pass, per_gpu, None, None, peak / GiB, None, card,
                             usable / GiB, msg)
    lines = {x.trainer: x for x in trainer_settings(choice.tokens_per_gpu, choice.tokens_per_gpu, par)}
    rec = lines[trainer].settings[key]
    rec_peak = choice.breakdown.peak_gb
    use = (f"use {name}={rec} (megatron-dynbatch budget's value: {choice.tokens_per_gpu} tokens per GPU, "
           f"predicted peak {rec_peak:.1f} GiB; predicted for {what}{note})")
    if peak > usable:
        where = ("more than the card: out of memory ahead" if peak > card * GiB else
                 "into the headroom kept for the allocator's fragmentation: out of memory likely")
        verdict, msg = "over", f"{head} -- {where}. {use[0].upper()}{use[1:]}"
    elif per_gpu < frac * choice.tokens_per_gpu:
        verdict = "far_under"
        share = _share(per_gpu / choice.tokens_per_gpu)
        msg = (f"{name}={val}" + (f" ({per_gpu} tokens per GPU)" if factor != 1 else "")
               + f" is {share} of the {choice.tokens_per_gpu} tokens per GPU that fit the {card:g} GiB card for the "
               f"{_PASS[own_pass]} pass (predicted peak {peak / GiB:.1f} GiB): speed left behind -- fewer, larger "
               f"micro-batches would fit. To go faster, {use}")
    else:
        verdict, msg = "fits", ""
    return BudgetVerdict(verdict, trainer, name, val, own_pass, per_gpu, rec, choice.tokens_per_gpu, peak / GiB,
                         rec_peak, card, usable / GiB, msg)


def card_or_none(gpu_memory_gb: Any) -> Optional[float]:
    """``gpu_memory_gb`` as a card size when it is one (a finite number > 0), else ``None`` -- for readers of a
    device that may report nothing usable (the drop-ins skip the check then)."""
    if isinstance(gpu_memory_gb, bool):
        return None
    try:
        value = float(gpu_memory_gb)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and 0 < value <= MAX_GPU_MEMORY_GB else None


__all__ = ["BudgetVerdict", "FAR_UNDER", "VERDICTS", "check_configured_budget", "card_or_none"]
