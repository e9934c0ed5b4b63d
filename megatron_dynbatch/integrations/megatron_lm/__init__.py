"""Dynamic batching inside Megatron-LM's own ``pretrain()`` loop: the hook, the flags and the batch sources.

The lines to add to an existing Megatron-LM launch script (for example a copy of ``pretrain_gpt.py``)::

    from megatron_dynbatch.integrations.megatron_lm import (add_dynamic_batch_args, global_batch_datasets_provider,
                                                            install)

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

One module per job; this file only hands their public names on:

* :mod:`.hook` -- :func:`install` and :class:`DynamicForwardBackward`: where the hook sits in Megatron-LM's
  ``train()`` and how each global batch is planned and run instead of the fixed micro-batches;
* :mod:`.flags` -- :func:`add_dynamic_batch_args` (the ``extra_args_provider``) and the checks of the flags;
* :mod:`.sources` -- the datasets providers and the global-batch sources (JSON lines, synthetic, the plain A/B
  baseline), with the data contract a provider of your own must keep;
* :mod:`.training` -- Megatron-LM's ``megatron.training``, imported only where needed: everything else works
  without it.
"""

from __future__ import annotations

from .flags import (add_data_source_args, add_dynamic_batch_args, check_data_source_args, check_megatron_lm_args,
                    checked_model_provider, help_text, validate_megatron_lm_args)
from .hook import DynamicForwardBackward, install, megatron_loss_dicts, plan_log_line
from .sources import (JsonlGlobalBatches, MockGlobalBatches, PlainMicroBatches, global_batch_datasets_provider,
                      parse_sample, plain_batches_datasets_provider, to_torch_sample)
from .training import MISSING_MEGATRON_LM, MegatronLMNotFoundError, import_megatron_training

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
