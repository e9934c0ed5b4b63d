"""NeMo-RL's sequence packer (``nemo_rl/data/packing/algorithms.py``) on this planner -- pure Python;
:mod:`megatron_dynbatch.integrations.nemo_rl` re-exports it under NeMo-RL's names.

Contract kept (NeMo-RL, read Aug 2026): ``get_packer(algorithm, bin_capacity, collect_metrics=False,
min_bin_count=None, bin_count_multiple=None)`` returns a packer whose ``pack(sequence_lengths)`` gives bins
(lists of indices into ``sequence_lengths``) with every index once, no bin over ``bin_capacity`` (lengths
arrive already padded to NeMo-RL's ``sequence_length_pad_multiple``), at least ``min_bin_count`` bins and a
multiple of ``bin_count_multiple`` of them, no empty bin; an empty input gives no bins; a sequence longer than
the capacity raises ``ValueError``; fewer sequences than required bins raises ``ValueError``; unknown
algorithm names raise ``ValueError``; ``min_bin_count < 0`` / ``bin_count_multiple < 1`` raise at construction.

What changes: NeMo-RL calls the packer with ``min_bin_count = bin_count_multiple = shards`` (the DP size) and
deals bin ``j`` to rank ``j % shards``. Its packers only fill bins, so ranks get whatever the round-robin gives
them. This packer plans ``bin_count_multiple`` ranks at once (equal counts, time or token balance across ranks
and bins, under the same capacity) and returns the bins *interleaved* -- bin ``j*dp + r`` is rank ``r``'s
``j``-th micro-batch -- so NeMo-RL's own round-robin dealing hands every rank exactly its planned share.
Every algorithm name NeMo-RL accepts selects this packer (the name is kept on ``packer.algorithm``) -- NeMo-RL's
own ``PackingAlgorithm`` members included (any enum member whose name or value is one of NeMo-RL's algorithms,
:func:`algorithm_name`). Lengths may be a list, an array or a tensor; errors are ``ValueError`` naming NeMo-RL's
arguments (``bin_capacity``, ``min_bin_count``, ``bin_count_multiple``, ``sequence_lengths``).
"""

from __future__ import annotations

import enum
import re
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..checks import as_budget, as_array, as_bool, as_int
from ..errors import DynBatchConfigError
from ..parallel import ParallelConfig
from ..planner import plan_global_batch
from ..planner.inputs import check_lengths
from .balance import balance_kwargs
from .words import NEMO_RL_WORDS, speaks, trainer_terms

if TYPE_CHECKING:
    from ..cost_model import CostModelLike
    from ..model_spec import ModelLike
    from ..parallel import ParallelLike

__all__ = ["DynBatchSequencePacker", "PackingAlgorithm", "algorithm_name", "get_packer", "packing_stats"]


class PackingAlgorithm(enum.Enum):
    """NeMo-RL's algorithm names; each selects :class:`DynBatchSequencePacker`."""

    CONCATENATIVE = "concatenative"
    FIRST_FIT_DECREASING = "first_fit_decreasing"
    FIRST_FIT_SHUFFLE = "first_fit_shuffle"
    MODIFIED_FIRST_FIT_DECREASING = "modified_first_fit_decreasing"


class DynBatchSequencePacker:
    """A NeMo-RL ``SequencePacker`` that plans with megatron-dynbatch (see the module docstring).

    Extra keyword arguments (all optional): ``parallel`` -- the layout (``tp, pp, cp, vpp, ...``; its ``dp`` is
    ``bin_count_multiple``) for the exact VPP rule and the cost model; ``model`` -- balance the model's time
    instead of tokens; ``cost_model``; ``max_seq_len`` -- the longest sequence the run can produce, checked
    against the capacity here, at construction (before step 1)."""

    def __init__(self, bin_capacity: int, collect_metrics: bool = False, min_bin_count: Optional[int] = None,
                 bin_count_multiple: Optional[int] = None, *, algorithm: str = "modified_first_fit_decreasing",
                 parallel: ParallelLike = None, model: Optional[ModelLike] = None, cost_model: CostModelLike = None,
                 max_seq_len: Optional[int] = None) -> None:
        self.bin_capacity = as_budget(bin_capacity, "bin_capacity", trainer="NeMo-RL",
                                   fix="pass the token capacity of one bin (train_mb_tokens)")
        self.collect_metrics = as_bool(collect_metrics, "collect_metrics")
        if min_bin_count is not None:
            min_bin_count = as_int(min_bin_count, "min_bin_count", minimum=0, fix="pass a count >= 0 or None")
        if bin_count_multiple is not None:
            bin_count_multiple = as_int(bin_count_multiple, "bin_count_multiple", minimum=1,
                                        fix="pass a positive multiple (the DP size) or None")
        self.min_bin_count = min_bin_count
        self.bin_count_multiple = bin_count_multiple
        self.algorithm = algorithm
        base = ParallelConfig.from_any(parallel)
        self.parallel = ParallelConfig(**{**base.to_dict(), "dp": bin_count_multiple or 1})
        self.model, self.cost_model = model, cost_model
        self.metrics: Optional[Dict[str, float]] = {} if self.collect_metrics else None
        self._history: List[Dict[str, float]] = []
        if max_seq_len is not None:
            from ..startup import check_max_seq_len_fits

            check_max_seq_len_fits(max_seq_len, max_tokens_per_gpu=self.bin_capacity, length_field="max_seq_len",
                                   budget_field="bin_capacity")

    @speaks(NEMO_RL_WORDS)
    def pack(self, sequence_lengths: Sequence[int]) -> List[List[int]]:
        """Bins of indices into ``sequence_lengths`` (a list, array or tensor; interleaved by rank, see the module
        docstring). Errors are ``ValueError`` (``DynBatchConfigError``) in NeMo-RL's words, as NeMo-RL raises."""
        bins, lens = self._plan(sequence_lengths)
        if self.collect_metrics and lens is not None:
            stats = packing_stats(lens, bins, self.bin_capacity)
            self._history.append(stats)
            self.metrics = stats
        return bins

    @speaks(NEMO_RL_WORDS)
    def _pack_implementation(self, sequence_lengths: Sequence[int]) -> List[List[int]]:
        """NeMo-RL's abstract packing step (its ``SequencePacker`` subclasses implement it): the bins of
        :meth:`pack`, the bin-count rules already met, without touching the metrics."""
        return self._plan(sequence_lengths)[0]

    def _plan(self, sequence_lengths: Sequence[int]) -> Tuple[List[List[int]], Optional[np.ndarray]]:
        seqs = as_array(sequence_lengths)
        if isinstance(seqs, (list, tuple, range)) and len(seqs) == 0 or \
                isinstance(seqs, np.ndarray) and seqs.ndim == 1 and seqs.size == 0:
            return [], None  # NeMo-RL: no sequences, no bins (anything else, 0-d arrays too, goes to check_lengths)
        lens = check_lengths(seqs, field="sequence_lengths")
        if int(lens.max()) > self.bin_capacity:
            i = int(np.argmax(lens))
            from ..errors import OversizeSampleError

            raise OversizeSampleError("bin_capacity", self.bin_capacity,
                                      f"sequence {i} has length {int(lens[i])}, more than the bin capacity",
                                      "raise train_mb_tokens / logprob_mb_tokens, or truncate the sequence")
        dp = self.parallel.dp
        per_rank = max(-(-(self.min_bin_count or 0) // dp), 1)
        # The capacity is the whole bin (NeMo-RL's train_mb_tokens); the planner's budget is per GPU after CP.
        kw = dict(parallel=self.parallel, max_tokens_per_gpu=max(1, self.bin_capacity // self.parallel.cp),
                  min_num_microbatches=per_rank if self.min_bin_count else None)
        kw.update(balance_kwargs(self.model, self.cost_model))
        if lens.size < dp * per_rank:
            raise _too_few(dp * per_rank, lens.size)
        try:
            with trainer_terms(NEMO_RL_WORDS, values={"bin_capacity": self.bin_capacity}):
                plan = plan_global_batch(lens, **kw)
        except DynBatchConfigError as err:  # the capacity needs more bins per rank than the sequences can fill
            need = _PER_RANK_NEED.search(err.problem)
            if need is None:
                raise
            raise _too_few(dp * int(need.group(1)), lens.size) from None
        m = plan.num_microbatches
        return [list(plan.micro_batches[r][j]) for j in range(m) for r in range(dp)], lens

    # ------------------------------------------------------------------ NeMo-RL's metrics interface
    def reset_metrics(self) -> None:
        self._history.clear()
        if self.metrics is not None:
            self.metrics = {}

    def compute_metrics(self, sequence_lengths: Sequence[int], bins: List[List[int]]) -> Dict[str, float]:
        return packing_stats(np.asarray(sequence_lengths, dtype=np.int64), bins, self.bin_capacity)

    def get_aggregated_metrics(self) -> Dict[str, float]:
        if not self._history:
            return {}
        keys = self._history[0].keys()
        return {k: float(np.mean([h[k] for h in self._history])) for k in keys}

    def print_metrics(self) -> None:
        if self.metrics is None:
            print("Metrics collection is not enabled. Initialize with collect_metrics=True.")
            return
        for k, v in self.get_aggregated_metrics().items():
            print(f"{k}: {v:.4f}")


#: the planner's refusal when every rank needs more non-empty micro-batches than its sequences can fill
_PER_RANK_NEED = re.compile(r"need at least (\d+) non-empty micro-batches per rank")


def _too_few(bins: int, sequences: int) -> DynBatchConfigError:
    """Too few sequences for the bins, in NeMo-RL's own words (its callers and tests match them), with our fix."""
    return DynBatchConfigError("sequence_lengths", f"{sequences} sequences",
                               f"Cannot create {bins} bins with only {sequences} sequences (every bin needs at least "
                               "one: no bin may be empty)",
                               "reduce min_bin_count / bin_count_multiple (the DP size) or provide more sequences")


def packing_stats(lengths: np.ndarray, bins: List[List[int]], capacity: int) -> Dict[str, float]:
    """A few packing statistics (our own names): bins, fill of the bins, largest bin."""
    fills = np.array([int(lengths[b].sum()) for b in bins], dtype=np.float64) if bins else np.zeros(1)
    return {"num_sequences": float(lengths.size), "num_bins": float(len(bins)),
            "avg_bin_utilization": float(fills.mean() / capacity), "max_bin_utilization": float(fills.max() / capacity),
            "min_bin_utilization": float(fills.min() / capacity)}


def algorithm_name(algorithm: Any) -> Optional[str]:
    """The NeMo-RL algorithm ``algorithm`` names, by its value (``"first_fit_decreasing"``), or ``None``. Accepted:
    a member of ANY enum -- NeMo-RL's own ``nemo_rl.data.packing.algorithms.PackingAlgorithm`` as much as this
    module's copy -- or a string, whose name or value is one of NeMo-RL's algorithms (case-insensitive)."""
    if isinstance(algorithm, enum.Enum):
        candidates = [algorithm.name, algorithm.value]
    elif isinstance(algorithm, str):
        candidates = [algorithm]
    else:
        return None
    for c in candidates:
        if isinstance(c, str):
            if c.upper() in PackingAlgorithm.__members__:
                return PackingAlgorithm[c.upper()].value
            if c.lower() in {a.value for a in PackingAlgorithm}:
                return c.lower()
    return None


def get_packer(algorithm: Union[PackingAlgorithm, str], bin_capacity: int, collect_metrics: bool = False,
               min_bin_count: Optional[int] = None, bin_count_multiple: Optional[int] = None, *,
               packer_class: type = DynBatchSequencePacker, **kwargs: Any) -> DynBatchSequencePacker:
    """NeMo-RL's factory: any of its algorithm names (an enum member, NeMo-RL's or ours, or a string; see
    :func:`algorithm_name`) gives a ``packer_class`` (:class:`DynBatchSequencePacker` or a subclass: the NeMo-RL
    drop-in passes one that is also NeMo-RL's own ``SequencePacker``); anything else raises ``ValueError``
    listing the known names."""
    name = algorithm_name(algorithm)
    if name is None:
        names = ", ".join(a.name for a in PackingAlgorithm)
        raise DynBatchConfigError("algorithm", algorithm, "unknown packing algorithm", f"use one of {names}")
    return packer_class(bin_capacity, collect_metrics, min_bin_count, bin_count_multiple, algorithm=name, **kwargs)
