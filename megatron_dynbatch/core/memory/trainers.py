"""A per-GPU token budget written in each trainer's own settings, and the trainers' documented defaults.

The budgets here are per GPU (per CP rank), padded tokens, as this package's planner counts them. Each trainer
counts its own way (read in their sources, Jan-Aug 2026):

* **Megatron-LM** (this package's flags) and **slime**: ``--max-tokens-per-gpu`` / ``--log-probs-max-tokens-per-
  gpu`` are per GPU; a micro-batch holds that times ``cp``. slime's own batching packs unpadded lengths and then
  pads each CP rank's share to a multiple of ``tp x 128`` (``data_pad_size_multiplier``), so its line is rounded
  down to that multiple -- then the padded share still fits; with the drop-in the padding is counted already;
* **verl** (Megatron actor): ``ppo_max_token_len_per_gpu`` / ``log_prob_max_token_len_per_gpu`` are per GPU and
  multiplied by ``context_parallel_size`` inside the actor; its engine pads every sequence to ``tp x cp x 2``
  (``tp`` without CP). The drop-in counts that padding; verl's own ``rearrange_micro_batches`` counts unpadded
  tokens and balances the workload with ``ceil(tokens / max_token_len)`` micro-batches, so its micro-batches can
  go over any value written here (verl #6735) -- use the drop-in for a budget that holds;
* **ROLL**: ``max_tokens_per_microbatch_in_train`` / ``..._in_infer`` bound the padded ``[b, s]`` area of one
  micro-batch, which context parallelism splits: the per-GPU budget times ``cp``;
* **NeMo-RL**: ``train_mb_tokens`` / ``logprob_mb_tokens`` (``policy.sequence_packing`` or
  ``policy.dynamic_batching``) are the capacity of one micro-batch (a bin), split by context parallelism: times
  ``cp``.

:data:`TRAINER_DEFAULTS` are the documented defaults ``bench --budgets`` compares the auto budget with. Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, List

from ..checks import as_int
from ..parallel import ParallelConfig

if TYPE_CHECKING:
    from ..parallel import ParallelLike

#: slime's default ``data_pad_size_multiplier`` (each CP rank's share is padded to ``tp x`` this)
SLIME_PAD = 128


@dataclass(frozen=True)
class TrainerLine:
    """One trainer's settings for the training and log-prob budgets, as it would be written, and a note."""

    trainer: str
    settings: Dict[str, int]
    line: str
    note: str

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TrainerDefault:
    """A trainer's documented default budget: ``setting`` = ``value``, per GPU or per micro-batch (``x cp``)."""

    trainer: str
    setting: str
    value: int
    per_gpu: bool
    source: str

    def tokens_per_gpu(self, cp: int) -> int:
        return self.value if self.per_gpu else max(1, self.value // cp)


TRAINER_DEFAULTS: Dict[str, TrainerDefault] = {
    "verl": TrainerDefault("verl", "ppo_max_token_len_per_gpu", 16384, True,
                           "verl/trainer/config/actor/actor.yaml (the ref and rollout log-prob budgets default to it)"),
    "roll": TrainerDefault("roll", "max_tokens_per_microbatch_in_train", 8192, False,
                           "ROLL's Dynamic Batching guide, its full configuration example (16384 for _in_infer)"),
}


def trainer_settings(train_tokens: Any, log_prob_tokens: Any, parallel: ParallelLike = None) -> List[TrainerLine]:
    """The budgets (per GPU) in every trainer's own settings (module docstring). The same budgets for everybody:
    ``megatron-dynbatch budget`` gives each trainer its own, from its loss path (:mod:`.loss_paths`), and takes
    that trainer's line of this function with them."""
    bt = as_int(train_tokens, "train_tokens", minimum=1)
    bl = as_int(log_prob_tokens, "log_prob_tokens", minimum=1)
    p = ParallelConfig.from_any(parallel)
    cp, tp = p.cp, p.tp
    pad = tp * SLIME_PAD
    st, sl = bt // pad * pad or bt, bl // pad * pad or bl  # below one multiple: keep it (and say so)
    align = tp * cp * 2 if cp > 1 else tp
    out = [
        TrainerLine("megatron-lm", {"--max-tokens-per-gpu": bt, "--log-probs-max-tokens-per-gpu": bl},
                    f"--max-tokens-per-gpu {bt} --log-probs-max-tokens-per-gpu {bl}",
                    f"per GPU, padding counted; a micro-batch holds this x cp {cp}"),
        TrainerLine("slime", {"--max-tokens-per-gpu": st, "--log-probs-max-tokens-per-gpu": sl},
                    f"--max-tokens-per-gpu {st} --log-probs-max-tokens-per-gpu {sl}",
                    f"slime's own batching: rounded down to tp x {SLIME_PAD} = {pad}, the multiple it pads each CP "
                    "rank's share to (the drop-in counts that padding itself)"
                    + ("" if bt >= pad else "; the budget is below one multiple, so a padded share goes over it: use "
                                            "the drop-in")),
        TrainerLine("verl", {"actor_rollout_ref.actor.ppo_max_token_len_per_gpu": bt,
                             "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": bl,
                             "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": bl},
                    f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={bt} "
                    f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={bl} "
                    f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={bl}",
                    "per GPU, verl multiplies by cp; holds with the drop-in" + (
                        f", which counts verl's padding of each sequence to a multiple of {align}" if align > 1
                        else "") + "; verl's own batching can go over it"),
        TrainerLine("roll", {"actor_train.max_tokens_per_microbatch_in_train": bt * cp,
                             "actor_train.max_tokens_per_microbatch_in_infer": bl * cp,
                             "reference.max_tokens_per_microbatch_in_infer": bl * cp},
                    f"actor_train.max_tokens_per_microbatch_in_train={bt * cp} "
                    f"actor_train.max_tokens_per_microbatch_in_infer={bl * cp} "
                    f"reference.max_tokens_per_microbatch_in_infer={bl * cp}",
                    f"per micro-batch: the padded [b, s] area, split over cp {cp}"),
        TrainerLine("nemo-rl", {"policy.sequence_packing.train_mb_tokens": bt * cp,
                                "policy.sequence_packing.logprob_mb_tokens": bl * cp},
                    f"policy.sequence_packing.train_mb_tokens={bt * cp} "
                    f"policy.sequence_packing.logprob_mb_tokens={bl * cp}",
                    f"per micro-batch, one bin, split over cp {cp}; the same names under policy.dynamic_batching"),
    ]
    return out


__all__ = ["TrainerLine", "TrainerDefault", "TRAINER_DEFAULTS", "trainer_settings", "SLIME_PAD"]
