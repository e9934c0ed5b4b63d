"""The planning side of the RL-trainer drop-ins: pure functions (lengths in, the trainer's index structures out)
that :mod:`megatron_dynbatch.integrations` wraps in each trainer's own signature and data types, and that the
benchmark (:mod:`megatron_dynbatch.bench.dropins`) scores against the trainers' own algorithms.

One module per trainer -- :mod:`.slime`, :mod:`.verl`, :mod:`.nemo_rl`, :mod:`.roll` -- each stating in its
docstring the contract it keeps (read from the trainer's public source) and the guarantees it adds: the hard
cap with the trainer's own padding counted, equal micro-batch counts, FLOPs balance, Megatron's exact VPP rule.
Each takes what its trainer passes (lists, arrays, tensors of any device and dtype, whole-number floats) and
raises in its trainer's words and exception type (:mod:`.words`). Torch-free like the rest of ``core/``.
"""
