"""The :class:`~.settings.MemorySettings` a Megatron-LM launch implies, from its flags or its parsed args.

Read: ``--recompute-granularity full|selective`` (``recompute``), ``--use-distributed-optimizer`` and
``--optimizer-cpu-offload`` (``optimizer``: offload wins, then distributed, else replicated), ``--fp16`` /
``--bf16`` (the weights' dtype; bf16 when neither is given, as this package assumes for GPU runs), the gradient
buffer (fp32 -- Megatron accumulates bf16 runs' gradients in fp32 -- unless ``--grad-reduce-in-bf16``),
``--expert-tensor-parallel-size`` and the LM head's own weights (``--untie-embeddings-and-output-weights``; an
argv list, e.g. a run preset's, is partial, so there an absent flag keeps the default: untied, the larger).
Anything else keeps the :class:`~.settings.MemorySettings` default or the ``overrides`` given. Pure Python.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..checks import get_arg
from .settings import MemorySettings


def _value(argv: Sequence[str], flag: str) -> Any:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def settings_from_megatron(args: Any, **overrides: Any) -> MemorySettings:
    """Memory settings of a Megatron launch: ``args`` an argv list (e.g. ``RunConfig.megatron_args``) or a parsed
    argument namespace; ``overrides`` (:class:`~.settings.MemorySettings` fields) win."""
    kw: dict = {}
    if isinstance(args, (list, tuple)):
        argv = [str(a) for a in args]
        gran = _value(argv, "--recompute-granularity")
        offload, dist = "--optimizer-cpu-offload" in argv, "--use-distributed-optimizer" in argv
        fp16 = "--fp16" in argv
        fp32 = "--bf16" not in argv and "--fp16" not in argv and "--fp32" in argv
        bf16_grads = "--grad-reduce-in-bf16" in argv
        etp = _value(argv, "--expert-tensor-parallel-size")
        untie = True if "--untie-embeddings-and-output-weights" in argv else None
    else:
        gran = get_arg(args, "recompute_granularity")
        offload = bool(get_arg(args, "optimizer_cpu_offload", False))
        dist = bool(get_arg(args, "use_distributed_optimizer", False))
        fp16 = bool(get_arg(args, "fp16", False))
        fp32 = not fp16 and not bool(get_arg(args, "bf16", True))
        bf16_grads = bool(get_arg(args, "grad_reduce_in_bf16", False))
        etp = get_arg(args, "expert_tensor_parallel_size")
        untie = bool(get_arg(args, "untie_embeddings_and_output_weights", False))
    if gran in ("full", "selective"):
        kw["recompute"] = gran
    kw["optimizer"] = "cpu_offload" if offload else "distributed" if dist else "replicated"
    kw["param_dtype"] = "fp16" if fp16 else "fp32" if fp32 else "bf16"
    if bf16_grads:
        kw["grad_dtype"] = "bf16"
    if etp is not None:
        kw["expert_tensor_parallel_size"] = int(etp) if str(etp).isdigit() else etp
    if untie is not None:
        kw["untie_embeddings"] = untie
    kw.update(overrides)
    return MemorySettings(**kw)


__all__ = ["settings_from_megatron"]
