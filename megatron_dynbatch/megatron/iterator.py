"""``DynamicBatchIterator``: a global batch + a plan -> this rank's packed THD micro-batches, and back.

Every rank builds the iterator from the SAME global batch (list of sample dicts). It plans the batch itself
(:func:`megatron_dynbatch.plan_global_batch`, deterministic, so all ranks agree with no communication) unless a
plan (:class:`~megatron_dynbatch.Plan` or :class:`~megatron_dynbatch.DynamicCPPlan`) is given, validates the plan,
and then

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

This class is the boundary (keywords -> one ``PlanOptions``, once) and the face; each job is its own module:

====================================  =========================================================================
:mod:`.batch_input`                   the sample dicts checked; a rank-local shard's view and metadata
:mod:`.rank_plan`                     plan the batch / check the given plan; this GPU's row, steps, samples
:mod:`.microbatch_packer`             pack a micro-batch, slice it to this GPU's CP share, carry its CP group
:mod:`.step_loss`                     one loss normaliser per optimizer step; Megatron's loss function
:mod:`.gather`                        outputs back per sample, CP slices reassembled, DP ranks gathered
====================================  =========================================================================

:meth:`DynamicBatchIterator.from_shard` builds the same iterator from only this DP rank's samples plus the global
batch's per-sample metadata (lengths, loss-mask statistics, group ids), for drivers that plan centrally and ship
each rank only its share (:mod:`megatron_dynbatch.integrations.ray`).

Sample dicts: ``tokens`` (1-D), optional ``labels`` and ``loss_mask`` (label positions, Megatron's convention),
per-token extras (advantages, old_log_probs, ref_log_probs, ...: length-``L`` tensors), per-sample scalars
(rewards, ...), and an optional group id under ``group_key`` (default ``"group_id"``; a GRPO prompt group stays
on one DP rank and defines the groups of ``loss_mode="group_mean"``).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterator, List, Mapping, Optional, Sequence, Union

from ..core.errors import DynBatchConfigError
from ..core.planner.api import options_of
from ..core.planner.options import PlanOptions, ResolvedOptions
from ..core.planner.plan_kind import PlanKind
from . import gather
from .batch_input import BatchInput, ShardSamples, check_loss_mode, check_sample_dicts
from .gather import split_per_sample
from .loss import LossNormalizer
from .microbatch_packer import MicroBatchPacker, dynamic_cp_groups_for
from .rank_plan import RankPlan, plan_batch
from .step_loss import StepLoss

__all__ = ["DynamicBatchIterator", "split_per_sample"]


class DynamicBatchIterator:
    """This DP rank's packed micro-batches for one global batch (see the module docstring).

    Args:
        samples: the global batch, identical on every rank (list of dicts).
        plan: a plan (:class:`Plan` or :class:`DynamicCPPlan`) for ``len(samples)`` samples; ``None`` to plan
            here from ``options`` / ``plan_kwargs``.
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
        plan: Optional[PlanKind] = None,
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
        check_sample_dicts(samples, "the global batch")
        check_loss_mode(loss_mode)
        batch = BatchInput.whole(samples, group_ids, group_key)
        if plan is None:
            if options is None and "max_tokens_per_gpu" not in plan_kwargs:
                raise DynBatchConfigError("max_tokens_per_gpu", None, "needed to plan the batch (no plan given)",
                                          "pass plan=Plan, options=PlanOptions(...) or max_tokens_per_gpu=<per-GPU "
                                          "token budget>")
            per_sample = {k: plan_kwargs.pop(k) for k in ("microbatch_group_ids", "rollout_ids") if k in plan_kwargs}
            resolved = options_of(options, plan_kwargs).resolve()  # the door: keywords -> options, resolved once
            plan = plan_batch(batch.lengths, resolved, batch.group_ids, **per_sample)
        elif plan_kwargs or options is not None:
            given = sorted(plan_kwargs) + (["options"] if options is not None else [])
            raise DynBatchConfigError("plan_kwargs", given, "given together with a plan",
                                      "pass either plan= or planning options, not both")
        self._setup(batch, plan, dp_rank=dp_rank, cp_rank=cp_rank, cp_size=cp_size, loss_mode=loss_mode,
                    group_reduce=group_reduce, pad_token_id=pad_token_id, device=device,
                    uniform_length=uniform_length, cp_groups=cp_groups)

    @classmethod
    def planned(cls, samples: Sequence[Mapping[str, Any]], options: ResolvedOptions, *,
                group_ids: Optional[Sequence[Hashable]] = None, group_key: str = "group_id",
                loss_mode: str = "token_mean", group_reduce: str = "token", pad_token_id: int = 0,
                device: Any = None) -> "DynamicBatchIterator":
        """The iterator of the global batch planned with options a caller resolved once
        (:meth:`PlanOptions.resolve`; :func:`~megatron_dynbatch.megatron.schedule.dynamic_forward_backward` below
        its door). Other arguments: as for the constructor."""
        check_sample_dicts(samples, "the global batch")
        check_loss_mode(loss_mode)
        batch = BatchInput.whole(samples, group_ids, group_key)
        self = cls.__new__(cls)
        self._setup(batch, plan_batch(batch.lengths, options, batch.group_ids), dp_rank=None, cp_rank=None,
                    cp_size=None, loss_mode=loss_mode, group_reduce=group_reduce, pad_token_id=pad_token_id,
                    device=device, uniform_length=None, cp_groups=None)
        return self

    @classmethod
    def from_shard(
        cls,
        samples: Sequence[Mapping[str, Any]],
        plan: PlanKind,
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
        check_sample_dicts(samples, "this rank's samples")
        check_loss_mode(loss_mode)
        batch = BatchInput.shard(samples, sample_indices=sample_indices, lengths=lengths,
                                 loss_mask_sums=loss_mask_sums, loss_token_counts=loss_token_counts,
                                 group_ids=group_ids, check_stats=check_stats)
        self = cls.__new__(cls)
        self._setup(batch, plan, dp_rank=dp_rank, cp_rank=cp_rank, cp_size=cp_size, loss_mode=loss_mode,
                    group_reduce=group_reduce, pad_token_id=pad_token_id, device=device,
                    uniform_length=uniform_length, cp_groups=cp_groups)
        held = set(batch.held)
        missing = [i for i in self.plan.rank_samples(self.row) if i not in held]
        if missing:
            raise DynBatchConfigError(
                "samples", f"{len(missing)} of DP rank {self.dp_rank}'s samples missing (e.g. {missing[:8]})",
                "the plan gives this DP rank samples that were not shipped to it",
                "send every actor the shard of ITS data-parallel rank (shard.dp_rank == "
                "parallel_state.get_data_parallel_rank())")
        return self

    def _setup(self, batch: BatchInput, plan: Any, *, dp_rank: Optional[int], cp_rank: Optional[int],
               cp_size: Optional[int], loss_mode: str, group_reduce: str, pad_token_id: int, device: Any,
               uniform_length: Optional[bool], cp_groups: Any) -> None:
        """Shared by ``__init__`` (the whole global batch) and :meth:`from_shard` (this rank's samples only): the
        checked plan and this GPU's row (:mod:`.rank_plan`), then the packer, the loss and the gather over it."""
        self._batch = batch
        self._rank = RankPlan.resolve(plan, batch.lengths, len(batch.samples), dp_rank=dp_rank, cp_rank=cp_rank,
                                      cp_size=cp_size, uniform_length=uniform_length)
        self.cp_groups = dynamic_cp_groups_for(self._rank, cp_groups)
        self._packer = MicroBatchPacker(batch.samples, self._rank, batch.mask_sums, pad_token_id=pad_token_id,
                                        device=device, cp_groups=self.cp_groups)
        self._loss = StepLoss(self._rank, batch.mask_sums, batch.mask_counts, loss_mode=loss_mode,
                              group_reduce=group_reduce, group_ids=batch.group_ids)

    # ------------------------------------------------------------------------------------------ faces
    samples = property(lambda self: self._batch.samples, doc="The global batch (a rank-local view for a shard).")
    lengths = property(lambda self: self._batch.lengths, doc="Token count of every sample of the global batch.")
    group_ids = property(lambda self: self._batch.group_ids, doc="One id per sample of the global batch, or None.")
    plan = property(lambda self: self._rank.plan, doc="The plan this iterator runs.")
    dp_rank = property(lambda self: self._rank.dp_rank, doc="This GPU's data-parallel rank.")
    cp_rank = property(lambda self: self._rank.cp_rank, doc="This GPU's context-parallel rank.")
    cp_size = property(lambda self: self._rank.cp_size, doc="The layout's context-parallel size.")
    row = property(lambda self: self._rank.row, doc="The row of the plan this GPU runs (PlanKind.row_of).")
    uniform_length = property(lambda self: self._rank.uniform_length,
                              doc="Whether every micro-batch of this row is padded to the row's longest.")
    dynamic_cp = property(lambda self: self._rank.plan.dynamic_cp, doc="Whether the plan is a dynamic-CP plan.")
    loss_mode = property(lambda self: self._loss.loss_mode, doc="The loss normalisation.")
    group_reduce = property(lambda self: self._loss.group_reduce, doc="group_mean's reduction inside a group.")
    pad_token_id = property(lambda self: self._packer.pad_token_id, doc="Token id on padding positions.")
    device = property(lambda self: self._packer.device, doc="Where packed tensors go.")

    @property
    def is_shard(self) -> bool:
        """True for a rank-local iterator (:meth:`from_shard`)."""
        return isinstance(self._batch.samples, ShardSamples)

    @property
    def local_indices(self) -> List[int]:
        """Global indices of the samples this iterator holds (all of them unless built :meth:`from_shard`)."""
        return self._batch.held

    # ------------------------------------------------------------------------------------------ layout
    @property
    def num_steps(self) -> int:
        """Optimizer steps in the plan (1 unless ``samples_per_step`` split the batch)."""
        return self._rank.num_steps

    @property
    def microbatches_per_step(self) -> List[int]:
        return list(self.plan.microbatches_per_step)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches this rank runs over all steps (the same on every DP rank); for a single-step plan the
        ``num_microbatches`` to pass to ``forward_backward_func``."""
        return self._rank.num_microbatches

    def step_range(self, step: Optional[int] = None) -> range:
        """Indices (into this rank's micro-batch list) of ``step``'s micro-batches; ``None`` = all steps."""
        return self._rank.step_range(step)

    def step_of_microbatch(self, j: int) -> int:
        return self._rank.step_of_microbatch(j)

    def step_samples(self, step: int) -> List[int]:
        """Global indices of the samples of optimizer step ``step`` (all DP ranks), ascending."""
        return self._rank.step_samples(step)

    def sample_indices(self, step: Optional[int] = None) -> List[int]:
        """Global indices of THIS rank's samples (of ``step``, or all), ascending: the order of ``restore_order``."""
        return self._rank.sample_indices(step)

    def max_seq_length(self, step: Optional[int] = None) -> int:
        """Longest packed micro-batch (full length, before CP slicing) of this rank in ``step``: what to pass as
        ``seq_length`` to ``forward_backward_func`` (with ``micro_batch_size=1``); the p2p shapes are sent per
        micro-batch under ``variable_seq_lengths``. With ``uniform_length`` every micro-batch of this rank has this
        length: the longest of the whole plan (so one forward-only call over all steps has one length too)."""
        return self._rank.max_seq_length(step)

    # ------------------------------------------------------------------------------------------- loss
    def normalizer(self, step: int = 0) -> LossNormalizer:
        """The :class:`LossNormalizer` of optimizer step ``step`` (global totals; identical on every rank)."""
        return self._loss.normalizer(step)

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
        j = self._packer.index_of(packed)
        if j is None:
            raise DynBatchConfigError("packed", type(packed).__name__, "is not a micro-batch of this iterator",
                                      "pass the objects the iterator yields")
        return self._loss.loss_func(packed, j, calculate_per_token_loss=calculate_per_token_loss,
                                    per_token_loss=per_token_loss, collect=collect, dp_size=dp_size,
                                    tuple_size=tuple_size, forward_only=forward_only,
                                    num_microbatches=num_microbatches, keep_packed=keep_packed)

    # ---------------------------------------------------------------------------------------- packing
    def microbatches(self, step: Optional[int] = None) -> List[Any]:
        """This rank's packed micro-batches of ``step`` (``None`` = all steps), in execution order (cached)."""
        return [self._packer.pack(j) for j in self.step_range(step)]

    def __iter__(self) -> Iterator[Any]:
        for j in self.step_range(None):
            yield self._packer.pack(j)

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
        / ``[T, ...]`` (un-sliced) that is split into each sample's real tokens (:func:`.gather.restore_order`)."""
        return gather.restore_order(self.microbatches(step), per_microbatch_outputs)

    def gather_across_dp(self, per_sample_local: Sequence[Any], step: Optional[int] = None,
                         group: Any = None) -> List[Any]:
        """All DP ranks' :meth:`restore_order` results in GLOBAL sample order (ascending sample index over the
        whole batch, or over ``step``'s samples). One ``torch.distributed.all_gather_object`` over ``group``
        (default: Megatron's data-parallel group, with the CP ranks under a dynamic-CP plan); every DP rank must
        call it."""
        return gather.gather_across_dp(self.sample_indices(step), per_sample_local, group=group,
                                       with_context_parallel=self.dynamic_cp)
