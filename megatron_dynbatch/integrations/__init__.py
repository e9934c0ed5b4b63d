"""Adapters for the trainers that drive Megatron: the Megatron-LM ``pretrain()`` hook (``megatron_lm``), Ray
trainers in the slime / ROLL style (``ray``), and drop-ins that replace one batching function of a trainer in its
own signature -- :mod:`.slime`, :mod:`.verl`, :mod:`.roll`, :mod:`.nemo_rl`, and Megatron-LM's own packing paths
:mod:`.megatron_packing` (Megatron-Core's sequence-packing scheduler) and :mod:`.megatron_rl` (Megatron RL's
trajectory packing); :mod:`.budget_check` is the drop-ins' start-up memory check. The planning half of each
drop-in is torch-free, in :mod:`megatron_dynbatch.core.dropin`. Each imports its framework lazily."""
