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
             "log_prob_fp32_copies", "moe_imbalance", "log_prob_static", "optimizer_step_bytes_per_param", "trainer",
             "loss_entropy", "loss_temperature", "loss_fused", "loss_chunk_tokens")
_NAMES = {"megatron-lm": "Megatron-LM", "slime": "slime", "verl": "verl", "roll": "ROLL", "nemo-rl": "NeMo-RL"}


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
                   help="override every trainer's loss path: N fp32 logits copies beside the bf16 logits in training")
    m.add_argument("--log-prob-fp32-copies", default=None, metavar="N", help="the same for log-prob passes")
    m.add_argument("--moe-imbalance", default=None, metavar="X", help="busiest expert's tokens over the mean (1.1)")
    m.add_argument("--log-prob-static", default=None, type=choice(LOG_PROB_STATIC, strict=False),
                   help="resident in a log-prob pass: training (the actor's whole state, default) or weights")
    m.add_argument("--optimizer-step-bytes-per-param", default=None, metavar="B",
                   help="the optimizer step's temporaries (0 for fused Adam; ~4 for torch's AdamW)")
    # the trainer loss options (MemorySettings fields: loss_paths.py reads what each changes per trainer)
    m.add_argument("--trainer", default=None, help="whose loss path the breakdowns count: megatron-lm (default), "
                                                   "slime, verl, roll or nemo-rl (each trainer's line uses its own)")
    m.add_argument("--loss-entropy", default=None, action="store_const", const=True,
                   help="the training loss has an entropy term (slime --entropy-coef, verl entropy_coeff, ROLL "
                        "entropy_loss_coef not 0)")
    m.add_argument("--loss-temperature", default=None, metavar="T",
                   help="the temperature the loss divides the logits by (slime --rollout-temperature; default 1)")
    m.add_argument("--loss-fused", default=None, action="store_const", const=True,
                   help="the trainer's fused loss kernel (verl use_fused_kernels, ROLL cross_entropy_loss_fusion)")
    m.add_argument("--loss-chunk-tokens", default=None, metavar="N",
                   help="the trainer's log-prob chunk (slime --log-probs-chunk-size, NeMo-RL logprob_chunk_size)")


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
             "logits_fp32_copies": int, "log_prob_fp32_copies": int, "loss_temperature": float,
             "loss_chunk_tokens": int}
    out: Dict[str, Any] = {}
    for name in _SETTINGS:
        v = getattr(args, name, None)
        if v is not None:
            out[name] = _number(v, "--" + name.replace("_", "-"), kinds[name]) if name in kinds else v
    return out


def _target(args: argparse.Namespace, layout: Callable[[argparse.Namespace], Any]) -> Dict[str, Any]:
    """Model, layout, settings, memory profile, the card and the preset (if any)."""
    from .core.memory import MemorySettings

    given = flag_settings(args)
    card = _card_flag(args.gpu_memory_gb)
    if args.run is None:
        if args.model is None:
            raise DynBatchConfigError("--model", None, "is required", "pass --model PRESET|FILE, or --run PRESET")
        if card is None:
            raise DynBatchConfigError("--gpu-memory-gb", None, "is required (no card size is known here)",
                                      "pass the GPU's memory in GiB, e.g. --gpu-memory-gb 79.1 for an H100 80GB "
                                      "(nvidia-smi --query-gpu=memory.total --format=csv, MiB / 1024)")
        return {"model": args.model, "parallel": layout(args), "settings": MemorySettings.from_any(given),
                "profile": args.cost_model, "run": None, "card": card}
    from .core.model_spec import ModelSpec
    from .core.run_config import RunConfig

    run = RunConfig.from_yaml(args.run)
    par = run.parallel()
    clash = {f"--{k}": (getattr(args, k), getattr(par, k)) for k in _LAYOUT}
    if args.model is not None and ModelSpec.from_any(args.model) != run.model_spec():
        clash["--model"] = (args.model, run.model)
    implied = run.memory_settings()
    for k in ("recompute", "optimizer"):
        if k in given:
            clash[f"--{k}"] = (given[k], getattr(implied, k))
    for flag, (mine, theirs) in clash.items():
        if mine is not None and mine != theirs:
            raise DynBatchConfigError(flag, mine, f"the run preset {run.name!r} says {theirs}",
                                      f"drop {flag} to use the preset's setting, or drop --run")
    if card is None:
        if run.options.gpu_memory_gb is None:
            raise DynBatchConfigError("--gpu-memory-gb", None, f"is required: the run preset {run.name!r} names no "
                                      "card", "pass the GPU's memory in GiB, e.g. --gpu-memory-gb "
                                      "79.1 for an H100 80GB")
        card = float(run.options.gpu_memory_gb)
    cost_model = run.options.cost_model
    profile = args.cost_model or (cost_model if cost_model and cost_model.endswith(".json") else None)
    return {"model": run.model_spec(), "parallel": par, "settings": implied.replace(**given), "profile": profile,
            "run": run, "card": card}


def _card_flag(text: Optional[str]) -> Optional[float]:
    """``--gpu-memory-gb``: GiB. A value that reads as bytes or MiB is an error; a known card's size in GB (80 for
    an H100 80GB) a warning saying the GiB torch reports (core.memory.budget.card_unit_problem)."""
    import warnings

    from .core.errors import BudgetWarning
    from .core.memory.budget import card_unit_problem

    card = _number(text, "--gpu-memory-gb", float)
    if card is None or not card == card or card <= 0:  # None, NaN and <= 0: choose_budget names them
        return card
    unit = card_unit_problem(card)
    if unit is None:
        return card
    kind, gib, name = unit
    if kind in ("bytes", "MiB"):
        raise DynBatchConfigError("--gpu-memory-gb", text, f"reads as a card size in {kind}, not GiB ({text} "
                                  f"{kind} = {gib:.1f} GiB)", f"pass the GiB: --gpu-memory-gb {gib:.1f}")
    warnings.warn(f"--gpu-memory-gb {text}: {name} is sold as {text} GB, and torch reports {gib:g} GiB "
                  f"(total_memory / 2**30); the budgets below are for {text} GiB -- pass --gpu-memory-gb {gib:g} "
                  "for that card", BudgetWarning, stacklevel=2)
    return card


def _check_cost_model_file(path: Any, spec: Any) -> None:
    """A cost-model file fitted for another model warns as ``plan`` does (its memory section, if any, is checked
    strictly by the memory model itself)."""
    if not isinstance(path, str) or not path.endswith(".json"):
        return
    from .core.cost_files import check_fitted_for

    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return  # the memory model names the file and the problem
    check_fitted_for(data, spec, path, field="--cost-model", transfers=True)


def words() -> Dict[str, str]:
    """Our names -> the ``budget`` flags: errors and fixes of the memory model in the words typed here."""
    from .core.memory.budget import FIX_WORDS

    out = dict(FIX_WORDS["cli"])
    out.update({f"settings.{k}": "--" + k.replace("_", "-") for k in _SETTINGS})
    out.update({"multiple": "--multiple", "parallel.dp": "--dp", "parallel.vpp": "--vpp",
                "parallel.sequence_parallel": "--sequence-parallel", "memory_profile": "--cost-model"})
    return out


def _per_trainer(spec: Any, par: Any, card: float, st: Any, kw: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Every trainer's budgets from its own loss path (``None`` and the problem when none fits)."""
    from .core.memory import choose_budget
    from .core.memory.loss_paths import TRAINERS

    out: Dict[str, Dict[str, Any]] = {}
    for name in TRAINERS:
        mine = st.replace(trainer=name)
        entry: Dict[str, Any] = {}
        for pass_ in ("train", "log_prob"):
            try:
                entry[pass_] = choose_budget(spec, par, card, pass_=pass_, settings=mine, **kw)
            except DynBatchConfigError as err:
                if err.field != "gpu_memory_gb":
                    raise
                entry[pass_] = None
                entry["problem"] = err.problem
        out[name] = entry
    return out


def cmd_budget(args: argparse.Namespace, layout: Callable[[argparse.Namespace], Any]) -> int:
    """``budget``: errors and fixes name this command's flags (``core.errors.trainer_terms``)."""
    from .core.errors import trainer_terms

    with trainer_terms(words()):
        return _budget(args, layout)


def _budget(args: argparse.Namespace, layout: Callable[[argparse.Namespace], Any]) -> int:
    from .core.flops import per_gpu_flops
    from .core.memory import choose_budget, peak_memory, trainer_settings
    from .core.memory.check import FAR_UNDER  # the drop-ins' start-up check says "speed left behind" below it too
    from .core.model_spec import ModelSpec

    multiple = _number(args.multiple, "--multiple", int)
    t = _target(args, layout)
    card = t["card"]
    spec, par, st = ModelSpec.from_any(t["model"]), t["parallel"], t["settings"]
    per_gpu_flops(1.0, spec, par)  # the layout checks `plan` makes: tp divides the heads and groups, ep the experts
    _check_cost_model_file(t["profile"], spec)
    kw = dict(profile=t["profile"], multiple=multiple)
    train = choose_budget(spec, par, card, pass_="train", settings=st, **kw)
    log_prob = choose_budget(spec, par, card, pass_="log_prob", settings=st, **kw)
    per = _per_trainer(spec, par, card, st, kw)
    lines = {}
    for name, e in per.items():
        if e["train"] is not None and e["log_prob"] is not None:
            lines[name] = next(x for x in trainer_settings(e["train"].tokens_per_gpu, e["log_prob"].tokens_per_gpu,
                                                           par) if x.trainer == name)
    configured: Dict[str, Any] = {}
    run = t["run"]
    if run is not None:
        for name, tokens, pass_ in (("max_tokens_per_gpu", run.budget_as_written(), "train"),
                                    ("log_probs_max_tokens_per_gpu", run.effective_log_probs_max_tokens_per_gpu,
                                     "log_prob")):
            if tokens == "auto":  # the preset lets the memory model choose: each trainer's own choice, printed below
                continue
            for trainer in run.named_trainers():
                choice = per[trainer][pass_]
                peak = peak_memory(spec, par, tokens, pass_=pass_, settings=st.replace(trainer=trainer),
                                   profile=t["profile"]).peak_bytes
                usable = train.usable_bytes
                configured.setdefault(name, {"tokens": tokens, "trainers": {}})["trainers"][trainer] = {
                    "predicted_peak_gb": peak / 2 ** 30, "fits": peak <= usable,
                    "of_auto": None if choice is None else tokens / choice.tokens_per_gpu}
            first = configured[name]["trainers"][run.named_trainers()[0]]
            configured[name].update(first)  # the first named trainer's verdict at the top level
    if args.json:
        trainers = {}
        for name, e in per.items():
            x = lines.get(name)
            passes = {p: None if e[p] is None else {"max_tokens_per_gpu": e[p].tokens_per_gpu,
                                                     "predicted_peak_gb": e[p].breakdown.peak_gb,
                                                     "loss_path": e[p].loss, "limited_by": e[p].limited_by}
                      for p in ("train", "log_prob")}
            trainers[name] = {"settings": x.settings if x else None, "line": x.line if x else None,
                              "note": x.note if x else e.get("problem"), **passes}
        print(json.dumps({"model": spec.name, "parallel": par.to_dict(), "gpu_memory_gb": card,
                          "trainer": st.trainer, "train": train.to_dict(), "log_prob": log_prob.to_dict(),
                          "trainers": trainers, **({"configured": configured,
                                                    "named_trainers": list(run.named_trainers())} if run else {})},
                         indent=1))
        return 0
    lay = f"dp={par.dp} tp={par.tp} pp={par.pp} cp={par.cp}" + (f" ep={par.ep}" if par.ep > 1 else "") + \
        (f" vpp={par.vpp}" if par.vpp > 1 else "") + (" sp" if par.sequence_parallel else "")
    print(f"{spec.name or 'model'} on {lay}" + (f" (run preset {run.name})" if run else "") + f"; {card:g} GiB card; "
          f"breakdowns with {_NAMES[st.trainer]}'s loss")
    print(train.summary())
    print()
    print(log_prob.summary())
    if configured:
        print()
        usable = train.usable_bytes / 2 ** 30
        for name, c in configured.items():
            for trainer, v in c["trainers"].items():
                of = v["of_auto"]
                verdict = ((f"fits, {of:.0%} of the auto budget" + ("" if of >= FAR_UNDER else ": speed left behind"))
                           if v["fits"] and of is not None else
                           f"over the {usable:.1f} GiB usable: out of memory ahead")
                who = f" with {_NAMES[trainer]}'s loss" if run.trainers else ""
                print(f"the preset's {name} {c['tokens']}{who}: predicted peak {v['predicted_peak_gb']:.1f} GiB "
                      f"({verdict})")
    print()
    print("in each trainer's settings, each from its own loss path (docs/tuning.md, loss paths):")
    for name, e in per.items():
        x = lines.get(name)
        if x is None:
            print(f"  {_NAMES[name]:<12} no budget fits: {e.get('problem')}")
            continue
        tr, lp = e["train"], e["log_prob"]
        print(f"  {_NAMES[name]:<12} {x.line}")
        print(f"  {'':<12} -- loss {tr.loss.split(' loss ', 1)[-1]} (training), "
              f"{lp.loss.split(' loss ', 1)[-1]} (log-prob); predicted peaks {tr.breakdown.peak_gb:.1f} / "
              f"{lp.breakdown.peak_gb:.1f} GiB")
        print(f"  {'':<12} -- {x.note}")
    return 0


__all__ = ["add_budget_parser", "add_memory_args", "cmd_budget", "flag_settings", "words"]
