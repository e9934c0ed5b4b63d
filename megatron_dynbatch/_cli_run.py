"""``megatron-dynbatch plan --run PRESET`` with flags: one meaning per flag.

A flag of ``plan`` that names something a run preset also decides -- the model, the layout (``--dp`` ...
``--sequence-parallel``, ``--gpus-per-node``), every planning option that has both a ``plan`` flag and a preset key
(:func:`preset_option_flags`, read from the :class:`~megatron_dynbatch.core.planner.options.PlanOptions` field
metadata: the budget, the balancing, the cost model and its decision margin, the oversize policy, FP8 alignment,
samples per step, the minimum CP group, the card's memory), GRPO groups (``--group-ids`` against ``group_size``) --
must agree with the preset. A flag that contradicts it is a :class:`~megatron_dynbatch.core.errors.DynBatchConfigError`
naming the flag, the preset's value and both ways out: drop the flag (plan the preset as written), or add
``--override-run`` (plan the preset with the flag's value instead). Overridden values go through
:meth:`RunConfig.replace`, so the result is checked exactly as a preset file with those values would be (``--dp 3``
on a preset with ``samples_per_step: 256`` is refused there).

``--dynamic-cp`` / ``--no-dynamic-cp`` are overrides by definition (documented on the flag) and need no
``--override-run``; ``--group-ids`` on a preset without ``group_size`` adds groups (the preset says nothing about
them). A flag equal to the preset's value is no contradiction.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .core.errors import DynBatchConfigError
from .core.parallel import ParallelConfig

OVERRIDE_FLAG = "--override-run"
#: the layout flags of ``plan`` that take a number: one per ``ParallelConfig`` field (``--sequence-parallel``, the
#: one switch, is checked on its own)
LAYOUT_FLAGS = tuple(f.name for f in dataclasses.fields(ParallelConfig) if f.name != "sequence_parallel")


@functools.lru_cache(maxsize=None)
def preset_option_flags() -> Tuple[Any, ...]:
    """The ``plan`` flags (:class:`~megatron_dynbatch.core.planner.option_flags.OptionFlag`) of the options a run
    preset also holds -- the fields with a ``cli`` and a launch spelling (a preset key is an option a launch
    sets) -- except ``--dynamic-cp``, an override by definition (module docstring)."""
    from .core.planner.option_flags import option_flags
    from .core.run_config import OPTION_KEYS

    return tuple(f for f in option_flags("cli") if f.field in OPTION_KEYS and f.field != "dynamic_cp")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flag_of_field(name: str) -> Optional[str]:
    """The ``plan`` flag that sets preset field ``name`` (named in the fix when the overridden preset fails)."""
    if name == "model" or name in LAYOUT_FLAGS:
        return _flag(name)
    return next((f.flag for f in preset_option_flags() if f.field == name), None)


def _same_model(flag_value: str, run: Any) -> bool:
    if flag_value == run.model:
        return True
    from .core.model_spec import ModelSpec

    try:
        return ModelSpec.from_any(flag_value) == run.model_spec()  # names do not take part in the comparison
    except DynBatchConfigError:
        return False


def _contradictions(args: argparse.Namespace, run: Any) -> List[Tuple[str, Any, str, Dict[str, Any]]]:
    """``(flag, value, what the preset says, the change that would apply it)`` for every flag that differs."""
    out: List[Tuple[str, Any, str, Dict[str, Any]]] = []
    par = run.parallel()
    preset = run.to_dict()  # what the preset says, in its own form (a budget "auto", balance_by "time")
    budget = [f for f in preset_option_flags() if f.field == "max_tokens_per_gpu"]
    others = [f for f in preset_option_flags() if f.field != "max_tokens_per_gpu"]
    if args.model and not _same_model(args.model, run):
        out.append(("--model", args.model, f"model {run.model!r}", {"model": args.model}))
    for spec in budget:  # the budget first, then the layout, then the other options (in field order)
        out += _option_contradiction(args, spec, preset, repr_=False)
    for name in LAYOUT_FLAGS:
        value = getattr(args, name, None)
        if name == "microbatch_group_size_per_vp_stage":
            mine = par.vp_group_size
            differs = value is not None and value != mine
        else:
            mine = getattr(par, name)
            differs = value is not None and value != mine
        if differs:
            said = f"{name}={mine}"
            if name == "dp":
                said += f" (world size {par.world_size} / tp x pp x cp = {par.model_parallel_size})"
            out.append((_flag(name), value, said, {"parallel": {name: value}}))
    if args.sequence_parallel and not par.sequence_parallel:
        out.append(("--sequence-parallel", True, "sequence_parallel=false", {"parallel": {"sequence_parallel": True}}))
    for spec in others:
        out += _option_contradiction(args, spec, preset)
    return out


def _option_contradiction(args: argparse.Namespace, spec: Any, preset: Dict[str, Any],
                          repr_: bool = True) -> List[Tuple[str, Any, str, Dict[str, Any]]]:
    value = getattr(args, spec.dest, None)
    mine = preset[spec.field]
    if value is None or value == mine:
        return []
    return [(spec.flag, value, f"{spec.field}={mine!r}" if repr_ else f"{spec.field}={mine}", {spec.field: value})]


def resolve_run(args: argparse.Namespace, run: Any) -> Any:
    """The preset to plan with: ``run``, or ``run`` with the flags' values under ``--override-run``.

    Refuses flags that contradict ``run`` unless ``--override-run`` was given (module docstring)."""
    found = _contradictions(args, run)
    if not found:
        return run
    if not getattr(args, "override_run", False):
        flag, value, said, _ = found[0]
        more = "".join(f"; {f} contradicts its {s}" for f, _, s, _ in found[1:])
        given = " ".join(f if v is True else f"{f} {v}" for f, v, _, _ in found)
        raise DynBatchConfigError(
            flag, value, f"contradicts the run preset {run.name!r}, which has {said}{more}",
            f"drop {' and '.join(f for f, _, _, _ in found)} to plan the preset as written, or add {OVERRIDE_FLAG} "
            f"to plan it with {given} instead")
    changes: Dict[str, Any] = {}
    for _, _, _, change in found:
        for key, value in change.items():
            if key == "parallel":
                changes.setdefault("parallel", {}).update(value)
            else:
                changes[key] = value
    try:
        return run.replace(**changes)
    except DynBatchConfigError as exc:  # say that it is the preset with the flags' values that fails the check
        flag = _flag_of_field(exc.field.split(".")[-1])
        raise DynBatchConfigError(
            exc.field, exc.value, f"{exc.problem} (the run preset {run.name!r} with the values of "
            f"{' '.join(f for f, _, _, _ in found)}, {OVERRIDE_FLAG})",
            exc.fix + (f" (flag {flag})" if flag else "")) from None


def check_group_ids(args: argparse.Namespace, run: Any, group_ids: Optional[Sequence[Any]]) -> None:
    """``--group-ids`` against the preset's ``group_size``: the same grouping, or ``--override-run``."""
    if group_ids is None or run is None or run.group_size is None or getattr(args, "override_run", False):
        return
    preset = run.group_ids(len(group_ids)) if len(group_ids) % run.group_size == 0 else None
    if preset is None or _partition(group_ids) != _partition(preset):
        raise DynBatchConfigError(
            "--group-ids", args.group_ids, f"groups the samples differently from the run preset {run.name!r}, "
            f"whose group_size={run.group_size} makes every {run.group_size} consecutive samples one group",
            f"drop --group-ids to use the preset's groups, or add {OVERRIDE_FLAG} to use the file's")


def _partition(ids: Sequence[Any]) -> List[int]:
    """Group ids relabelled by first appearance (two labellings of one grouping compare equal)."""
    first: Dict[Any, int] = {}
    return [first.setdefault(g if isinstance(g, (int, str, float)) else repr(g), len(first)) for g in ids]


__all__ = ["OVERRIDE_FLAG", "LAYOUT_FLAGS", "check_group_ids", "preset_option_flags", "resolve_run"]
