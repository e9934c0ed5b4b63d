"""Where the hook's global batches come from: Megatron's datasets providers and the batch sources behind them.

Data contract: with ``--dataloader-type external`` the datasets provider's train object IS the iterator; it must
yield the WHOLE global batch (``--global-batch-size`` sample dicts, the same on every rank: ``tokens``, optional
``loss_mask`` / ``labels`` / ``group_id``), because the plan is computed from all lengths on every rank.
:func:`global_batch_datasets_provider` does this from a JSON-lines file (:class:`JsonlGlobalBatches`) or from
synthetic data (:class:`MockGlobalBatches`), positioned after Megatron's ``consumed_train_samples``; a provider of
your own must do the same and carry ``is_distributed = True`` (every rank builds it).

Without ``--use-dynamic-batch-size`` the entry point runs the SAME data as plain fixed micro-batches
(:func:`plain_batches_datasets_provider`, :class:`PlainMicroBatches`, Megatron-LM's own ``forward_step``): an A/B
baseline whose losses equal the hook's with ``--calculate-per-token-loss`` (``tests/test_megatron_lm_loop.py``).

Invariants the tests assert (``tests/test_scripts.py``): batch ``k`` of a source depends only on the flags and
``k`` (every rank, and a resumed run, read the same batch); a bad record or flag is a ``DynBatchConfigError``
naming the line or the flag.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional

import numpy as np

from .flags import check_data_source_args, validate_megatron_lm_args
from .training import megatron_args

__all__ = ["global_batch_datasets_provider", "plain_batches_datasets_provider", "JsonlGlobalBatches",
           "MockGlobalBatches", "PlainMicroBatches", "parse_sample", "to_torch_sample"]


# ==================================================================================== Megatron's providers
def global_batch_datasets_provider(train_val_test_num_samples: Any, vp_stage: Optional[int] = None):
    """Megatron datasets provider for ``--dataloader-type external``: ``(train iterator, None, None)``; the
    iterator yields whole global batches from ``--dynbatch-train-data`` or ``--dynbatch-mock-data``. Validates
    the flags first (this runs before Megatron builds a data loader around the result)."""
    args = megatron_args()
    validate_megatron_lm_args(args)
    check_data_source_args(args)
    return _global_batch_source(args), None, None


global_batch_datasets_provider.is_distributed = True  # type: ignore[attr-defined]  # every rank builds it


def plain_batches_datasets_provider(train_val_test_num_samples: Any, vp_stage: Optional[int] = None):
    """Megatron datasets provider for the A/B run WITHOUT the hook: the same data flags, the same global batches,
    cut into plain fixed micro-batches (:class:`PlainMicroBatches`) for Megatron-LM's own forward step."""
    from megatron.core import parallel_state

    args = megatron_args()
    check_data_source_args(args)
    train = PlainMicroBatches(_global_batch_source(args), micro_batch_size=args.micro_batch_size,
                              seq_length=args.seq_length, dp_rank=parallel_state.get_data_parallel_rank(),
                              dp_size=parallel_state.get_data_parallel_world_size(),
                              attention_mask=bool(getattr(args, "create_attention_mask_in_dataloader", False)))
    return train, None, None


plain_batches_datasets_provider.is_distributed = True  # type: ignore[attr-defined]


def _global_batch_source(args: Any) -> Iterator[List[Dict[str, Any]]]:
    """The global-batch source the data flags select, positioned after ``args.consumed_train_samples``."""
    if getattr(args, "dynbatch_mock_data", False):
        return MockGlobalBatches(
            args.global_batch_size, vocab_size=int(args.padded_vocab_size),
            max_length=int(args.dynbatch_mock_max_length or args.seq_length), seed=int(args.seed),
            start_batch=int(args.consumed_train_samples) // int(args.global_batch_size),
            lengths=getattr(args, "dynbatch_mock_lengths", None))
    return JsonlGlobalBatches(args.dynbatch_train_data, args.global_batch_size,
                              start_sample=int(args.consumed_train_samples))


# ================================================================================== global-batch sources
class JsonlGlobalBatches(Iterator[List[Dict[str, Any]]]):
    """Global batches of ``batch_size`` consecutive JSONL samples, starting after ``start_sample`` samples
    (Megatron's ``consumed_train_samples`` when resuming) and wrapping around at the end of the file."""

    def __init__(self, path: str, batch_size: int, *, start_sample: int = 0, as_torch: bool = True) -> None:
        from ...core.errors import DynBatchConfigError

        if not os.path.isfile(path):
            raise DynBatchConfigError("--dynbatch-train-data", path, "file not found", "pass a JSON-lines file")
        with open(path, encoding="utf-8") as fh:
            records = [(i + 1, line) for i, line in enumerate(fh) if line.strip()]
        if not records:
            raise DynBatchConfigError("--dynbatch-train-data", path, "the file holds no samples",
                                      "write one JSON per line")
        self.samples = []
        for lineno, line in records:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DynBatchConfigError(f"{path}:{lineno}", line[:40], f"is not valid JSON ({exc.msg})",
                                          "write one JSON object per line") from None
            self.samples.append(parse_sample(obj, f"{os.path.basename(path)}:{lineno}"))
        if batch_size < 1:
            raise DynBatchConfigError("--global-batch-size", batch_size, "must be >= 1", "pass the samples per step")
        self.batch_size = int(batch_size)
        self.position = int(start_sample) % len(self.samples)
        self.as_torch = as_torch

    def __next__(self) -> List[Dict[str, Any]]:
        n = len(self.samples)
        batch = [self.samples[(self.position + k) % n] for k in range(self.batch_size)]
        self.position = (self.position + self.batch_size) % n
        return [to_torch_sample(s) for s in batch] if self.as_torch else [dict(s) for s in batch]


def parse_sample(obj: Any, where: str) -> Dict[str, Any]:
    """One JSONL record -> a sample dict of Python lists (validated; ``where`` names the line in errors)."""
    from ...core.errors import DynBatchConfigError

    if not isinstance(obj, Mapping) or "tokens" not in obj:
        raise DynBatchConfigError(where, type(obj).__name__, "each line must be a JSON object with 'tokens'",
                                  'write {"tokens": [1, 2, 3], "loss_mask": [0, 1, 1]}')
    tokens = obj["tokens"]
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                             for t in tokens):
        raise DynBatchConfigError(f"{where}.tokens", str(tokens)[:40], "must be a non-empty list of token ids >= 0",
                                  "store token ids, not text")
    out: Dict[str, Any] = {"tokens": tokens}
    for key in ("loss_mask", "labels"):
        if key in obj and obj[key] is not None:
            if not isinstance(obj[key], list) or len(obj[key]) != len(tokens):
                got = len(obj[key]) if isinstance(obj[key], list) else obj[key]
                raise DynBatchConfigError(f"{where}.{key}", f"{got}",
                                          f"must be a list with one entry per token ({len(tokens)})",
                                          f"write {key} aligned with tokens")
            out[key] = obj[key]
    if obj.get("group_id") is not None:
        out["group_id"] = obj["group_id"]
    return out


def to_torch_sample(sample: Mapping[str, Any]) -> Dict[str, Any]:
    """Lists -> tensors in the layout :class:`~megatron_dynbatch.megatron.iterator.DynamicBatchIterator` takes."""
    import torch

    out: Dict[str, Any] = {"tokens": torch.as_tensor(sample["tokens"], dtype=torch.long)}
    if "loss_mask" in sample:
        out["loss_mask"] = torch.as_tensor(sample["loss_mask"], dtype=torch.float)
    if "labels" in sample:
        out["labels"] = torch.as_tensor(sample["labels"], dtype=torch.long)
    if "group_id" in sample:
        out["group_id"] = sample["group_id"]
    return out


class MockGlobalBatches(Iterator[List[Dict[str, Any]]]):
    """Synthetic RL-like global batches: a short prompt (loss mask 0) and a long-tailed response (loss mask 1),
    ``group_size`` responses per prompt id; each sample's tokens are an arithmetic progression modulo the
    vocabulary (random start, stride 1-3), which a model can learn. Batch ``k`` depends only on ``(seed, k)``:
    identical on every rank. With ``lengths`` (one per sample, each >= 2) every batch holds samples of exactly
    those lengths, in an order drawn per batch, instead of the long-tailed draw."""

    def __init__(self, batch_size: int, *, vocab_size: int, max_length: int, seed: int = 1234,
                 group_size: int = 8, start_batch: int = 0, as_torch: bool = True,
                 lengths: Optional[List[int]] = None) -> None:
        self.batch_size, self.vocab_size, self.max_length = int(batch_size), int(vocab_size), int(max_length)
        self.seed, self.group_size, self.k = int(seed), max(1, int(group_size)), int(start_batch)
        self.as_torch = as_torch
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        if self.lengths is not None and (len(self.lengths) != self.batch_size or min(self.lengths) < 2):
            from ...core.errors import DynBatchConfigError

            raise DynBatchConfigError("lengths", self.lengths[:16], f"needs {self.batch_size} lengths >= 2 (one "
                                      "per sample of the batch)", "pass one length >= 2 per sample")

    def __next__(self) -> List[Dict[str, Any]]:
        rng = np.random.default_rng([self.seed, self.k])
        order = None if self.lengths is None else rng.permutation(self.batch_size)
        out = []
        for i in range(self.batch_size):
            if order is not None:
                n = self.lengths[int(order[i])]
                prompt = int(rng.integers(1, max(2, n // 2)))
            else:
                prompt = int(rng.integers(8, max(9, min(512, self.max_length // 4))))
                resp = int(np.clip(rng.lognormal(mean=np.log(max(2, self.max_length) / 8), sigma=1.0), 1,
                                   max(1, self.max_length - prompt)))
                n = prompt + resp
            resp = n - prompt
            mask = [0] * (prompt - 1) + [1] * resp + [0]  # label positions that predict response tokens
            # a learnable sequence (arithmetic progression mod the vocabulary, random start and stride), so a
            # smoke run shows the loss going down
            start, stride = int(rng.integers(1, self.vocab_size)), int(rng.integers(1, 4))
            tokens = ((start + stride * np.arange(n)) % (self.vocab_size - 1) + 1).tolist()
            s = {"tokens": tokens, "loss_mask": mask,
                 "group_id": self.k * self.batch_size // self.group_size + i // self.group_size}
            out.append(to_torch_sample(s) if self.as_torch else s)
        self.k += 1
        return out


# ============================================================================== the plain A/B baseline
class PlainMicroBatches(Iterator[Dict[str, Any]]):
    """The SAME global batches cut the way plain Megatron batching cuts them, for A/B runs without the hook.

    Megatron's pretraining sampler gives DP rank ``r`` samples ``[k*mbs*dp + r*mbs, ... + mbs)`` of a global
    batch as its micro-batch ``k``; each sample is padded to ``seq_length`` (labels and loss mask exactly as
    :func:`~megatron_dynbatch.megatron.packing.pack_microbatch` makes them, loss mask 0 on padding). Yields
    Megatron's micro-batch dicts (``tokens``, ``labels``, ``loss_mask``, ``position_ids``, each
    ``[mbs, seq_length]``; ``attention_mask`` ``[mbs, 1, S, S]`` too when Megatron's
    ``--create-attention-mask-in-dataloader`` asks for it), which Megatron-LM's own ``pretrain_gpt.forward_step``
    consumes. With ``--calculate-per-token-loss`` Megatron's loss is then the global token mean, the quantity the
    hook's default ``token_mean`` computes from packed micro-batches."""

    def __init__(self, global_batches: Iterator[List[Dict[str, Any]]], *, micro_batch_size: int, seq_length: int,
                 dp_rank: int, dp_size: int, attention_mask: bool = False) -> None:
        self.source, self.mbs, self.seq_length = global_batches, int(micro_batch_size), int(seq_length)
        self.attention_mask = bool(attention_mask)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self._pending: List[Dict[str, Any]] = []

    def __next__(self) -> Dict[str, Any]:
        import torch

        from ...core.errors import DynBatchConfigError
        from ...megatron.packing import pack_microbatch

        if not self._pending:
            batch = next(self.source)
            per_mb = self.mbs * self.dp_size
            if len(batch) % per_mb:
                raise DynBatchConfigError("--global-batch-size", len(batch),
                                          f"is not a multiple of micro-batch size x DP = {per_mb}",
                                          "pass a global batch size divisible by --micro-batch-size x DP")
            self._pending = [batch[k + self.dp_rank * self.mbs: k + (self.dp_rank + 1) * self.mbs]
                             for k in range(0, len(batch), per_mb)]
        rows = []
        for sample in self._pending.pop(0):
            n = len(sample["tokens"])
            if n > self.seq_length:
                raise DynBatchConfigError("--seq-length", self.seq_length, f"a sample has {n} tokens",
                                          "raise --seq-length to the longest sample for plain batching")
            packed = pack_microbatch([sample])
            pad = self.seq_length - n
            rows.append({k: torch.nn.functional.pad(getattr(packed, k)[0, :n], (0, pad))
                         for k in ("tokens", "labels", "loss_mask")})
        out = {k: torch.stack([r[k] for r in rows]) for k in ("tokens", "labels", "loss_mask")}
        out["position_ids"] = torch.arange(self.seq_length, dtype=torch.long).expand(len(rows), -1).contiguous()
        if self.attention_mask:  # Megatron's dataset contract: [mbs, 1, S, S] bool, True = masked (the future)
            future = torch.ones(self.seq_length, self.seq_length, dtype=torch.bool).triu(1)
            out["attention_mask"] = future.expand(len(rows), 1, -1, -1).contiguous()
        return out
