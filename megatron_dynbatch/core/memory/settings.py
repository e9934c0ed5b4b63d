"""What a memory prediction assumes about the training job: :class:`MemorySettings`.

Everything the model shape and the parallel layout do not say -- the optimizer's layout, activation recompute,
the dtypes of weights and gradients, how many fp32 copies of the logits the loss keeps, MoE routing imbalance,
and how much of the card is kept back -- is one frozen, validated value. Every field is checked at construction
(``DynBatchConfigError`` naming the field, its value and the fix); NumPy scalars are accepted and stored as
Python numbers, so two settings built from equal values compare (and hash) equal on every rank.

Defaults describe a Megatron-LM bf16 run: bf16 weights, fp32 gradient buffers (Megatron accumulates bf16 runs'
gradients in fp32), Adam with an fp32 master copy and two fp32 moments (12 bytes per parameter) sharded by the
distributed optimizer, no recompute, Megatron's vocab-parallel cross entropy (one fp32 copy of the logits),
4 GiB kept for the CUDA context, NCCL buffers and library workspaces, and 10% of the card left free for the
allocator's fragmentation (``headroom``). Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Dict, Mapping, Optional, Union

from ..checks import as_bool, as_float, as_int, did_you_mean
from ..errors import DynBatchConfigError
from .loss_paths import LossOptions, check_trainer

GiB = float(1 << 30)
OPTIMIZERS = ("distributed", "replicated", "cpu_offload")
RECOMPUTE = ("none", "selective", "full")
#: bytes per element of the dtypes weights and gradients may have
DTYPE_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0}
#: what a log-prob / reference pass has resident: the training model's whole state, or a forward-only copy
LOG_PROB_STATIC = ("training", "weights")
#: most fp32 copies of the logits a loss may keep (each is 4 bytes x T x V/tp)
MAX_FP32_COPIES = 16


def _option(default: Any = None, *, megatron: Optional[str] = None, cli: Optional[str] = None) -> Any:
    """A field with its spellings at the entry points (as ``PlanOptions``' fields carry them)."""
    return field(default=default, metadata={"megatron": megatron, "cli": cli})


def _choice(value: Any, field: str, choices: Any) -> str:
    if not isinstance(value, str) or value not in choices:
        hint = did_you_mean(value, list(choices), n=1, cutoff=0.5)
        raise DynBatchConfigError(f"settings.{field}", value, "is not one of the choices",
                                  f"{hint + ' ' if hint else ''}use one of {', '.join(choices)}")
    return value


@dataclass(frozen=True)
class MemorySettings:
    """How the training job uses memory (module docstring).

    * ``optimizer``: ``"distributed"`` (Adam state sharded over the data-parallel ranks: ``--use-distributed-
      optimizer``), ``"replicated"`` (every rank holds it) or ``"cpu_offload"`` (on the host:
      ``--optimizer-cpu-offload``);
    * ``recompute``: ``"none"``, ``"selective"`` (counted like none: with flash/fused attention there is no score
      matrix left to recompute) or ``"full"`` (``--recompute-granularity full --recompute-method uniform
      --recompute-num-layers 1``: each layer keeps its input, one layer is recomputed at a time);
    * ``param_dtype`` / ``grad_dtype``: ``"bf16"``, ``"fp16"`` or ``"fp32"``; ``optimizer_bytes_per_param``: the
      optimizer state per parameter before sharding (12: fp32 master + two fp32 moments);
    * ``optimizer_step_bytes_per_param``: temporary buffers of the optimizer's step (0 for fused Adam --
      Transformer Engine's or apex's; about 4 for torch's foreach AdamW, Megatron's fallback without them);
    * ``trainer``: whose loss path the LM head's term counts (:mod:`.loss_paths`: ``megatron-lm`` -- Megatron's
      cross entropy, this package's own loss -- ``slime``, ``verl``, ``roll``, ``nemo-rl``), with the trainer
      options that change it: ``loss_entropy`` (an entropy term in the training loss), ``loss_temperature``,
      ``loss_fused`` (the trainer's fused loss kernel), ``loss_chunk_tokens`` (its log-prob chunk);
    * ``logits_fp32_copies``: ``None`` (the trainer's loss path decides) or a count that overrides it: fp32
      copies of the ``T x V/tp`` logits beside the bf16 logits in the training loss (1 is Megatron's cross
      entropy); ``log_prob_fp32_copies``: the same for log-prob / reference passes;
    * ``moe_imbalance``: tokens of the busiest expert over the mean (>= 1; only MoE models read it). Default 1.1,
      not 1.0 (perfectly balanced routing, which under-predicts -- an OOM): Megatron-LM's CI memory measurements
      (``tests/test_megatron_ci_memory.py``: ``mixtral_8x7b_tp1pp4ep8vpp8_release`` and
      ``mixtral_8x7b_alltoall_tp2pp4ep4_release``) show a steady-state imbalance of 1.09-1.10 on the measured GPU's
      experts with aux-loss balancing. Early training can reach 1.41 (the second case's highest peak); on a GPU the
      first-step memory probe and the online memory guard cover that, or pass a higher value;
      ``expert_tensor_parallel_size``: Megatron's ETP (default the layout's ``tp``);
    * ``untie_embeddings``: the LM head has its own weights (False: tied to the input embedding);
    * ``log_prob_static``: what is resident during a log-prob pass -- ``"training"`` (the training model with its
      gradients and optimizer state: the actor of slime, verl and Megatron RL) or ``"weights"`` (a separate
      forward-only model, e.g. a reference model);
    * ``reserve_gb``: GiB never available to tensors (CUDA context, NCCL buffers, cuBLAS / TE workspaces);
    * ``headroom``: fraction of the card left free for allocator fragmentation (the budget is chosen so the
      predicted peak, reserve included, stays under ``card x (1 - headroom)``).
    """

    optimizer: str = "distributed"
    recompute: str = "none"
    param_dtype: str = "bf16"
    grad_dtype: str = "fp32"
    optimizer_bytes_per_param: float = 12.0
    optimizer_step_bytes_per_param: float = 0.0
    logits_fp32_copies: Optional[int] = None
    log_prob_fp32_copies: Optional[int] = None
    moe_imbalance: float = 1.1
    expert_tensor_parallel_size: Optional[int] = None
    untie_embeddings: bool = True
    log_prob_static: str = "training"
    reserve_gb: float = 4.0
    headroom: float = 0.10
    #: whose loss path the LM-head term counts (``megatron-lm``, ``slime``, ``verl``, ``roll``, ``nemo-rl``:
    #: :mod:`megatron_dynbatch.core.memory.loss_paths`)
    trainer: str = _option("megatron-lm", megatron="--dynbatch-trainer", cli="--trainer")
    #: the training loss has an entropy term (slime ``--entropy-coef``, verl ``entropy_coeff``, ROLL
    #: ``entropy_loss_coef`` not 0)
    loss_entropy: bool = _option(False, megatron="--dynbatch-loss-entropy", cli="--loss-entropy")
    #: the temperature the loss divides the logits by (slime ``--rollout-temperature``)
    loss_temperature: float = _option(1.0, megatron="--dynbatch-loss-temperature", cli="--loss-temperature")
    #: the trainer's fused loss kernel (Megatron ``--cross-entropy-loss-fusion``, verl ``use_fused_kernels``,
    #: ROLL ``cross_entropy_loss_fusion``)
    loss_fused: bool = _option(False, megatron="--dynbatch-loss-fused", cli="--loss-fused")
    #: the trainer's log-prob chunk in tokens (slime ``--log-probs-chunk-size``, NeMo-RL ``logprob_chunk_size``);
    #: ``None``: unchunked
    loss_chunk_tokens: Optional[int] = _option(None, megatron="--dynbatch-loss-chunk-tokens",
                                               cli="--loss-chunk-tokens")

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "optimizer", _choice(self.optimizer, "optimizer", OPTIMIZERS))
        s(self, "recompute", _choice(self.recompute, "recompute", RECOMPUTE))
        s(self, "param_dtype", _choice(self.param_dtype, "param_dtype", tuple(DTYPE_BYTES)))
        s(self, "grad_dtype", _choice(self.grad_dtype, "grad_dtype", tuple(DTYPE_BYTES)))
        s(self, "log_prob_static", _choice(self.log_prob_static, "log_prob_static", LOG_PROB_STATIC))
        for name, hi in (("optimizer_bytes_per_param", 64.0), ("optimizer_step_bytes_per_param", 64.0)):
            s(self, name, as_float(getattr(self, name), f"settings.{name}", minimum=0.0, maximum=hi,
                                   fix=f"pass bytes per parameter between 0 and {hi:g}"))
        for name in ("logits_fp32_copies", "log_prob_fp32_copies"):
            if getattr(self, name) is None:
                continue
            s(self, name, as_int(getattr(self, name), f"settings.{name}", minimum=0, maximum=MAX_FP32_COPIES,
                                 fix="pass 1 (Megatron's cross entropy), 2 for a loss that also keeps entropy"))
        s(self, "moe_imbalance", as_float(self.moe_imbalance, "settings.moe_imbalance", minimum=1.0, maximum=64.0,
                                          fix="pass the busiest expert's tokens over the mean, e.g. 1.0 or 1.5"))
        if self.expert_tensor_parallel_size is not None:
            s(self, "expert_tensor_parallel_size", as_int(self.expert_tensor_parallel_size,
                                                          "settings.expert_tensor_parallel_size", minimum=1,
                                                          maximum=2 ** 20, fix="pass Megatron's ETP, e.g. 1"))
        s(self, "untie_embeddings", as_bool(self.untie_embeddings, "settings.untie_embeddings"))
        s(self, "reserve_gb", as_float(self.reserve_gb, "settings.reserve_gb", minimum=0.0, maximum=1024.0,
                                       fix="pass the GiB kept for the CUDA context and NCCL, e.g. 4"))
        s(self, "headroom", as_float(self.headroom, "settings.headroom", minimum=0.0, maximum=0.9,
                                     fix="pass the fraction of the card left free, e.g. 0.1"))
        s(self, "trainer", check_trainer(self.trainer, "settings.trainer"))
        opts = self.loss_options()  # validates the loss options (named as the fields)
        s(self, "loss_entropy", opts.entropy)
        s(self, "loss_temperature", opts.temperature)
        s(self, "loss_fused", opts.fused)
        s(self, "loss_chunk_tokens", opts.chunk_tokens)

    @property
    def weight_bytes(self) -> float:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def grad_bytes(self) -> float:
        return DTYPE_BYTES[self.grad_dtype]

    def fp32_copies(self, pass_: str) -> Optional[int]:
        """fp32 logits copies set for ``pass_`` (``"train"`` or ``"log_prob"``); ``None``: the trainer's path."""
        return self.logits_fp32_copies if pass_ == "train" else self.log_prob_fp32_copies

    def loss_options(self) -> LossOptions:
        """The trainer loss options (:class:`~.loss_paths.LossOptions`)."""
        from ..errors import reword

        try:
            return LossOptions(self.loss_entropy, self.loss_temperature, self.loss_fused, self.loss_chunk_tokens)
        except DynBatchConfigError as err:
            raise reword(err, {k: "settings." + k for k in ("loss_entropy", "loss_temperature", "loss_fused",
                                                              "loss_chunk_tokens")}) from None

    def replace(self, **changes: Any) -> "MemorySettings":
        return replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_any(cls, value: MemorySettingsLike) -> "MemorySettings":
        """``None`` (the defaults), a :class:`MemorySettings`, or a mapping of its fields."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = sorted(str(k) for k in value if k not in known)
            if unknown:
                raise DynBatchConfigError("settings", unknown[0], "is not a memory setting",
                                          f"use only {', '.join(sorted(known))}")
            return cls(**dict(value))
        raise DynBatchConfigError("settings", type(value).__name__, "must be a MemorySettings or a mapping",
                                  "pass MemorySettings(optimizer=..., recompute=...) or a dict of its fields")


#: What :meth:`MemorySettings.from_any` accepts: the settings, a mapping of their fields, or ``None`` (defaults)
MemorySettingsLike = Union[MemorySettings, Mapping[str, Any], None]

__all__ = ["MemorySettings", "MemorySettingsLike", "LossOptions", "GiB", "OPTIMIZERS", "RECOMPUTE", "DTYPE_BYTES",
           "LOG_PROB_STATIC"]
