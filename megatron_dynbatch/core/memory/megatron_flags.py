"""The :class:`~.settings.MemorySettings` a Megatron-LM launch implies, from its flags or its parsed args.

Read: ``--recompute-granularity full|selective`` (``recompute``), ``--use-distributed-optimizer`` and
``--optimizer-cpu-offload`` (``optimizer``: offload wins, then distributed, else replicated), ``--fp16`` /
``--bf16`` (the weights' dtype; bf16 when neither is given, as this package assumes for GPU runs), the gradient
buffer (fp32 -- Megatron accumulates bf16 runs' gradients in fp32 -- unless ``--grad-reduce-in-bf16``),
``--expert-tensor-parallel-size`` and the LM head's own weights (``--untie-embeddings-and-output-weights``; an
argv list, e.g. a run preset's, is partial, so there an absent flag keeps the default: untied, the larger).
Anything else keeps the :class:`~.settings.MemorySettings` default or the ``overrides`` given.

The same launch's model and layout, for the memory model (checked against Megatron-LM's measured CI peaks,
``tests/test_megatron_ci_memory.py``): :func:`model_from_megatron` (the shape flags, ``--hidden-dropout`` /
``--attention-dropout`` with Megatron's 0.1 defaults, ``--qk-layernorm``; the vocabulary padded as Megatron pads
it) and :func:`parallel_from_megatron` (``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
``--num-layers-per-virtual-pipeline-stage`` or ``--num-virtual-stages-per-pipeline-rank``, ``--context-parallel-
size``, ``--expert-model-parallel-size``, ``--sequence-parallel``, the data-parallel size from the world size);
:func:`model_overrides_from_megatron` the model fields an argv list (e.g. a run preset's ``megatron_args``) sets
beyond the shape (dropout, QK-layernorm). Pure Python.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional, Sequence

from ..checks import get_arg
from ..errors import DynBatchConfigError
from ..model_spec import ModelSpec
from ..parallel import ParallelConfig
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


def namespace_from_argv(argv: Sequence[str]) -> argparse.Namespace:
    """An argv list as Megatron's parsed args would read: ``--flag value`` -> ``flag=value`` (ints and floats
    parsed), a flag followed by another flag (or last) -> ``True``; ``--no-x`` flags are kept as given."""
    out: Dict[str, Any] = {}
    items = [str(a) for a in argv]
    i = 0
    while i < len(items):
        a = items[i]
        if not a.startswith("--"):
            i += 1
            continue
        key, value = a[2:], None
        if "=" in key:
            key, value = key.split("=", 1)
        elif i + 1 < len(items) and not items[i + 1].startswith("--"):
            value = items[i + 1]
            i += 1
        i += 1
        parsed: Any = True
        if value is not None:
            parsed = value
            for cast in (int, float):
                try:
                    parsed = cast(value)
                    break
                except ValueError:
                    continue
        out[key.replace("-", "_")] = parsed
    return argparse.Namespace(**out)


def model_overrides_from_megatron(argv: Sequence[str]) -> Dict[str, Any]:
    """The ModelSpec fields beyond the shape an argv list sets: ``hidden_dropout``, ``attention_dropout``,
    ``qk_layernorm`` (only those it names)."""
    ns = vars(namespace_from_argv(argv))
    out: Dict[str, Any] = {k: ns[k] for k in ("hidden_dropout", "attention_dropout") if k in ns}
    if "qk_layernorm" in ns:
        out["qk_layernorm"] = True
    return out


def model_from_megatron(argv: Sequence[str], *, vocab_size: Optional[int] = None,
                        name: Optional[str] = None) -> ModelSpec:
    """The model a Megatron-LM launch trains, from its argv list (module docstring). ``vocab_size``: the
    tokenizer's vocabulary (Megatron reads it from the tokenizer; ``--vocab-size`` is used when given)."""
    ns = namespace_from_argv(argv)
    for attr, default in (("hidden_dropout", 0.1), ("attention_dropout", 0.1)):  # Megatron's argument defaults
        if getattr(ns, attr, None) is None:
            setattr(ns, attr, default)
    ns.qk_layernorm = bool(getattr(ns, "qk_layernorm", False))
    ns.swiglu = bool(getattr(ns, "swiglu", False))
    ns.group_query_attention = bool(getattr(ns, "group_query_attention", False))
    ns.multi_latent_attention = bool(getattr(ns, "multi_latent_attention", False))
    if vocab_size is None and getattr(ns, "vocab_size", None) is None:
        raise DynBatchConfigError("vocab_size", None, "the launch flags name no vocabulary (Megatron reads it from "
                                  "the tokenizer)", "pass model_from_megatron(argv, vocab_size=...)")
    return ModelSpec.from_megatron(ns, vocab_size=vocab_size, name=name)


def parallel_from_megatron(argv: Sequence[str], world_size: int) -> ParallelConfig:
    """The layout of a Megatron-LM launch on ``world_size`` GPUs, from its argv list (module docstring)."""
    ns = namespace_from_argv(argv)
    tp = int(get_arg(ns, "tensor_model_parallel_size", 1))
    pp = int(get_arg(ns, "pipeline_model_parallel_size", 1))
    cp = int(get_arg(ns, "context_parallel_size", 1))
    vpp = 1
    if get_arg(ns, "num_layers_per_virtual_pipeline_stage") is not None:
        vpp = int(ns.num_layers) // (pp * int(ns.num_layers_per_virtual_pipeline_stage))
    elif get_arg(ns, "num_virtual_stages_per_pipeline_rank") is not None:
        vpp = int(ns.num_virtual_stages_per_pipeline_rank)
    if world_size % (tp * pp * cp):
        raise DynBatchConfigError("world_size", world_size, f"is not a multiple of tp x pp x cp = {tp * pp * cp}",
                                  "pass the launch's number of GPUs")
    return ParallelConfig(dp=world_size // (tp * pp * cp), tp=tp, pp=pp, cp=cp,
                          ep=int(get_arg(ns, "expert_model_parallel_size", 1)), vpp=vpp,
                          microbatch_group_size_per_vp_stage=get_arg(ns, "microbatch_group_size_per_vp_stage"),
                          sequence_parallel=bool(getattr(ns, "sequence_parallel", False)))


__all__ = ["settings_from_megatron", "model_from_megatron", "parallel_from_megatron", "model_overrides_from_megatron",
           "namespace_from_argv"]
