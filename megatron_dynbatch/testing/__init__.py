"""Test support: run real megatron-core on CPU with gloo, and spawn several ranks from one test.

* :mod:`megatron_dynbatch.testing.megatron_cpu` -- the documented CPU shims, distributed init/teardown and
  tiny GPT builders;
* :mod:`megatron_dynbatch.testing.multiproc` -- ``run_ranks(fn, world_size, *args)``;
* :mod:`megatron_dynbatch.testing.attention_ref` -- the per-sample attention reference of the THD tests.

Nothing here is imported by the library itself (except the CPU shims, lazily, where megatron-core must run on a
CPU: the demo and ``measure``'s megatron-core slice); megatron-core is imported only when these modules are.
"""
