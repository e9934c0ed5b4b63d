"""``megatron-dynbatch plan --run PRESET`` with flags: one meaning per flag.

A flag of ``plan`` that names something a run preset also decides -- the model, the layout (``--dp`` ...
``--sequence-parallel``, ``--gpus-per-node``), the budget, the balancing, the oversize policy, FP8 alignment,
samples per step, the cost model and its decision margin, GRPO groups (``--group-ids`` against ``group_size``) --
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
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .core.errors import DynBatchConfigError

OVERRIDE_FLAG = "--override-run"
LAYOUT_FLAGS = ("dp", "tp", "pp", "cp", "ep", "vpp", "microbatch_group_size_per_vp_stage", "gpus_per_node")
#: flags named like the preset field they set (``--fp8`` sets ``fp8_alignment``)
_SAME_NAME_FLAGS = ("balance_by", "oversize", "samples_per_step", "cost_model", "decision_margin", "min_cp_size")
#: preset fields that ``plan`` has a flag for (named in the fix when the overridden preset fails its checks)
_FLAG_OF_FIELD = ("model", "max_tokens_per_gpu") + _SAME_NAME_FLAGS + LAYOUT_FLAGS


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


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
    par = run.layout
    if args.model and not _same_model(args.model, run):
        out.append(("--model", args.model, f"model {run.model!r}", {"model": args.model}))
    if args.max_tokens_per_gpu is not None and args.max_tokens_per_gpu != run.max_tokens_per_gpu:
        out.append(("--max-tokens-per-gpu", args.max_tokens_per_gpu, f"max_tokens_per_gpu={run.max_tokens_per_gpu}",
                    {"max_tokens_per_gpu": args.max_tokens_per_gpu}))
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
    for flag, field in (("fp8", "fp8_alignment"),) + tuple((f, f) for f in _SAME_NAME_FLAGS):
        value = getattr(args, flag)
        if value is not None and value != getattr(run, field):
            out.append((_flag(flag), value, f"{field}={getattr(run, field)!r}", {field: value}))
    return out


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
        name = exc.field.split(".")[-1]
        flag = _flag(name) if name in _FLAG_OF_FIELD else None
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


__all__ = ["OVERRIDE_FLAG", "LAYOUT_FLAGS", "check_group_ids", "resolve_run"]
