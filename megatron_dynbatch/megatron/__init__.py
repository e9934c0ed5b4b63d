"""The torch / megatron-core edge: turns a plan into packed THD micro-batches for Megatron's
``forward_backward_func`` and brings per-sample results back in sample order.

torch is imported by the modules that compute with it (``packing``, ``context_parallel``, ``attention``,
``norms``, ``specs``); megatron-core only inside the functions that need it, so ``iterator``, ``loss``,
``schedule`` and ``args`` import without it. Planning itself lives in :mod:`megatron_dynbatch.core`.
"""
