"""Built-in benchmark workloads: global batches shaped like real RL and SFT training steps.

Each :class:`Workload` names a model preset, a parallel layout, a per-GPU token budget and a seeded length
generator. The shapes follow what is publicly known about such batches:

* **long-CoT GRPO**: prompts of 100-2k tokens, ``n`` responses per prompt whose lengths are lognormal with a
  per-prompt difficulty factor and a spike at the maximum response length (truncated generations); responses
  to one prompt share it, so ``group_ids`` mark the GRPO groups;
* **long-context SFT**: a real long-context document-length distribution (99,519 documents, mean 3,962, p99
  26,058, max 124,913; published with the DistCA simulator), shipped in the package as 8,192 quantiles
  (``bench/data/``; provenance, derivation and how close it is: :mod:`.documents` and
  ``benchmarks/derive_document_lengths.py``). ``Workload.generate(seed, documents=...)`` draws from other
  lengths instead, e.g. the real file through :func:`load_document_lengths`;
* **SFT mix**: short chat turns plus a minority of long documents.

Sizes are scaled so the full default benchmark finishes in well under a minute on one CPU core while every
workload still needs several micro-batches per rank (the regime where the planners differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..core.errors import DynBatchConfigError
from ..core.parallel import ParallelConfig
from .documents import (BUNDLED_DOCUMENTS, BUNDLED_QUANTILES, DOCUMENT_LENGTHS_FILE, bundled_document_lengths,
                        document_pool as _documents, document_statistics, load_document_lengths,
                        pool_source as _pool_source)


@dataclass(frozen=True)
class Batch:
    """One generated global batch."""

    lengths: np.ndarray
    group_ids: Optional[np.ndarray] = None
    source: str = "synthetic"


@dataclass(frozen=True)
class Workload:
    """A benchmark scenario. ``generate(seed)`` returns the global batch of that seed."""

    name: str
    description: str
    model: str
    parallel: ParallelConfig
    max_tokens_per_gpu: int
    #: ``generator(rng, documents)``: the batch, drawing document lengths (where it uses any) from ``documents``
    generator: Callable[[np.random.Generator, np.ndarray], Batch] = field(repr=False, compare=False)
    default: bool = True  # part of the default benchmark run
    #: a dynamic-CP workload: ``dynbatch-dyncp`` and ``megatron-hybrid-cp`` run, and every plan is scored with
    #: the CP communication term (``score_with_cp_comm``)
    dynamic_cp: bool = False

    def generate(self, seed: int = 0, documents: Optional[Sequence[int]] = None) -> Batch:
        """The global batch of ``seed``. ``documents`` (document lengths, e.g. :func:`load_document_lengths` of
        the real file) replaces the bundled distribution in every long-document generator; workloads without
        documents ignore it."""
        return self.generator(np.random.default_rng(seed), _documents(documents))

    def to_dict(self) -> dict:
        d = {"name": self.name, "description": self.description, "model": self.model,
             "parallel": self.parallel.to_dict(), "max_tokens_per_gpu": self.max_tokens_per_gpu}
        if self.dynamic_cp:
            d["dynamic_cp"] = True
        return d


# --------------------------------------------------------------------------------------- length sources
def grpo_lengths(rng: np.random.Generator, prompts: int, group: int, max_response: int,
                 median_response: float, sigma: float = 0.8, truncated: float = 0.08,
                 prompt_range: Tuple[int, int] = (100, 2048)) -> Batch:
    """Long-CoT GRPO rollouts: ``prompts x group`` samples, prompt log-uniform in ``prompt_range``, responses
    lognormal around ``median_response`` scaled by a per-prompt difficulty, clipped to ``max_response``, plus
    an extra ``truncated`` fraction forced to exactly ``max_response`` (generations cut at the limit)."""
    lo, hi = prompt_range
    prompt = np.exp(rng.uniform(np.log(lo), np.log(hi), prompts)).astype(np.int64)
    difficulty = rng.lognormal(0.0, 0.5, prompts)
    resp = rng.lognormal(np.log(median_response), sigma, (prompts, group)) * difficulty[:, None]
    resp = np.minimum(np.round(resp), max_response)
    resp[rng.random((prompts, group)) < truncated] = max_response
    resp = np.maximum(resp, 1).astype(np.int64)
    lengths = (prompt[:, None] + resp).reshape(-1)
    return Batch(lengths=lengths, group_ids=np.repeat(np.arange(prompts), group), source="synthetic GRPO")


def document_sample(rng: np.random.Generator, count: int, max_len: Optional[int] = None,
                    documents: Optional[Sequence[int]] = None) -> Batch:
    """``count`` documents drawn (with replacement) from ``documents`` (default: the bundled distribution),
    optionally truncated to ``max_len``."""
    pool = _documents(documents)
    source = _pool_source(pool)
    lengths = pool[rng.integers(0, pool.size, count)]
    if max_len is not None:
        lengths = np.minimum(lengths, max_len)
    return Batch(lengths=lengths.astype(np.int64), source=source)


def documents_by_tokens(rng: np.random.Generator, tokens: int, max_len: int, multiple: int = 1,
                        documents: Optional[Sequence[int]] = None) -> Batch:
    """Documents drawn from ``documents`` (default: the bundled distribution; truncated to ``max_len``) until
    they hold ``tokens`` tokens (the last one cut to fit), then the last few dropped so the count is a multiple
    of ``multiple``: a batch sized by what the ranks can hold, e.g. one micro-batch per rank."""
    pool = _documents(documents)
    source = _pool_source(pool)
    out: List[int] = []
    total = 0
    while total < tokens:
        L = int(min(pool[int(rng.integers(0, pool.size))], max_len))
        if total + L > tokens:
            L = tokens - total
        out.append(L)
        total += L
    keep = max(multiple, len(out) - len(out) % multiple)
    return Batch(lengths=np.asarray(out[:keep], dtype=np.int64), source=f"{source}, <= {tokens} tokens")


def sft_mix(rng: np.random.Generator, chats: int, docs: int, max_len: int,
            documents: Optional[Sequence[int]] = None) -> Batch:
    """Short chat samples (lognormal, median ~600) shuffled with long documents (those of ``documents``, default
    the bundled distribution, above 4k tokens, truncated to ``max_len``)."""
    chat = np.clip(np.round(rng.lognormal(np.log(600), 0.9, chats)), 16, max_len).astype(np.int64)
    pool = _documents(documents)
    source = _pool_source(pool)
    long_pool = pool[pool > 4096]
    doc = np.minimum(long_pool[rng.integers(0, long_pool.size, docs)], max_len)
    lengths = np.concatenate([chat, doc])
    return Batch(lengths=lengths[rng.permutation(lengths.size)], source=f"chat lognormal + {source}")


# --------------------------------------------------------------------------------------- registry
def _builtin() -> List[Workload]:
    P = ParallelConfig
    return [
        Workload(
            "grpo-longcot-8b",
            "long-CoT GRPO, Qwen3-8B, 64 prompts x 8 responses (16k max response, ~8% truncated), tp=2 dp=16",
            "qwen3-8b", P(dp=16, tp=2), 32768,
            lambda rng, _: grpo_lengths(rng, prompts=64, group=8, max_response=16384, median_response=3000),
        ),
        Workload(
            "grpo-longcot-32k",
            "long-CoT GRPO, Qwen3-8B, 32 prompts x 16 responses (32k max response), tp=2 cp=2 dp=8",
            "qwen3-8b", P(dp=8, tp=2, cp=2), 24576,
            lambda rng, _: grpo_lengths(rng, prompts=32, group=16, max_response=32768, median_response=6000),
        ),
        Workload(
            "grpo-moe-30b-a3b",
            "GRPO on Qwen3-30B-A3B (MoE), ep=8 (EP ranks in lockstep), dp=16, 64 prompts x 8, 16k max response",
            "qwen3-30b-a3b", P(dp=16, ep=8), 24576,
            lambda rng, _: grpo_lengths(rng, prompts=64, group=8, max_response=16384, median_response=2500),
        ),
        Workload(
            "sft-longctx-70b-cp8",
            "long-context SFT, Llama-3.1-70B, 1,024 documents of the real length distribution (up to 125k), "
            "tp=8 cp=8 dp=4",
            "llama-3.1-70b", P(dp=4, tp=8, cp=8), 16384,
            lambda rng, docs: document_sample(rng, 1024, documents=docs),
        ),
        Workload(
            "sft-longctx-70b-cp4-pp4",
            "long-context SFT, Llama-3.1-70B, 1,024 documents of the real length distribution truncated to 64k, "
            "tp=8 cp=4 pp=4 dp=4",
            "llama-3.1-70b", P(dp=4, tp=8, cp=4, pp=4), 16384,
            lambda rng, docs: document_sample(rng, 1024, max_len=65536, documents=docs),
        ),
        Workload(
            "pp4-vpp2-qwen3-32b",
            "GRPO on Qwen3-32B with pp=4 vpp=2 (interleaved 1F1B), tp=4 dp=8, 64 prompts x 8, 8k max response",
            "qwen3-32b", P(dp=8, tp=4, pp=4, vpp=2), 16384,
            lambda rng, _: grpo_lengths(rng, prompts=64, group=8, max_response=8192, median_response=1500),
        ),
        Workload(
            "large-dp-256",
            "dp=256 with ~4 samples per rank: GRPO on Qwen3-8B, 128 prompts x 8, 16k max response, tp=1",
            "qwen3-8b", P(dp=256), 32768,
            lambda rng, _: grpo_lengths(rng, prompts=128, group=8, max_response=16384, median_response=3000),
        ),
        Workload(
            "sft-mix-8b",
            "SFT mix, Llama-3.1-8B: 1,792 short chats + 256 long documents (<= 32k), tp=2 cp=2 dp=8",
            "llama-3.1-8b", P(dp=8, tp=2, cp=2), 16384,
            lambda rng, docs: sft_mix(rng, chats=1792, docs=256, max_len=32768, documents=docs),
        ),
        # ---- dynamic context parallelism (docs/dynamic_cp.md): long tails where one sequence dominates a rank
        Workload(
            "dyncp-longdoc-8b-1mb",
            "long documents, ONE micro-batch per rank: Llama-3.1-8B, documents of the real length distribution "
            "(<= 32k) filling 85% of tp=2 dp=8 x 32k, pool of 8 GPUs",
            "llama-3.1-8b", P(dp=8, tp=2), 32768,
            lambda rng, docs: documents_by_tokens(rng, int(0.85 * 8 * 32768), 32768, 8, documents=docs),
            dynamic_cp=True, default=False,
        ),
        Workload(
            "dyncp-longdoc-8b-4mb",
            "long documents, ~4 micro-batches per rank: Llama-3.1-8B, documents of the real length distribution "
            "(<= 32k), tp=2 dp=8 x 32k, pool of 8 GPUs",
            "llama-3.1-8b", P(dp=8, tp=2), 32768,
            lambda rng, docs: documents_by_tokens(rng, int(3.4 * 8 * 32768), 32768, 8, documents=docs),
            dynamic_cp=True, default=False,
        ),
        Workload(
            "dyncp-longctx-70b-cp4-pp4",
            "long-context SFT with PP: Llama-3.1-70B, 1,024 documents of the real length distribution truncated "
            "to 64k, tp=8 cp=4 pp=4 dp=4 (pool of 16 GPUs per stage; the same batch as sft-longctx-70b-cp4-pp4)",
            "llama-3.1-70b", P(dp=4, tp=8, cp=4, pp=4), 16384,
            lambda rng, docs: document_sample(rng, 1024, max_len=65536, documents=docs),
            dynamic_cp=True, default=False,
        ),
        Workload(
            "dyncp-longcot-64k-8b",
            "long-CoT RL at 32k-64k: Qwen3-8B GRPO, 16 prompts x 8, responses up to 64k (median 20k, ~8% "
            "truncated), tp=2 cp=4 dp=4 (pool of 16), 20k per GPU",
            "qwen3-8b", P(dp=4, tp=2, cp=4), 20480,
            lambda rng, _: grpo_lengths(rng, prompts=16, group=8, max_response=65536, median_response=20000,
                                     sigma=0.6), dynamic_cp=True, default=False,
        ),
        Workload(
            "dyncp-longcot-64k-32b-pp4",
            "long-CoT RL at 32k-64k with PP: Qwen3-32B GRPO, 8 prompts x 8, responses up to 64k, tp=4 cp=2 pp=4 "
            "dp=4 (pool of 8 per stage), 40k per GPU",
            "qwen3-32b", P(dp=4, tp=4, cp=2, pp=4), 40960,
            lambda rng, _: grpo_lengths(rng, prompts=8, group=8, max_response=65536, median_response=20000,
                                     sigma=0.6), dynamic_cp=True, default=False,
        ),
        Workload(
            "smoke",
            "tiny smoke test for CI (tiny-gpt, dp=2, 8 prompts x 4 responses)",
            "tiny-gpt", P(dp=2), 2048,
            lambda rng, _: grpo_lengths(rng, prompts=8, group=4, max_response=1024, median_response=300,
                                     prompt_range=(16, 256)),
            default=False,
        ),
    ]


WORKLOADS: Dict[str, Workload] = {w.name: w for w in _builtin()}


def default_workloads() -> List[Workload]:
    return [w for w in WORKLOADS.values() if w.default]


def select_workloads(spec: Optional[str]) -> List[Workload]:
    """Workloads named in a comma-separated ``spec`` (``None``/``""``/``"all"``: the default set)."""
    if spec is None or not spec.strip() or spec.strip() == "all":
        return default_workloads()
    out = []
    for name in (s.strip() for s in spec.split(",")):
        if not name:
            continue
        if name not in WORKLOADS:
            raise DynBatchConfigError("--workloads", name, "unknown workload",
                                      f"use a comma-separated subset of {', '.join(WORKLOADS)}")
        out.append(WORKLOADS[name])
    if not out:
        raise DynBatchConfigError("--workloads", spec, "names no workload", f"use e.g. {next(iter(WORKLOADS))}")
    return out


__all__ = ["BUNDLED_DOCUMENTS", "BUNDLED_QUANTILES", "DOCUMENT_LENGTHS_FILE", "Batch", "WORKLOADS", "Workload",
           "bundled_document_lengths", "default_workloads", "document_sample", "document_statistics",
           "documents_by_tokens", "grpo_lengths", "load_document_lengths", "select_workloads", "sft_mix"]
