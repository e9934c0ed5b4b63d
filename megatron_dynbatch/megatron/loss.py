"""Exact loss normalisation that does not depend on how samples are packed into micro-batches.

The problem
-----------
With dynamic batching, micro-batches hold different numbers of samples and tokens, and DP ranks hold different
numbers of micro-batches' worth of tokens. Megatron's schedule normalises each micro-batch on its own (see
the table below), so the usual ``loss = sum(per_token_loss * mask) / mask.sum()`` per micro-batch gives the
*mean of per-micro-batch means*: the gradient then depends on the packing, which is exactly what a balancer
changes from step to step.

The fix
-------
Every rank sees the lengths and loss masks of the WHOLE global batch (that is what the planner plans from), so
it knows the global normalisers without any communication. The objective of one optimizer step is written as
a weighted sum over every token of the step::

    L = sum_{samples i} sum_{positions j} w_ij * loss_ij,      w_ij = loss_mask_ij * c_i

with one coefficient ``c_i`` per sample that depends only on global totals (:class:`LossNormalizer`):

==============  ====================================================  =========================================
mode            L                                                     c_i
==============  ====================================================  =========================================
``token_mean``  sum of masked token losses / masked tokens of step     ``1 / T``, ``T = sum_i T_i``
``sample_mean`` mean over samples of each sample's token mean          ``1 / (N * T_i)``
``group_mean``  mean over groups of each group's mean (see below)      ``1 / (G * T_g)`` or ``1 / (G * n_g * T_i)``
``token_sum``   sum of masked token losses                             ``1``
==============  ====================================================  =========================================

``T_i = sum_j loss_mask_ij`` (the loss mask the packer produces, :func:`sample_loss_mask`). Samples with
``T_i == 0`` have no loss and are not counted in ``N``; groups with no loss token are not counted in ``G``.
``group_mean`` reduces each group either by its tokens (``group_reduce="token"``, default: the group's loss is
its masked token losses over its masked tokens ``T_g``) or by its samples (``group_reduce="sample"``: the
mean of the token means of its ``n_g`` samples that have loss tokens); groups come from ``group_ids`` (e.g. the
GRPO prompt a response belongs to).

Each micro-batch's loss function returns its partial sum ``S = sum_{local tokens} w_ij * loss_ij`` multiplied
by a factor that undoes exactly what Megatron does next (:func:`megatron_loss_factor`). The partial sums of all
micro-batches on all DP and CP ranks add up to ``L`` whatever the packing, so the gradient after
``finalize_model_grads`` is ``grad L`` exactly.

What Megatron-core 0.16 does to the value a loss function returns (``schedules.forward_step_calc_loss``,
``DistributedDataParallel`` and ``finalize_model_grads``), ``M`` = micro-batches per step, ``n`` = the token
count returned with the loss, ``dp``/``cp`` = data/context-parallel sizes (DDP reduces over the DP x CP group):

* ``(x, n, logs)``, ``calculate_per_token_loss=False``: Megatron applies ``x / max(n, 1) / M``, then DDP sums
  over DP x CP and scales by ``1/(dp*cp)``  ->  ``f = M * dp * cp * max(n, 1)``;
* ``(x, n, logs)``, ``calculate_per_token_loss=True``: DDP sums (factor 1) and ``finalize_model_grads`` divides
  by ``K = sum(n)`` over all micro-batches, DP and CP ranks  ->  ``f = K``, the step's loss-token positions;
* ``(x, logs)``, ``False``: ``x * cp / M``, then DDP ``/(dp*cp)``  ->  ``f = M * dp``;
* ``(x, logs)``, ``True``: ``x * cp / M``, DDP sums, no division (``K = 0``)  ->  ``f = M / cp``.

With the 3-tuple we return ``n`` = the number of positions with a non-zero loss mask in the (CP-local) micro-
batch, so under ``calculate_per_token_loss`` Megatron's all-reduced ``sum(n)`` is the step's global count
``K`` that every rank already knows. Context parallelism needs nothing else: each CP rank computes ``S`` on its
zig-zag slice of tokens (weights are sliced with them) and DDP sums the CP ranks' gradients.

Not covered by these factors: MoE auxiliary losses and MTP losses, which Megatron scales on its own
(``MoEAuxLossAutoScaler`` / ``MTPLossAutoScaler``, per micro-batch); they keep Megatron's per-micro-batch
semantics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..core.checks import is_int
from ..core.errors import DynBatchConfigError

LOSS_MODES = ("token_mean", "sample_mean", "group_mean", "token_sum")
GROUP_REDUCE = ("token", "sample")

#: Key under which the loss function puts its :class:`MicroBatchResult` in Megatron's per-micro-batch logs.
RESULT_KEY = "dynbatch"

__all__ = [
    "LOSS_MODES",
    "GROUP_REDUCE",
    "RESULT_KEY",
    "LossNormalizer",
    "MicroBatchResult",
    "sample_loss_mask",
    "loss_mask_stats",
    "megatron_loss_factor",
    "token_sample_ids",
    "make_loss_func",
    "reference_loss",
]


# --------------------------------------------------------------------------------------- loss masks
def _to_numpy_1d(value: Any) -> np.ndarray:
    try:
        import torch

        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", torch.float64).numpy().reshape(-1)
    except ImportError:  # pragma: no cover - torch is present wherever samples hold tensors
        pass
    return np.asarray(value, dtype=np.float64).reshape(-1)


def sample_loss_mask(sample: Mapping[str, Any]) -> np.ndarray:
    """The loss mask (float64, one entry per token) that :func:`megatron_dynbatch.megatron.packing.pack_microbatch`
    gives this sample: its ``loss_mask`` (default all ones) and, when the sample has no ``labels``, 0 on the
    last position (there is no next token to predict inside the sample)."""
    if not isinstance(sample, Mapping) or "tokens" not in sample:
        raise DynBatchConfigError("sample", type(sample).__name__, "must be a dict with a 'tokens' entry",
                                  "pass dicts like {'tokens': LongTensor[L], 'loss_mask': ...}")
    n = len(sample["tokens"])
    if "loss_mask" in sample:
        mask = _to_numpy_1d(sample["loss_mask"]).copy()
        if mask.size != n:
            raise DynBatchConfigError("sample['loss_mask']", f"{mask.size} entries",
                                      f"the loss mask must have one entry per token ({n})",
                                      "align loss_mask with tokens (label positions, Megatron's convention)")
    else:
        mask = np.ones(n, dtype=np.float64)
    if "labels" not in sample and n > 0:
        mask[n - 1] = 0.0
    return mask


def loss_mask_stats(samples: Sequence[Mapping[str, Any]]) -> Tuple[np.ndarray, np.ndarray]:
    """Per sample: the loss-mask sum (float64) and the number of positions with a non-zero mask (int64)."""
    sums = np.zeros(len(samples), dtype=np.float64)
    counts = np.zeros(len(samples), dtype=np.int64)
    for i, s in enumerate(samples):
        m = sample_loss_mask(s)
        sums[i] = float(m.sum())
        counts[i] = int(np.count_nonzero(m))
    return sums, counts


# ------------------------------------------------------------------------------------- normaliser
@dataclass(frozen=True)
class LossNormalizer:
    """Per-sample coefficients ``c_i`` of one optimizer step (see the module docstring).

    ``coefficients`` is indexed by the sample's index in the GLOBAL batch (samples outside ``subset`` have 0);
    ``total_loss_tokens`` is ``K``, the step's number of positions with a non-zero loss mask (what Megatron
    sums under ``calculate_per_token_loss``). Build it with :meth:`from_samples` or :meth:`from_stats`; every
    rank builds the same one from the same global batch, with no communication.
    """

    mode: str
    coefficients: np.ndarray
    total_loss_tokens: int
    loss_mask_sums: np.ndarray
    subset: Tuple[int, ...]
    num_units: int  # T-normalised units: 1 (token_mean), N (sample_mean), G (group_mean), 0 (token_sum)
    group_reduce: str = "token"

    @classmethod
    def from_samples(
        cls,
        samples: Sequence[Mapping[str, Any]],
        mode: str = "token_mean",
        *,
        group_ids: Optional[Sequence[Hashable]] = None,
        group_reduce: str = "token",
        subset: Optional[Sequence[int]] = None,
    ) -> "LossNormalizer":
        """From the global batch's sample dicts (only ``tokens``, ``labels`` presence and ``loss_mask`` are read)."""
        sums, counts = loss_mask_stats(samples)
        return cls.from_stats(sums, counts, mode, group_ids=group_ids, group_reduce=group_reduce, subset=subset)

    @classmethod
    def from_stats(
        cls,
        loss_mask_sums: Sequence[float],
        loss_token_counts: Optional[Sequence[int]] = None,
        mode: str = "token_mean",
        *,
        group_ids: Optional[Sequence[Hashable]] = None,
        group_reduce: str = "token",
        subset: Optional[Sequence[int]] = None,
    ) -> "LossNormalizer":
        """From per-sample loss-mask sums ``T_i`` (and non-zero position counts; default = the sums, for 0/1
        masks). ``subset``: the sample indices of this optimizer step (default: all)."""
        if mode not in LOSS_MODES:
            raise DynBatchConfigError("loss_mode", mode, "unknown loss normalisation", f"use one of {LOSS_MODES}")
        if group_reduce not in GROUP_REDUCE:
            raise DynBatchConfigError("group_reduce", group_reduce, "unknown group reduction",
                                      f"use one of {GROUP_REDUCE}")
        sums = np.asarray(loss_mask_sums, dtype=np.float64).reshape(-1)
        n = sums.size
        if (sums < 0).any() or not np.isfinite(sums).all():
            bad = int(np.flatnonzero((sums < 0) | ~np.isfinite(sums))[0])
            raise DynBatchConfigError(f"loss_mask_sums[{bad}]", float(sums[bad]),
                                      "loss masks must be finite and non-negative", "pass 0/1 (or >= 0) masks")
        if loss_token_counts is None:
            counts = np.rint(sums).astype(np.int64)
        else:
            counts = np.asarray(loss_token_counts, dtype=np.int64).reshape(-1)
            if counts.size != n:
                raise DynBatchConfigError("loss_token_counts", f"{counts.size} entries",
                                          f"needs one count per sample ({n})", "pass one count per sample")
        idx = np.arange(n) if subset is None else np.asarray(sorted(int(i) for i in subset), dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise DynBatchConfigError("subset", idx.tolist(), f"indices must be in [0, {n})", "pass sample indices")
        coef = np.zeros(n, dtype=np.float64)
        t = sums[idx]
        if mode == "token_sum":
            coef[idx] = 1.0
            units = 0
        elif mode == "token_mean":
            total = float(t.sum())
            units = 1
            if total > 0:
                coef[idx] = 1.0 / total
        elif mode == "sample_mean":
            has = t > 0
            units = int(has.sum())
            if units:
                coef[idx[has]] = 1.0 / (units * t[has])
        else:  # group_mean
            if group_ids is None:
                raise DynBatchConfigError("group_ids", None, "loss mode 'group_mean' needs a group id per sample",
                                          "pass group_ids (or a 'group_id' field in every sample), or use "
                                          "token_mean / sample_mean")
            gids = list(group_ids)
            if len(gids) != n:
                raise DynBatchConfigError("group_ids", f"{len(gids)} ids", f"needs one id per sample ({n})",
                                          "pass one group id per sample of the global batch")
            members: Dict[Hashable, List[int]] = {}
            for i in idx.tolist():
                members.setdefault(gids[i], []).append(i)
            live = {g: m for g, m in members.items() if sums[m].sum() > 0}
            units = len(live)
            for g, m in live.items():
                m_arr = np.asarray(m, dtype=np.int64)
                if group_reduce == "token":
                    coef[m_arr] = 1.0 / (units * float(sums[m_arr].sum()))
                else:
                    has = m_arr[sums[m_arr] > 0]
                    coef[has] = 1.0 / (units * has.size * sums[has])
        return cls(mode=mode, coefficients=coef, total_loss_tokens=int(counts[idx].sum()),
                   loss_mask_sums=sums, subset=tuple(int(i) for i in idx), num_units=units,
                   group_reduce=group_reduce)

    # ------------------------------------------------------------------------------------- weights
    def token_weights(self, packed: Any, factor: float = 1.0):
        """Per-token weights ``loss_mask * c_i * factor`` for a (possibly CP-sliced) packed micro-batch, as a
        float64 tensor shaped like ``packed.loss_mask`` (``[1, T]`` or ``[1, T/cp]``)."""
        import torch

        seg = token_sample_ids(packed)
        idx = torch.as_tensor(packed.sample_indices, dtype=torch.long)
        coef = torch.from_numpy(self.coefficients)[idx] * float(factor)
        return packed.loss_mask.detach().to("cpu", torch.float64) * coef[seg].unsqueeze(0)


def token_sample_ids(packed: Any):
    """For each token a (possibly CP-sliced) packed micro-batch holds, the position of its sample within the
    micro-batch (int64 ``[T_local]``); padding belongs to the slot it pads."""
    import torch

    seg = torch.repeat_interleave(torch.arange(len(packed.seqlens_padded)),
                                  torch.as_tensor(packed.seqlens_padded, dtype=torch.long))
    cp = int(getattr(packed, "cp_size", 1))
    if cp > 1:
        from .context_parallel import zigzag_partition_indices

        seg = seg[zigzag_partition_indices(packed.cu_seqlens_padded.cpu(), cp, int(packed.cp_rank))]
    return seg


def reference_loss(
    normalizer: LossNormalizer,
    per_token_losses: Union[Mapping[int, Any], Sequence[Any]],
    loss_masks: Union[Mapping[int, Any], Sequence[Any]],
) -> float:
    """``L = sum_i c_i * sum_j mask_ij * loss_ij`` over the normaliser's samples, in float64 (a reference,
    e.g. for tests comparing against an unpacked per-sample computation)."""
    total = 0.0
    for i in normalizer.subset:
        loss = _to_numpy_1d(per_token_losses[i])
        mask = _to_numpy_1d(loss_masks[i])
        total += float(normalizer.coefficients[i]) * float((loss * mask).sum())
    return total


# ------------------------------------------------------------------------------------- megatron
def megatron_loss_factor(
    *,
    num_microbatches: int,
    calculate_per_token_loss: bool,
    dp_size: int,
    cp_size: int = 1,
    total_loss_tokens: int = 0,
    tuple_size: int = 3,
) -> float:
    """The factor ``f`` (before the per-micro-batch ``max(n, 1)`` of the 3-tuple form) that makes the sum of
    ``S * f`` over the loss functions' returns turn into exactly ``grad L`` after Megatron's scaling. See the
    table in the module docstring; ``total_loss_tokens`` is only used with ``calculate_per_token_loss``."""
    for name, v in (("num_microbatches", num_microbatches), ("dp_size", dp_size), ("cp_size", cp_size)):
        if not is_int(v) or v < 1:
            raise DynBatchConfigError(name, v, "must be a positive integer", f"pass the {name.replace('_', ' ')}")
    if tuple_size == 3:
        return float(total_loss_tokens) if calculate_per_token_loss else float(num_microbatches * dp_size * cp_size)
    if tuple_size == 2:
        return float(num_microbatches) / cp_size if calculate_per_token_loss else float(num_microbatches * dp_size)
    raise DynBatchConfigError("tuple_size", tuple_size, "Megatron loss functions return 2 or 3 values",
                              "use tuple_size=3 (loss, num_tokens, logs) or 2 (loss, logs)")


@dataclass
class MicroBatchResult:
    """What our loss function leaves in Megatron's per-micro-batch logs under :data:`RESULT_KEY`.

    ``loss_sum``: this micro-batch's contribution ``S`` to the step's loss ``L`` (0-d tensor, detached);
    ``sample_indices`` and ``outputs``: the global indices of its samples and, if ``collect`` was given, the
    collected per-token tensor (detached, CP-local ``[1, T_local, ...]``)."""

    loss_sum: Any
    sample_indices: List[int]
    outputs: Any = None
    packed: Any = None


PerTokenFn = Callable[[Any, Any], Any]


def _default_dp_cp() -> Tuple[int, int]:
    """(dp, cp) from Megatron's ``parallel_state`` when it is initialised, else (1, 1)."""
    import sys

    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        return ps.get_data_parallel_world_size(), ps.get_context_parallel_world_size()
    return 1, 1


def make_loss_func(
    normalizer: Optional[LossNormalizer],
    packed: Any,
    *,
    num_microbatches: int,
    calculate_per_token_loss: bool = False,
    dp_size: Optional[int] = None,
    cp_size: Optional[int] = None,
    per_token_loss: Optional[PerTokenFn] = None,
    collect: Optional[PerTokenFn] = None,
    tuple_size: int = 3,
    keep_packed: bool = False,
) -> Callable[[Any], tuple]:
    """A Megatron loss function (``loss_func(output_tensor) -> tuple``) for one packed micro-batch.

    Args:
        normalizer: the step's :class:`LossNormalizer` (its ``mode`` is the loss mode). ``None`` for a
            forward-only pass: the loss is 0 and only ``collect`` matters.
        packed: the micro-batch (:class:`~megatron_dynbatch.megatron.packing.PackedMicroBatch`, possibly CP-sliced).
        num_microbatches: ``M`` passed to ``forward_backward_func`` for this step.
        calculate_per_token_loss: ``config.calculate_per_token_loss`` (must match, it changes the factor).
        dp_size, cp_size: data- and context-parallel sizes (default: from ``parallel_state``) -- Megatron's,
            which set its scaling; a dynamic-CP micro-batch (``packed.dynamic_cp``) may run on a group of another
            size: each token still sits on exactly one GPU of the DP x CP pool, so the factors are unchanged.
        per_token_loss: ``fn(output_tensor, packed) -> [1, T_local]`` per-token loss. Default: the output is
            already the per-token loss (``GPTModel(..., labels=...)`` returns cross-entropy per token). For RL,
            e.g. a PPO clipped objective computed from ``-output`` (log-probs) and ``packed.extras``.
        collect: ``fn(output_tensor, packed) -> [1, T_local, ...]``, a per-token result to bring back per
            sample (e.g. ``lambda out, mb: -out`` for log-probs); stored detached in the logs.
        tuple_size: 3 (``(loss, num_tokens, logs)``, default) or 2 (``(loss, logs)``).
        keep_packed: also store the micro-batch in the logs (to unpack collected outputs yourself).

    The returned value's gradient is exactly this micro-batch's share of ``grad L`` once Megatron has applied
    its own scaling (see the module docstring); ``logs[RESULT_KEY]`` is a :class:`MicroBatchResult`.
    """
    import torch

    if dp_size is None or cp_size is None:
        d_dp, d_cp = _default_dp_cp()
        dp_size = d_dp if dp_size is None else dp_size
        cp_size = d_cp if cp_size is None else cp_size
    packed_cp = int(getattr(packed, "cp_size", 1))
    if packed_cp != cp_size and not getattr(packed, "dynamic_cp", False):
        raise DynBatchConfigError("packed.cp_size", packed_cp, f"does not match the context-parallel size {cp_size}",
                                  "slice micro-batches with the run's CP size (DynamicBatchIterator does this)")
    total = normalizer.total_loss_tokens if normalizer is not None else 0
    factor = megatron_loss_factor(num_microbatches=num_microbatches, calculate_per_token_loss=calculate_per_token_loss,
                                  dp_size=dp_size, cp_size=cp_size, total_loss_tokens=total, tuple_size=tuple_size)
    n_local = int(torch.count_nonzero(packed.loss_mask).item())
    if tuple_size == 3 and not calculate_per_token_loss:
        factor *= max(n_local, 1)  # Megatron divides by the returned count
    weights64 = normalizer.token_weights(packed) if normalizer is not None else None
    sample_indices = list(packed.sample_indices)

    def loss_func(output_tensor: Any, non_loss_data: bool = False) -> tuple:
        if non_loss_data:  # collect_non_loss_data=True path: hand back the collected outputs only
            return MicroBatchResult(None, sample_indices,
                                    collect(output_tensor, packed).detach() if collect is not None else None,
                                    packed if keep_packed else None)
        if normalizer is not None:
            per_tok = per_token_loss(output_tensor, packed) if per_token_loss is not None else output_tensor
            if per_tok.shape != packed.loss_mask.shape:
                per_tok = per_tok.reshape(packed.loss_mask.shape)
            w = weights64.to(device=per_tok.device, dtype=torch.float64)
            s64 = (per_tok.double() * w).sum()
            value = (s64 * factor).to(per_tok.dtype)
            loss_sum = s64.detach()
        else:
            value = output_tensor.sum() * 0.0
            loss_sum = torch.zeros((), dtype=torch.float64)
        outputs = collect(output_tensor, packed).detach() if collect is not None else None
        logs: Dict[str, Any] = {RESULT_KEY: MicroBatchResult(loss_sum, sample_indices, outputs,
                                                             packed if keep_packed else None)}
        if tuple_size == 2:
            return value, logs
        return value, torch.tensor(n_local, dtype=torch.int, device=value.device), logs

    return loss_func
