"""Adapters for the trainers that drive Megatron: the Megatron-LM ``pretrain()`` hook (``megatron_lm``) and Ray
trainers in the slime / ROLL style (``ray``). Each imports its framework lazily."""
