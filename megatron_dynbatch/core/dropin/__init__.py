"""The planning side of the RL-trainer drop-ins: pure functions (lengths in, the trainer's index structures out)
that :mod:`megatron_dynbatch.integrations` wraps in each trainer's own signature and data types, and that the
benchmark (:mod:`megatron_dynbatch.bench.dropins`) scores against the trainers' own algorithms.

One module per trainer -- :mod:`.slime`, :mod:`.verl`, :mod:`.nemo_rl`, :mod:`.roll`, and Megatron-LM's own
packing paths :mod:`.megatron_packing` (Megatron-Core's sequence-packing scheduler) and :mod:`.megatron_rl`
(Megatron RL's trajectory packing) -- each stating in its docstring the contract it keeps (read from the
trainer's public source) and the guarantees it adds: the hard cap with the trainer's own padding counted, equal
micro-batch counts, FLOPs balance, Megatron's exact VPP rule. Each takes what its trainer passes (lists, arrays,
tensors of any device and dtype, whole-number floats) and raises in its trainer's words and exception type
(:mod:`.words`). Shared by several: :mod:`.balance` (what the Megatron RL and NeMo-RL drop-ins balance by),
:mod:`.sequence_limit` (a cap on the sequences in one micro-batch), :mod:`.budgets` (each trainer's configured
budgets, read for the start-up memory check). Torch-free like the rest of ``core/``.
"""
