"""The partitioning primitives the baselines share: one copy each, in :mod:`megatron_dynbatch.core.partitioning`
(the planner's portfolio, :mod:`megatron_dynbatch.core.planner.portfolio`, scores the same peer heuristics), named
here for the benchmark's modules -- :func:`karmarkar_karp`, :func:`first_fit`, :func:`split_largest_bins`,
:func:`modified_first_fit_decreasing`, :func:`adjust_bin_count`, :func:`next_fit_packs` -- with
:class:`BaselineInfeasible`, what a modelled system raises where it would refuse a batch."""

from __future__ import annotations

from ..core.partitioning import (PartitionInfeasible, adjust_bin_count, first_fit, karmarkar_karp,
                                 modified_first_fit_decreasing, next_fit_packs, split_largest_bins)

#: The modelled system would refuse this batch (assertion, crash or Megatron error); the message says why. The
#: core's :class:`~megatron_dynbatch.core.partitioning.PartitionInfeasible` under the benchmark's name, so that a
#: refusal raised by a shared primitive and one raised by a baseline are caught alike.
BaselineInfeasible = PartitionInfeasible

__all__ = ["BaselineInfeasible", "adjust_bin_count", "first_fit", "karmarkar_karp", "modified_first_fit_decreasing",
           "next_fit_packs", "split_largest_bins"]
