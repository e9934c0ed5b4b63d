"""``megatron-dynbatch budget``: the largest token budgets that fit the card, and the lines to paste.

Takes the model and layout from the flags or a run preset (``--run``: its model, layout, ETP, cost-model file, and
the memory settings its Megatron flags imply -- :func:`~megatron_dynbatch.core.memory.megatron_flags.
settings_from_megatron`; a flag that contradicts the preset is refused), the card size (``--gpu-memory-gb``,
required: this command runs anywhere, not on the GPU) and the memory settings (``--recompute``, ``--optimizer``,
``--headroom``, ...). It prints the training and log-prob budgets with their one-screen breakdowns
(:meth:`~megatron_dynbatch.core.memory.budget.BudgetChoice.summary`), what the preset's own budgets would peak at,
and the budgets in each trainer's settings (:func:`~megatron_dynbatch.core.memory.trainers.trainer_settings`).
``--cost-model FILE`` uses the file's calibrated ``memory`` section (``calibrate`` writes it). ``--json``: the
same as one object with ``train`` and ``log_prob`` entries. Pure Python (no torch).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Dict, Optional

from .core.errors import DynBatchConfigError

_LAYOUT = ("dp", "tp", "pp", "cp", "ep", "vpp")
_SETTINGS = ("recompute", "optimizer", "param_dtype", "grad_dtype", "headroom", "reserve_gb", "logits_fp32_copies",
             "log_prob_fp32_copies", "moe_imbalance", "log_prob_static", "optimizer_step_bytes_per_param")


def add_budget_parser(sub: Any, add_layout_args: Callable[[argparse.ArgumentParser], None],
                      layout: Callable[[argparse.Namespace], Any]) -> None:
    """The ``budget`` subcommand (the CLI passes its layout-flag helpers, so this module never imports it)."""
    b = sub.add_parser("budget", help="the largest --max-tokens-per-gpu that fits your GPU, in each trainer's words",
                       description="Predict each GPU's peak memory for the layout and print the largest training and "
                                   "log-prob token budgets that fit the card minus the headroom, what limits them, "
                                   "and the settings to paste into Megatron-LM, slime, verl, ROLL or NeMo-RL "
                                   "(docs/tuning.md).")
    from .core.planner.option_flags import add_option_flags

    add_option_flags(b, "cli", only=("model",))  # the planning option's own flag (its gpu_memory_gb is required text)
    b.add_argument("--run", default=None, metavar="PRESET", help="run preset: model, layout, Megatron flags")
    add_layout_args(b)
    b.add_argument("--gpu-memory-gb", default=None, metavar="N",
                   help="the card's memory in GiB (torch.cuda.get_device_properties(0).total_memory / 2**30; e.g. "
                        "79.1 for an H100 80GB, 139.8 for an H200)")
    b.add_argument("--cost-model", default=None, metavar="FILE",
                   help="a calibrate file: its measured memory section replaces the analytic numbers")
    add_memory_args(b.add_argument_group("memory settings (default: a bf16 Megatron-LM run, or what --run's flags "
                                         "imply)"))
    b.add_argument("--multiple", default="256", metavar="N", help="round the budgets down to a multiple of N (256)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(func=lambda args: cmd_budget(args, layout))


def add_memory_args(m: Any) -> None:
    """The memory-model settings as flags (``budget``, and ``plan --max-tokens-per-gpu auto``)."""
    from ._argparse import choice  # any case; a miss goes on to MemorySettings, which names the close match
    from .core.memory.settings import DTYPE_BYTES, LOG_PROB_STATIC, OPTIMIZERS, RECOMPUTE

    m.add_argument("--recompute", default=None, type=choice(RECOMPUTE, strict=False), help="none, selective or full")
    m.add_argument("--optimizer", default=None, type=choice(OPTIMIZERS, strict=False),
                   help="distributed, replicated or cpu_offload")
    m.add_argument("--param-dtype", default=None, type=choice(DTYPE_BYTES, strict=False), help="bf16, fp16 or fp32")
    m.add_argument("--grad-dtype", default=None, type=choice(DTYPE_BYTES, strict=False),
                   help="fp32 (Megatron's default for bf16) or bf16")
    m.add_argument("--headroom", default=None, metavar="X", help="fraction of the card left free (default 0.1)")
    m.add_argument("--reserve-gb", default=None, metavar="G", help="GiB for the CUDA context, NCCL (default 4)")
    m.add_argument("--logits-fp32-copies", default=None, metavar="N",
                   help="fp32 logits copies the training loss keeps (1; 2 with an entropy term)")
    m.add_argument("--log-prob-fp32-copies", default=None, metavar="N", help="the same for log-prob passes (1)")
    m.add_argument("--moe-imbalance", default=None, metavar="X", help="busiest expert's tokens over the mean (1.0)")
    m.add_argument("--log-prob-static", default=None, type=choice(LOG_PROB_STATIC, strict=False),
                   help="resident in a log-prob pass: training (the actor's whole state, default) or weights")
    m.add_argument("--optimizer-step-bytes-per-param", default=None, metavar="B",
                   help="the optimizer step's temporaries (0 for fused Adam; ~4 for torch's AdamW)")


def _number(text: Optional[str], flag: str, kind: type) -> Any:
    if text is None:
        return None
    try:
        return kind(str(text).strip())
    except ValueError:
        raise DynBatchConfigError(flag, text, f"is not {'a whole number' if kind is int else 'a number'}",
                                  f"pass e.g. {flag} {'2' if kind is int else '0.1'}") from None


def flag_settings(args: argparse.Namespace) -> Dict[str, Any]:
    """The memory settings the flags of :func:`add_memory_args` give (only those given)."""
    kinds = {"headroom": float, "reserve_gb": float, "moe_imbalance": float, "optimizer_step_bytes_per_param": float,
             "logits_fp32_copies": int, "log_prob_fp32_copies": int}
    out: Dict[str, Any] = {}
    for name in _SETTINGS:
        v = getattr(args, name)
        if v is not None:
            out[name] = _number(v, "--" + name.replace("_", "-"), kinds[name]) if name in kinds else v
    return out


def _target(args: argparse.Namespace, layout: Callable[[argparse.Namespace], Any]) -> Dict[str, Any]:
    """Model, layout, settings, memory profile and the preset (if any)."""
    from .core.memory import MemorySettings, settings_from_megatron

    given = flag_settings(args)
    if args.run is None:
        if args.model is None:
            raise DynBatchConfigError("--model", None, "is required", "pass --model PRESET|FILE, or --run PRESET")
        return {"model": args.model, "parallel": layout(args), "settings": MemorySettings.from_any(given),
                "profile": args.cost_model, "run": None}
    from .core.model_spec import ModelSpec
    from .core.run_config import RunConfig

    run = RunConfig.from_yaml(args.run)
    par = run.parallel()
    clash = {f"--{k}": (getattr(args, k), getattr(par, k)) for k in _LAYOUT}
    if args.model is not None and ModelSpec.from_any(args.model) != run.model_spec():
        clash["--model"] = (args.model, run.model)
    implied = settings_from_megatron(list(run.megatron_args),
                                     **({"expert_tensor_parallel_size": run.expert_tensor_parallel_size}
                                        if run.expert_tensor_parallel_size else {}))
    for k in ("recompute", "optimizer"):
        if k in given:
            clash[f"--{k}"] = (given[k], getattr(implied, k))
    for flag, (mine, theirs) in clash.items():
        if mine is not None and mine != theirs:
            raise DynBatchConfigError(flag, mine, f"the run preset {run.name!r} says {theirs}",
                                      f"drop {flag} to use the preset's setting, or drop --run")
    profile = args.cost_model or (run.cost_model if run.cost_model and run.cost_model.endswith(".json") else None)
    return {"model": run.model_spec(), "parallel": par, "settings": implied.replace(**given), "profile": profile,
            "run": run}


def cmd_budget(args: argparse.Namespace, layout: Callable[[argparse.Namespace], Any]) -> int:
    from .core.memory import choose_budget, peak_memory, trainer_settings
    from .core.memory.check import FAR_UNDER  # the drop-ins' start-up check says "speed left behind" below it too
    from .core.model_spec import ModelSpec

    if args.gpu_memory_gb is None:
        raise DynBatchConfigError("--gpu-memory-gb", None, "is required (no card size is known here)",
                                  "pass the GPU's memory in GiB, e.g. --gpu-memory-gb 79.1 for an H100 80GB "
                                  "(nvidia-smi --query-gpu=memory.total --format=csv, MiB / 1024)")
    card = _number(args.gpu_memory_gb, "--gpu-memory-gb", float)
    multiple = _number(args.multiple, "--multiple", int)
    t = _target(args, layout)
    spec, par, st = ModelSpec.from_any(t["model"]), t["parallel"], t["settings"]
    kw = dict(settings=st, profile=t["profile"], multiple=multiple)
    train = choose_budget(spec, par, card, pass_="train", **kw)
    log_prob = choose_budget(spec, par, card, pass_="log_prob", **kw)
    lines = trainer_settings(train.tokens_per_gpu, log_prob.tokens_per_gpu, par)
    configured = {}
    run = t["run"]
    if run is not None:
        for name, tokens, choice in (("max_tokens_per_gpu", run.max_tokens_per_gpu, train),
                                     ("log_probs_max_tokens_per_gpu", run.effective_log_probs_max_tokens_per_gpu,
                                      log_prob)):
            if tokens == "auto":  # the preset lets the memory model choose: nothing configured to judge
                continue
            peak = peak_memory(spec, par, tokens, pass_=choice.pass_, settings=st, profile=t["profile"]).peak_bytes
            configured[name] = {"tokens": tokens, "predicted_peak_gb": peak / 2 ** 30,
                                "fits": peak <= choice.usable_bytes, "of_auto": tokens / choice.tokens_per_gpu}
    if args.json:
        print(json.dumps({"model": spec.name, "parallel": par.to_dict(), "gpu_memory_gb": card,
                          "train": train.to_dict(), "log_prob": log_prob.to_dict(),
                          "trainers": {x.trainer: {"settings": x.settings, "line": x.line, "note": x.note}
                                       for x in lines}, **({"configured": configured} if run else {})}, indent=1))
        return 0
    lay = f"dp={par.dp} tp={par.tp} pp={par.pp} cp={par.cp}" + (f" ep={par.ep}" if par.ep > 1 else "") + \
        (f" vpp={par.vpp}" if par.vpp > 1 else "") + (" sp" if par.sequence_parallel else "")
    print(f"{spec.name or 'model'} on {lay}" + (f" (run preset {run.name})" if run else "") + f"; {card:g} GiB card")
    print(train.summary())
    print()
    print(log_prob.summary())
    if configured:
        print()
        usable = train.usable_bytes / 2 ** 30
        for name, c in configured.items():
            verdict = (f"fits, {c['of_auto']:.0%} of the auto budget" + ("" if c["of_auto"] >= FAR_UNDER else
                                                                         ": speed left behind")
                       if c["fits"] else f"over the {usable:.1f} GiB usable: out of memory ahead")
            print(f"the preset's {name} {c['tokens']}: predicted peak {c['predicted_peak_gb']:.1f} GiB ({verdict})")
    print()
    print("in each trainer's settings:")
    names = {"megatron-lm": "Megatron-LM", "slime": "slime", "verl": "verl", "roll": "ROLL", "nemo-rl": "NeMo-RL"}
    for x in lines:
        print(f"  {names[x.trainer]:<12} {x.line}")
        print(f"  {'':<12} -- {x.note}")
    return 0


__all__ = ["add_budget_parser", "add_memory_args", "cmd_budget", "flag_settings"]
