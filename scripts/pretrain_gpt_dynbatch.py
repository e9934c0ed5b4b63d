#!/usr/bin/env python
"""Megatron-LM ``pretrain()`` entry point for GPT models with megatron-dynbatch dynamic micro-batches.

Run it like Megatron-LM's ``pretrain_gpt.py`` (from a Megatron-LM checkout on ``PYTHONPATH``, or with
``MEGATRON_LM_DIR`` set) and add the dynamic-batching flags::

    torchrun --nproc-per-node 8 scripts/pretrain_gpt_dynbatch.py <Megatron flags> \\
        --use-dynamic-batch-size --balance-by-flops --max-tokens-per-gpu 16384 \\
        --micro-batch-size 1 --global-batch-size 256 --dataloader-type external --eval-iters 0 \\
        --dynbatch-train-data samples.jsonl          # or --dynbatch-mock-data

How it hooks in (the least invasive place)
------------------------------------------
Megatron-LM's ``train()`` (``megatron/training/training.py``) obtains the schedule ONCE, through the name
``get_forward_backward_func`` that the module imported from ``megatron.core.pipeline_parallel``, and hands it
to every ``train_step``; ``train_step`` calls it with ``num_microbatches=get_num_microbatches()`` (the fixed
``global_batch_size / (micro_batch_size * dp)``). :func:`install` replaces that ONE module attribute,
``megatron.training.training.get_forward_backward_func``, by a function that returns Megatron's real schedule
wrapped in :class:`DynamicForwardBackward`. The wrapper ignores the fixed count: it takes one global batch from
the data iterator, plans it (:func:`megatron_dynbatch.args.plan_kwargs_from_args`: identical plan on every
rank, no communication) and runs it through :func:`megatron_dynbatch.schedule.dynamic_forward_backward` with the
plan's micro-batch count, THD packing and exact loss normalisation. Nothing else in Megatron is patched, so the
optimizer step, gradient finalisation, checkpointing and logging are Megatron's own.

The lines to add to an existing launch script (e.g. a copy of ``pretrain_gpt.py``)::

    from megatron_dynbatch.args import add_dynamic_batch_args        # 1. the flags
    import pretrain_gpt_dynbatch as dynbatch                          #    (this file, scripts/ on PYTHONPATH)
    dynbatch.install()                                                # 2. patch get_forward_backward_func
    pretrain(dynbatch.global_batch_datasets_provider,                 # 3. every rank gets the same global batch
             dynbatch.checked_model_provider(model_provider_fn),      # 4. validate the flags at model build
             ModelType.encoder_or_decoder, forward_step,
             extra_args_provider=dynbatch.extra_args_provider)        # 5. our flags + this script's data flags

Data contract: with ``--dataloader-type external`` the datasets provider's train object IS the iterator; it must
yield the WHOLE global batch (``--global-batch-size`` sample dicts, the same on every rank: ``tokens``, optional
``loss_mask`` / ``labels`` / ``group_id``), because the plan is computed from all lengths on every rank.

Caveats: Megatron's own ``get_num_microbatches()`` still drives bookkeeping that does not touch the data: with
``--micro-batch-size 1 --global-batch-size N`` its sample counter and learning-rate schedule count N samples
per step, which is exact; MoE auxiliary-loss *logging* divides by that count instead of the planned one.
Evaluation through this entry point is not wired: pass ``--eval-iters 0``.

Without Megatron-LM (``megatron.training`` is not part of the megatron-core wheel) the script still answers
``--help`` and explains what to install; the pure-Python parts are unit-tested in ``tests/test_scripts.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import numpy as np

MISSING_MEGATRON_LM = (
    "pretrain_gpt_dynbatch.py needs Megatron-LM's training package (megatron.training), which the megatron-core "
    "wheel does not contain. Clone Megatron-LM at the tag matching your megatron-core (e.g. core_v0.16.1) and "
    "put it on PYTHONPATH, or set MEGATRON_LM_DIR=/path/to/Megatron-LM. The planner, the CLI and the CPU demo "
    "(`megatron-dynbatch demo`) work without it."
)


# ================================================================================== flags of this script
def add_entry_point_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Data flags of this entry point (separate from :mod:`megatron_dynbatch.args`, which is shared)."""
    g = parser.add_argument_group(title="dynbatch entry point", description="data source of pretrain_gpt_dynbatch.py")
    g.add_argument("--dynbatch-train-data", type=str, default=None, metavar="JSONL",
                   help="JSON-lines file, one sample per line: {\"tokens\": [...], \"loss_mask\": [...] (optional), "
                        "\"labels\": [...] (optional), \"group_id\": ... (optional)}. Read by every rank; one global "
                        "batch = --global-batch-size consecutive lines; wraps around at the end.")
    g.add_argument("--dynbatch-mock-data", action="store_true", default=False,
                   help="Synthetic long-tailed samples (seeded, identical on every rank) for smoke and speed runs.")
    g.add_argument("--dynbatch-mock-max-length", type=int, default=None,
                   help="Longest synthetic sample (default --seq-length).")
    return parser


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: the dynamic-batching flags plus this script's data flags."""
    from megatron_dynbatch.args import add_dynamic_batch_args

    return add_entry_point_args(add_dynamic_batch_args(parser))


def check_entry_point_args(args: Any) -> None:
    """Checks specific to this entry point (after :func:`validate_dynamic_batch_args`)."""
    from megatron_dynbatch.errors import DynBatchConfigError

    if not getattr(args, "use_dynamic_batch_size", False):
        raise DynBatchConfigError("--use-dynamic-batch-size", False, "this entry point only runs dynamic batching",
                                  "add --use-dynamic-batch-size --max-tokens-per-gpu N, or use pretrain_gpt.py")
    if getattr(args, "dataloader_type", "external") != "external":
        raise DynBatchConfigError("--dataloader-type", args.dataloader_type,
                                  "every rank needs the whole global batch, which Megatron's samplers do not give",
                                  "pass --dataloader-type external")
    if bool(getattr(args, "dynbatch_train_data", None)) == bool(getattr(args, "dynbatch_mock_data", False)):
        raise DynBatchConfigError("--dynbatch-train-data", getattr(args, "dynbatch_train_data", None),
                                  "give exactly one data source", "pass --dynbatch-train-data FILE or --dynbatch-mock-data")
    if (getattr(args, "eval_iters", 0) or 0) > 0:
        raise DynBatchConfigError("--eval-iters", args.eval_iters, "evaluation is not wired in this entry point",
                                  "pass --eval-iters 0")
    if getattr(args, "micro_batch_size", 1) not in (None, 1):
        raise DynBatchConfigError("--micro-batch-size", args.micro_batch_size,
                                  "micro-batches are planned by token budget; Megatron's count must be in samples",
                                  "pass --micro-batch-size 1 and --global-batch-size = samples per optimizer step")


# ================================================================================== global-batch sources
def parse_sample(obj: Any, where: str) -> Dict[str, Any]:
    """One JSONL record -> a sample dict of Python lists (validated; ``where`` names the line in errors)."""
    from megatron_dynbatch.errors import DynBatchConfigError

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
    """Lists -> tensors in the layout :class:`~megatron_dynbatch.iterator.DynamicBatchIterator` takes."""
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
        from megatron_dynbatch.errors import DynBatchConfigError

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
    ``group_size`` responses per prompt id. Batch ``k`` depends only on ``(seed, k)``: identical on every rank."""

    def __init__(self, batch_size: int, *, vocab_size: int, max_length: int, seed: int = 1234,
                 group_size: int = 8, start_batch: int = 0, as_torch: bool = True) -> None:
        self.batch_size, self.vocab_size, self.max_length = int(batch_size), int(vocab_size), int(max_length)
        self.seed, self.group_size, self.k, self.as_torch = int(seed), max(1, int(group_size)), int(start_batch), as_torch

    def __next__(self) -> List[Dict[str, Any]]:
        rng = np.random.default_rng([self.seed, self.k])
        out = []
        for i in range(self.batch_size):
            prompt = int(rng.integers(8, max(9, min(512, self.max_length // 4))))
            resp = int(np.clip(rng.lognormal(mean=np.log(max(2, self.max_length) / 8), sigma=1.0), 1,
                               max(1, self.max_length - prompt)))
            n = prompt + resp
            mask = [0] * (prompt - 1) + [1] * resp + [0]  # label positions that predict response tokens
            s = {"tokens": rng.integers(1, self.vocab_size, n).tolist(), "loss_mask": mask,
                 "group_id": self.k * self.batch_size // self.group_size + i // self.group_size}
            out.append(to_torch_sample(s) if self.as_torch else s)
        self.k += 1
        return out


def global_batch_datasets_provider(train_val_test_num_samples: Any, vp_stage: Optional[int] = None):
    """Megatron datasets provider for ``--dataloader-type external``: (train iterator, None, None)."""
    from megatron.training import get_args

    args = get_args()
    if getattr(args, "dynbatch_mock_data", False):
        train = MockGlobalBatches(args.global_batch_size, vocab_size=int(args.padded_vocab_size),
                                  max_length=int(args.dynbatch_mock_max_length or args.seq_length), seed=int(args.seed),
                                  start_batch=int(args.consumed_train_samples) // int(args.global_batch_size))
    else:
        train = JsonlGlobalBatches(args.dynbatch_train_data, args.global_batch_size,
                                   start_sample=int(args.consumed_train_samples))
    return train, None, None


global_batch_datasets_provider.is_distributed = True  # type: ignore[attr-defined]  # every rank builds it


# ==================================================================================== the schedule hook
def megatron_loss_dicts(loss: Optional[float], num_microbatches: int, device: Any = None) -> List[Dict[str, Any]]:
    """What ``train_step`` reduces on the last pipeline stage: one ``{"lm loss": tensor([L])}`` per micro-batch.
    Megatron averages one-element entries over micro-batches, so it logs exactly the step's loss ``L``
    (already reduced over DP x CP by the dynamic schedule); ``[]`` off the last stage."""
    if loss is None:
        return []
    import torch

    value = torch.tensor([float(loss)], dtype=torch.float32, device=device)
    return [{"lm loss": value} for _ in range(max(1, int(num_microbatches)))]


#: Megatron schedule keywords the wrapper sets itself (everything else is passed through).
_OWN_KWARGS = ("forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length", "micro_batch_size",
               "decoder_seq_length", "forward_only")


class DynamicForwardBackward:
    """A drop-in ``forward_backward_func`` (Megatron's keyword signature) that runs each global batch with a
    dynamic-batching plan. ``inner`` is Megatron's real schedule; ``args`` Megatron's parsed args."""

    def __init__(self, inner: Callable[..., Any], args: Any, *, run_step: Optional[Callable[..., Any]] = None,
                 plan_kwargs: Optional[Callable[..., Dict[str, Any]]] = None, device: Any = None) -> None:
        self.inner = inner
        self.args = args
        self.run_step = run_step
        self.plan_kwargs = plan_kwargs
        self.device = device
        self.last_result: Any = None

    def __call__(self, *, data_iterator: Any, model: Any, forward_only: bool = False, **kwargs: Any) -> List[Dict[str, Any]]:
        from megatron_dynbatch.errors import DynBatchConfigError

        if forward_only:
            raise DynBatchConfigError("--eval-iters", getattr(self.args, "eval_iters", None),
                                      "evaluation is not wired in pretrain_gpt_dynbatch.py", "pass --eval-iters 0")
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
        plan_kwargs = self.plan_kwargs or _default_plan_kwargs
        run_step = self.run_step or _default_run_step
        pk = dict(plan_kwargs(self.args))
        pk.pop("samples_per_step", None)  # one Megatron iteration = one optimizer step = this global batch
        passthrough = {k: v for k, v in kwargs.items() if k not in _OWN_KWARGS}
        result = run_step(model, samples, pk, forward_backward_func=self.inner,
                          loss_mode=getattr(self.args, "dynbatch_loss_mode", "token_mean") or "token_mean",
                          group_reduce=getattr(self.args, "dynbatch_group_reduce", "token") or "token",
                          **passthrough)
        self.last_result = result
        return megatron_loss_dicts(result.loss, result.num_microbatches, device=self.device)


def _default_plan_kwargs(args: Any) -> Dict[str, Any]:
    from megatron_dynbatch.args import plan_kwargs_from_args

    return plan_kwargs_from_args(args)


def _default_run_step(*a: Any, **k: Any) -> Any:
    from megatron_dynbatch.schedule import dynamic_forward_backward

    return dynamic_forward_backward(*a, **k)


def install(training_module: Any = None, *, get_args: Optional[Callable[[], Any]] = None) -> Callable[[], None]:
    """Patch ``training_module.get_forward_backward_func`` (default ``megatron.training.training``) so that the
    schedule Megatron's ``train()`` obtains is wrapped in :class:`DynamicForwardBackward`. Idempotent; returns
    a function that restores the original."""
    if training_module is None:
        training_module = _import_megatron_training().training
    original = getattr(training_module, "get_forward_backward_func", None)
    if original is None:
        raise RuntimeError("megatron.training.training has no get_forward_backward_func: this Megatron-LM "
                           "version obtains its schedule differently; wrap the call site by hand "
                           "(see the docstring of pretrain_gpt_dynbatch.py)")
    if getattr(original, "_dynbatch_original", None) is not None:
        original = original._dynbatch_original  # already installed: wrap the real one again
    if get_args is None:
        def get_args() -> Any:
            from megatron.training import get_args as megatron_get_args

            return megatron_get_args()

    def get_forward_backward_func(*a: Any, **k: Any) -> DynamicForwardBackward:
        return DynamicForwardBackward(original(*a, **k), get_args(), device=_current_device())

    get_forward_backward_func._dynbatch_original = original  # type: ignore[attr-defined]
    training_module.get_forward_backward_func = get_forward_backward_func

    def restore() -> None:
        training_module.get_forward_backward_func = original

    return restore


def _current_device() -> Any:
    try:
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover
        return None


def checked_model_provider(model_provider: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a Megatron model provider so that the dynamic-batching flags are validated (once) on the first
    model build -- the earliest point where Megatron's args, layout and vocabulary are all final."""
    state = {"done": False}

    def provider(*a: Any, **k: Any) -> Any:
        if not state["done"]:
            from megatron.training import get_args

            from megatron_dynbatch.args import validate_dynamic_batch_args

            args = get_args()
            validate_dynamic_batch_args(args)
            check_entry_point_args(args)
            state["done"] = True
        return model_provider(*a, **k)

    return provider


# ========================================================================================= entry point
def _import_megatron_training() -> Any:
    """``megatron.training`` (with ``MEGATRON_LM_DIR`` added to ``sys.path`` when set), or SystemExit(2) with
    :data:`MISSING_MEGATRON_LM`."""
    root = os.environ.get("MEGATRON_LM_DIR")
    if root and root not in sys.path:
        sys.path.insert(0, root)
    try:
        import megatron.training as training  # noqa: F401
        import megatron.training.training  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"error: {MISSING_MEGATRON_LM} (import failed: {exc})") from None
    return training


def _our_help() -> str:
    """Help for this script's own flag groups (Megatron-LM's ``--help`` does not list extra-args providers:
    its fault-tolerance setup parses the command line before ``pretrain`` adds them)."""
    parser = argparse.ArgumentParser(prog="pretrain_gpt_dynbatch.py", add_help=False,
                                     description=__doc__.split("\n\n")[0])
    extra_args_provider(parser)
    return parser.format_help()


def _help_without_megatron() -> str:
    return _our_help() + "\nMegatron-LM's own flags are listed here once megatron.training is importable.\n" \
        + MISSING_MEGATRON_LM + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run Megatron-LM's ``pretrain()`` with the dynamic-batching hook installed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _import_megatron_training()
    except SystemExit as exc:
        if "-h" in argv or "--help" in argv:
            print(_help_without_megatron())
            return 0
        print(exc, file=sys.stderr)
        return 2
    from functools import partial

    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    try:
        from gpt_builders import gpt_builder  # Megatron-LM root (next to pretrain_gpt.py)
        from model_provider import model_provider
    except ImportError as exc:
        print(f"error: cannot import Megatron-LM's model_provider/gpt_builders ({exc}); run from the Megatron-LM "
              "root or set MEGATRON_LM_DIR", file=sys.stderr)
        return 2
    if "-h" in argv or "--help" in argv:
        print(_our_help() + "\nMegatron-LM's flags follow.\n", flush=True)
    sys.argv = [sys.argv[0]] + argv
    install()
    pretrain(
        global_batch_datasets_provider,
        checked_model_provider(partial(model_provider, gpt_builder)),
        ModelType.encoder_or_decoder,
        _unused_forward_step,
        extra_args_provider=extra_args_provider,
        args_defaults={"dataloader_type": "external"},
    )
    return 0


def _unused_forward_step(data_iterator: Any, model: Any) -> Any:  # pragma: no cover - never called
    """Megatron requires a forward step; the dynamic schedule uses its own packed-THD forward step instead."""
    raise RuntimeError("the dynamic-batching hook is not installed: call install() before pretrain()")


if __name__ == "__main__":
    sys.exit(main())
