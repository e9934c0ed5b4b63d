"""Dynamic batching inside Megatron-LM's own ``pretrain()`` loop: the hook, the flags and the batch sources.

The lines to add to an existing Megatron-LM launch script (for example a copy of ``pretrain_gpt.py``)::

    from megatron_dynbatch.integrations.megatron_lm import add_dynamic_batch_args, global_batch_datasets_provider, install

    install()                                         # patches megatron.training.training.get_forward_backward_func
    pretrain(global_batch_datasets_provider,          # instead of train_valid_test_datasets_provider
             partial(model_provider, gpt_builder),
             ModelType.encoder_or_decoder,
             forward_step,                            # kept for Megatron's signature; the hook uses its own
             args_defaults={'tokenizer_type': 'GPT2BPETokenizer',
                            'dataloader_type': 'external'},   # or pass --dataloader-type external
             extra_args_provider=add_dynamic_batch_args)

plus the flags ``--use-dynamic-batch-size --max-tokens-per-gpu N --micro-batch-size 1 --global-batch-size S
--eval-iters 0`` and a data source (``--dynbatch-train-data FILE.jsonl`` or ``--dynbatch-mock-data``).
``scripts/pretrain_gpt_dynbatch.py`` is exactly this, ready to run.

How it hooks in (the least invasive place)
------------------------------------------
Megatron-LM's ``train()`` (``megatron/training/training.py``) obtains the schedule ONCE, through the name
``get_forward_backward_func`` that the module imported from ``megatron.core.pipeline_parallel``, and hands it
to every ``train_step``; ``train_step`` calls it with ``num_microbatches=get_num_microbatches()`` (the fixed
``global_batch_size / (micro_batch_size * dp)``). :func:`install` replaces that ONE module attribute,
``megatron.training.training.get_forward_backward_func``, by a function that validates the flags and returns
Megatron's real schedule wrapped in :class:`DynamicForwardBackward`. The wrapper ignores the fixed count: it
takes one global batch from the data iterator, plans it (:func:`megatron_dynbatch.megatron.args.plan_options_from_args`:
identical plan on every rank, no communication) and runs it through
:func:`megatron_dynbatch.megatron.schedule.dynamic_forward_backward` with the plan's micro-batch count, THD packing and
exact loss normalisation. One more attribute is replaced when present: ``num_floating_point_operations`` (the
FLOPs behind Megatron's TFLOP/s and ``num_floating_point_operations_so_far``), which assumes ``--seq-length``
tokens per sample; after a hooked step it returns the step's FLOPs from the real lengths. Nothing else in
Megatron is patched, so the optimizer step, gradient finalisation, checkpointing and logging are Megatron's
own. Besides ``lm loss`` the loss dicts carry ``dynbatch tokens`` / ``dynbatch padded tokens`` (real and
padded tokens of the step), which Megatron logs next to the loss. The ``forward_step`` given to ``pretrain()`` is not called (the
packed-THD forward step of :mod:`megatron_dynbatch.megatron.schedule` is).

With ``--dynbatch-online-calibration`` the wrapper keeps one
:class:`~megatron_dynbatch.megatron.online_calibration.OnlineCalibrator` per rank: every step's micro-batches are timed
(CUDA events, read once after the step's last backward), every ``--dynbatch-calibration-interval`` steps the cost
model is refitted and merged with one small all-reduce, and the following steps are planned with it on every rank
alike; the refit line (``dynbatch calibration | step N | ...``) is printed on global rank 0.

Data contract: with ``--dataloader-type external`` the datasets provider's train object IS the iterator; it must
yield the WHOLE global batch (``--global-batch-size`` sample dicts, the same on every rank: ``tokens``, optional
``loss_mask`` / ``labels`` / ``group_id``), because the plan is computed from all lengths on every rank.
:func:`global_batch_datasets_provider` does this from a JSON-lines file or synthetic data; a provider of your own
must do the same and carry ``is_distributed = True`` (every rank builds it).

Flags are validated (:func:`validate_megatron_lm_args`) by the datasets provider, by the hook when ``train()``
fetches the schedule, and -- earliest, optional -- by a model provider wrapped in :func:`checked_model_provider`.

Without ``--use-dynamic-batch-size`` the entry point runs the SAME data as plain fixed micro-batches
(:func:`plain_batches_datasets_provider`, Megatron-LM's own ``forward_step``): an A/B baseline whose losses
equal the hook's with ``--calculate-per-token-loss`` (``tests/test_megatron_lm_loop.py``).

Caveats: Megatron's own ``get_num_microbatches()`` still drives bookkeeping that does not touch the data: with
``--micro-batch-size 1 --global-batch-size N`` its sample counter and learning-rate schedule count N samples
per step, which is exact; MoE auxiliary-loss *logging* divides by that count instead of the planned one.
Evaluation is not wired: pass ``--eval-iters 0``.

Megatron-LM's ``megatron.training`` is not part of the megatron-core wheel. This module imports it lazily (only
:func:`install` without a module, the datasets provider and the model-provider check need it); when it is
missing they raise :class:`MegatronLMNotFoundError` saying what to install. Everything else (flags, batch
sources, the wrapper) works without it and is unit-tested in ``tests/test_scripts.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional

import numpy as np

__all__ = [
    "MISSING_MEGATRON_LM",
    "MegatronLMNotFoundError",
    "import_megatron_training",
    "install",
    "add_dynamic_batch_args",
    "add_data_source_args",
    "validate_megatron_lm_args",
    "check_megatron_lm_args",
    "check_data_source_args",
    "checked_model_provider",
    "global_batch_datasets_provider",
    "JsonlGlobalBatches",
    "MockGlobalBatches",
    "PlainMicroBatches",
    "plain_batches_datasets_provider",
    "parse_sample",
    "to_torch_sample",
    "DynamicForwardBackward",
    "megatron_loss_dicts",
    "plan_log_line",
    "help_text",
]

MISSING_MEGATRON_LM = (
    "the Megatron-LM integration (megatron_dynbatch.integrations.megatron_lm, scripts/pretrain_gpt_dynbatch.py) needs "
    "Megatron-LM's training package (megatron.training), which the megatron-core wheel does not contain. Clone "
    "Megatron-LM at the tag matching your megatron-core (e.g. core_v0.16.1) and put it on PYTHONPATH, or set "
    "MEGATRON_LM_DIR=/path/to/Megatron-LM. The planner, the CLI and the CPU demo (`megatron-dynbatch demo`) work "
    "without it."
)


class MegatronLMNotFoundError(ImportError):
    """``megatron.training`` (Megatron-LM, not the megatron-core wheel) cannot be imported."""


def import_megatron_training() -> Any:
    """``megatron.training`` (with ``$MEGATRON_LM_DIR`` put on ``sys.path`` first when set), or
    :class:`MegatronLMNotFoundError` with :data:`MISSING_MEGATRON_LM`."""
    root = os.environ.get("MEGATRON_LM_DIR")
    if root and root not in sys.path:
        sys.path.insert(0, root)
    try:
        import megatron.training as training
        import megatron.training.training  # noqa: F401  (the module install() patches)
    except ImportError as exc:
        raise MegatronLMNotFoundError(f"{MISSING_MEGATRON_LM} (import failed: {exc})") from exc
    return training


def _megatron_get_args() -> Any:
    return import_megatron_training().get_args()


# ============================================================================================= the flags
def add_data_source_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The data-source flags of :func:`global_batch_datasets_provider`."""
    g = parser.add_argument_group(title="dynbatch data source",
                                  description="global batches for megatron_dynbatch.integrations.megatron_lm."
                                              "global_batch_datasets_provider")
    g.add_argument("--dynbatch-train-data", type=str, default=None, metavar="JSONL",
                   help="JSON-lines file, one sample per line: {\"tokens\": [...], \"loss_mask\": [...] (optional), "
                        "\"labels\": [...] (optional), \"group_id\": ... (optional)}. Read by every rank; one global "
                        "batch = --global-batch-size consecutive lines; wraps around at the end.")
    g.add_argument("--dynbatch-mock-data", action="store_true", default=False,
                   help="Synthetic long-tailed samples (seeded, identical on every rank) for smoke and speed runs.")
    g.add_argument("--dynbatch-mock-max-length", type=int, default=None,
                   help="Longest synthetic sample (default --seq-length).")
    g.add_argument("--dynbatch-mock-lengths", type=_length_list, default=None, metavar="L1,L2,...",
                   help="Synthetic samples of exactly these lengths (one per sample of the global batch, in a "
                        "seeded order per batch) instead of the long-tailed draw: a length profile to reproduce, "
                        "e.g. one long document among short answers.")
    return parser


def add_dynamic_batch_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider`` for Megatron-LM: the dynamic-batching flags of
    :func:`megatron_dynbatch.megatron.args.add_dynamic_batch_args` plus the data-source flags. To keep another provider
    (e.g. ModelOpt's), chain them: ``extra_args_provider=lambda p: add_dynamic_batch_args(add_modelopt_args(p))``.
    On a Megatron-LM whose parser has ``--sequence-packing-scheduler`` it also registers this planner there
    (:func:`megatron_dynbatch.integrations.megatron_packing.register_packing_scheduler`)."""
    from ..megatron.args import add_dynamic_batch_args as add_core_args
    from .megatron_packing import extend_scheduler_flag, register_packing_scheduler

    if extend_scheduler_flag(parser):  # a Megatron-LM with --sequence-packing-scheduler: offer `dynbatch` there
        register_packing_scheduler()
    return add_data_source_args(add_core_args(parser))


def check_megatron_lm_args(args: Any) -> None:
    """Checks specific to running inside Megatron-LM's ``pretrain()`` (after
    :func:`~megatron_dynbatch.megatron.args.validate_dynamic_batch_args`)."""
    from ..core.errors import DynBatchConfigError

    if not getattr(args, "use_dynamic_batch_size", False):
        raise DynBatchConfigError("--use-dynamic-batch-size", False,
                                  "the megatron_dynbatch hook is installed, so training runs dynamic batching",
                                  "add --use-dynamic-batch-size --max-tokens-per-gpu N (or do not call install())")
    if getattr(args, "dataloader_type", "external") != "external":
        raise DynBatchConfigError("--dataloader-type", args.dataloader_type,
                                  "every rank needs the whole global batch, which Megatron's samplers do not give",
                                  "pass --dataloader-type external")
    if (getattr(args, "eval_iters", 0) or 0) > 0:
        raise DynBatchConfigError("--eval-iters", args.eval_iters, "evaluation is not wired in this entry point",
                                  "pass --eval-iters 0")
    from ..megatron.compat import upstream_cp_rerouting

    rerouting = upstream_cp_rerouting(args)
    if rerouting:
        raise DynBatchConfigError(rerouting[0], True,
                                  "upstream then reroutes samples between ranks itself, which contradicts the "
                                  "plan every rank computes from the whole global batch",
                                  f"drop {rerouting[0]} (use --context-parallel-size; see docs/dynamic_cp.md)")
    if getattr(args, "micro_batch_size", 1) not in (None, 1):
        raise DynBatchConfigError("--micro-batch-size", args.micro_batch_size,
                                  "micro-batches are planned by token budget; Megatron's count must be in samples",
                                  "pass --micro-batch-size 1 and --global-batch-size = samples per optimizer step")


def _length_list(text: str) -> List[int]:
    """argparse type of ``--dynbatch-mock-lengths``: comma-separated positive integers."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give one length >= 2 per sample, e.g. 128,40,16")
    return values


def check_data_source_args(args: Any) -> None:
    """Exactly one of ``--dynbatch-train-data`` / ``--dynbatch-mock-data`` (for :func:`global_batch_datasets_provider`);
    ``--dynbatch-mock-lengths`` only with mock data, one length per sample of the global batch, none over
    ``--seq-length``."""
    from ..core.errors import DynBatchConfigError

    if bool(getattr(args, "dynbatch_train_data", None)) == bool(getattr(args, "dynbatch_mock_data", False)):
        raise DynBatchConfigError("--dynbatch-train-data", getattr(args, "dynbatch_train_data", None),
                                  "give exactly one data source", "pass --dynbatch-train-data FILE or --dynbatch-mock-data")
    lengths = getattr(args, "dynbatch_mock_lengths", None)
    if lengths is None:
        return
    if not getattr(args, "dynbatch_mock_data", False):
        raise DynBatchConfigError("--dynbatch-mock-lengths", ",".join(map(str, lengths)),
                                  "only shapes synthetic data", "add --dynbatch-mock-data, or drop the flag")
    gbs = getattr(args, "global_batch_size", None)
    if gbs is not None and len(lengths) != int(gbs):
        raise DynBatchConfigError("--dynbatch-mock-lengths", f"{len(lengths)} lengths",
                                  f"needs one length per sample of the global batch ({gbs})",
                                  f"give {gbs} lengths, or pass --global-batch-size {len(lengths)}")
    longest = int(getattr(args, "dynbatch_mock_max_length", None) or getattr(args, "seq_length", None) or max(lengths))
    if max(lengths) > longest:
        raise DynBatchConfigError("--dynbatch-mock-lengths", max(lengths),
                                  f"is longer than the longest sample the run allows ({longest})",
                                  "raise --seq-length (and --max-position-embeddings), or shorten the lengths")


def validate_megatron_lm_args(args: Any) -> Any:
    """:func:`~megatron_dynbatch.megatron.args.validate_dynamic_batch_args` + :func:`check_megatron_lm_args`. Cheap and
    idempotent (it runs at each of the points listed in the module docstring). Returns ``args``."""
    from ..megatron.args import validate_dynamic_batch_args

    validate_dynamic_batch_args(args)
    check_megatron_lm_args(args)
    return args


def checked_model_provider(model_provider: Callable[..., Any]) -> Callable[..., Any]:
    """Optional: wrap a Megatron model provider so that the flags are validated on the first model build, the
    earliest point where Megatron's args, layout and vocabulary are all final (before the checkpoint load)."""
    state = {"done": False}

    def provider(*a: Any, **k: Any) -> Any:
        if not state["done"]:
            validate_megatron_lm_args(_megatron_get_args())
            state["done"] = True
        return model_provider(*a, **k)

    return provider


# ================================================================================== global-batch sources
def parse_sample(obj: Any, where: str) -> Dict[str, Any]:
    """One JSONL record -> a sample dict of Python lists (validated; ``where`` names the line in errors)."""
    from ..core.errors import DynBatchConfigError

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
                raise DynBatchConfigError(f"{where}.{key}", f"{len(obj[key]) if isinstance(obj[key], list) else obj[key]}",
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


class JsonlGlobalBatches(Iterator[List[Dict[str, Any]]]):
    """Global batches of ``batch_size`` consecutive JSONL samples, starting after ``start_sample`` samples
    (Megatron's ``consumed_train_samples`` when resuming) and wrapping around at the end of the file."""

    def __init__(self, path: str, batch_size: int, *, start_sample: int = 0, as_torch: bool = True) -> None:
        from ..core.errors import DynBatchConfigError

        if not os.path.isfile(path):
            raise DynBatchConfigError("--dynbatch-train-data", path, "file not found", "pass a JSON-lines file")
        with open(path, encoding="utf-8") as fh:
            records = [(i + 1, line) for i, line in enumerate(fh) if line.strip()]
        if not records:
            raise DynBatchConfigError("--dynbatch-train-data", path, "the file holds no samples", "write one JSON per line")
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
        self.seed, self.group_size, self.k, self.as_torch = int(seed), max(1, int(group_size)), int(start_batch), as_torch
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        if self.lengths is not None and (len(self.lengths) != self.batch_size or min(self.lengths) < 2):
            from ..core.errors import DynBatchConfigError

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


def global_batch_datasets_provider(train_val_test_num_samples: Any, vp_stage: Optional[int] = None):
    """Megatron datasets provider for ``--dataloader-type external``: ``(train iterator, None, None)``; the
    iterator yields whole global batches from ``--dynbatch-train-data`` or ``--dynbatch-mock-data``. Validates
    the flags first (this runs before Megatron builds a data loader around the result)."""
    args = _megatron_get_args()
    validate_megatron_lm_args(args)
    check_data_source_args(args)
    return _global_batch_source(args), None, None


global_batch_datasets_provider.is_distributed = True  # type: ignore[attr-defined]  # every rank builds it


class PlainMicroBatches(Iterator[Dict[str, Any]]):
    """The SAME global batches cut the way plain Megatron batching cuts them, for A/B runs without the hook.

    Megatron's pretraining sampler gives DP rank ``r`` samples ``[k*mbs*dp + r*mbs, ... + mbs)`` of a global
    batch as its micro-batch ``k``; each sample is padded to ``seq_length`` (labels and loss mask exactly as
    :func:`~megatron_dynbatch.megatron.packing.pack_microbatch` makes them, loss mask 0 on padding). Yields
    Megatron's micro-batch dicts (``tokens``, ``labels``, ``loss_mask``, ``position_ids``, each
    ``[mbs, seq_length]``; ``attention_mask`` ``[mbs, 1, S, S]`` too when Megatron's
    ``--create-attention-mask-in-dataloader`` asks for it), which Megatron-LM's own ``pretrain_gpt.forward_step``
    consumes. With
    ``--calculate-per-token-loss`` Megatron's loss is then the global token mean, the quantity the hook's
    default ``token_mean`` computes from packed micro-batches."""

    def __init__(self, global_batches: Iterator[List[Dict[str, Any]]], *, micro_batch_size: int, seq_length: int,
                 dp_rank: int, dp_size: int, attention_mask: bool = False) -> None:
        self.source, self.mbs, self.seq_length = global_batches, int(micro_batch_size), int(seq_length)
        self.attention_mask = bool(attention_mask)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self._pending: List[Dict[str, Any]] = []

    def __next__(self) -> Dict[str, Any]:
        import torch

        from ..core.errors import DynBatchConfigError
        from ..megatron.packing import pack_microbatch

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


def plain_batches_datasets_provider(train_val_test_num_samples: Any, vp_stage: Optional[int] = None):
    """Megatron datasets provider for the A/B run WITHOUT the hook: the same data flags, the same global batches,
    cut into plain fixed micro-batches (:class:`PlainMicroBatches`) for Megatron-LM's own forward step."""
    from megatron.core import parallel_state

    args = _megatron_get_args()
    check_data_source_args(args)
    train = PlainMicroBatches(_global_batch_source(args), micro_batch_size=args.micro_batch_size,
                              seq_length=args.seq_length, dp_rank=parallel_state.get_data_parallel_rank(),
                              dp_size=parallel_state.get_data_parallel_world_size(),
                              attention_mask=bool(getattr(args, "create_attention_mask_in_dataloader", False)))
    return train, None, None


plain_batches_datasets_provider.is_distributed = True  # type: ignore[attr-defined]


# ==================================================================================== the schedule hook
#: Extra per-step statistics the hook adds to Megatron's loss dicts (logged in its iteration line, TensorBoard
#: and W&B as the mean over the log interval): real tokens of the global batch, and tokens incl. padding.
STAT_KEYS = ("dynbatch tokens", "dynbatch padded tokens")


def megatron_loss_dicts(loss: Optional[float], num_microbatches: int, device: Any = None,
                        stats: Optional[Mapping[str, float]] = None) -> List[Dict[str, Any]]:
    """What ``train_step`` reduces on the last pipeline stage: one ``{"lm loss": tensor([L]), **stats}`` per
    micro-batch. Megatron averages one-element entries over micro-batches, so it logs exactly the step's loss
    ``L`` (already reduced over DP x CP by the dynamic schedule) and each statistic; ``[]`` off the last stage."""
    if loss is None:
        return []
    import torch

    entries = {"lm loss": float(loss), **{k: float(v) for k, v in (stats or {}).items()}}
    return [{k: torch.tensor([v], dtype=torch.float32, device=device) for k, v in entries.items()}
            for _ in range(max(1, int(num_microbatches)))]


#: Megatron schedule keywords the wrapper sets itself (everything else is passed through).
_OWN_KWARGS = ("forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length", "micro_batch_size",
               "decoder_seq_length", "forward_only")


class DynamicForwardBackward:
    """A drop-in ``forward_backward_func`` (Megatron's keyword signature) that runs each global batch with a
    dynamic-batching plan. ``inner`` is Megatron's real schedule; ``args`` Megatron's parsed args."""

    def __init__(self, inner: Callable[..., Any], args: Any, *, run_step: Optional[Callable[..., Any]] = None,
                 plan_options: Optional[Callable[[Any], Any]] = None, device: Any = None) -> None:
        self.inner = inner
        self.args = args
        self.run_step = run_step
        self.plan_options = plan_options  # args -> PlanOptions (or a dict of them); default: the launch flags
        self.device = device
        self.last_result: Any = None
        self.last_lengths: List[int] = []
        self.last_model: Any = None
        self.calibrator: Any = None  # online calibration (--dynbatch-online-calibration), made on the first step

    def __call__(self, *, data_iterator: Any, model: Any, forward_only: bool = False, **kwargs: Any) -> List[Dict[str, Any]]:
        from ..core.errors import DynBatchConfigError

        if forward_only:
            raise DynBatchConfigError("--eval-iters", getattr(self.args, "eval_iters", None),
                                      "evaluation is not wired in the Megatron-LM hook", "pass --eval-iters 0")
        source = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
        if source is None:
            raise DynBatchConfigError("data_iterator", None, "this rank has no training data iterator",
                                      "use global_batch_datasets_provider (is_distributed=True) with "
                                      "--dataloader-type external")
        samples = next(source)
        if not isinstance(samples, list) or not samples or not isinstance(samples[0], Mapping):
            raise DynBatchConfigError("data_iterator", type(samples).__name__,
                                      "must yield the whole global batch as a list of sample dicts",
                                      "yield [{'tokens': LongTensor, ...}, ...] (the same list on every rank)")
        run_step = self.run_step or _default_run_step
        from ..core.planner.api import options_of
        from ..megatron.args import plan_options_from_args

        given = (self.plan_options or plan_options_from_args)(self.args)
        opts = given if not isinstance(given, Mapping) else options_of(None, given)
        opts = opts.replace(samples_per_step=None)  # one Megatron iteration = one optimizer step = this global batch
        passthrough = {k: v for k, v in kwargs.items() if k not in _OWN_KWARGS}
        if getattr(self.args, "dynbatch_online_calibration", False):
            passthrough["calibrator"] = self._calibrator(opts)
        result = run_step(model, samples, opts, forward_backward_func=self.inner,
                          loss_mode=getattr(self.args, "dynbatch_loss_mode", "token_mean") or "token_mean",
                          group_reduce=getattr(self.args, "dynbatch_group_reduce", "token") or "token",
                          **passthrough)
        self.last_result = result
        self.last_lengths = [int(len(smp["tokens"])) for smp in samples]
        self.last_model = opts.model
        plan = getattr(getattr(result, "iterator", None), "plan", None)
        stats = {STAT_KEYS[0]: float(sum(self.last_lengths))}
        if plan is not None:
            stats[STAT_KEYS[1]] = float(sum(sum(r) for r in plan.microbatch_tokens))
            self._log_plan(plan)
        return megatron_loss_dicts(result.loss, result.num_microbatches, device=self.device, stats=stats)

    def _calibrator(self, options: Any) -> Any:
        """The rank's :class:`~megatron_dynbatch.megatron.online_calibration.OnlineCalibrator`: it plans with the
        refitted model once there is one (``dynamic_forward_backward`` swaps it in), the configured
        ``--dynbatch-cost-model`` before and as the prior's shape."""
        if self.calibrator is None:
            from ..core.calibration.online import DEFAULT_INTERVAL
            from ..megatron.online_calibration import OnlineCalibrator

            interval = getattr(self.args, "dynbatch_calibration_interval", None) or DEFAULT_INTERVAL
            self.calibrator = OnlineCalibrator(options.model, options.parallel, interval=interval,
                                               base=getattr(self.args, "dynbatch_cost_model", None),
                                               device=self.device)
        return self.calibrator

    def _log_plan(self, plan: Any) -> None:
        """One ``dynbatch plan | iteration N | ...`` line (:func:`plan_log_line`) on global rank 0, on the
        iterations Megatron logs (``--log-interval``)."""
        iteration = int(getattr(self.args, "curr_iteration", 0) or 0) + 1
        interval = int(getattr(self.args, "log_interval", 1) or 1)
        if iteration % interval:
            return
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
                return
        except ImportError:  # pragma: no cover
            pass
        print(f"dynbatch plan | iteration {iteration:8d} | {plan_log_line(plan)}", flush=True)

    def step_flops(self) -> Optional[float]:
        """Training (forward + backward) FLOPs of the last global batch from its REAL sample lengths
        (:func:`megatron_dynbatch.core.flops.calculate_fwd_flops` x 3), or None before the first step."""
        if not getattr(self, "last_lengths", None) or self.last_model is None:
            return None
        from ..core.flops import FWD_BWD_FACTOR, calculate_fwd_flops

        return float(calculate_fwd_flops(self.last_lengths, self.last_model) * FWD_BWD_FACTOR)


def plan_log_line(plan: Any) -> str:
    """What the hook logs about a step's plan: micro-batches per GPU (the count every GPU runs) and, for a
    dynamic-CP plan, how many micro-batches ran on CP groups of each size and the modelled speed-up over the
    fixed layout's plan, e.g. ``micro-batches per GPU: 3 | cp groups (size: count): 1: 6, 2: 1, 4: 1 |
    modelled speed-up vs fixed cp: 1.008``."""
    parts = [f"micro-batches per GPU: {plan.num_microbatches}"]
    group_sizes = getattr(plan, "group_sizes", None)
    if callable(group_sizes):
        sizes = group_sizes()
        parts.append("cp groups (size: count): " + ", ".join(f"{g}: {n}" for g, n in sorted(sizes.items())))
        speedup = float(plan.speedup_vs_fixed_cp)
        parts.append("modelled speed-up vs fixed cp: " + (f"{speedup:.3f}" if np.isfinite(speedup) else
                                                          "n/a (the fixed layout cannot hold this batch)"))
    else:
        parts.append(f"cp groups (size: count): {plan.parallel.cp}: {plan.num_microbatches * plan.parallel.dp}")
    return " | ".join(parts)


def _default_run_step(*a: Any, **k: Any) -> Any:
    from ..megatron.schedule import dynamic_forward_backward

    return dynamic_forward_backward(*a, **k)


def install(training_module: Any = None, *, get_args: Optional[Callable[[], Any]] = None,
            validate: bool = True) -> Callable[[], None]:
    """Patch ``training_module.get_forward_backward_func`` (default ``megatron.training.training``, imported
    lazily; :class:`MegatronLMNotFoundError` if absent) so that the schedule Megatron's ``train()`` obtains is
    wrapped in :class:`DynamicForwardBackward`, and (when the module has it) ``num_floating_point_operations``
    so that FLOPs and TFLOP/s count the real lengths (:meth:`DynamicForwardBackward.step_flops`). Call it before ``pretrain()``. With ``validate`` the flags are
    checked (:func:`validate_megatron_lm_args`) each time the schedule is fetched. Idempotent; returns a
    function that restores the original."""
    if training_module is None:
        training_module = import_megatron_training().training
    original = getattr(training_module, "get_forward_backward_func", None)
    if original is None:
        raise RuntimeError("megatron.training.training has no get_forward_backward_func: this Megatron-LM "
                           "version obtains its schedule differently; wrap the call site by hand "
                           "(see the docstring of megatron_dynbatch/integrations/megatron_lm.py)")
    if getattr(original, "_dynbatch_original", None) is not None:
        original = original._dynbatch_original  # already installed: wrap the real one again
    read_args = get_args or _megatron_get_args

    state: Dict[str, Any] = {}

    def get_forward_backward_func(*a: Any, **k: Any) -> DynamicForwardBackward:
        args = read_args()
        if validate:
            validate_megatron_lm_args(args)
        state["fb"] = DynamicForwardBackward(original(*a, **k), args, device=_current_device())
        return state["fb"]

    get_forward_backward_func._dynbatch_original = original  # type: ignore[attr-defined]
    training_module.get_forward_backward_func = get_forward_backward_func
    flops_original = getattr(training_module, "num_floating_point_operations", None)
    flops_original = getattr(flops_original, "_dynbatch_original", flops_original)
    if flops_original is not None:
        def num_floating_point_operations(args: Any, batch_size: Any, *a: Any, **k: Any) -> Any:
            fb = state.get("fb")
            real = fb.step_flops() if fb is not None else None
            return flops_original(args, batch_size, *a, **k) if real is None else real

        num_floating_point_operations._dynbatch_original = flops_original  # type: ignore[attr-defined]
        training_module.num_floating_point_operations = num_floating_point_operations

    def restore() -> None:
        training_module.get_forward_backward_func = original
        if flops_original is not None:
            training_module.num_floating_point_operations = flops_original

    return restore


def _current_device() -> Any:
    try:
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover
        return None


def help_text(prog: str = "pretrain_gpt_dynbatch.py", description: Optional[str] = None) -> str:
    """``--help`` text of the flags :func:`add_dynamic_batch_args` adds (Megatron-LM's own ``--help`` does not
    list extra-args providers: its fault-tolerance setup parses the command line before ``pretrain`` adds them)."""
    parser = argparse.ArgumentParser(prog=prog, add_help=False, description=description)
    add_dynamic_batch_args(parser)
    return parser.format_help()
