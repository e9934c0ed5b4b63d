"""The torch / megatron-core edge: turns a plan into packed THD micro-batches for Megatron's
``forward_backward_func`` and brings per-sample results back in sample order.

torch is imported at module level by the modules that compute with it (``packing``, ``context_parallel``,
``varlen``, ``attention``, ``norms``, ``memory_reader``, ``cpu``; ``specs`` through ``attention``), elsewhere
only inside the functions that need it; megatron-core at module level only by ``attention`` (and so ``specs``),
so ``iterator``, ``loss``, ``schedule``, ``args`` and the rest import without it. Planning itself lives in
:mod:`megatron_dynbatch.core`.

Modules, by job:

* planning a rank's share: :mod:`.rank_plan` (plan the global batch or check a given plan, find this GPU's row),
  :mod:`.local` (local mode's one all-reduce), :mod:`.batch_input` (the global batch checked, a shard's view);
* packing: :mod:`.packing` (one micro-batch in Megatron's THD layout), :mod:`.microbatch_packer` (this GPU's
  micro-batches, sliced for CP by :mod:`.context_parallel`), :mod:`.gather` (results back in sample order);
* the loss: :mod:`.loss` (exact normalisation whatever the packing) and :mod:`.step_loss` (one per optimizer
  step);
* running Megatron's schedule: :mod:`.iterator` (``DynamicBatchIterator``), :mod:`.schedule`
  (``dynamic_forward_backward``) with its typed arguments :mod:`.step_config`, :mod:`.dynamic_cp` (per
  micro-batch CP groups), :mod:`.args` (the launch flags);
* watching the run: :mod:`.step_timer` and :mod:`.online_calibration` (timings and refits),
  :mod:`.memory_reader`, :mod:`.memory_guard` and :mod:`.probe` (peaks, the guard, the first-step probe),
  :mod:`.model_layers` (the layers a rank holds), :mod:`.collectives` (a vector reduced over the ranks, a line
  printed once), :mod:`.device` (this GPU's memory);
* the model: :mod:`.attention` and :mod:`.varlen` (THD attention on the local spec), :mod:`.norms` (sequence
  parallel without Apex or TE), :mod:`.specs` (the local GPT specs);
* running on CPU: :mod:`.cpu` (megatron-core on gloo ranks), :mod:`.ranks` (spawn local ranks); :mod:`.compat`
  holds every difference between megatron-core versions.
"""
