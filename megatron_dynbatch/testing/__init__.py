"""Test support, never imported by the library: references and stand-ins the tests compare against.

* :mod:`megatron_dynbatch.testing.attention_ref` -- the per-sample attention reference of the THD tests;
* :mod:`megatron_dynbatch.testing.exact` -- exact bin packing: whether a small step fits ``k`` bins at all, to
  check a planner refusal independently;
* :mod:`megatron_dynbatch.testing.peer_types` / :mod:`~megatron_dynbatch.testing.peer_models` -- stand-ins for the
  trainers' data types and models of their batching functions;
* :mod:`megatron_dynbatch.testing.upstream_packing` / :mod:`~megatron_dynbatch.testing.upstream_rl` -- Megatron-LM's
  own packing paths on gloo ranks (``MEGATRON_LM_DIR``).

What the shipped code needs to run megatron-core on CPU ranks (the demo, ``calibrate``'s slices, the whole-model
memory bench) lives in the package proper: :mod:`megatron_dynbatch.megatron.cpu` (the documented CPU shims,
distributed init, tiny GPT builders) and :mod:`megatron_dynbatch.megatron.ranks` (``run_ranks``).
"""
