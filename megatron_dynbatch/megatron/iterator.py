"""``DynamicBatchIterator``: a global batch + a plan -> this rank's packed THD micro-batches, and back.

Every rank builds the iterator from the SAME global batch (list of sample dicts). It plans the batch itself
(:func:`megatron_dynbatch.plan_global_batch`, deterministic, so all ranks agree with no communication) unless a
:class:`~megatron_dynbatch.Plan` is given, validates the plan, and then

* yields this DP rank's micro-batches in the plan's execution order, packed by
  :func:`megatron_dynbatch.megatron.packing.pack_microbatch` with the plan's alignment and, with context parallelism,
  sliced to this CP rank's zig-zag share (:func:`megatron_dynbatch.megatron.context_parallel.slice_packed_for_cp`);
* exposes one optimizer step at a time when the plan splits the batch into several (``samples_per_step``):
  ``microbatches(step)``, ``data_iterator(step, num_model_chunks)`` (a list of independent iterators over the
  same micro-batches for VPP, one per model chunk, as Megatron's interleaved schedule expects);
* builds the loss function of each micro-batch with the step's global normalisation
  (:mod:`megatron_dynbatch.megatron.loss`), so the gradient does not depend on the packing;
* maps per-micro-batch results back to the ORIGINAL sample order (``restore_order``) and gathers them across DP
  ranks (``gather_across_dp``, one ``all_gather_object``).

:meth:`DynamicBatchIterator.from_shard` builds the same iterator from only this DP rank's samples plus the global
batch's per-sample metadata (lengths, loss-mask statistics, group ids), for drivers that plan centrally and ship
each rank only its share (:mod:`megatron_dynbatch.integrations.ray`).

Sample dicts: ``tokens`` (1-D), optional ``labels`` and ``loss_mask`` (label positions, Megatron's convention),
per-token extras (advantages, old_log_probs, ref_log_probs, ...: length-``L`` tensors), per-sample scalars
(rewards, ...), and an optional group id under ``group_key`` (default ``"group_id"``; a GRPO prompt group stays
on one DP rank and defines the groups of ``loss_mode="group_mean"``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Iterator, List, Mapping, Optional, Sequence, Union

import numpy as np

from ..core.alignment import Alignment
from ..core.checks import hashable_group_id, is_int
from ..core.errors import DynBatchConfigError
from .loss import LOSS_MODES, LossNormalizer, loss_mask_stats, make_loss_func
from ..core.parallel import ParallelConfig
from ..core.planner import Plan, plan_global_batch
from ..core.planner.api import options_of
from ..core.planner.dyncp.plan import DynamicCPPlan
from ..core.planner.inputs import check_group_ids
from ..core.planner.options import PlanOptions

__all__ = ["DynamicBatchIterator"]


def _parallel_state():
    """Megatron's ``parallel_state`` if it is initialised (never imports megatron-core: if it was not imported
    yet, it cannot have been initialised, and importing it costs seconds)."""
    import sys

    ps = sys.modules.get("megatron.core.parallel_state")
    return ps if ps is not None and ps.model_parallel_is_initialized() else None


class DynamicBatchIterator:
    """This DP rank's packed micro-batches for one global batch (see the module docstring).

    Args:
        samples: the global batch, identical on every rank (list of dicts).
        plan: a :class:`Plan` for ``len(samples)`` samples; ``None`` to plan here from ``plan_kwargs``.
        dp_rank: this rank's data-parallel rank (default: ``parallel_state`` if initialised -- then the plan's
            ``dp`` must equal Megatron's data-parallel size -- else 0).
        cp_rank, cp_size: context-parallel slice to produce (default: ``parallel_state``; ``cp_size`` must equal
            the plan's ``cp``).
        loss_mode, group_reduce: loss normalisation (:mod:`megatron_dynbatch.megatron.loss`).
        group_ids: one id per sample (default: each sample's ``group_key`` entry when every sample has one).
            They keep a group on one DP rank when planning and define ``group_mean``'s groups; with
            ``dynamic_cp=True`` only the latter (a dynamic-CP plan has no DP ranks to keep a group on).
        pad_token_id: token id used on padding positions.
        device: where packed tensors go (default: where the sample tokens are).
        cp_groups: under a dynamic-CP plan (:class:`~megatron_dynbatch.core.planner.dyncp.plan.DynamicCPPlan`), the
            :class:`~megatron_dynbatch.megatron.dynamic_cp.DynamicCPGroups` whose process groups the micro-batches
            carry (default: created on first use when ``parallel_state`` is initialised). With such a plan the
            rank runs row ``dp_rank * cp + cp_rank`` of the plan (``self.row``), every micro-batch is packed with
            its group's alignment and sliced to this GPU's share of the group, and ``gather_across_dp`` gathers
            over the DP x CP group.
        uniform_length: pad every micro-batch of this rank to its longest one (within the plan's budget).
            Default: on for ``pp == 2`` with ``vpp > 1``, where megatron-core 0.16's pipeline shape exchange
            (``variable_seq_lengths``) mixes up the two directions between the only two stages (the same peer is
            both previous and next stage; NVIDIA/Megatron-LM #5100, PR #5271); with uniform lengths no shape
            exchange is needed. Costs the padding in compute, never in memory.
        options: the planner's :class:`~megatron_dynbatch.core.planner.options.PlanOptions` when ``plan`` is None;
            keywords given too replace its fields.
        **plan_kwargs: the options as keywords (any :class:`PlanOptions` field, and ``balance_by_flops``;
            ``microbatch_group_ids`` / ``rollout_ids`` per sample) when ``plan`` is None.
    """

    def __init__(
        self,
        samples: Sequence[Mapping[str, Any]],
        plan: Optional[Plan] = None,
        *,
        dp_rank: Optional[int] = None,
        cp_rank: Optional[int] = None,
        cp_size: Optional[int] = None,
        loss_mode: str = "token_mean",
        group_reduce: str = "token",
        group_ids: Optional[Sequence[Hashable]] = None,
        group_key: str = "group_id",
        pad_token_id: int = 0,
        device: Any = None,
        uniform_length: Optional[bool] = None,
        cp_groups: Any = None,
        options: Optional[PlanOptions] = None,
        **plan_kwargs: Any,
    ) -> None:
        _check_sample_dicts(samples, "the global batch")
        _check_loss_mode(loss_mode)
        lengths = np.asarray([len(s["tokens"]) for s in samples], dtype=np.int64)
        if group_ids is None and all(group_key in s for s in samples):
            group_ids = [hashable_group_id(s[group_key]) for s in samples]
        gids = check_group_ids(group_ids, len(samples)) if group_ids is not None else None

        if plan is None:
            if options is None and "max_tokens_per_gpu" not in plan_kwargs:
                raise DynBatchConfigError("max_tokens_per_gpu", None, "needed to plan the batch (no plan given)",
                                          "pass plan=Plan, options=PlanOptions(...) or max_tokens_per_gpu=<per-GPU "
                                          "token budget>")
            batch = {k: plan_kwargs.pop(k) for k in ("microbatch_group_ids", "rollout_ids") if k in plan_kwargs}
            opts = options_of(options, plan_kwargs)
            # Under dynamic CP a sample may run on GPUs of several DP ranks, so "a group stays on one DP rank"
            # has no meaning (the planner refuses it); the ids still define group_mean's groups (the loss).
            plan = plan_global_batch(lengths, opts, group_ids=None if opts.dynamic_cp else gids, **batch)
        elif plan_kwargs or options is not None:
            given = sorted(plan_kwargs) + (["options"] if options is not None else [])
            raise DynBatchConfigError("plan_kwargs", given, "given together with a plan",
                                      "pass either plan= or planning options, not both")
        self._setup(samples, lengths, plan, gids, None, dp_rank=dp_rank, cp_rank=cp_rank, cp_size=cp_size,
                    loss_mode=loss_mode, group_reduce=group_reduce, pad_token_id=pad_token_id, device=device,
                    uniform_length=uniform_length, cp_groups=cp_groups)

    @classmethod
    def from_shard(
        cls,
        samples: Sequence[Mapping[str, Any]],
        plan: Plan,
        *,
        sample_indices: Sequence[int],
        lengths: Sequence[int],
        loss_mask_sums: Sequence[float],
        loss_token_counts: Optional[Sequence[int]] = None,
        group_ids: Optional[Sequence[Hashable]] = None,
        dp_rank: Optional[int] = None,
        cp_rank: Optional[int] = None,
        cp_size: Optional[int] = None,
        loss_mode: str = "token_mean",
        group_reduce: str = "token",
        pad_token_id: int = 0,
        device: Any = None,
        uniform_length: Optional[bool] = None,
        check_stats: bool = True,
        cp_groups: Any = None,
    ) -> "DynamicBatchIterator":
        """A RANK-LOCAL iterator: built from only the samples this DP rank runs, plus the global batch's
        per-sample metadata, with exactly the behaviour of one built from the whole batch.

        Used when a driver plans centrally and ships each DP rank only its own samples (see
        :mod:`megatron_dynbatch.integrations.ray`). The loss stays exact because the normaliser only needs
        per-sample numbers of the whole batch, not its tokens.

        Args:
            samples: this rank's sample dicts; ``samples[k]`` is global sample ``sample_indices[k]``. Must hold at
                least every sample that ``plan`` gives to ``dp_rank`` (more are allowed and ignored).
            plan: the plan of the WHOLE global batch (all DP ranks).
            sample_indices: global index of each entry of ``samples`` (distinct).
            lengths: token count of every sample of the global batch (what the plan was made from).
            loss_mask_sums: ``T_i`` of every sample of the global batch
                (:func:`megatron_dynbatch.megatron.loss.loss_mask_stats`, first array).
            loss_token_counts: non-zero loss-mask positions of every sample (second array; default: the sums, for
                0/1 masks).
            group_ids: one id per sample of the global batch (``group_mean``; optional otherwise).
            check_stats: recompute this rank's samples' lengths and loss-mask statistics and refuse metadata that
                disagrees with them (cheap; catches a shard paired with the wrong batch).
            Other arguments: as for the constructor.

        ``it.samples`` is then a view indexed by GLOBAL sample index that holds only this rank's samples
        (``it.local_indices``); every other method behaves as for the full batch (``step_samples`` and the
        normalisers still cover all ranks, ``gather_across_dp`` still gives the global order).
        """
        _check_sample_dicts(samples, "this rank's samples")
        _check_loss_mode(loss_mode)
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
            got_sums, got_counts = loss_mask_stats(samples)
            for k, i in enumerate(idx):
                if abs(got_sums[k] - sums[i]) > 1e-6 * max(1.0, sums[i]) or got_counts[k] != counts[i]:
                    raise DynBatchConfigError(
                        f"loss_mask_sums[{i}]", float(sums[i]),
                        f"global sample {i}'s loss mask sums to {got_sums[k]} ({int(got_counts[k])} non-zero "
                        f"positions) here",
                        "compute the statistics with megatron_dynbatch.megatron.loss.loss_mask_stats on the "
                        "samples that are shipped")
        gids = list(group_ids) if group_ids is not None else None
        if gids is not None and len(gids) != n:
            raise DynBatchConfigError("group_ids", f"{len(gids)} ids", f"needs one id per sample of the global batch "
                                      f"({n})", "pass the group ids of the WHOLE batch")
        self = cls.__new__(cls)
        view = _ShardSamples(samples, idx, n)
        self._setup(view, lens, plan, gids, (sums, counts), dp_rank=dp_rank, cp_rank=cp_rank, cp_size=cp_size,
                    loss_mode=loss_mode, group_reduce=group_reduce, pad_token_id=pad_token_id, device=device,
                    uniform_length=uniform_length, cp_groups=cp_groups)
        held = set(idx)
        missing = [i for i in self.plan.rank_samples(self.row) if i not in held]
        if missing:
            raise DynBatchConfigError(
                "samples", f"{len(missing)} of DP rank {self.dp_rank}'s samples missing (e.g. {missing[:8]})",
                "the plan gives this DP rank samples that were not shipped to it",
                "send every actor the shard of ITS data-parallel rank (shard.dp_rank == "
                "parallel_state.get_data_parallel_rank())")
        return self

    @property
    def is_shard(self) -> bool:
        """True for a rank-local iterator (:meth:`from_shard`)."""
        return isinstance(self.samples, _ShardSamples)

    @property
    def local_indices(self) -> List[int]:
        """Global indices of the samples this iterator holds (all of them unless built :meth:`from_shard`)."""
        if isinstance(self.samples, _ShardSamples):
            return sorted(self.samples.indices)
        return list(range(len(self.samples)))

    def _setup(
        self,
        samples: Sequence[Mapping[str, Any]],
        lengths: np.ndarray,
        plan: Any,
        group_ids: Optional[List[Hashable]],
        mask_stats: Optional[tuple],
        *,
        dp_rank: Optional[int],
        cp_rank: Optional[int],
        cp_size: Optional[int],
        loss_mode: str,
        group_reduce: str,
        pad_token_id: int,
        device: Any,
        uniform_length: Optional[bool],
        cp_groups: Any = None,
    ) -> None:
        """Shared by ``__init__`` (the whole global batch) and :meth:`from_shard` (this rank's samples only):
        ``samples[i]`` must give global sample ``i`` for every sample this rank runs; ``lengths``, ``group_ids``
        and ``mask_stats`` (``None`` = computed from ``samples``) describe the WHOLE global batch."""
        self.samples = samples
        self.lengths = lengths
        self.loss_mode = loss_mode
        self.group_reduce = group_reduce
        self.pad_token_id = int(pad_token_id)
        self.device = device
        self.group_ids = group_ids
        if not isinstance(plan, Plan):
            raise DynBatchConfigError("plan", type(plan).__name__, "must be a megatron_dynbatch.Plan",
                                      "build it with plan_global_batch(...) or Plan.from_dict(...)")
        try:
            plan.validate(num_samples=len(samples))
        except AssertionError as exc:
            raise DynBatchConfigError("plan", f"{plan.num_samples} samples / {len(samples)} given",
                                      f"does not fit this global batch: {exc}",
                                      "plan the same global batch on every rank (same lengths, same order)") from None
        self.plan = plan
        par: ParallelConfig = plan.parallel
        ps = _parallel_state()
        if ps is not None and dp_rank is None:
            world_dp = ps.get_data_parallel_world_size()
            if world_dp != par.dp:
                local = (" -- a local-mode plan (plan_local_batch) holds only this rank's samples, and a loss "
                         "normalised over them alone would not give plain batching's gradient" if par.dp == 1 else "")
                raise DynBatchConfigError("plan.parallel.dp", par.dp,
                                          f"the plan is for dp={par.dp} but Megatron's data-parallel size is "
                                          f"{world_dp}{local}",
                                          "plan the global batch with parallel=parallel_from_args(args) / the running "
                                          "layout (local mode is for trainers that pack themselves, e.g. the verl "
                                          "drop-in)")
        if dp_rank is None:
            dp_rank = ps.get_data_parallel_rank() if ps is not None else 0
        if cp_size is None:
            cp_size = par.cp
        if cp_rank is None:
            cp_rank = ps.get_context_parallel_rank() if (ps is not None and cp_size > 1) else 0
        if not isinstance(dp_rank, (int, np.integer)) or not 0 <= dp_rank < par.dp:
            raise DynBatchConfigError("dp_rank", dp_rank, f"must be in [0, {par.dp})", "pass this rank's DP rank")
        if cp_size != par.cp:
            raise DynBatchConfigError("cp_size", cp_size, f"the plan was made for cp={par.cp}",
                                      "plan with the running context-parallel size")
        if not isinstance(cp_rank, (int, np.integer)) or not 0 <= cp_rank < cp_size:
            raise DynBatchConfigError("cp_rank", cp_rank, f"must be in [0, {cp_size})", "pass this rank's CP rank")
        self.dp_rank, self.cp_rank, self.cp_size = int(dp_rank), int(cp_rank), int(cp_size)
        # the row of the plan this rank runs: its DP rank, or under dynamic CP its pool GPU dp_rank * cp + cp_rank
        self.dynamic_cp = isinstance(plan, DynamicCPPlan)
        self.row = self.dp_rank * self.cp_size + self.cp_rank if self.dynamic_cp else self.dp_rank

        # The plan's token counts must be what packing this batch produces (catches a plan of other lengths).
        for j, mb in enumerate(plan.micro_batches[self.row]):
            size = plan.groups[self.row][j][1] if self.dynamic_cp else 1
            align = plan.alignment_for(size) if self.dynamic_cp else plan.alignment
            want = align.padded_total(int(align.seq_len(self.lengths[mb]).sum())) // size
            if plan.microbatch_tokens and plan.microbatch_tokens[self.row][j] != want:
                raise DynBatchConfigError(
                    "plan", f"micro-batch {j} of rank {self.row}",
                    f"planned as {plan.microbatch_tokens[self.row][j]} tokens but these samples pack to {want}",
                    "plan the same global batch (same lengths) that is passed to the iterator")

        if self.dynamic_cp and uniform_length:
            raise DynBatchConfigError("uniform_length", uniform_length, "a dynamic-CP plan runs micro-batches of "
                                      "different CP sizes, which cannot share one length", "pass uniform_length=None")
        self.uniform_length = (bool(par.pp == 2 and par.vpp > 1) if uniform_length is None else
                               bool(uniform_length)) and not self.dynamic_cp
        self.cp_groups = cp_groups
        if self.dynamic_cp and cp_groups is None and ps is not None and \
                (ps.get_data_parallel_world_size(), ps.get_context_parallel_world_size()) == (par.dp, par.cp):
            from .dynamic_cp import get_dynamic_cp_groups

            self.cp_groups = get_dynamic_cp_groups()
        if self.dynamic_cp and self.cp_groups is not None and \
                (self.cp_groups.dp, self.cp_groups.cp) != (par.dp, par.cp):
            raise DynBatchConfigError("cp_groups", f"dp={self.cp_groups.dp}, cp={self.cp_groups.cp}",
                                      f"the plan's pool is dp={par.dp} x cp={par.cp}",
                                      "plan with the running layout (the groups come from parallel_state)")
        self._index_of = {tuple(mb): j for j, mb in enumerate(plan.micro_batches[self.row])}
        self._offsets = np.concatenate([[0], np.cumsum(plan.microbatches_per_step)]).astype(int).tolist()
        self._mask_sums, self._mask_counts = loss_mask_stats(samples) if mask_stats is None else mask_stats
        self._normalizers: Dict[int, LossNormalizer] = {}
        self._packed: Dict[int, Any] = {}

    # ------------------------------------------------------------------------------------------ layout
    @property
    def num_steps(self) -> int:
        """Optimizer steps in the plan (1 unless ``samples_per_step`` split the batch)."""
        return len(self.plan.microbatches_per_step)

    @property
    def microbatches_per_step(self) -> List[int]:
        return list(self.plan.microbatches_per_step)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches this rank runs over all steps (the same on every DP rank); for a single-step plan the
        ``num_microbatches`` to pass to ``forward_backward_func``."""
        return self.plan.num_microbatches

    def step_range(self, step: Optional[int] = None) -> range:
        """Indices (into this rank's micro-batch list) of ``step``'s micro-batches; ``None`` = all steps."""
        if step is None:
            return range(0, self.num_microbatches)
        if not is_int(step) or not 0 <= step < self.num_steps:
            raise DynBatchConfigError("step", step, f"must be in [0, {self.num_steps})",
                                      "pass the optimizer step index within this global batch")
        return range(self._offsets[step], self._offsets[step + 1])

    def step_of_microbatch(self, j: int) -> int:
        return int(np.searchsorted(self._offsets, j, side="right") - 1)

    def step_samples(self, step: int) -> List[int]:
        """Global indices of the samples of optimizer step ``step`` (all DP ranks), ascending."""
        r = self.step_range(step)
        return sorted({i for rank in self.plan.micro_batches for j in r for i in rank[j]})

    def sample_indices(self, step: Optional[int] = None) -> List[int]:
        """Global indices of THIS rank's samples (of ``step``, or all), ascending: the order of ``restore_order``."""
        mbs = self.plan.micro_batches[self.row]
        return sorted(i for j in self.step_range(step) for i in mbs[j])

    def max_seq_length(self, step: Optional[int] = None) -> int:
        """Longest packed micro-batch (full length, before CP slicing) of this rank in ``step``: what to pass as
        ``seq_length`` to ``forward_backward_func`` (with ``micro_batch_size=1``); the p2p shapes are sent per
        micro-batch under ``variable_seq_lengths``. With ``uniform_length`` every micro-batch of this rank has this
        length: the longest of the whole plan (so one forward-only call over all steps has one length too)."""
        rng = self.step_range(None if self.uniform_length else step)
        longest = max(self.plan.microbatch_tokens[self.row][j] for j in rng)
        # a dynamic-CP plan lists per-GPU tokens: Megatron divides seq_length by its CP size
        return longest * self.cp_size if self.dynamic_cp else longest

    # ------------------------------------------------------------------------------------------- loss
    def normalizer(self, step: int = 0) -> LossNormalizer:
        """The :class:`LossNormalizer` of optimizer step ``step`` (global totals; identical on every rank)."""
        self.step_range(step)
        if step not in self._normalizers:
            self._normalizers[step] = LossNormalizer.from_stats(
                self._mask_sums, self._mask_counts, self.loss_mode, group_ids=self.group_ids,
                group_reduce=self.group_reduce, subset=self.step_samples(step))
        return self._normalizers[step]

    def loss_func(
        self,
        packed: Any,
        *,
        calculate_per_token_loss: bool = False,
        per_token_loss: Optional[Callable[[Any, Any], Any]] = None,
        collect: Optional[Callable[[Any, Any], Any]] = None,
        dp_size: Optional[int] = None,
        tuple_size: int = 3,
        forward_only: bool = False,
        num_microbatches: Optional[int] = None,
        keep_packed: bool = False,
    ) -> Callable[[Any], tuple]:
        """Megatron loss function for one of this iterator's micro-batches (:func:`megatron_dynbatch.megatron.loss.
        make_loss_func` with the step's normaliser and ``num_microbatches``). ``forward_only=True`` gives a
        zero loss that only collects outputs. ``num_microbatches`` defaults to the micro-batch's step size."""
        j = self._index_of.get(tuple(getattr(packed, "sample_indices", ())))
        if j is None:
            raise DynBatchConfigError("packed", type(packed).__name__, "is not a micro-batch of this iterator",
                                      "pass the objects the iterator yields")
        step = self.step_of_microbatch(j)
        m = num_microbatches if num_microbatches is not None else self.plan.microbatches_per_step[step]
        return make_loss_func(None if forward_only else self.normalizer(step), packed, num_microbatches=m,
                              calculate_per_token_loss=calculate_per_token_loss,
                              dp_size=self.plan.parallel.dp if dp_size is None else dp_size, cp_size=self.cp_size,
                              per_token_loss=per_token_loss, collect=collect, tuple_size=tuple_size,
                              keep_packed=keep_packed)

    # ---------------------------------------------------------------------------------------- packing
    def _pack(self, j: int) -> Any:
        if j not in self._packed:
            from .packing import pack_microbatch

            idx = self.plan.micro_batches[self.row][j]
            if self.dynamic_cp:
                self._packed[j] = self._pack_dynamic(j, idx)
                return self._packed[j]
            align = self.plan.alignment
            if self.uniform_length:  # the longest micro-batch is a multiple of total_multiple
                align = Alignment(seq_multiple=align.seq_multiple, total_multiple=self.max_seq_length())
            packed = pack_microbatch([self.samples[i] for i in idx], align,
                                     pad_token_id=self.pad_token_id, sample_indices=idx, device=self.device)
            self._check_loss_mask(packed, idx)
            if self.cp_size > 1:
                from .context_parallel import slice_packed_for_cp

                packed = slice_packed_for_cp(packed, self.cp_size, self.cp_rank)
            self._packed[j] = packed
        return self._packed[j]

    def _pack_dynamic(self, j: int, idx: Sequence[int]) -> Any:
        """Slot ``j`` of a dynamic-CP plan: packed with its group's alignment, sliced to this GPU's zig-zag share
        of the group, carrying the group's process group."""
        from dataclasses import replace

        from .context_parallel import slice_packed_for_cp
        from .packing import pack_microbatch

        start, size = self.plan.groups[self.row][j]
        packed = pack_microbatch([self.samples[i] for i in idx], self.plan.alignment_for(size),
                                 pad_token_id=self.pad_token_id, sample_indices=idx, device=self.device)
        self._check_loss_mask(packed, idx)
        if size > 1:
            packed = slice_packed_for_cp(packed, size, self.row - start)
        group = self.cp_groups.group(start, size) if self.cp_groups is not None else None
        return replace(packed, dynamic_cp=True, cp_group=group, _packed_seq_params=None)

    def _check_loss_mask(self, packed: Any, idx: Sequence[int]) -> None:
        """The normaliser counted each sample's loss tokens from the sample dict; the packer must agree."""
        mask = packed.loss_mask[0].detach().to("cpu").double()
        starts = packed.cu_seqlens_padded[:-1].tolist()
        for i, s, n in zip(idx, starts, packed.seqlens, strict=True):
            got = float(mask[s:s + n].sum())
            if abs(got - self._mask_sums[i]) > 1e-6 * max(1.0, self._mask_sums[i]):
                raise DynBatchConfigError(f"samples[{i}]['loss_mask']", got,
                                          f"the packed loss mask sums to {got}, the normaliser counted "
                                          f"{self._mask_sums[i]}", "report this: packing and loss disagree")

    def microbatches(self, step: Optional[int] = None) -> List[Any]:
        """This rank's packed micro-batches of ``step`` (``None`` = all steps), in execution order (cached)."""
        return [self._pack(j) for j in self.step_range(step)]

    def __iter__(self) -> Iterator[Any]:
        for j in self.step_range(None):
            yield self._pack(j)

    def __len__(self) -> int:
        return self.num_microbatches

    def data_iterator(self, step: Optional[int] = None,
                      num_model_chunks: int = 1) -> Union[Iterator[Any], List[Iterator[Any]]]:
        """What to pass as ``data_iterator`` to ``forward_backward_func`` for ``step`` (``None`` = every step in
        one call, e.g. a forward-only pass): one iterator, or with VPP (``num_model_chunks > 1``) a list of
        independent iterators over the same micro-batches, one per model chunk."""
        mbs = self.microbatches(step)
        if num_model_chunks == 1:
            return iter(mbs)
        return [iter(mbs) for _ in range(num_model_chunks)]

    # ------------------------------------------------------------------------------------ restoring
    def restore_order(self, per_microbatch_outputs: Sequence[Any], step: Optional[int] = None) -> List[Any]:
        """Per-sample results of THIS rank in ORIGINAL sample order (the order of :meth:`sample_indices`).

        ``per_microbatch_outputs[k]`` belongs to the ``k``-th micro-batch of ``step`` (``None`` = all) and is
        either a sequence with one entry per sample in packing order, or a full per-token tensor ``[1, T, ...]``
        / ``[T, ...]`` (un-sliced) that is split into each sample's real tokens."""
        mbs = self.microbatches(step)
        if len(per_microbatch_outputs) != len(mbs):
            raise DynBatchConfigError("per_microbatch_outputs", f"{len(per_microbatch_outputs)} entries",
                                      f"expected one per micro-batch ({len(mbs)})",
                                      "pass the outputs of every micro-batch of the step, in execution order")
        found: Dict[int, Any] = {}
        for k, (mb, out) in enumerate(zip(mbs, per_microbatch_outputs, strict=True)):
            if _is_tensor(out):
                per_sample = split_per_sample(out, mb)
            else:
                per_sample = list(out)
            if len(per_sample) != len(mb.sample_indices):
                raise DynBatchConfigError(f"per_microbatch_outputs[{k}]", f"{len(per_sample)} entries",
                                          f"micro-batch {k} holds {len(mb.sample_indices)} samples",
                                          "give one output per sample, in packing order")
            for i, o in zip(mb.sample_indices, per_sample, strict=True):
                found[i] = o
        return [found[i] for i in sorted(found)]

    def gather_across_dp(self, per_sample_local: Sequence[Any], step: Optional[int] = None,
                         group: Any = None) -> List[Any]:
        """All DP ranks' :meth:`restore_order` results in GLOBAL sample order (ascending sample index over the
        whole batch, or over ``step``'s samples). One ``torch.distributed.all_gather_object`` over ``group``
        (default: Megatron's data-parallel group); every DP rank must call it."""
        import torch.distributed as dist

        mine = self.sample_indices(step)
        if len(per_sample_local) != len(mine):
            raise DynBatchConfigError("per_sample_local", f"{len(per_sample_local)} entries",
                                      f"this rank has {len(mine)} samples", "pass restore_order(...)'s result")
        if group is None:
            ps = _parallel_state()
            group = (ps.get_data_parallel_group(with_context_parallel=self.dynamic_cp) if ps is not None else None)
        world = dist.get_world_size(group=group)
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, (mine, list(per_sample_local)), group=group)
        found: Dict[int, Any] = {}
        for indices, values in gathered:
            found.update(zip(indices, values, strict=True))
        return [found[i] for i in sorted(found)]


# ------------------------------------------------------------------------------------------ helpers
class _ShardSamples(Sequence):
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


def _check_sample_dicts(samples: Any, what: str) -> None:
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


def _check_loss_mode(loss_mode: str) -> None:
    if loss_mode not in LOSS_MODES:
        raise DynBatchConfigError("loss_mode", loss_mode, "unknown loss normalisation", f"use one of {LOSS_MODES}")


def _is_tensor(x: Any) -> bool:
    try:
        import torch

        return isinstance(x, torch.Tensor)
    except ImportError:  # pragma: no cover
        return False


def split_per_sample(per_token: Any, packed: Any) -> List[Any]:
    """Split a FULL-length per-token tensor (``[1, T, ...]`` or ``[T, ...]``) of ``packed``'s layout into each
    sample's real-token slice, in packing order. Works on CP-sliced micro-batches too (they keep the full
    ``cu_seqlens``), as long as ``per_token`` was already reassembled to the full length."""
    total = int(packed.cu_seqlens_padded[-1])
    x = per_token
    if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == total:
        x = x[0]
    if x.dim() < 1 or x.shape[0] != total:
        raise DynBatchConfigError("per_token.shape", tuple(per_token.shape),
                                  f"expected [1, {total}, ...] or [{total}, ...] (the full packed length)",
                                  "gather context-parallel outputs first (context_parallel.gather_cp_outputs)")
    starts = packed.cu_seqlens_padded[:-1].tolist()
    return [x[s:s + n] for s, n in zip(starts, packed.seqlens, strict=True)]
