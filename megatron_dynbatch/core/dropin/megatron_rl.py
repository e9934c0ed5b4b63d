"""Megatron RL's trajectory packing (``megatron/rl/sequence_packing_utils.py``) on this planner -- the pure half;
:mod:`megatron_dynbatch.integrations.megatron_rl` puts it behind upstream's ``SequencePacker`` interface.

Contract kept (Megatron-LM ``main``, read Aug 2026). ``pack_all_trajectories`` gathers every DP rank's
trajectories (rows of ``--seq-length`` tokens, pad-filled), a ``SequencePacker(bin_size=seq_length, pad_token,
max_sequences_per_bin, seq_length_multiple)`` packs them into bins -- ``[num_bins, bin_size]`` tensors, each
sequence at an offset that is a multiple of ``seq_length_multiple`` (``2*cp`` under CP, else 1), at most
``max_sequences_per_bin`` per bin (``--rl-sequence-packing-max-sequences-per-bin``, default 50) -- and
``distribute_packed_bins`` deals them to DP ranks (``fifo``: contiguous runs; ``round-robin``), appending empty
all-pad bins to ranks that got fewer, so every rank runs the same count; each bin is one micro-batch
(micro-batch size 1), padded to ``bin_size``; an empty filler bin still runs a full forward and backward.

What changes: upstream packs longest first, next-fit, then deals the bins by position. Here
:func:`plan_rl_bins` plans the whole rollout batch at once with :func:`plan_global_batch`: ``dp * M`` bins, ``M``
per rank, none empty, each within ``bin_size`` (slot rounding counted) and ``max_sequences_per_bin``, ranks
balanced by the cost model (attention differs between bins of the same width), the count the model's cheapest
(every bin is charged its full ``bin_size``, as Megatron RL runs it) and one Megatron's interleaved schedule
accepts. The bins come back rank-major -- rank ``r`` owns bins ``r*M .. r*M+M-1`` -- which is exactly what
upstream's ``fifo`` dealing hands out when the count divides, so no filler bin is ever needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional

import numpy as np

from ..checks import as_int
from ..errors import DynBatchConfigError, OversizeSampleError
from ..parallel import ParallelConfig
from ..planner.inputs import check_lengths
from ..planner.options import PlanOptions
from .balance import balance_kwargs
from .sequence_limit import plan_with_sequence_limit

if TYPE_CHECKING:
    from ..cost_model import CostModelLike
    from ..model_spec import ModelLike
    from ..parallel import ParallelLike

__all__ = ["RlBinPlan", "bin_seq_starts", "plan_rl_bins", "round_up"]


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (Megatron RL's slot length of a sequence)."""
    return -(-int(n) // multiple) * multiple


def bin_seq_starts(lengths: Any, bin_indices: List[int], multiple: int) -> List[int]:
    """Megatron RL's ``seq_starts`` of one bin: each sequence's aligned offset, then the padded end."""
    starts, pos = [], 0
    for i in bin_indices:
        starts.append(pos)
        pos += round_up(int(lengths[i]), multiple)
    return starts + [pos]


@dataclass
class RlBinPlan:
    """``bins[k]`` lists global sequence indices; rank ``r`` owns ``bins[r*per_rank:(r+1)*per_rank]``."""

    bins: List[List[int]]
    per_rank: int
    dp: int
    plan: Any  # the underlying Plan (statistics: rank_time, imbalance, ...)

    def rank_bins(self, rank: int) -> List[List[int]]:
        return self.bins[rank * self.per_rank:(rank + 1) * self.per_rank]


def plan_rl_bins(seq_lengths: Any, *, bin_size: int, dp: int, seq_length_multiple: int = 1,
                 max_sequences_per_bin: Optional[int] = 50, parallel: ParallelLike = None,
                 model: Optional[ModelLike] = None, cost_model: CostModelLike = None) -> RlBinPlan:
    """Plan Megatron RL's bins for the gathered rollout batch (see the module docstring).

    ``seq_lengths``: real length of every trajectory (upstream's ``get_actual_sequence_lengths``);
    ``bin_size``: ``--seq-length``; ``dp``: the data-parallel size; ``seq_length_multiple``: the slot alignment
    upstream's packer uses (``2*cp`` under CP); ``parallel``: the rest of the layout (``cp``, ``pp``, ``vpp``)
    for the cost model and the VPP rule; ``model`` / ``cost_model``: balance modelled time (tokens otherwise)."""
    if hasattr(seq_lengths, "tolist") and not isinstance(seq_lengths, np.ndarray):
        seq_lengths = seq_lengths.tolist()  # a torch tensor of lengths (duck-typed: core/ never imports torch)
    lens = check_lengths(seq_lengths)
    bin_size = as_int(bin_size, "bin_size", minimum=1, fix="pass --seq-length (Megatron RL's bin size)")
    dp = as_int(dp, "dp", minimum=1, fix="pass the data-parallel size")
    mult = as_int(seq_length_multiple, "seq_length_multiple", minimum=1, fix="pass 2*cp under CP, else 1")
    if bin_size % mult:
        raise DynBatchConfigError("bin_size", bin_size, f"must be a multiple of seq_length_multiple={mult}",
                                  "use a --seq-length divisible by 2*cp")
    if lens.size < dp:
        raise DynBatchConfigError("trajectories", f"{lens.size} sequences",
                                  f"cannot give each of the {dp} DP ranks a bin of its own",
                                  "generate at least one trajectory per DP rank")
    slots = -(-lens // mult) * mult
    if int(slots.max()) > bin_size:
        i = int(np.argmax(slots))
        raise OversizeSampleError("--seq-length", bin_size, f"trajectory {i} takes {int(slots[i])} tokens, more "
                                  "than one bin holds", "raise --seq-length or truncate trajectories to it")
    base = ParallelConfig.from_any(parallel).to_dict()
    cp = int(base.get("cp", 1))
    if mult % (2 * cp if cp > 1 else 1):  # then cp divides mult, which divides bin_size (checked above)
        raise DynBatchConfigError("seq_length_multiple", mult, f"must be a multiple of 2*cp={2 * cp}",
                                  "pass Megatron RL's own seq_length_multiple (2*cp)")
    base.update(dp=dp, sequence_parallel=False)  # every bin is padded to bin_size anyway
    kwargs: Any = dict(parallel=ParallelConfig(**base), max_tokens_per_gpu=bin_size // cp,
                       sequence_pad_multiple=mult, microbatch_pad_multiple=bin_size // cp)
    kwargs.update(balance_kwargs(model, cost_model))
    plan = plan_with_sequence_limit(lens, max_sequences_per_bin, PlanOptions.from_kwargs(kwargs),
                                    field="--rl-sequence-packing-max-sequences-per-bin")
    m = plan.num_microbatches
    bins = [list(map(int, plan.micro_batches[r][j])) for r in range(dp) for j in range(m)]
    return RlBinPlan(bins=bins, per_rank=m, dp=dp, plan=plan)
