"""``megatron-dynbatch calibrate``: time the user's model on their device and write a calibrated cost-model file.

The command validates everything first (:func:`~megatron_dynbatch.core.calibration.setup.plan_calibration`; every
bad flag is a ``DynBatchConfigError`` naming the flag, its value and the fix), prints the grid and its estimate
(``--dry-run`` stops there: no torch, no megatron-core), times the grid on a slice of the model
(:func:`~megatron_dynbatch.measure.calibrate.run_calibration`; or refits saved records, ``--from-records``), prints
the fit error per group size and what the calibrated model changes on a sample batch (the default model's plan
re-scored, and the batch re-planned: :func:`~megatron_dynbatch.core.calibration.compare.step_time_change`), and
writes the cost-model file (``--output``) that ``plan|bench --cost-model``, ``RunConfig.options`` and
``--dynbatch-cost-model`` read. ``--run PRESET`` takes the model, layout, budget and dynamic CP from a run preset
(a flag that contradicts it is refused). Progress goes to stderr: on a terminal one line updated per grid point,
elsewhere (a log, a pipe) a line every :data:`PROGRESS_EVERY_S` seconds. megatron-core's notices that it falls back
to torch (no Transformer Engine / Apex: expected on a CPU machine and wherever the local spec runs) are counted
into one note instead of a dozen warnings (:func:`_megatron_notices`); any other warning still prints. On a machine
where no CUDA device is visible, ``--dry-run`` says so next to the GPU grid it prints, and a timing run with
``--device cuda`` is refused naming ``--device`` before anything is built.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, TextIO

from .core.errors import DynBatchConfigError

DEFAULT_OUTPUT = "calibrated_cost_model.json"
_LAYOUT = ("dp", "tp", "pp", "cp", "ep", "vpp", "gpus_per_node")
#: seconds between progress lines when stderr is not a terminal
PROGRESS_EVERY_S = 10.0
#: where megatron-core's own warnings come from ...
_MEGATRON_FILE = re.compile(r"[\\/]megatron[\\/]core[\\/]")
#: ... and the notices of it that say nothing to act on here: its fallbacks to torch where Transformer Engine /
#: Apex are not installed, and its deprecations of its own internals (pyproject.toml filters the same for pytest)
_MEGATRON_NOTICE = re.compile(r"are not installed|Falling back to|is deprecated|will be removed|tp_group is None|"
                              r"ffn_hidden_size, but it was not provided")


def add_calibrate_parser(sub: Any, add_layout_args: Callable[[argparse.ArgumentParser], None],
                         layout: Callable[[argparse.Namespace], Any]) -> None:
    """The ``calibrate`` subcommand (the CLI passes its layout-flag helpers, so this module never imports it)."""
    c = sub.add_parser("calibrate", help="time your model on this device and write a calibrated cost-model file",
                       description="Time a 1-2 layer slice of your model (megatron-core; Transformer Engine spec "
                                   "where installed, else the local THD spec) over packed micro-batches and CP "
                                   "shares, fit the cost model, print its error and write the file "
                                   "--cost-model / --dynbatch-cost-model read (docs/cost_model.md).")
    c.add_argument("--model", default=None, help="model preset name or YAML/JSON/config.json path")
    c.add_argument("--run", default=None, metavar="PRESET", help="run preset: model, layout, budget, dynamic CP")
    add_layout_args(c)
    c.add_argument("--dynamic-cp", action="store_true", help="the layout plans dynamic CP: time every pool group size")
    c.add_argument("--max-tokens-per-gpu", default=None, metavar="N",
                   help="training budget: the largest per-GPU share timed")
    c.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    c.add_argument("--layers", default=None, metavar="N", help="decoder layers in the slice (default 2)")
    c.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default bf16 on a GPU, fp32 on a CPU)")
    c.add_argument("--spec", default="auto", help="layer spec: auto (TE where installed), local or te")
    c.add_argument("--lm-head", action="store_true", help="time the embedding, LM head and loss too")
    c.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                   help="also measure peak memory (1- and 2-layer slices, one with the LM head) for the file's memory "
                        "section, which `budget --cost-model` reads (default: on a GPU; a CPU has no allocator "
                        "statistics)")
    g = c.add_argument_group("grid")
    g.add_argument("--group-sizes", default=None, metavar="G1,G2", help="CP group sizes (default: the layout's)")
    g.add_argument("--grid-tokens", default=None, metavar="T1,T2", help="per-GPU token counts (default: the budget "
                                                                         "and its halvings to 1/32)")
    g.add_argument("--grid-seqs", default=None, metavar="N1,N2", help="sequences per micro-batch (default 1,2,4,8)")
    g.add_argument("--warmup", default="1", metavar="N", help="untimed runs per point (default 1)")
    g.add_argument("--repeats", default="3", metavar="N", help="timed runs per point, minimum kept (default 3)")
    g.add_argument("--max-seconds", default=None, metavar="S", help="stop timing before this many seconds")
    c.add_argument("--base", default="fitted", metavar="NAME|FILE",
                   help="profile for what compute timings cannot tell (peak FLOPs, network); also the model the "
                        "report compares with (default fitted)")
    c.add_argument("--lengths", default=None, metavar="FILE", help="sample batch for the report (default: synthetic)")
    c.add_argument("--seed", default="0", metavar="N", help="seed of the synthetic sample batch")
    c.add_argument("--cpu-threads", default=None, metavar="N", help="torch threads for --device cpu")
    c.add_argument("--output", default=DEFAULT_OUTPUT, metavar="FILE",
                   help=f"cost-model file (default {DEFAULT_OUTPUT})")
    c.add_argument("--records", default=None, metavar="FILE", help="also write the timed records here")
    c.add_argument("--from-records", default=None, metavar="FILE", help="refit records a previous run wrote; no timing")
    c.add_argument("--dry-run", action="store_true", help="print the grid and the time estimate; time nothing")
    c.add_argument("--json", action="store_true", help="print the result as JSON")
    c.set_defaults(func=lambda args: cmd_calibrate(args, layout))


def _int(text: Optional[str], flag: str, low: int = 0) -> Optional[int]:
    from .core.checks import as_int

    if text is None:
        return None
    try:
        value: Any = int(str(text).strip(), 10)
    except ValueError:
        value = text
    return as_int(value, flag, minimum=low, fix=f"pass {flag} with a whole number >= {low}")


def _ints(text: Optional[str], flag: str) -> Optional[List[Any]]:
    if text is None:
        return None
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(not p for p in parts):
        raise DynBatchConfigError(flag, text, "must be comma-separated whole numbers", f"pass e.g. {flag} 1,2,4")
    return [_int(p, flag, 1) for p in parts]


def _seconds(text: Optional[str]) -> Optional[float]:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise DynBatchConfigError("--max-seconds", text, "is not a number of seconds",
                                  "pass e.g. --max-seconds 600") from None


def _target(args: argparse.Namespace, layout: Callable[[argparse.Namespace], Any]) -> Dict[str, Any]:
    """Model, layout, budget and dynamic CP: from ``--run`` (flags must agree) or from the flags."""
    if args.run is None:
        if args.model is None:
            raise DynBatchConfigError("--model", None, "is required", "pass --model PRESET|FILE, or --run PRESET")
        if args.max_tokens_per_gpu is None:
            raise DynBatchConfigError("--max-tokens-per-gpu", None, "is required (the largest share timed is the "
                                      "training budget)", "pass --max-tokens-per-gpu N, or --run PRESET")
        return {"model": args.model, "parallel": layout(args), "dynamic_cp": args.dynamic_cp,
                "max_tokens_per_gpu": _int(args.max_tokens_per_gpu, "--max-tokens-per-gpu", 1), "run": None}
    from .core.model_spec import ModelSpec
    from .core.run_config import RunConfig

    run = RunConfig.from_yaml(args.run)
    par = run.parallel()
    given = {f"--{k.replace('_', '-')}": (getattr(args, k), getattr(par, k)) for k in _LAYOUT}
    given["--max-tokens-per-gpu"] = (_int(args.max_tokens_per_gpu, "--max-tokens-per-gpu", 1), run.budget())
    if args.model is not None and ModelSpec.from_any(args.model) != run.model_spec():
        given["--model"] = (args.model, run.model)
    for flag, (mine, theirs) in given.items():
        if mine is not None and mine != theirs:
            raise DynBatchConfigError(flag, mine, f"the run preset {run.name!r} says {theirs}",
                                      f"drop {flag} to calibrate the preset's setting, or drop --run")
    return {"model": run.model_spec(), "parallel": par, "dynamic_cp": run.options.dynamic_cp or args.dynamic_cp,
            "max_tokens_per_gpu": run.budget(), "run": run}


def cmd_calibrate(args: argparse.Namespace, layout: Callable[[argparse.Namespace], Any]) -> int:
    from .core.calibration.setup import plan_calibration

    target = _target(args, layout)
    setup = plan_calibration(
        target["model"], parallel=target["parallel"], max_tokens_per_gpu=target["max_tokens_per_gpu"],
        device=args.device, layers=_int(args.layers, "--layers", 1), dtype=args.dtype, spec=args.spec,
        lm_head=args.lm_head, dynamic_cp=target["dynamic_cp"], group_sizes=_ints(args.group_sizes, "--group-sizes"),
        tokens=_ints(args.grid_tokens, "--grid-tokens"), seqs=_ints(args.grid_seqs, "--grid-seqs"),
        warmup=_int(args.warmup, "--warmup"), repeats=_int(args.repeats, "--repeats", 1),
        max_seconds=_seconds(args.max_seconds), base=args.base,
        memory="auto" if args.memory is None else args.memory)
    lengths = _sample(args, setup)
    threads = _int(args.cpu_threads, "--cpu-threads", 1)
    if args.dry_run:
        if args.json:
            print(json.dumps({"setup": setup.describe(), "grid": setup.grid_rows(), "estimate_s": setup.estimate_s},
                             indent=1))
        else:
            print("\n".join(setup.describe()))
            if setup.device != "cpu" and not cuda_visible():
                print(f"note: no CUDA device is visible on this machine: this is the grid and estimate of a GPU run "
                      f"(--device {setup.device}); add --device cpu to time on this CPU instead")
            print("grid (group size: lengths): "
                  + "; ".join(f"{p.group_size}: {list(p.lengths)}" for p in setup.points))
        return 0
    if not args.json:
        print("\n".join(setup.describe()), flush=True)
    out: Dict[str, Any] = {"setup": setup.describe()}
    if args.from_records:
        from .measure.calibrate import refit_from_file

        from .measure.calibrate import refit_memory_from_data

        cm, report, data = refit_from_file(setup, args.from_records)
        out["environment"] = data.get("environment", {})
        memory_fit, memory_note = refit_memory_from_data(setup, data), ""
    else:
        result = _time(setup, threads, quiet=args.json)
        cm, report = result.cost_model, result.report
        memory_fit, memory_note = result.memory_fit, result.memory_note
        out.update(environment=result.environment, spec=result.spec_note, timed=len(result.records),
                   stopped_early=result.stopped_early, wall_s=result.wall_s)
        if args.records:
            with open(args.records, "w", encoding="utf-8") as fh:
                json.dump(result.records_json(), fh, indent=1)
        if not args.json:
            print(f"timed {len(result.records)} of {len(setup.points)} micro-batch shares in {result.wall_s:.0f} s on "
                  f"{result.environment.get('device')} ({result.spec_note}; kernel {result.environment.get('kernel')})"
                  + ("; stopped by --max-seconds" if result.stopped_early else ""))
    from .core.calibration.compare import step_time_change
    from .core.cost_files import save_cost_model

    change = step_time_change(lengths, old=args.base, new=cm, options=_plan_options(target, setup).resolve())
    save_cost_model(cm, args.output, report,
                    memory=memory_fit.profile.to_dict() if memory_fit is not None else None)
    if memory_fit is not None:
        out["memory_fit"] = memory_fit.to_dict()
    out.update(fit=report.to_dict(), cost_model=cm.to_dict(), sample={"samples": int(len(lengths)),
               "tokens": int(sum(lengths)), **change.to_dict()}, output=args.output)
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        _print_result(report, change, lengths, setup, args)
        _print_memory(memory_fit, memory_note, args)
    return 0


def _print_memory(fit: Any, note: str, args: argparse.Namespace) -> None:
    if fit is None:
        if note:
            print(note)
        return
    c = fit.coefficients
    print(f"memory fit ({fit.num_records} peaks, error {fit.rel_rms_error:.1%} rms, {fit.max_rel_error:.1%} max): "
          f"{c['layer'] / 1024:.1f} KiB per token per layer kept, {c['backward_extra'] / 1024:.1f} KiB per token in "
          f"backward, {c['head'] / 1024:.1f} KiB per token for the LM head and loss, workspace "
          f"{c['workspace'] / 2 ** 20:.1f} MiB; `megatron-dynbatch budget --cost-model {args.output} ...` uses it")


def cuda_visible() -> bool:
    """Whether this machine shows a CUDA (or ROCm) device, without importing torch (a dry run never does): torch's
    own answer when torch is already imported, else the driver's device files or ``nvidia-smi``."""
    if "torch" in sys.modules:
        return bool(sys.modules["torch"].cuda.is_available())
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd") or shutil.which("nvidia-smi"))


class ProgressPrinter:
    """The ``progress(i, n, elapsed, projected_s)`` callback of a timing run, on ``stream``: on a terminal one line
    rewritten per grid point; elsewhere a line for the first point and then at most one every ``every_s`` seconds,
    so a log shows the run is alive without a line per point. Each line quotes the run's projected length
    (``projected_s``: the points left at the speed measured so far), which starts at the dry run's estimate
    (``estimate_s``) and follows the device as it goes."""

    def __init__(self, stream: TextIO, estimate_s: float, *, every_s: float = PROGRESS_EVERY_S) -> None:
        self.stream, self.estimate_s, self.every_s = stream, float(estimate_s), float(every_s)
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._last: Optional[float] = None
        self.printed = False

    def __call__(self, i: int, n: int, elapsed: float, projected_s: Optional[float] = None) -> None:
        total = self.estimate_s if projected_s is None else float(projected_s)
        text = f"timing micro-batch share {i + 1}/{n} ({elapsed:.0f} s elapsed, ~{total:.0f} s in all)"
        if self.tty:
            print(f"\r  {text}", end="", file=self.stream, flush=True)
            self.printed = True
        elif self._last is None or elapsed - self._last >= self.every_s:
            print(f"  {text}", file=self.stream, flush=True)
            self._last = elapsed

    def close(self) -> None:
        if self.printed:  # end the rewritten terminal line
            print(file=self.stream, flush=True)
            self.printed = False


def _megatron_notices(caught: List[warnings.WarningMessage], stream: TextIO, *, quiet: bool) -> None:
    """The warnings of a timing run (``caught``): megatron-core's notices (:data:`_MEGATRON_NOTICE`) as one note on
    ``stream``, every other warning as Python shows it."""
    notices = [w for w in caught if _MEGATRON_FILE.search(str(w.filename)) and _MEGATRON_NOTICE.search(str(w.message))]
    for w in caught:
        if w not in notices:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if notices and not quiet:
        print(f"note: {len(notices)} notice(s) of megatron-core hidden: it falls back to torch where Transformer "
              "Engine / Apex are not installed (expected on a CPU), and deprecates parts of itself", file=stream)


def _time(setup: Any, threads: Optional[int], *, quiet: bool) -> Any:
    progress = ProgressPrinter(sys.stderr, setup.estimate_s)
    caught: List[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:  # the filters in force decide what is recorded
            from .measure.calibrate import run_calibration

            import torch

            if setup.device != "cpu" and not torch.cuda.is_available():
                raise DynBatchConfigError("--device", setup.device, "no CUDA device is available on this machine",
                                          "pass --device cpu to time on this CPU, or run on a GPU machine")
            if threads is not None:
                torch.set_num_threads(threads)
            return run_calibration(setup, progress=None if quiet else progress)
    except ImportError as exc:  # torch or megatron-core missing (or broken)
        from .requirements import import_problem

        problem = import_problem("torch", "megatron.core") or str(exc)
        raise DynBatchConfigError("calibrate", setup.device, f"timing needs torch and megatron-core: {problem}",
                                  "run bash scripts/setup.sh --test, or pass --dry-run / --from-records") from None
    finally:
        progress.close()
        _megatron_notices(caught, sys.stderr, quiet=quiet)


def _sample(args: argparse.Namespace, setup: Any) -> Any:
    from .core.calibration.compare import sample_lengths

    if args.lengths:
        from ._cli_io import read_values

        return read_values(args.lengths, "--lengths", integers=True)
    return sample_lengths(setup.max_tokens_per_gpu, setup.parallel, seed=_int(args.seed, "--seed"))


def _plan_options(target: Dict[str, Any], setup: Any) -> Any:
    """The options the sample batch is planned with (one optimizer step; the cost model is replaced)."""
    from .core.planner.options import PlanOptions

    run = target["run"]
    if run is not None:
        return run.plan_options().replace(samples_per_step=None)
    return PlanOptions(model=setup.model, parallel=setup.parallel, max_tokens_per_gpu=setup.max_tokens_per_gpu,
                       dynamic_cp=bool(setup.dynamic_cp))


def _print_result(report: Any, change: Any, lengths: Any, setup: Any, args: argparse.Namespace) -> None:
    from .core.calibration.report import fit_table, profile_line

    print("fit error per group size (relative, on the timed shares):")
    print("\n".join("  " + row for row in fit_table(report)))
    print(f"uncertainty (the default decision margin): {report.uncertainty:.1%}")
    print(f"fitted profile: {profile_line(report.profile)}")
    p = setup.parallel
    src = args.lengths or f"synthetic, seed {args.seed}"
    print(f"sample batch ({len(lengths)} samples, {int(sum(lengths)):,} tokens; {src}) on dp={p.dp} tp={p.tp} "
          f"pp={p.pp} cp={p.cp}{' with dynamic CP' if setup.dynamic_cp else ''}:")
    print("  " + change.describe(f"'{args.base}'", "calibrated model"))
    print(f"wrote {args.output}: plan with `plan --cost-model {args.output}`, `bench --cost-model {args.output}`, "
          f"`--dynbatch-cost-model {args.output}` (Megatron) or `cost_model: {args.output}` (run preset)")
