"""Test support: run real megatron-core on CPU with gloo, and spawn several ranks from one test.

* :mod:`megatron_dynbatch.testing.megatron_cpu` -- the documented CPU shims, distributed init/teardown and
  tiny GPT builders;
* :mod:`megatron_dynbatch.testing.multiproc` -- ``run_ranks(fn, world_size, *args)``.

Nothing here is imported by the library itself; megatron-core is imported only when these modules are.
"""
