#!/usr/bin/env python
"""Megatron-LM ``pretrain()`` entry point for GPT models with megatron-dynbatch dynamic micro-batches.

Run it like Megatron-LM's ``pretrain_gpt.py`` (with a Megatron-LM checkout on ``PYTHONPATH``, or
``MEGATRON_LM_DIR`` set) and add the dynamic-batching flags::

    torchrun --nproc-per-node 8 scripts/pretrain_gpt_dynbatch.py <Megatron flags> \\
        --use-dynamic-batch-size --balance-by-flops --max-tokens-per-gpu 16384 \\
        --micro-batch-size 1 --global-batch-size 256 --dataloader-type external --eval-iters 0 \\
        --dynbatch-train-data samples.jsonl          # or --dynbatch-mock-data

This file is only the entry point. The hook, the flags and the batch sources live in
:mod:`megatron_dynbatch.integrations.megatron_lm` (``hook.py``'s docstring says how the hook works); to add dynamic
batching to a launch script of your own, these are the lines::

    from megatron_dynbatch.integrations.megatron_lm import (add_dynamic_batch_args, global_batch_datasets_provider,
                                                            install)

    install()
    pretrain(global_batch_datasets_provider, partial(model_provider, gpt_builder), ModelType.encoder_or_decoder,
             forward_step, args_defaults={'tokenizer_type': 'GPT2BPETokenizer', 'dataloader_type': 'external'},
             extra_args_provider=add_dynamic_batch_args)

Without ``--use-dynamic-batch-size`` the same command runs plain Megatron batching on the same samples
(fixed ``--micro-batch-size`` micro-batches padded to ``--seq-length``, Megatron-LM's own ``forward_step``):
the A/B baseline. On a machine without CUDA the CPU shims of ``megatron_dynbatch.megatron.cpu`` are
installed (tests and smoke runs only). Without Megatron-LM (``megatron.training`` is not part of the
megatron-core wheel) the script still answers ``--help`` and explains what to install.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional, Sequence

try:
    from megatron_dynbatch.integrations import megatron_lm
except ImportError:  # a checkout that is not pip-installed: use the package next to scripts/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_dynbatch.integrations import megatron_lm

DESCRIPTION = __doc__.split("\n\n")[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run Megatron-LM's ``pretrain()`` with the dynamic-batching hook installed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = "-h" in argv or "--help" in argv
    try:
        megatron_lm.import_megatron_training()
    except megatron_lm.MegatronLMNotFoundError as exc:
        if wants_help:
            print(megatron_lm.help_text(description=DESCRIPTION)
                  + "\nMegatron-LM's own flags are listed here once megatron.training is importable.\n"
                  + megatron_lm.MISSING_MEGATRON_LM + "\n")
            return 0
        print(f"error: {exc}", file=sys.stderr)
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
    if wants_help:
        print(megatron_lm.help_text(description=DESCRIPTION) + "\nMegatron-LM's flags follow.\n", flush=True)
    sys.argv = [sys.argv[0]] + argv
    import torch

    if not torch.cuda.is_available():  # CPU smoke/test runs only: the documented shims
        from megatron_dynbatch.megatron import cpu as megatron_cpu

        megatron_cpu.install_megatron_lm_cpu_shims()
        gpt_builder = megatron_cpu.thd_gpt_builder(gpt_builder)
    model = partial(model_provider, gpt_builder)
    if "--use-dynamic-batch-size" in argv:
        megatron_lm.install()
        datasets, forward_step = megatron_lm.global_batch_datasets_provider, _unused_forward_step
        model = megatron_lm.checked_model_provider(model)
    else:  # the A/B baseline: the same data in plain fixed micro-batches, Megatron-LM's own forward step
        from pretrain_gpt import forward_step

        datasets = megatron_lm.plain_batches_datasets_provider
    pretrain(
        datasets,
        model,
        ModelType.encoder_or_decoder,
        forward_step,
        extra_args_provider=megatron_lm.add_dynamic_batch_args,
        args_defaults={"dataloader_type": "external", "eval_interval": 1000},
    )
    return 0


def _unused_forward_step(data_iterator: Any, model: Any) -> Any:  # pragma: no cover - never called
    """Megatron requires a forward step; the dynamic schedule uses its own packed-THD forward step instead."""
    raise RuntimeError("the dynamic-batching hook is not installed: call megatron_lm.install() before pretrain()")


if __name__ == "__main__":
    sys.exit(main())
