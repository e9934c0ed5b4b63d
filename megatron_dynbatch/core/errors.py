"""Error types.

Every configuration or input problem raises :class:`DynBatchConfigError`, a ``ValueError`` subclass whose
message always names three things: the offending field (or command-line flag), the value it had, and how to
fix it. Tests match on these parts, so keep the format stable::

    <field>=<value!r>: <problem>. Fix: <fix>

The trainer drop-ins (:mod:`megatron_dynbatch.integrations`) raise :class:`DropinAssertionError` (and
:class:`OversizeAssertionError`) where the trainer's own function raises ``AssertionError``: one exception that
is both ours (a ``DynBatchConfigError``, so a ``ValueError``) and the trainer's type, so callers and tests
written against the trainer keep catching it.
"""

from __future__ import annotations

from typing import Any


class DynBatchConfigError(ValueError):
    """Bad input or configuration. ``field``, ``value`` and ``fix`` are kept as attributes."""

    def __init__(self, field: str, value: Any, problem: str, fix: str) -> None:
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}={value!r}: {problem}. Fix: {fix}")


class OversizeSampleError(DynBatchConfigError):
    """A single sample does not fit the per-micro-batch token budget (policy ``oversize='error'``)."""


class OversizeSampleWarning(UserWarning):
    """Emitted when ``oversize='alone'`` places an over-budget sample in a micro-batch of its own."""


class DropinAssertionError(DynBatchConfigError, AssertionError):
    """A drop-in's refusal where the trainer's own function asserts (slime's ``build_dp_schedule``, verl's
    ``seqlen_balancing``, ROLL's ``dynamic_batching_shard``): field, value and fix like every
    ``DynBatchConfigError``, and an ``AssertionError`` like the trainer's."""


class OversizeAssertionError(OversizeSampleError, DropinAssertionError):
    """An over-budget sample where the trainer asserts on it (verl's ``max_token_len`` check, ROLL's padded
    length check)."""
