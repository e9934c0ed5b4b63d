"""Planning time on adversarial input shapes: a slow plan stalls a whole cluster, so the planner is timed on the
shapes that are hardest for a count search and a bin packer, not only on friendly GRPO batches.

Each :class:`Shape` builds one batch (deterministic) and the planner arguments for it. The shapes:

* ``just over budget/2`` (formerly ``half+1 spike``) -- every sample half the budget + 1 token (a truncation spike
  at the maximum response length with a budget about twice it): only one sample fits a micro-batch, the token
  bound says half as many;
* ``just over budget/3`` (formerly ``third+1``) -- every sample a third of the budget + 1 token: two per
  micro-batch, the token bound says three;
* ``uniform 30-70% of budget`` -- sizes spread around half the budget, so best fit and the balancing packer
  disagree;
* ``just over budget/2, pp8`` / ``GRPO pp4`` -- the same under 1F1B scoring (pipeline polish, extra counts);
* ``GRPO MoE ep8`` -- expert-parallel lockstep (global bins dealt by size tier);
* ``groups of 8`` -- GRPO groups of spike samples (units, not samples, are placed);
* ``1% at cap`` / ``1% oversize`` -- a few huge samples among tiny ones (``oversize='alone'`` for the latter);
* ``all zeros`` / ``all at cap`` -- degenerate batches;
* ``steps of 16 ...`` -- very many optimizer steps in one call (``samples_per_step=16`` over 4 ranks: 4,096
  steps at 65,536 samples), where per-step overhead, not packing, is the cost: samples 90-100% of the budget
  (one per micro-batch), and 45-50% with ``pp=3, vpp=2`` (two share a micro-batch: Megatron's interleaved
  schedule needs a multiple of 3 micro-batches, and 4 samples per rank fill only 3);
* ``one giant group`` -- every sample but one in one ``group_ids`` group over 2 ranks (token mode): the other
  rank can fill one micro-batch, so the batch is refused; a refusal is an answer too and is timed like a plan
  ("refused" in the report). It used to search for minutes.
* ``dyncp ...`` -- dynamic CP at the sizes issue 20 reported slow (fixed sizes, timed once per run): 16,384 GRPO
  samples over a pool of dp=64 x cp=4 with pp=4, and one 128k document among 9,999 short ones on dp=16 x cp=2
  with pp=4 (Llama-3.1-8B); and issue 28's: 8 samples over a pool of dp=1,024 x cp=1,024 (a million GPUs:
  the plan lists each one; it took 10 s -- a tree of two million groups built node by node, each GPU's entry
  appended one by one);
* issue 33's hostile inputs: ``GRPO groups of 8, tight budget, pp8 vpp4`` (1,455 samples over dp=64, Llama-3.1-8B,
  responses truncated at the budget of 3,000 tokens: only M=16 is valid and it packs only by the unit search,
  which took 3.3-12 s of CPU before its charges counted its packings) and ``GRPO MoE ep8 (FLOPs), 65536 over
  dp1024`` (Qwen3-30B-A3B, the growth shape at full size, timed in the default run too); the third, 16,384
  samples on ``dp=64 x cp=4`` with ``pp=4``, is ``dyncp GRPO dp64xcp4 pp4`` above;
* ``GRPO pp4096 (FLOPs)`` -- a pipeline far deeper than any model (issue 28: 6 s): the 1F1B simulation is
  compressed (the stages whose warm-up covers every micro-batch are a flow shop in closed form), and the
  planner, which scores more micro-batches the deeper the pipeline, stops where one simulation gets expensive.

The default ``megatron-dynbatch bench`` times them at 4,096 samples; ``bench --adversarial`` at 65,536 samples
over up to 1,024 ranks, where the target is < 2 s on one core, and at 4,096 / 16,384 / 65,536 samples to show the
growth (no worse than ``n log n``). Times are CPU seconds of the planning process (``time.process_time``), so a
busy machine does not turn a met target into a miss.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .speed import SpeedResult

#: the planning-time target of every shape at full size (n <= 65,536, dp <= 1,024)
TARGET_MS = 2000.0
BUDGET = 4096
FULL_SIZE = 65_536
DEFAULT_SIZE = 4_096
GROWTH_SIZES = (4_096, 16_384, 65_536)


@dataclass(frozen=True)
class Shape:
    name: str
    dp: int
    make: Callable[[int, np.random.Generator], Tuple[np.ndarray, Dict[str, Any]]]
    #: a fixed batch size (the shape ignores the requested one and is timed once per run)
    samples: Optional[int] = None

    def build(self, n: int) -> Tuple[np.ndarray, Dict[str, Any]]:
        """The batch of ``n`` samples and the planner arguments (``dp`` shrinks with ``n`` to keep >= 64 samples
        per rank, except in a fixed-size shape)."""
        n = self.samples or n
        lengths, kwargs = self.make(n, np.random.default_rng(n))
        dp = self.dp if self.samples else max(1, min(self.dp, n // 64))  # a fixed-size shape keeps its layout
        par = dict(kwargs.pop("parallel", {}), dp=dp)
        kwargs = {"max_tokens_per_gpu": BUDGET, **kwargs, "parallel": par}  # balance_by: time with a model
        return np.asarray(lengths, dtype=np.int64), kwargs


def _grpo(n: int, rng: np.random.Generator, max_len: int) -> np.ndarray:
    return np.minimum(rng.lognormal(7.5, 1.0, n).astype(np.int64) + 200, max_len)


#: issue 33's hostile grouped step: 1,455 GRPO samples in groups of 8, every response truncated at a budget so tight
#: that a third of the samples fill a micro-batch alone and Megatron's interleaved rule (pp=8, vpp=4) leaves one
#: count, 16, that packs only by the unit search (fallback.units_search); 3.3-12 s before its work was bounded
TIGHT_GROUPS = "GRPO groups of 8, tight budget, pp8 vpp4"
TIGHT_BUDGET = 3000

SHAPES: Tuple[Shape, ...] = (
    Shape("just over budget/2", 1, lambda n, r: (np.full(n, BUDGET // 2 + 1), {})),
    Shape("just over budget/3", 2, lambda n, r: (np.full(n, BUDGET // 3 + 1), {})),
    Shape("uniform 30-70% of budget", 1, lambda n, r: (r.integers(int(0.3 * BUDGET), int(0.7 * BUDGET), n), {})),
    Shape("just over budget/2, pp8", 128, lambda n, r: (np.full(n, BUDGET // 2 + 1), {"parallel": {"pp": 8}})),
    Shape("GRPO pp4 (FLOPs)", 1024, lambda n, r: (_grpo(n, r, 16_384), {
        "parallel": {"pp": 4}, "model": "qwen3-8b", "max_tokens_per_gpu": 32_768})),
    Shape("GRPO MoE ep8 (FLOPs)", 1024, lambda n, r: (_grpo(n, r, 16_384), {
        "parallel": {"ep": 8}, "model": "qwen3-30b-a3b", "max_tokens_per_gpu": 32_768})),
    Shape("groups of 8", 1024, lambda n, r: (np.full(n, BUDGET // 2 + 1), {"group_ids": np.arange(n) // 8})),
    Shape("1% at cap", 1024, lambda n, r: (np.where(r.random(n) < 0.99, 5, BUDGET - 1), {})),
    Shape("1% oversize (alone)", 256, lambda n, r: (np.where(r.random(n) < 0.99, 500, 3 * BUDGET),
                                                    {"oversize": "alone"})),
    Shape("all zeros", 1024, lambda n, r: (np.zeros(n, dtype=np.int64), {})),
    Shape("all at cap", 8, lambda n, r: (np.full(n, BUDGET), {})),
    Shape("one giant group (refused)", 2, lambda n, r: (r.integers(1, 100, n), {
        "group_ids": np.r_[np.zeros(n - 1, dtype=np.int64), 1]})),
    Shape("steps of 16", 4, lambda n, r: (r.integers(int(0.9 * BUDGET), BUDGET + 1, n), {
        "samples_per_step": 16, "model": "qwen3-8b"})),
    Shape("steps of 16 pp3 vpp2", 4, lambda n, r: (r.integers(int(0.45 * BUDGET), BUDGET // 2 + 1, n), {
        "samples_per_step": 16, "model": "qwen3-8b", "parallel": {"pp": 3, "vpp": 2}})),
    Shape("dyncp GRPO dp64xcp4 pp4", 64, lambda n, r: (_grpo(n, r, 16_384), {
        "parallel": {"cp": 4, "pp": 4}, "model": "llama-3.1-8b", "max_tokens_per_gpu": 8192, "dynamic_cp": True}),
        samples=16_384),
    Shape("dyncp 128k doc + short, dp16xcp2 pp4", 16, lambda n, r: (np.append(131_072, _grpo(n - 1, r, 16_384)), {
        "parallel": {"cp": 2, "pp": 4}, "model": "llama-3.1-8b", "max_tokens_per_gpu": 65_536, "dynamic_cp": True}),
        samples=10_000),
    Shape("GRPO pp4096 (FLOPs)", 64, lambda n, r: (_grpo(n, r, 16_384), {
        "parallel": {"pp": 4096}, "model": "qwen3-8b", "max_tokens_per_gpu": 32_768})),
    Shape("dyncp 8 samples, pool dp1024 x cp1024", 1024, lambda n, r: (_grpo(n, r, 16_384), {
        "parallel": {"cp": 1024}, "model": "llama-3.1-8b", "max_tokens_per_gpu": 8192, "dynamic_cp": True}),
        samples=8),
    Shape(TIGHT_GROUPS, 64, lambda n, r: (_grpo(n, r, TIGHT_BUDGET), {
        "parallel": {"pp": 8, "vpp": 4}, "model": "llama-3.1-8b", "max_tokens_per_gpu": TIGHT_BUDGET,
        "group_ids": np.arange(n) // 8}), samples=1455),
    Shape("GRPO MoE ep8 (FLOPs), 65536 over dp1024", 1024, lambda n, r: (_grpo(n, r, 16_384), {
        "parallel": {"ep": 8}, "model": "qwen3-30b-a3b", "max_tokens_per_gpu": 32_768}), samples=FULL_SIZE),
)


def adversarial_tasks(sizes: Sequence[int], shapes: Sequence[Shape] = SHAPES) -> List[Tuple[int, Shape]]:
    """The ``(size, shape)`` pairs of a run, in order: every shape at every size, but a fixed-size shape
    (``samples``) only once, at the first size."""
    return [(n, shape) for k, n in enumerate(sizes) for shape in shapes if shape.samples is None or k == 0]


def time_shape(shape: Shape, n: int, repeats: int = 1) -> Tuple[List[float], int, Dict[str, Any]]:
    """CPU milliseconds of ``repeats`` plans of ``shape`` at ``n`` samples (after one untimed warm-up), the
    plan's micro-batch count (0: the planner refused the batch) and the planner arguments it was built with."""
    lengths, kwargs = shape.build(n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # oversize='alone' warns by design
        m = _plan_count(lengths, kwargs)
        runs = []
        for _ in range(repeats):
            t0 = time.process_time()
            _plan_count(lengths, kwargs)
            runs.append(1e3 * (time.process_time() - t0))
    return runs, m, kwargs


def _plan_count(lengths: np.ndarray, kwargs: Dict[str, Any]) -> int:
    from ..core.errors import DynBatchConfigError
    from ..core.planner import plan_global_batch

    try:
        return plan_global_batch(lengths, **kwargs).num_microbatches
    except DynBatchConfigError:
        return 0


def run_adversarial(sizes: Sequence[int] = (DEFAULT_SIZE,), repeats: int = 1,
                    shapes: Sequence[Shape] = SHAPES) -> List[Any]:
    """One :class:`~megatron_dynbatch.bench.speed.SpeedResult` per shape and size."""
    out = []
    for n, shape in adversarial_tasks(sizes, shapes):
        runs, m, kwargs = time_shape(shape, n, repeats)
        par = kwargs["parallel"]
        out.append(SpeedResult(shape.samples or n, par["dp"] * par.get("cp", 1) if kwargs.get("dynamic_cp")
                               else par["dp"], runs, TARGET_MS, m, shape=shape.name, clock="cpu"))
    return out
