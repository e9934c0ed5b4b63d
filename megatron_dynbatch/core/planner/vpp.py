"""Megatron's rules on the number of micro-batches ``M`` for interleaved (virtual) pipelines.

From ``megatron/core/pipeline_parallel/schedules.py`` (interleaved 1F1B), with ``N`` the
``microbatch_group_size_per_vp_stage`` (default ``pp``):

* ``pp <= N <= M`` else ``ValueError``;
* ``M % N`` must be ``0`` or ``>= pp`` else ``RuntimeError`` (dependency bubbles).

Without interleaving (``vpp == 1``) any ``M >= 1`` is accepted.
"""

from __future__ import annotations

from ..checks import as_int
from ..errors import DynBatchConfigError
from ..parallel import ParallelConfig


def is_valid_microbatch_count(m: int, parallel: ParallelConfig) -> bool:
    if m < 1:
        return False
    if parallel.vpp <= 1:
        return True
    n = parallel.vp_group_size
    return m >= n and (m % n == 0 or m % n >= parallel.pp)


def next_valid_microbatch_count(m: int, parallel: ParallelConfig) -> int:
    """Smallest valid count >= ``m``."""
    m = max(1, int(m))
    if parallel.vpp <= 1:
        return m
    n = parallel.vp_group_size
    m = max(m, n)
    while not is_valid_microbatch_count(m, parallel):
        m += 1
    return m


def check_forced_count(m: int, parallel: ParallelConfig) -> int:
    """Raise a clear error for a user-forced ``num_microbatches`` that Megatron would reject."""
    m = as_int(m, "num_microbatches", minimum=1, fix="pass None to let the planner choose")
    if not is_valid_microbatch_count(m, parallel):
        n = parallel.vp_group_size
        raise DynBatchConfigError(
            "num_microbatches", m,
            f"interleaved pipeline (pp={parallel.pp}, vpp={parallel.vpp}, microbatch_group_size_per_vp_stage={n}) "
            f"needs M >= {n} and M % {n} == 0 or >= {parallel.pp}",
            f"use {next_valid_microbatch_count(m, parallel)} or pass None",
        )
    return m
