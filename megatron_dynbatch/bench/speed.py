"""One planning-time measurement (:class:`SpeedResult`), shared by the runner's speed micro-benchmark and the
adversarial input shapes (:mod:`.adversarial`).

It lives apart from :mod:`.runner` so that :mod:`.adversarial` (which the runner calls) does not import the
runner back: the dependency goes one way, runner -> adversarial -> speed. Plain data, JSON round-trippable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List

import numpy as np


@dataclass
class SpeedResult:
    """Planning time of ``plan_global_batch`` for ``samples`` over ``dp`` ranks."""

    samples: int
    dp: int
    runs_ms: List[float]
    target_ms: float
    microbatches: int = 0
    shape: str = "GRPO"  # the input shape (see bench/adversarial.py for the adversarial ones)
    clock: str = "wall"  # "wall" (perf_counter) or "cpu" (process_time)

    @property
    def median_ms(self) -> float:
        return float(np.median(self.runs_ms)) if self.runs_ms else float("nan")

    @property
    def meets_target(self) -> bool:
        return self.median_ms < self.target_ms

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d.update(median_ms=self.median_ms, meets_target=self.meets_target)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "SpeedResult":
        return cls(int(d["samples"]), int(d["dp"]), [float(x) for x in d["runs_ms"]], float(d["target_ms"]),
                   int(d.get("microbatches", 0)), str(d.get("shape", "GRPO")), str(d.get("clock", "wall")))


__all__ = ["SpeedResult"]
