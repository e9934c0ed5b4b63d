"""GPU memory: each GPU's predicted peak for the real layout, and the token budget that fits the card.

One model, used by everything that needs a memory number (``max_tokens_per_gpu="auto"``, ``megatron-dynbatch
budget``, the drop-ins' start-up check, the online memory guard, ``bench --budgets``, ``benchmarks/gpu/memory.py``
and the legacy ``estimate_*`` front)::

    from megatron_dynbatch.core.memory import MemorySettings, choose_budget, peak_memory

    st = MemorySettings(optimizer="cpu_offload", recompute="full")
    choice = choose_budget("qwen3-8b", {"dp": 8}, 80, settings=st)           # training pass
    print(choice.tokens_per_gpu, choice.summary())
    choose_budget("qwen3-8b", {"dp": 8}, 80, pass_="log_prob", settings=st)  # forward-only log-prob pass
    peak_memory("qwen3-8b", {"dp": 8}, 16384, settings=st).summary()         # one size, every stage

Modules, one job each:

* :mod:`.settings` -- :class:`MemorySettings`: optimizer layout, recompute, dtypes, logits copies, MoE
  imbalance, reserve and headroom (validated at construction);
* :mod:`.params` -- parameter counts and each stage's static bytes (weights, gradients, optimizer state);
* :mod:`.analytic` -- the shape-derived per-token bytes of a layer, a layer's input, the LM head and loss;
* :mod:`.loss_paths` -- each trainer's loss path (Megatron-LM, slime, verl, ROLL, NeMo-RL), read from its code:
  the bytes per token per vocabulary column its loss keeps, per pass, and the options that change them;
* :mod:`.profile` -- :class:`MemoryProfile`: those coefficients, analytic or fitted by ``calibrate`` (the
  ``memory`` section of the cost-model file: :func:`load_memory_profile`, :func:`resolve_memory_profile`);
* :mod:`.peak` -- :func:`peak_memory` -> :class:`MemoryBreakdown`: every pipeline stage's peak, per pass;
* :mod:`.budget` -- :func:`choose_budget` -> :class:`BudgetChoice`: the largest budget that fits;
* :mod:`.auto_fit` -- what ``auto`` says when no budget holds the longest sample (the card, layout or settings
  that would), and the words a plan's summary uses for an automatic budget;
* :mod:`.fit` -- fitting a profile to measured peaks of model slices (torch-free; the measuring is in
  :mod:`megatron_dynbatch.measure.memory`);
* :mod:`.trainers` -- the budget in each trainer's own settings (Megatron-LM / slime, verl, ROLL, NeMo-RL);
* :mod:`.check` -- :func:`~.check.check_configured_budget` -> :class:`~.check.BudgetVerdict`: a trainer's
  configured budget judged against the card (the drop-ins' start-up check: out of memory ahead, or speed left
  behind);
* :mod:`.guard` -- :class:`~.guard.MemoryGuard`: the online guard's state, measured step peaks in (merged over
  ranks), the refitted slope and the next step's budget out (the measuring is in
  :mod:`megatron_dynbatch.megatron.memory_guard`);
* :mod:`.megatron_flags` -- the settings a Megatron-LM launch implies (its argv or parsed args);
* :mod:`.estimate` -- the first API (``estimate_memory``, ``estimate_max_tokens_per_gpu``), a thin front.

Torch-free: nothing here imports torch, megatron or ray.
"""

from .analytic import analytic_bytes, layer_activation_bytes
from .loss_paths import TRAINERS, LossOptions, LossPath, loss_path, loss_path_bytes
from .budget import MAX_GPU_MEMORY_GB, BudgetChoice, choose_budget
from .estimate import MemoryEstimate, estimate_max_tokens_per_gpu, estimate_memory
from .fit import MemoryFit, MemoryRecord, check_memory_records, fit_memory_records, memory_grid
from .megatron_flags import settings_from_megatron
from .params import parameter_counts, stage_static
from .peak import MemoryBreakdown, StageMemory, peak_memory
from .profile import MemoryProfile, load_memory_profile, model_key, resolve_memory_profile
from .settings import GiB, OPTIMIZERS, RECOMPUTE, MemorySettings
from .trainers import TRAINER_DEFAULTS, trainer_settings

__all__ = [
    "MemorySettings", "MemoryProfile", "MemoryBreakdown", "StageMemory", "BudgetChoice", "MemoryFit",
    "MemoryRecord", "MemoryEstimate", "peak_memory", "choose_budget", "fit_memory_records", "check_memory_records",
    "memory_grid", "load_memory_profile", "resolve_memory_profile", "model_key", "parameter_counts", "stage_static",
    "analytic_bytes", "layer_activation_bytes", "estimate_memory", "estimate_max_tokens_per_gpu",
    "trainer_settings", "TRAINER_DEFAULTS", "settings_from_megatron", "GiB", "OPTIMIZERS", "RECOMPUTE",
    "MAX_GPU_MEMORY_GB", "TRAINERS", "LossOptions", "LossPath", "loss_path", "loss_path_bytes",
]
