"""The global batch an iterator is built from: the sample dicts checked, and a rank-local shard's view and metadata.

:class:`~megatron_dynbatch.megatron.iterator.DynamicBatchIterator` takes either the whole global batch (identical
on every rank) or, built ``from_shard``, only this DP rank's samples plus per-sample metadata of the whole batch.
This module checks both at that boundary and turns them into one :class:`BatchInput` -- samples indexable by
GLOBAL sample index, the whole batch's lengths, loss-mask statistics and group ids -- so the layers below
(:mod:`.rank_plan`, :mod:`.microbatch_packer`, :mod:`.step_loss`, :mod:`.gather`) never ask which door was used.

Invariant: ``lengths``, ``mask_sums``, ``mask_counts`` and ``group_ids`` describe the WHOLE global batch;
``samples[i]`` gives global sample ``i`` for every sample this rank holds (all of them, or a shard's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Iterator, List, Mapping, Optional, Sequence

import numpy as np

from ..core.checks import hashable_group_id
from ..core.errors import DynBatchConfigError
from ..core.planner.inputs import check_group_ids
from .loss import LOSS_MODES, loss_mask_stats

__all__ = ["BatchInput", "ShardSamples", "check_loss_mode", "check_sample_dicts"]


@dataclass(frozen=True)
class BatchInput:
    """The checked global batch (module docstring)."""

    #: the sample dicts, indexed by global sample index (a :class:`ShardSamples` view for a rank-local iterator)
    samples: Sequence[Mapping[str, Any]]
    #: token count of every sample of the global batch
    lengths: np.ndarray
    #: ``T_i`` and the non-zero loss-mask positions of every sample (:func:`~.loss.loss_mask_stats`)
    mask_sums: np.ndarray
    mask_counts: np.ndarray
    #: one id per sample of the global batch, or ``None``
    group_ids: Optional[List[Hashable]]

    @classmethod
    def whole(cls, samples: Sequence[Mapping[str, Any]], group_ids: Optional[Sequence[Hashable]],
              group_key: str) -> "BatchInput":
        """The whole global batch (checked with :func:`check_sample_dicts`); ``group_ids`` default to each sample's
        ``group_key`` entry when all have one."""
        lengths = np.asarray([len(s["tokens"]) for s in samples], dtype=np.int64)
        if group_ids is None and all(group_key in s for s in samples):
            group_ids = [hashable_group_id(s[group_key]) for s in samples]
        gids = check_group_ids(group_ids, len(samples)) if group_ids is not None else None
        sums, counts = loss_mask_stats(samples)
        return cls(samples, lengths, sums, counts, gids)

    @classmethod
    def shard(cls, samples: Sequence[Mapping[str, Any]], *, sample_indices: Sequence[int], lengths: Sequence[int],
              loss_mask_sums: Sequence[float], loss_token_counts: Optional[Sequence[int]],
              group_ids: Optional[Sequence[Hashable]], check_stats: bool) -> "BatchInput":
        """This rank's samples plus the whole batch's metadata (``DynamicBatchIterator.from_shard``'s arguments),
        each checked against the others (the samples themselves with :func:`check_sample_dicts`)."""
        lens = np.asarray(lengths)
        if lens.ndim != 1 or lens.size == 0 or not np.issubdtype(lens.dtype, np.integer) or (lens < 0).any():
            raise DynBatchConfigError("lengths", f"array of shape {lens.shape}, dtype {lens.dtype}",
                                      "must be the non-negative integer token counts of the whole global batch",
                                      "pass the lengths the plan was made from")
        lens = lens.astype(np.int64)
        n = int(lens.size)
        idx = [int(i) for i in sample_indices]
        if len(idx) != len(samples):
            raise DynBatchConfigError("sample_indices", f"{len(idx)} indices",
                                      f"needs one global index per local sample ({len(samples)})",
                                      "pass the global index of each sample this rank holds, in the same order")
        if len(set(idx)) != len(idx) or any(not 0 <= i < n for i in idx):
            raise DynBatchConfigError("sample_indices", idx[:16], f"must be distinct indices in [0, {n})",
                                      "pass the global index of each sample this rank holds")
        local_lens = np.asarray([len(s["tokens"]) for s in samples], dtype=np.int64)
        bad = np.flatnonzero(local_lens != lens[idx])
        if bad.size:
            k = int(bad[0])
            raise DynBatchConfigError(f"samples[{k}] (global sample {idx[k]})", f"{int(local_lens[k])} tokens",
                                      f"the batch metadata says {int(lens[idx[k]])} tokens",
                                      "ship each rank the samples the plan was made from (same order, same data)")
        sums = np.asarray(loss_mask_sums, dtype=np.float64).reshape(-1)
        counts = (np.rint(sums).astype(np.int64) if loss_token_counts is None
                  else np.asarray(loss_token_counts, dtype=np.int64).reshape(-1))
        for name, arr in (("loss_mask_sums", sums), ("loss_token_counts", counts)):
            if arr.size != n:
                raise DynBatchConfigError(name, f"{arr.size} entries", f"needs one entry per sample of the global "
                                          f"batch ({n})", "pass the statistics of the WHOLE batch, not of this rank")
        if check_stats:
            _check_shard_stats(samples, idx, sums, counts)
        gids = list(group_ids) if group_ids is not None else None
        if gids is not None and len(gids) != n:
            raise DynBatchConfigError("group_ids", f"{len(gids)} ids", f"needs one id per sample of the global batch "
                                      f"({n})", "pass the group ids of the WHOLE batch")
        return cls(ShardSamples(samples, idx, n), lens, sums, counts, gids)

    @property
    def held(self) -> List[int]:
        """Global indices of the samples held here, ascending (all of them unless a shard)."""
        if isinstance(self.samples, ShardSamples):
            return sorted(self.samples.indices)
        return list(range(len(self.samples)))


def _check_shard_stats(samples: Sequence[Mapping[str, Any]], idx: Sequence[int], sums: np.ndarray,
                       counts: np.ndarray) -> None:
    """Refuse metadata that disagrees with the shipped samples' own loss masks (a shard paired with another batch)."""
    got_sums, got_counts = loss_mask_stats(samples)
    for k, i in enumerate(idx):
        if abs(got_sums[k] - sums[i]) > 1e-6 * max(1.0, sums[i]) or got_counts[k] != counts[i]:
            raise DynBatchConfigError(
                f"loss_mask_sums[{i}]", float(sums[i]),
                f"global sample {i}'s loss mask sums to {got_sums[k]} ({int(got_counts[k])} non-zero "
                f"positions) here",
                "compute the statistics with megatron_dynbatch.megatron.loss.loss_mask_stats on the "
                "samples that are shipped")


class ShardSamples(Sequence):
    """This rank's samples, indexed by GLOBAL sample index; ``len`` is the global batch size. Indexing a sample
    this rank does not hold raises (it was never shipped here)."""

    def __init__(self, samples: Sequence[Mapping[str, Any]], indices: Sequence[int], num_samples: int) -> None:
        self._by_index = {int(i): s for i, s in zip(indices, samples, strict=True)}
        self.indices = [int(i) for i in indices]
        self._n = int(num_samples)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Mapping[str, Any]:
        if isinstance(i, slice):
            raise TypeError("a rank-local sample view cannot be sliced; index it by global sample index")
        try:
            return self._by_index[int(i)]
        except KeyError:
            raise DynBatchConfigError(f"samples[{int(i)}]", "not held by this rank",
                                      "a rank-local iterator holds only the samples its plan gives this DP rank",
                                      f"use one of this rank's samples ({len(self._by_index)} held)") from None

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        raise TypeError("a rank-local sample view holds only this rank's samples; iterate over .indices and index "
                        "by global sample index")

    def __contains__(self, sample: Any) -> bool:
        return any(sample is s for s in self._by_index.values())


def check_sample_dicts(samples: Any, what: str) -> None:
    """Refuse anything but a non-empty list of sample dicts with a ``tokens`` entry and the same keys."""
    if isinstance(samples, (str, bytes, Mapping)) or not isinstance(samples, Sequence):
        raise DynBatchConfigError("samples", type(samples).__name__, "must be a list of sample dicts",
                                  "pass the global batch as a list of {'tokens': ..., ...} dicts")
    if len(samples) == 0:
        raise DynBatchConfigError("samples", [], f"{what} is empty", "pass at least dp samples")
    for i, s in enumerate(samples):
        if not isinstance(s, Mapping) or "tokens" not in s:
            raise DynBatchConfigError(f"samples[{i}]", type(s).__name__, "must be a dict with a 'tokens' entry",
                                      "pass dicts like {'tokens': LongTensor[L], 'loss_mask': ...}")
    keys0 = set(samples[0].keys())
    for i, s in enumerate(samples):
        diff = sorted(set(s.keys()) ^ keys0, key=str)
        if diff:
            raise DynBatchConfigError(
                f"samples[{i}] keys", diff, "every sample of the global batch must carry the same fields "
                "(any two samples may share a micro-batch)",
                "give every sample the same keys (e.g. a loss_mask of ones, labels for all or none)")


def check_loss_mode(loss_mode: str) -> None:
    if loss_mode not in LOSS_MODES:
        raise DynBatchConfigError("loss_mode", loss_mode, "unknown loss normalisation", f"use one of {LOSS_MODES}")
