"""Which micro-batch counts per rank an optimizer step may use: :class:`CountRule`.

A count ``M`` is valid when

* Megatron's interleaved schedule accepts it (:mod:`.vpp`; any ``M >= 1`` without VPP);
* ``M >= min_num_microbatches`` (verl's ``min_num_micro_batch``, NeMo-RL's ``min_bin_count / dp``: a floor,
  e.g. to keep a pipeline full); and
* ``M % num_microbatches_multiple == 0`` (verl's ``num_batches_divided_by``, NeMo-RL's ``bin_count_multiple``:
  callers that assert divisibility themselves).

With both knobs at 1 the rule is exactly the VPP rule, so plans without them are unchanged. The valid counts
are periodic (period ``lcm(multiple, N)`` once ``M >= N``), so :meth:`CountRule.next` and
:meth:`CountRule.previous` take at most one period of steps. Pure Python; no state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..checks import as_int
from ..errors import DynBatchConfigError
from ..parallel import MAX_RANKS, ParallelConfig
from .vpp import is_valid_microbatch_count

#: Largest ``min_num_microbatches`` / ``num_microbatches_multiple`` accepted.
MAX_COUNT_KNOB = 2 ** 24


@dataclass(frozen=True)
class CountRule:
    """Valid micro-batch counts per rank and optimizer step (see the module docstring)."""

    parallel: ParallelConfig
    minimum: int = 1
    multiple: int = 1

    @classmethod
    def build(cls, parallel: ParallelConfig, min_num_microbatches: Optional[int] = None,
              num_microbatches_multiple: Optional[int] = None) -> "CountRule":
        """Validated rule: ``None`` means no floor / no multiple."""
        minimum = 1 if min_num_microbatches is None else as_int(
            min_num_microbatches, "min_num_microbatches", minimum=1, maximum=MAX_COUNT_KNOB,
            fix="pass the fewest micro-batches per rank and step you need (e.g. pp), or None")
        multiple = 1 if num_microbatches_multiple is None else as_int(
            num_microbatches_multiple, "num_microbatches_multiple", minimum=1, maximum=min(MAX_COUNT_KNOB, MAX_RANKS),
            fix="pass the number the per-rank count must divide by (e.g. microbatch_group_size_per_vp_stage), or None")
        return cls(parallel, minimum, multiple)

    @property
    def is_default(self) -> bool:
        return self.minimum == 1 and self.multiple == 1

    def is_valid(self, m: int) -> bool:
        return m >= self.minimum and m % self.multiple == 0 and is_valid_microbatch_count(m, self.parallel)

    def next(self, m: int) -> int:
        """Smallest valid count ``>= m``."""
        m = max(1, int(m), self.minimum)
        k = self.multiple
        m = -(-m // k) * k
        if self.parallel.vpp > 1:
            m = max(m, -(-self.parallel.vp_group_size // k) * k)
        while not is_valid_microbatch_count(m, self.parallel):
            m += k
        return m

    def previous(self, m: int) -> Optional[int]:
        """Largest valid count ``<= m``, or ``None`` if there is none."""
        k = self.multiple
        m = int(m) // k * k
        while m >= self.minimum and m >= 1 and not is_valid_microbatch_count(m, self.parallel):
            m -= k
        return m if m >= max(1, self.minimum) else None

    def check_forced(self, m: int) -> int:
        """A user-forced count, or a ``DynBatchConfigError`` naming the rule it breaks."""
        from .vpp import check_forced_count

        m = check_forced_count(m, self.parallel)
        if not self.is_valid(m):
            raise DynBatchConfigError(
                "num_microbatches", m,
                f"breaks min_num_microbatches={self.minimum} / num_microbatches_multiple={self.multiple}",
                f"use {self.next(m)} or pass None")
        return m

    def describe(self) -> str:
        """The non-default parts, for error messages (``""`` when there are none)."""
        parts = []
        if self.minimum > 1:
            parts.append(f"min_num_microbatches={self.minimum}")
        if self.multiple > 1:
            parts.append(f"num_microbatches_multiple={self.multiple}")
        return ", ".join(parts)
