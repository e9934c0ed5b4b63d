"""Door equivalence: the same random planning requests through every public door, fingerprinted, before and after.

Why
---
Issue 31 reshapes how options travel (one ``PlanOptions``, resolved once; ``RunConfig`` holding one; flags built
from the fields) and promises that behaviour stays the same: same plans, same refusals, at every door. This script
is the instrument for that promise. It draws ``--n`` random cases (seeded; each case has its own seed
``SEED:I``) -- batches of lengths (empty, one sample, a few hundred, a few thousand; Python and NumPy ints; hostile
values) and option sets (every ``PlanOptions`` field, the batch's ids, the legacy ``balance_by_flops`` switch, and
deliberately invalid values) -- and sends each through every door that can express it:

===================  ==========================================================================================
door                 entry point
===================  ==========================================================================================
``api_kwargs``       ``plan_global_batch(lengths, **options, **ids)``
``api_options``      ``plan_global_batch(lengths, PlanOptions(**options), **ids)``
``cli``              ``megatron-dynbatch plan --lengths FILE ... --json`` in-process (``cli.main``), flags from
                     each field's ``metadata["cli"]``; a refusal is its exit status and the field its message names
``launch``           Megatron-LM: ``add_dynamic_batch_args`` + Megatron's own model/layout/optimizer args (as
                     ``tests/test_plan_options.py`` builds them), ``validate_dynamic_batch_args``,
                     ``plan_options_from_args``, then ``plan_global_batch``
``preset``           ``RunConfig.from_dict(...).plan_options()``, then ``plan_global_batch``
``iterator``         ``DynamicBatchIterator(samples, **options)`` (torch on CPU; every 4th case)
``ray``              ``integrations.ray.plan_rollout(samples, put=False, **options)``: the training plan and the
                     log-prob plan
``packing_seat``     upstream's packing seat: ``core.dropin.megatron_packing.plan_sample_id_groups``
``sequence_limit``   ``core.dropin.sequence_limit.plan_with_sequence_limit`` (verl/NeMo-RL's sequence cap)
``slime``            ``core.dropin.slime.slime_schedule`` (slime's rollout schedule)
``verl_local``       ``core.dropin.verl.local_plan`` (verl's per-rank micro-batches)
``verl_balance``     ``core.dropin.verl.balance_partitions`` (verl's DP partitions)
``roll``             ``core.dropin.roll.roll_shard`` (ROLL's shards)
``nemo_rl``          ``core.dropin.nemo_rl.get_packer(...).pack`` (NeMo-RL's packer)
``megatron_rl``      ``core.dropin.megatron_rl.plan_rl_bins`` (Megatron RL's bins)
===================  ==========================================================================================

A door that cannot express a case (the CLI has no ``rollouts_per_step``; a launch always has a model) records
``"-"``. Otherwise it records a fingerprint: a plan's is a hash of what it decided -- each row's micro-batches of
sample ids, the micro-batches per optimizer step, the per-GPU budget, what it balanced and its kind -- read only
through the plan protocol (``core/planner/plan_kind.py``); a drop-in's is a hash of its return value (its plan by
the same rule); a refusal is ``E:<exception class>:<DynBatchConfigError.field>`` (never the message text, which
may be reworded). Only public, documented entry points and plan attributes are used, nothing an options object
derives (those move behind a resolution step).

Use
---
``python scripts/door_equivalence.py --write base.json.gz`` on the code before a change, then
``python scripts/door_equivalence.py --compare base.json.gz`` after it: per-door counts of same / different and the
first differences, each with its repro line (``--case SEED:I`` prints the case and every door's fingerprint);
exit status 1 on any difference. ``--n``, ``--seed`` and ``--doors`` narrow a run (a compare uses the file's seed
and checks only the cases and doors it runs). ``tests/test_door_equivalence.py`` runs the first cases against
``tests/data/door_equivalence_baseline.json.gz``. Cross-door agreement (two doors given the same options giving
different plans or refusals) is reported by ``--agreement FILE``: findings, not failures.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_N = 2000
DEFAULT_SEED = 31
NA = "-"
BASELINE = ROOT / "tests" / "data" / "door_equivalence_baseline.json.gz"

MODELS = ["qwen3-0.6b", "qwen3-4b", "qwen3-8b", "llama-3.1-8b", "qwen3-30b-a3b"]
#: options the plan command has no flag for (the CLI door records "-" for a case that sets one)
NOT_CLI = ("rollouts_per_step", "refine_rounds", "equal_samples_per_rank", "min_num_microbatches",
           "num_microbatches_multiple", "sequence_pad_multiple", "microbatch_pad_multiple", "forward_only",
           "memory_probe", "balance_by_flops")
#: options a Megatron launch does not set (tests/test_plan_options.py NOT_LAUNCH_OPTIONS)
NOT_LAUNCH = ("rollouts_per_step", "num_microbatches", "refine_rounds", "equal_samples_per_rank",
              "min_num_microbatches", "num_microbatches_multiple", "sequence_pad_multiple", "microbatch_pad_multiple",
              "forward_only")
#: run-preset keys that are options (RunConfig fields)
PRESET_KEYS = ("max_tokens_per_gpu", "gpu_memory_gb", "memory", "balance_by", "oversize", "fp8_alignment",
               "samples_per_step", "dynamic_cp", "min_cp_size", "cost_model", "decision_margin", "memory_probe")
BATCH = ("group_ids", "microbatch_group_ids", "rollout_ids")


# ============================================================================================ cases
def _pick(rng: np.random.Generator, items: List[Any], p: Optional[List[float]] = None) -> Any:
    return items[int(rng.choice(len(items), p=p))]


def _lengths(rng: np.random.Generator, scale: int) -> Tuple[Any, str]:
    """A batch of lengths and how it is typed (``list``, ``int64``, ``int32``)."""
    u = rng.random()
    n = 0 if u < 0.02 else 1 if u < 0.06 else int(rng.integers(2, 65)) if u < 0.6 else \
        int(rng.integers(65, 513)) if u < 0.985 else int(rng.integers(1500, 4097))
    shape = rng.random()
    hi = max(2, int(scale * _pick(rng, [0.3, 0.8, 1.0, 1.3], [0.3, 0.4, 0.2, 0.1])))
    if shape < 0.5:
        lens = rng.integers(1, hi + 1, n)
    elif shape < 0.8:  # long-tailed (RL responses)
        lens = np.clip(rng.lognormal(math.log(max(hi / 6, 2)), 0.9, n), 1, hi * 1.2).astype(np.int64)
    elif shape < 0.9:
        lens = np.full(n, int(rng.integers(1, hi + 1)), dtype=np.int64)
    else:
        lens = rng.integers(1, 64, n)
    lens = [int(x) for x in lens]
    if n and rng.random() < 0.05:  # hostile values
        k = int(rng.integers(0, n))
        lens[k] = _pick(rng, [0, -3, 3.5, 10 ** 12, True, "12", None, float("nan"), scale * 50])
    typed = _pick(rng, ["list", "int64", "int32"], [0.6, 0.3, 0.1])
    return lens, typed


def make_case(seed: int, index: int) -> Dict[str, Any]:
    """Case ``index`` of the run seeded ``seed``: ``{"lengths", "typed", "kw", "ids", "extra"}`` (JSON-able)."""
    rng = np.random.default_rng([seed, index])
    kw: Dict[str, Any] = {}
    model = _pick(rng, [None, "model", "dict", "bad"], [0.3, 0.61, 0.07, 0.02])
    if model == "model":
        kw["model"] = _pick(rng, MODELS, [0.35, 0.2, 0.25, 0.1, 0.1])
    elif model == "dict":
        kw["model"] = "dict:" + _pick(rng, MODELS[:3])
    elif model == "bad":
        kw["model"] = _pick(rng, ["no-such-model", "Qwen3-0.6B", "qwen3-0.6"])
    budget = _pick(rng, [256, 1024, 2048, 4096, 8192, 16384, "auto", "AUTO ", "np4096", 0, -5, 2.5, "big", True,
                         "missing"], [.05, .13, .16, .21, .16, .08, .1, .02, .03, .01, .01, .01, .01, .01, .01])
    if budget != "missing":
        kw["max_tokens_per_gpu"] = budget
    if isinstance(budget, str) and budget.strip().lower() == "auto" and rng.random() < 0.9:
        kw["gpu_memory_gb"] = _pick(rng, [79.1, 139.8, 40, 16, 0, "nan"], [.45, .3, .12, .07, .03, .03])
    elif rng.random() < 0.03:
        kw["gpu_memory_gb"] = 79.1
    if rng.random() < (0.5 if "gpu_memory_gb" in kw else 0.05):
        kw["memory"] = _pick(rng, [{"recompute": "full"}, {"optimizer": "cpu_offload", "recompute": "full"},
                                   {"optimizer": "distributed"}, {"recompute": "most"}])
    par: Dict[str, Any] = {"dp": _pick(rng, [1, 2, 3, 4, 8], [.25, .3, .05, .25, .15])}
    for key, values, p in (("tp", [2, 4], .2), ("pp", [2, 4], .15), ("cp", [2, 4], .2)):
        if rng.random() < p:
            par[key] = _pick(rng, values)
    if par.get("pp") and rng.random() < 0.4:
        par["vpp"] = 2
    if kw.get("model") == "qwen3-30b-a3b" and rng.random() < 0.5:
        par["ep"] = _pick(rng, [2, 8])
    if par.get("tp") and rng.random() < 0.3:
        par["sequence_parallel"] = True
    if rng.random() < 0.01:
        par["dp"] = 0
    kw["parallel"] = par
    r = rng.random()
    if r < 0.3:
        kw["balance_by"] = _pick(rng, ["time", "flops", "tokens", "Tokens", "raw"], [.3, .3, .3, .05, .05])
    elif r < 0.36:
        kw["balance_by_flops"] = bool(rng.random() < 0.5)
    for name, values, p, probs in (
            ("cost_model", ["analytic", "fitted", "fitted-v2"], .12, [.5, .4, .1]),
            ("decision_margin", [0, 0.03, 0.2, 1.5], .1, [.3, .3, .3, .1]),
            ("oversize", ["alone", "error", "skip"], .25, [.8, .15, .05]),
            ("fp8_alignment", ["fp8", "mxfp8", "nvfp4", 16, "fp9"], .1, [.3, .3, .15, .15, .1]),
            ("refine_rounds", [0, 3], .04, None),
            ("forward_only", [True], .03, None),
            ("memory_probe", [False, True], .03, None),
            ("equal_samples_per_rank", [True], .04, None),
            ("min_num_microbatches", [2, 5], .04, None),
            ("num_microbatches_multiple", [2, 4], .04, None),
            ("sequence_pad_multiple", [8, 64], .04, None),
            ("microbatch_pad_multiple", [16, 128], .04, None)):
        if rng.random() < p:
            kw[name] = _pick(rng, values, probs)
    lengths, typed = _lengths(rng, _scale(kw))
    n = len(lengths)
    ids: Dict[str, Any] = {}
    r = rng.random()
    if r < 0.15:
        kw["samples_per_step"] = _pick(rng, [max(1, n // 2), max(1, n // 4), int(rng.integers(1, max(2, n + 2))), 0],
                                       [.4, .4, .15, .05])
    elif r < 0.22:
        size = int(rng.integers(1, 5))
        ids["rollout_ids"] = [i // size for i in range(n)]
        kw["rollouts_per_step"] = int(rng.integers(1, max(2, n // size + 1)))
    if rng.random() < 0.2:
        g = int(rng.integers(1, 9))
        ids["group_ids"] = [i // g for i in range(n)]
    if rng.random() < 0.05:
        ids["microbatch_group_ids"] = [i // 2 for i in range(n)]
    if rng.random() < 0.15:
        kw["dynamic_cp"] = True
        if "cp" not in par and rng.random() < 0.7:
            par["cp"] = _pick(rng, [2, 4])
        if rng.random() < 0.4:
            kw["min_cp_size"] = _pick(rng, [1, 2, 3, 4])
    elif rng.random() < 0.01:
        kw["min_cp_size"] = 2
    if rng.random() < 0.08:
        kw["num_microbatches"] = _pick(rng, [1, 3, 8, [2, 3], 0])
    extra = {"limit": _pick(rng, [None, 1, 2, 4]), "microbatches": int(rng.integers(1, 9)),
             "round": _pick(rng, [1, 8, 128])}
    return {"lengths": lengths, "typed": typed, "kw": kw, "ids": ids, "extra": extra}


def _scale(kw: Dict[str, Any]) -> int:
    b = kw.get("max_tokens_per_gpu")
    if isinstance(b, int) and not isinstance(b, bool) and b > 0:
        return b * int(kw["parallel"].get("cp", 1))
    return 4096 if b in ("auto", "AUTO ") else 2048


# ============================================================================================ values of a case
def _model(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("dict:"):
        from megatron_dynbatch import ModelSpec

        return ModelSpec.from_any(value[5:]).to_dict()
    return value


def _value(name: str, value: Any) -> Any:
    """A case's JSON-able value as the Python door takes it."""
    if name == "model":
        return _model(value)
    if name == "max_tokens_per_gpu" and value == "np4096":
        return np.int64(4096)
    if name == "gpu_memory_gb" and value == "nan":
        return float("nan")
    if name == "num_microbatches" and isinstance(value, list):
        return tuple(value)
    return value


def py_kwargs(case: Dict[str, Any]) -> Dict[str, Any]:
    return {k: _value(k, v) for k, v in case["kw"].items()}


def typed_lengths(case: Dict[str, Any]) -> Any:
    lens = case["lengths"]
    if case["typed"] == "list" or not all(type(x) is int for x in lens):
        return list(lens)
    return np.asarray(lens, dtype=np.int64 if case["typed"] == "int64" else np.int32)


def _clean_lengths(case: Dict[str, Any]) -> bool:
    return all(type(x) is int and 0 <= x <= 10 ** 6 for x in case["lengths"])


def _budget(case: Dict[str, Any]) -> Optional[int]:
    b = case["kw"].get("max_tokens_per_gpu")
    if b == "np4096":
        return 4096
    return b if isinstance(b, int) and not isinstance(b, bool) else None


def _only(case: Dict[str, Any], allowed: Tuple[str, ...]) -> bool:
    return set(case["kw"]) <= set(allowed) and not case["ids"]


# ============================================================================================ fingerprints
def _plan_like(x: Any) -> bool:
    return hasattr(x, "micro_batches") and hasattr(x, "microbatches_per_step") and hasattr(x, "max_tokens_per_gpu")


def plan_key(plan: Any) -> List[Any]:
    """What a plan decided, read through the plan protocol (``PlanKind``)."""
    return ["plan", plan.kind or "plain", [[[int(i) for i in mb] for mb in row] for row in plan.micro_batches],
            [int(c) for c in plan.microbatches_per_step], int(plan.max_tokens_per_gpu), str(plan.balance_by)]


def canonical(x: Any, depth: int = 0) -> Any:
    """A JSON-able form of a door's return value (plans by :func:`plan_key`; floats to 9 digits)."""
    if _plan_like(x):
        return plan_key(x)
    if depth > 6:
        return type(x).__name__
    if isinstance(x, (bool, str)) or x is None:
        return x
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(f"{float(x):.9g}") if math.isfinite(x) else str(x)
    if isinstance(x, np.ndarray):
        return canonical(x.tolist(), depth + 1)
    if isinstance(x, dict):
        return {str(k): canonical(v, depth + 1) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))
                if "time_s" not in str(k)}
    if isinstance(x, (list, tuple)):
        return [canonical(v, depth + 1) for v in x]
    import dataclasses

    if dataclasses.is_dataclass(x):
        return {f.name: canonical(getattr(x, f.name), depth + 1) for f in dataclasses.fields(x)
                if not f.name.startswith("_") and "time_s" not in f.name}
    return type(x).__name__


def digest(x: Any) -> str:
    blob = json.dumps(canonical(x), sort_keys=True, separators=(",", ":")).encode()
    return "P:" + hashlib.sha256(blob).hexdigest()[:16]


def refusal(exc: BaseException) -> str:
    field = getattr(exc, "field", None)
    return f"E:{type(exc).__name__}:{field if field is not None else ''}"


# ============================================================================================ the doors
def door_api_kwargs(case: Dict[str, Any]) -> Any:
    from megatron_dynbatch import plan_global_batch

    return plan_global_batch(typed_lengths(case), **py_kwargs(case), **case["ids"])


def door_api_options(case: Dict[str, Any]) -> Any:
    from megatron_dynbatch import PlanOptions, plan_global_batch

    kw = py_kwargs(case)
    if "balance_by_flops" in kw:  # the legacy switch is a planning-call keyword (PlanOptions.from_kwargs maps it)
        opts = PlanOptions.from_kwargs(kw)
    else:
        opts = PlanOptions(**kw)
    return plan_global_batch(typed_lengths(case), opts, **case["ids"])


def _cli_tokens(case: Dict[str, Any]) -> Optional[List[str]]:
    """The ``plan`` command's flags for a case, from each field's ``metadata["cli"]``; ``None``: not expressible."""
    import dataclasses

    from megatron_dynbatch import PlanOptions

    kw = case["kw"]
    if any(k in kw for k in NOT_CLI) or set(case["ids"]) - {"group_ids"}:
        return None
    if str(kw.get("model", "")).startswith("dict:") or kw.get("gpu_memory_gb") == "nan":
        return None
    if isinstance(kw.get("max_tokens_per_gpu"), (bool, float)) or kw.get("max_tokens_per_gpu") == "np4096":
        return None
    flags = {f.name: f.metadata.get("cli") for f in dataclasses.fields(PlanOptions) if f.init}
    argv: List[str] = []
    for name, value in kw.items():
        if name == "parallel":
            for key, v in value.items():
                argv += ["--sequence-parallel"] if key == "sequence_parallel" else [f"--{key}", str(v)]
        elif name == "memory":
            for key, v in value.items():
                argv += [f"--{key}", str(v)]
        elif name == "dynamic_cp":
            argv += [flags[name]] if value else []
        elif name == "num_microbatches":
            if isinstance(value, list):
                return None
            argv += [flags[name], str(value)]
        else:
            flag = flags.get(name)
            if not (flag or "").startswith("--"):
                return None
            argv += [flag, str(value)]
    return argv


def door_cli(case: Dict[str, Any]) -> Any:
    from megatron_dynbatch.cli import main

    argv = _cli_tokens(case)
    if argv is None or not all(type(x) is int for x in case["lengths"]):
        return NA
    with tempfile.TemporaryDirectory() as tmp:
        lengths = Path(tmp) / "lengths.json"
        lengths.write_text(json.dumps(case["lengths"]))
        extra = []
        if "group_ids" in case["ids"]:
            groups = Path(tmp) / "groups.json"
            groups.write_text(json.dumps(case["ids"]["group_ids"]))
            extra = ["--group-ids", str(groups)]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["plan", "--lengths", str(lengths), *extra, *argv, "--json"])
    if rc == 0:
        from megatron_dynbatch import PlanKind

        return PlanKind.from_dict(json.loads(out.getvalue()))
    text = err.getvalue()
    said = text.split("error: ", 1)[1].splitlines()[0] if "error: " in text else ""
    if said.startswith("argument "):  # argparse refused a flag's text: the flag it names
        return f"E:cli-argparse-{rc}:{said.split(':', 1)[0][len('argument '):]}"
    return f"E:cli-{rc}:{said.split('=', 1)[0].strip()[:60]}"


def launch_namespace(case: Dict[str, Any]) -> Optional[argparse.Namespace]:
    """Megatron-style parsed args for a case (Megatron's model, layout and optimizer args plus our flags, as
    ``tests/test_plan_options.py`` builds them); ``None``: a launch cannot express the case."""
    from megatron_dynbatch import ModelSpec, PlanOptions
    from megatron_dynbatch.megatron.args import add_dynamic_batch_args

    kw = case["kw"]
    if kw.get("model") is None or any(k in kw for k in NOT_LAUNCH) or set(case["ids"]) - {"group_ids"}:
        return None
    if kw.get("gpu_memory_gb") == "nan" or isinstance(kw.get("max_tokens_per_gpu"), (bool, float)):
        return None
    try:
        spec = ModelSpec.from_any(_model(kw["model"]))
    except Exception:  # an unknown model name is Megatron's parser's business, not a flag of ours
        return None
    flags = ["--use-dynamic-batch-size"]
    words = PlanOptions.spellings("megatron")
    for name, value in kw.items():
        if name in ("model", "parallel", "memory"):
            continue
        if name == "max_tokens_per_gpu":
            flags += ["--max-tokens-per-gpu", str(4096 if value == "np4096" else value)]
        elif name == "balance_by_flops":
            flags += ["--balance-by-flops"] if value else []
        elif name in ("dynamic_cp", "memory_probe"):
            flags += ([words[name]] if value else ["--no-" + words[name][2:]] if name == "memory_probe" else [])
        else:
            flags += [words[name], str(value)]
    ns = add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(flags)
    for key, value in spec.to_dict().items():
        setattr(ns, key, value)
    ns.num_experts = spec.num_experts
    ns.group_query_attention = True
    par = kw["parallel"]
    ns.tensor_model_parallel_size = par.get("tp", 1)
    ns.pipeline_model_parallel_size = par.get("pp", 1)
    ns.context_parallel_size = par.get("cp", 1)
    ns.expert_model_parallel_size = par.get("ep", 1)
    ns.virtual_pipeline_model_parallel_size = par.get("vpp")
    ns.sequence_parallel = par.get("sequence_parallel", False)
    ns.world_size = par["dp"] * ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size * \
        ns.context_parallel_size
    memory = kw.get("memory") or {}
    if memory.get("recompute") not in (None, "none", "full", "selective"):
        return None  # Megatron's own parser refuses it (--recompute-granularity {full,selective})
    if memory.get("recompute") in ("full", "selective"):
        ns.recompute_granularity = memory["recompute"]
    if memory.get("optimizer") in ("distributed", "cpu_offload"):
        ns.use_distributed_optimizer = True
    if memory.get("optimizer") == "cpu_offload":
        ns.optimizer_cpu_offload = True
    ns.untie_embeddings_and_output_weights = True
    return ns


def door_launch(case: Dict[str, Any]) -> Any:
    from megatron_dynbatch import plan_global_batch
    from megatron_dynbatch.megatron.args import plan_options_from_args, validate_dynamic_batch_args

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage text
            ns = launch_namespace(case)
    except SystemExit:
        return "E:argparse:"
    if ns is None:
        return NA
    opts = plan_options_from_args(validate_dynamic_batch_args(ns))
    return plan_global_batch(typed_lengths(case), opts, **case["ids"])


def door_preset(case: Dict[str, Any]) -> Any:
    from megatron_dynbatch import RunConfig, plan_global_batch

    kw = case["kw"]
    if kw.get("model") is None or set(kw) - set(PRESET_KEYS) - {"model", "parallel"} or \
            set(case["ids"]) - {"group_ids"} or kw.get("max_tokens_per_gpu") == "np4096":
        return NA
    data = {"name": "door", **{k: _value(k, v) for k, v in kw.items()}}
    data["parallel"] = dict(kw["parallel"])
    if "memory" not in data:
        data["memory"] = {}
    rc = RunConfig.from_dict(data)
    return plan_global_batch(typed_lengths(case), rc.plan_options(), **case["ids"])


def _samples(case: Dict[str, Any], tensors: bool) -> Optional[List[Dict[str, Any]]]:
    if not _clean_lengths(case) or sum(case["lengths"]) > 400_000:
        return None
    if tensors:
        import torch

        return [{"tokens": torch.zeros(n, dtype=torch.long)} for n in case["lengths"]]
    return [{"tokens": [0] * n} for n in case["lengths"]]


def door_iterator(case: Dict[str, Any]) -> Any:
    from megatron_dynbatch import DynamicBatchIterator

    samples = _samples(case, tensors=True)
    if samples is None or case.get("index", 0) % 4:
        return NA
    kw = py_kwargs(case)
    if "balance_by_flops" in kw:
        return NA
    # this GPU placed explicitly: the answer must not depend on a Megatron parallel state another test left set up
    it = DynamicBatchIterator(samples, dp_rank=0, cp_rank=0, **kw, **case["ids"])
    return it.plan


def door_ray(case: Dict[str, Any]) -> Any:
    from megatron_dynbatch.integrations.ray import plan_rollout

    samples = _samples(case, tensors=False)
    kw = py_kwargs(case)
    if samples is None or set(case["ids"]) - {"group_ids"} or "balance_by_flops" in kw:
        return NA
    rp = plan_rollout(samples, put=False, group_ids=case["ids"].get("group_ids"), **kw)
    return [rp.plan, rp.log_probs_plan]


def door_packing_seat(case: Dict[str, Any]) -> Any:
    from megatron_dynbatch.core.dropin.megatron_packing import plan_sample_id_groups

    kw = py_kwargs(case)
    budget = kw.pop("max_tokens_per_gpu", None)
    if budget is None or case["ids"] or "balance_by_flops" in kw:
        return NA
    par = kw.pop("parallel")
    pairs = [(1000 + i, n) for i, n in enumerate(case["lengths"])]
    rest = {k: v for k, v in par.items() if k not in ("dp", "cp")}
    groups, plan = plan_sample_id_groups(pairs, max_seqlen_per_dp_cp_rank=budget, dp=par["dp"],
                                         cp=par.get("cp", 1), parallel=rest or None, **kw)
    return [groups, plan]


def door_sequence_limit(case: Dict[str, Any]) -> Any:
    from megatron_dynbatch.core.dropin.sequence_limit import plan_with_sequence_limit

    kw = py_kwargs(case)
    if case["ids"] or "balance_by_flops" in kw or case["extra"]["limit"] is None:
        return NA
    return plan_with_sequence_limit(typed_lengths(case), case["extra"]["limit"], **kw)


def _trainer_args(case: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """What a trainer's own settings carry: budget, layout, model, cost model (the options a drop-in maps; the
    case's other options are not the trainer's to give)."""
    kw = case["kw"]
    budget = _budget(case)
    if budget is None:
        return None
    return {"budget": budget, "par": kw["parallel"], "model": _model(kw.get("model")),
            "cost_model": kw.get("cost_model"), "oversize": kw.get("oversize")}


def door_slime(case: Dict[str, Any]) -> Any:
    from megatron_dynbatch.core.dropin.slime import slime_parallel, slime_schedule

    t = _trainer_args(case)
    n = len(case["lengths"])
    if t is None or not n or case["ids"]:
        return NA
    par = t["par"]
    size = case["extra"]["microbatches"]
    rollouts = [i // size for i in range(n)]
    gbs = max(1, (max(rollouts) + 1) // 2)
    parallel = slime_parallel(par["dp"], par.get("cp", 1), par.get("vpp", 1), tp=par.get("tp", 1),
                              pp=par.get("pp"), sequence_parallel=par.get("sequence_parallel", False))
    return slime_schedule(typed_lengths(case), rollout_indices=rollouts, global_batch_size=gbs, parallel=parallel,
                          max_tokens_per_gpu=t["budget"], model=t["model"], cost_model=t["cost_model"],
                          oversize=t["oversize"] or "alone")


def door_verl_local(case: Dict[str, Any]) -> Any:
    from megatron_dynbatch.core.dropin.verl import local_plan

    t = _trainer_args(case)
    if t is None or case["ids"]:
        return NA
    par = t["par"]
    total = sum(x for x in case["lengths"] if type(x) is int and x > 0)  # verl's count: at least the tokens' worth
    count = -(-total // max(1, t["budget"] * par.get("cp", 1))) + case["extra"]["microbatches"] % 3
    return local_plan(typed_lengths(case), t["budget"], max(1, count), tp=par.get("tp", 1),
                      cp=par.get("cp", 1), pp=par.get("pp", 1), model=t["model"], cost_model=t["cost_model"])


def door_verl_balance(case: Dict[str, Any]) -> Any:
    from megatron_dynbatch.core.dropin.verl import balance_partitions

    t = _trainer_args(case)
    if t is None or set(case["ids"]) - {"group_ids"}:
        return NA
    par = t["par"]
    lens, uids = typed_lengths(case), case["ids"].get("group_ids")
    if par["dp"] > 0 and len(lens) % par["dp"]:  # verl splits evenly: whole groups off the end
        keep = len(lens) - len(lens) % par["dp"]
        while uids and 0 < keep < len(lens) and uids[keep - 1] == uids[keep]:
            keep -= par["dp"]
        lens, uids = lens[:max(keep, 0)], uids[:max(keep, 0)] if uids else uids
    return balance_partitions(lens, par["dp"], uids=uids,
                              max_token_len=t["budget"], tp=par.get("tp", 1), cp=par.get("cp", 1),
                              pp=par.get("pp", 1), model=t["model"], cost_model=t["cost_model"])


def door_roll(case: Dict[str, Any]) -> Any:
    from megatron_dynbatch.core.dropin.roll import roll_shard

    t = _trainer_args(case)
    if t is None or case["ids"]:
        return NA
    par = t["par"]
    lens = typed_lengths(case)
    lens = lens[:len(lens) - len(lens) % par["dp"]] if par["dp"] > 0 else lens  # ROLL shards evenly
    return roll_shard(lens, par["dp"], t["budget"], case["extra"]["round"], par.get("pp", 1),
                      par.get("vpp"), model=t["model"])


def door_nemo_rl(case: Dict[str, Any]) -> Any:
    from megatron_dynbatch.core.dropin.nemo_rl import get_packer

    t = _trainer_args(case)
    if t is None or case["ids"]:
        return NA
    return get_packer("modified_first_fit_decreasing", bin_capacity=t["budget"]).pack(typed_lengths(case))


def door_megatron_rl(case: Dict[str, Any]) -> Any:
    from megatron_dynbatch.core.dropin.megatron_rl import plan_rl_bins

    t = _trainer_args(case)
    if t is None or case["ids"]:
        return NA
    rest = {k: v for k, v in t["par"].items() if k != "dp"}
    return plan_rl_bins(typed_lengths(case), bin_size=t["budget"], dp=t["par"]["dp"],
                        seq_length_multiple=case["extra"]["round"], parallel=rest or None, model=t["model"],
                        cost_model=t["cost_model"])


DOORS: Dict[str, Callable[[Dict[str, Any]], Any]] = {
    "api_kwargs": door_api_kwargs, "api_options": door_api_options, "cli": door_cli, "launch": door_launch,
    "preset": door_preset, "iterator": door_iterator, "ray": door_ray, "packing_seat": door_packing_seat,
    "sequence_limit": door_sequence_limit, "slime": door_slime, "verl_local": door_verl_local,
    "verl_balance": door_verl_balance, "roll": door_roll, "nemo_rl": door_nemo_rl, "megatron_rl": door_megatron_rl,
}
#: doors whose input is the options themselves (cross-door agreement compares these)
OPTION_DOORS = ("api_kwargs", "api_options", "cli", "launch", "preset", "iterator", "ray")


def fingerprint(door: str, case: Dict[str, Any]) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result = DOORS[door](case)
        except Exception as exc:  # noqa: BLE001 -- a refusal (or a crash) is this door's answer
            return refusal(exc)
    if isinstance(result, str):
        return result
    if door == "ray":  # the training plan's fingerprint, then the log-prob plan's
        return digest(result[0]) + "+" + digest(result[1])[2:]
    return digest(result)


def run(n: int, seed: int, doors: List[str], start: int = 0, progress: bool = False) -> Dict[str, Dict[str, str]]:
    out: Dict[str, Dict[str, str]] = {}
    t0 = time.time()
    for i in range(start, start + n):
        case = make_case(seed, i)
        case["index"] = i
        out[f"{seed}:{i}"] = {door: fingerprint(door, case) for door in doors}
        if progress and (i + 1) % 100 == 0:
            print(f"  {i + 1 - start}/{n} cases, {time.time() - t0:.0f} s", file=sys.stderr)
    return out


# ============================================================================================ files
def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def write(path: Path, data: Dict[str, Any]) -> None:
    text = json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n"
    if str(path).endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)


def read(path: Path) -> Dict[str, Any]:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw)


def counts(results: Dict[str, Dict[str, str]], doors: List[str]) -> Dict[str, Dict[str, int]]:
    table = {d: {"plans": 0, "refusals": 0, "n/a": 0} for d in doors}
    for row in results.values():
        for d in doors:
            fp = row.get(d, NA)
            table[d]["plans" if fp.startswith("P:") else "refusals" if fp.startswith("E:") else "n/a"] += 1
    return table


def compare(base: Dict[str, Any], results: Dict[str, Dict[str, str]], doors: List[str], show: int = 10) -> int:
    same = {d: 0 for d in doors}
    diff: Dict[str, int] = {d: 0 for d in doors}
    examples: List[str] = []
    for key, row in results.items():
        was = base["cases"].get(key)
        if was is None:
            continue
        for d in doors:
            if d not in was:
                continue
            if was[d] == row[d]:
                same[d] += 1
            else:
                diff[d] += 1
                if len(examples) < show:
                    examples.append(f"  {key} {d}: before {was[d]}  after {row[d]}\n"
                                    f"    repro: python scripts/door_equivalence.py --case {key} --doors {d}")
    print(f"compared with {base['meta'].get('commit', '?')[:12]} (n={base['meta'].get('n')}, "
          f"seed={base['meta'].get('seed')}):")
    for d in doors:
        print(f"  {d:15s} same {same[d]:5d}  different {diff[d]:5d}")
    if examples:
        print("first differences:")
        print("\n".join(examples))
    return 1 if any(diff.values()) else 0


def _said_field(fp: str) -> str:
    """A refusal's field in the Python keyword's words (a door names it by its own flag)."""
    from megatron_dynbatch import PlanOptions

    field = fp.split(":", 2)[2] if fp.count(":") >= 2 else ""
    words = {flag: name for door in ("cli", "megatron") for name, flag in PlanOptions.spellings(door).items()}
    words.update({"--dp": "parallel.dp", "--balance-by-flops": "balance_by", "samples": "lengths",
                  "len(lengths)": "lengths", "--log-probs-max-tokens-per-gpu": "max_tokens_per_gpu"})
    field = words.get(field, field)
    return "lengths" if field.startswith("lengths[") else field.split(".")[0] if field.startswith("parallel") \
        else field


def agreement(results: Dict[str, Dict[str, str]], show: int = 6) -> None:
    """Where two option doors given the same case answer differently (both answer: neither ``-``), by kind:
    different plans; one plans and the other refuses; both refuse but name different fields (in the Python
    keyword's words, so a door's own flag names agree with the keyword)."""
    kinds = ("different plans", "plan vs refusal", "refusals naming different fields")
    pairs: Dict[Tuple[str, str], Dict[str, List[str]]] = {}
    for key, row in results.items():
        for a_i, a in enumerate(OPTION_DOORS):
            for b in OPTION_DOORS[a_i + 1:]:
                fa, fb = row.get(a, NA).split("+")[0], row.get(b, NA).split("+")[0]  # ray: the training plan
                if NA in (fa, fb) or fa == fb:
                    continue
                if fa[0] == fb[0] == "P":
                    kind = kinds[0]
                elif fa[0] != fb[0]:
                    kind = kinds[1]
                elif _said_field(fa) != _said_field(fb):
                    kind = kinds[2]
                else:
                    continue
                pairs.setdefault((a, b), {}).setdefault(kind, []).append(f"{key}: {fa} vs {fb}")
    if not pairs:
        print("every option door agrees wherever two answer")
    for (a, b), by_kind in sorted(pairs.items()):
        print(f"{a} vs {b}: " + ", ".join(f"{len(by_kind[k])} {k}" for k in kinds if k in by_kind))
        for k in kinds:
            for line in by_kind.get(k, [])[:show]:
                print(f"    [{k}] {line}")


def show_case(key: str, doors: List[str]) -> None:
    seed, index = (int(x) for x in key.split(":"))
    case = make_case(seed, index)
    case["index"] = index
    print(json.dumps({k: v for k, v in case.items() if k != "lengths"}, default=str))
    lens = case["lengths"]
    print(f"lengths ({len(lens)}, {case['typed']}): {lens[:20]}{' ...' if len(lens) > 20 else ''}")
    for d in doors:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                result = DOORS[d](case)
                print(f"  {d}: {fingerprint(d, case)}"
                      + (f"  micro-batches per row {[len(r) for r in result.micro_batches][:8]}"
                         if _plan_like(result) else ""))
            except Exception as exc:  # noqa: BLE001
                print(f"  {d}: {refusal(exc)}  ({str(exc)[:300]})")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=None, help=f"cases (default {DEFAULT_N}; a compare: the file's)")
    p.add_argument("--seed", type=int, default=None, help=f"run seed (default {DEFAULT_SEED}; a compare: the file's)")
    p.add_argument("--doors", default=None, help=f"comma-separated subset of: {','.join(DOORS)}")
    p.add_argument("--write", metavar="FILE", help="write the fingerprints (.gz: gzipped JSON)")
    p.add_argument("--compare", metavar="FILE", help="compare with a written file; exit 1 on any difference")
    p.add_argument("--agreement", metavar="FILE", help="report where option doors disagree in a written file")
    p.add_argument("--case", metavar="SEED:I", help="print one case and every door's answer")
    p.add_argument("--progress", action="store_true", help="progress on stderr every 100 cases")
    args = p.parse_args(argv)
    doors = list(DOORS) if not args.doors else [d.strip() for d in args.doors.split(",") if d.strip()]
    unknown = [d for d in doors if d not in DOORS]
    if unknown:
        p.error(f"unknown door(s) {unknown}; choose from {list(DOORS)}")
    if args.case:
        show_case(args.case, doors)
        return 0
    if args.agreement:
        agreement(read(Path(args.agreement))["cases"])
        return 0
    base = read(Path(args.compare)) if args.compare else None
    seed = args.seed if args.seed is not None else base["meta"]["seed"] if base else DEFAULT_SEED
    n = args.n if args.n is not None else base["meta"]["n"] if base else DEFAULT_N
    t0 = time.time()
    results = run(n, seed, doors, progress=args.progress)
    elapsed = time.time() - t0
    for d, c in counts(results, doors).items():
        print(f"  {d:15s} plans {c['plans']:5d}  refusals {c['refusals']:5d}  n/a {c['n/a']:5d}")
    print(f"{n} cases x {len(doors)} doors in {elapsed:.0f} s")
    if args.write:
        write(Path(args.write), {"meta": {"commit": _git_commit(), "n": n, "seed": seed, "doors": doors,
                                          "seconds": round(elapsed)}, "cases": results})
        print(f"wrote {args.write}")
    if base is not None:
        return compare(base, results, doors)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
