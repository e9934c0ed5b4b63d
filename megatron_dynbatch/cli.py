"""``megatron-dynbatch``: the command line.

Subcommands
-----------
``bench``  the built-in benchmark (all default workloads, every algorithm, planning speed); see
           ``docs/benchmarks.md``;
``plan``   plan one global batch read from a file and print a summary and the per-rank micro-batches;
``flops``  FLOPs of a model at given sequence lengths and the linear/quadratic coefficients the planner uses;
``runs``   list the run presets, print one as YAML, or print the Megatron flags it implies;
``calibrate`` time the user's model on their device and write a calibrated cost-model file (``_cli_calibrate.py``);
``budget``  the largest token budgets that fit the GPU, in each trainer's settings (``_cli_budget.py``);
``demo``   a tiny GPT trained with real megatron-core on CPU ranks (``megatron_dynbatch.demo``, imported only
           when asked for).

Configuration errors (:class:`~megatron_dynbatch.core.errors.DynBatchConfigError`) print as one line on stderr and
exit with status 2, like argparse's own usage errors; no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

from ._argparse import SuggestingArgumentParser, choice
from ._cli_io import read_values as _read_values
from ._cli_run import LAYOUT_FLAGS
from ._cli_summary import group_line, plan_summary, rank_table
from .core.errors import DynBatchConfigError
from .core.planner.option_flags import add_option_flags, option_values
from .core.planner.option_flags import positive_int as _positive_int

PROG = "megatron-dynbatch"


# ============================================================================================ helpers
def _add_cost_model_args(p: argparse.ArgumentParser) -> None:
    """``--cost-model`` and ``--decision-margin``: the options' own flags (``core/planner/option_flags.py``)."""
    add_option_flags(p, "cli", only=("cost_model", "decision_margin"))


def _add_layout_args(p: argparse.ArgumentParser, *, dp: bool = True) -> None:
    g = p.add_argument_group("parallel layout")
    if dp:
        g.add_argument("--dp", type=_positive_int, default=None,
                       help="data-parallel size: ranks that split the batch (default 1)")
    g.add_argument("--tp", type=_positive_int, default=None, help="tensor-parallel size")
    g.add_argument("--pp", type=_positive_int, default=None, help="pipeline-parallel size")
    g.add_argument("--cp", type=_positive_int, default=None,
                   help="context-parallel size (a micro-batch holds max_tokens_per_gpu * cp tokens)")
    g.add_argument("--ep", type=_positive_int, default=None, help="expert-parallel size (MoE models)")
    g.add_argument("--vpp", type=_positive_int, default=None,
                   help="virtual pipeline stages per rank (interleaved 1F1B)")
    g.add_argument("--microbatch-group-size-per-vp-stage", type=_positive_int, default=None,
                   help="Megatron's N for interleaved pipelines (default: pp)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallelism: tokens per micro-batch must divide by tp")
    g.add_argument("--gpus-per-node", type=_positive_int, default=None,
                   help="GPUs per node (default 8): which CP groups cross nodes, with Megatron's rank order")


def _layout(args: argparse.Namespace) -> Any:
    from .core.parallel import DEFAULT_GPUS_PER_NODE, ParallelConfig

    return ParallelConfig(dp=getattr(args, "dp", None) or 1, tp=args.tp or 1, pp=args.pp or 1, cp=args.cp or 1,
                          ep=args.ep or 1, vpp=args.vpp or 1,
                          microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
                          sequence_parallel=args.sequence_parallel,
                          gpus_per_node=getattr(args, "gpus_per_node", None) or DEFAULT_GPUS_PER_NODE)


# ============================================================================================ bench
def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench.report import format_report
    from .bench.adversarial import DEFAULT_SIZE as ADVERSARIAL_DEFAULT, GROWTH_SIZES as ADVERSARIAL_FULL
    from .bench.runner import ALGORITHMS, iter_algorithms, run_bench
    from .bench.workloads import WORKLOADS, select_workloads

    if args.dropins:
        return _cmd_bench_dropins(args)
    if args.budgets:  # the auto budget against hand-set ones (bench/budgets.py)
        from .bench.budgets import cmd_budgets

        return cmd_budgets(args)
    if args.list:
        for w in WORKLOADS.values():
            print(f"{w.name:<26} {'' if w.default else '(not in default run) '}{w.description}")
        print("\nalgorithms: " + ", ".join(ALGORITHMS))
        return 0
    workloads = select_workloads(args.workloads)
    plot_workload = args.plot_workload or workloads[0].name
    if args.plot and plot_workload not in [w.name for w in workloads]:
        raise DynBatchConfigError("--plot-workload", plot_workload, "is not among the workloads being run",
                                  f"use one of {', '.join(w.name for w in workloads)}")
    if args.plot:
        from .bench.plot import require_matplotlib

        require_matplotlib(args.plot)  # before the run, not after it
    result = run_bench(workloads, seeds=args.seeds, algorithms=iter_algorithms(args.algorithms),
                       speed=_bench_speed(args), speed_repeats=args.speed_repeats, progress=args.progress,
                       keep_plans=bool(args.plot), argv=args.argv,
                       adversarial_sizes=ADVERSARIAL_FULL if args.adversarial else (ADVERSARIAL_DEFAULT,),
                       cost_model=args.cost_model, gpus_per_node=args.gpus_per_node,
                       decision_margin=args.decision_margin)
    if args.output:
        Path(args.output).write_text(result.to_json(indent=1) + "\n", encoding="utf-8")
    if args.json:
        print(result.to_json(indent=1))
    else:
        print(format_report(result))
    if args.plot:
        from .bench.plot import plot_timelines

        plans = {k[2]: v for k, v in result.plans.items() if k[0] == plot_workload and k[1] == 0}
        plot_timelines(plans, args.plot, title=f"{plot_workload} (seed 0): per-rank timelines")
        print(f"wrote {args.plot}", file=sys.stderr)
    bad = result.dynbatch_cap_violations
    # the plain planner's failed or malformed plans; dynamic CP's malformed ones or its breaks of the bench's own
    # check (slower than megatron-dynamic-cp, runner.dyncp_slower_than): notes on its rows
    broken = [r for r in result.dynbatch_errors if r.algorithm == "dynbatch" or
              (r.algorithm == "dynbatch-dyncp" and r.notes)]
    if bad or broken:
        print(f"{PROG}: error: the planner produced {bad} over-budget micro-batch(es) and {len(broken)} failed, "
              f"malformed or slower-than-upstream plan(s); this is a bug", file=sys.stderr)
        return 1
    return 0


def _cmd_bench_dropins(args: argparse.Namespace) -> int:
    """``bench --dropins``: each RL trainer's own batching against its megatron-dynbatch drop-in."""
    from .bench.dropins import dropins_json, format_dropins, run_dropins
    from .bench.workloads import select_workloads

    rows, meta = run_dropins(select_workloads(args.workloads), seeds=args.seeds)
    meta["command"] = "megatron-dynbatch " + " ".join(args.argv)
    text = dropins_json(rows, meta)
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    print(text if args.json else format_dropins(rows))
    over = sum(r.cap_violations for r in rows if r.algorithm.startswith("drop-in"))
    if over:
        print(f"{PROG}: error: a drop-in produced {over} over-budget micro-batch(es); this is a bug", file=sys.stderr)
        return 1
    return 0


# ============================================================================================ plan
def _cmd_plan(args: argparse.Namespace) -> int:
    """``plan``: planning errors name the flags (``--max-tokens-per-gpu``); with ``--run`` the preset's keys."""
    from .core.errors import trainer_terms
    from .core.memory.budget import FIX_WORDS
    from .core.planner.options import PlanOptions

    with trainer_terms({} if args.run else {**FIX_WORDS["cli"], **PlanOptions.spellings("cli")}):
        return _plan(args)


def _plan(args: argparse.Namespace) -> int:
    from .core.planner.api import plan_resolved

    if args.plot:
        from .bench.plot import require_matplotlib

        require_matplotlib(args.plot)
    lengths = _read_values(args.lengths, "--lengths", integers=True)
    group_ids = _read_values(args.group_ids, "--group-ids", integers=False) if args.group_ids else None
    opts, run = _plan_options(args)
    res = opts.resolve()  # the one resolution of this command: preset, cost-model file, "auto"
    par = opts.parallel
    if res.model is not None:  # check the layout against the model (tp divides the heads, ep the experts)
        from .core.flops import per_gpu_flops

        per_gpu_flops(1.0, res.model, par)
    group_source = "--group-ids" if group_ids is not None else None
    if run is not None:
        from ._cli_run import check_group_ids

        check_group_ids(args, run, group_ids)
        if group_ids is None:
            group_ids = run.group_ids(len(lengths))
            group_source = f"the run preset's group_size={run.group_size}" if group_ids is not None else None
    balance_by = {"time": "cost-model time (FLOPs at kernel efficiency)", "flops": "raw FLOPs",
                  "tokens": "tokens"}[str(res.balance_by)]
    args.model, args.max_tokens_per_gpu, args.fp8 = res.model, res.max_tokens_per_gpu, opts.fp8_alignment
    args.cost_model = res.cost_model  # a run preset's cost model scores the baselines too (--compare)
    if opts.dynamic_cp:  # the pool summary and the fixed-CP plan next to it (_cli_dyncp.py)
        from ._cli_dyncp import check_dynamic_cp_flags, run_plan_dynamic_cp

        check_dynamic_cp_flags(args, opts, group_ids, run)
        return run_plan_dynamic_cp(args, lengths, res)
    plan = plan_resolved(lengths, res, group_ids=group_ids)
    if args.json:
        print(plan.to_json(indent=1))
        return 0
    print(plan_summary(plan, args, balance_by, len(lengths), groups=group_line(group_ids, group_source)))
    if res.budget_choice is not None:  # --max-tokens-per-gpu auto: what the memory model chose, and why
        print(res.budget_choice.summary())
    print()
    print(rank_table(plan, args.max_ranks))
    baselines: Dict[str, Any] = {}
    if args.compare:
        print()
        text, baselines = _compare(plan, lengths, args, par)
        print(text)
    if args.plot:
        from .bench.plot import plot_timelines

        p = plan.parallel
        plot_timelines({"dynbatch": plan, **baselines}, args.plot, max_ranks=args.max_ranks,
                       title=f"{len(lengths)} samples, dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp}, "
                             f"{plan.cap:,} tokens per micro-batch: per-rank timelines")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _plan_options(args: argparse.Namespace) -> Tuple[Any, Any]:
    """The planner's options: the ``--run`` preset's (a flag must agree with it, or ``--override-run`` applies
    it: ``_cli_run.py``), else the flags' (each :class:`PlanOptions` field's flag is its ``metadata["cli"]``)."""
    from .core.planner.options import PlanOptions

    if args.run:
        from ._cli_run import resolve_run
        from .core.run_config import RunConfig

        run = resolve_run(args, RunConfig.from_yaml(args.run))
        opts = run.plan_options()
        changes = {"num_microbatches": args.num_microbatches}
        if args.dynamic_cp is not None:  # --dynamic-cp / --no-dynamic-cp override the preset (documented)
            changes["dynamic_cp"] = args.dynamic_cp
            if not args.dynamic_cp:  # the preset's minimum CP group belongs to dynamic CP
                changes["min_cp_size"] = None
        return opts.replace(**changes), run
    if args.override_run:
        raise DynBatchConfigError("--override-run", True, "only means something with --run PRESET (it lets the flags "
                                  "replace the preset's values)", "drop --override-run, or add --run PRESET")
    if args.max_tokens_per_gpu is None:
        raise DynBatchConfigError("--max-tokens-per-gpu", None, "is required",
                                  "pass --max-tokens-per-gpu N, or --run PRESET (configs/runs/*.yaml)")
    layout = {name: getattr(args, name) for name in LAYOUT_FLAGS if getattr(args, name, None) is not None}
    if args.sequence_parallel:
        layout["sequence_parallel"] = True
    from ._cli_budget import flag_settings

    given = {**option_values(args, "cli"), "parallel": layout, "memory": flag_settings(args) or None}
    return PlanOptions(**{k: v for k, v in given.items() if v is not None}), None


def _compare(plan: Any, lengths: Sequence[int], args: argparse.Namespace, par: Any) -> Tuple[str, Dict[str, Any]]:
    """The comparison table, and the baselines' plans (for ``--plot``)."""
    from .bench.baselines import BASELINES, BaselineContext, run_baseline
    from .bench.table import aligned
    from .core.cost_files import resolve_cost_model

    cm = resolve_cost_model(getattr(args, "cost_model", None), args.model, par)
    ctx = BaselineContext.build(par, args.max_tokens_per_gpu, args.model, args.fp8)
    lb = plan.lower_bound_step_time
    cells = [["algorithm", "step s", "x LB", "mb/rank", "over budget", ""],
             ["dynbatch", f"{plan.predicted_step_time:.4f}", f"{plan.step_time_vs_lower_bound:.4f}",
              str(plan.num_microbatches), str(plan.cap_violations), ""]]
    plans: Dict[str, Any] = {}
    for name in BASELINES:
        res = run_baseline(name, lengths, ctx, cm)
        if res.error:
            cells.append([name, "", "", "", "", f"failed: {res.error}"])
            continue
        q = plans[name] = res.plan
        counts = {len(r) for r in q.micro_batches}
        mb = str(max(counts)) if len(counts) == 1 else f"{min(counts)}-{max(counts)}"
        cells.append([name, f"{q.predicted_step_time:.4f}", f"{q.predicted_step_time / lb if lb else 0:.4f}", mb,
                      str(q.cap_violations), ""])
    out = aligned(cells, "<>>>><")
    out.append("(step s: modelled step time; x LB: / the lower bound; mb/rank: micro-batches per rank; over budget: "
               "micro-batches over the token budget, each an OOM risk; docs/benchmarks.md)")
    return "\n".join(out), plans


# ============================================================================================ flops
def _cmd_flops(args: argparse.Namespace) -> int:
    from .core.flops import FWD_BWD_FACTOR, flops_breakdown, per_gpu_flops
    from .core.model_spec import ModelSpec

    spec = ModelSpec.from_any(args.model)
    par = _layout(args)
    b = flops_breakdown(spec)
    share = float(per_gpu_flops(1.0, spec, par))  # validates the layout against the model
    rows = []
    for L in args.seqlen:
        fwd = b.linear * L + b.quadratic * L * L
        rows.append({"seqlen": L, "fwd_flops": fwd, "fwd_bwd_flops": FWD_BWD_FACTOR * fwd,
                     "fwd_bwd_flops_per_gpu": FWD_BWD_FACTOR * fwd * share,
                     "attention_fraction": b.quadratic * L * L / fwd if fwd else 0.0})
    if args.json:
        print(json.dumps({"model": spec.name, "parallel": par.to_dict(), "linear": b.linear,
                          "quadratic": b.quadratic, "breakdown": b.to_dict(), "gpus_per_replica": round(1 / share),
                          "rows": rows}, indent=1))
        return 0
    moe = f", MoE {spec.num_experts} experts top-{spec.moe_router_topk}" if spec.num_experts else ""
    print(f"model: {spec.name or args.model}  ({spec.num_layers} layers, hidden {spec.hidden_size}{moe})")
    print("forward FLOPs of one sequence of length L: linear*L + quadratic*L^2 with")
    print(f"  linear    = {b.linear:.6e} FLOPs/token")
    print(f"  quadratic = {b.quadratic:.6e} FLOPs/token^2 (causal core attention)")
    parts = {k: v for k, v in b.to_dict().items() if k != "attention_core_per_sq_token" and v}
    print("  linear breakdown: " + ", ".join(f"{k.replace('_per_token', '')} {v:.3e}" for k, v in parts.items()))
    print(f"per-GPU share: 1/(tp*pp*cp) = 1/{round(1 / share)} (tp={par.tp} pp={par.pp} cp={par.cp}; ep={par.ep} "
          f"moves routed-expert work but not the average)")
    print()
    head = f"{'seqlen':>8}  {'fwd TFLOP':>11}  {'fwd+bwd TFLOP':>13}  {'per GPU TFLOP':>13}  {'attention %':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['seqlen']:>8}  {r['fwd_flops'] / 1e12:>11.3f}  {r['fwd_bwd_flops'] / 1e12:>13.3f}  "
              f"{r['fwd_bwd_flops_per_gpu'] / 1e12:>13.3f}  {100 * r['attention_fraction']:>11.1f}")
    return 0


# ============================================================================================ runs
def _cmd_runs(args: argparse.Namespace) -> int:
    from .core.run_config import RunConfig, available_run_presets

    if args.action == "list":
        names = available_run_presets()
        width = max((len(n) for n in names), default=0)
        for name in names:
            try:
                about = RunConfig.from_yaml(name).description
            except DynBatchConfigError as exc:  # one broken user preset must not hide the others
                about = f"(does not load: {exc})"
            print(f"{name:<{width}}  {about}".rstrip())
        print("\n'runs show NAME' prints one; 'runs args NAME' the Megatron flags it implies; "
              "'plan --run NAME' plans with it")
        return 0
    if args.preset is None:
        raise DynBatchConfigError("runs " + args.action, None, "needs a run preset",
                                  "pass a preset name or a YAML path")
    rc = RunConfig.from_yaml(args.preset)
    if args.action == "args":
        import shlex

        print(" ".join(shlex.quote(a) for a in rc.to_megatron_args()))
    else:
        import yaml

        print(yaml.safe_dump(rc.to_dict(), sort_keys=False).rstrip())
    return 0


# ============================================================================================ demo
def _cmd_demo(args: argparse.Namespace) -> int:
    try:
        from .demo import main as demo_main
    except ImportError as exc:
        from .requirements import import_problem

        if getattr(exc, "name", None) == "megatron_dynbatch.demo" or "megatron_dynbatch.demo" in str(exc):
            print(f"{PROG}: error: the demo is not available in this installation (megatron_dynbatch/demo.py is "
                  f"missing)", file=sys.stderr)
        else:
            print(f"{PROG}: error: the demo {import_problem(exc.name or 'torch') or exc}", file=sys.stderr)
        return 2
    try:
        rc = demo_main(list(args.demo_args))
    except SystemExit as exc:  # the demo's own usage errors (2) and --help (0)
        return int(exc.code or 0)
    return int(rc or 0)


# ============================================================================================ warnings
@contextlib.contextmanager
def _cli_warnings() -> Iterator[None]:
    """This package's warnings (e.g. ``oversize='alone'``) print as ``megatron-dynbatch: warning: ...`` lines,
    like the errors, instead of Python's ``file:line: Category: ...`` plus a source line; others are unchanged."""
    import warnings

    default = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if getattr(category, "__module__", "").startswith("megatron_dynbatch"):
            print(f"{PROG}: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


# ============================================================================================ parser
def _bench_speed(args: argparse.Namespace) -> bool:
    """Whether ``bench`` times its planning-speed cases: as asked (``--speed`` / ``--no-speed``, ``--adversarial``),
    else only in the default run -- a run filtered to a few workloads is after their rows, and the speed cases would
    be most of its time."""
    if args.speed is not None:
        return bool(args.speed)
    return args.workloads is None or bool(args.adversarial)


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingArgumentParser(
        prog=PROG, description="FLOPs-balanced dynamic micro-batching for Megatron-Core: benchmark, plan, FLOPs.",
        epilog="Start with 'megatron-dynbatch bench'; docs/quickstart.md walks through the rest.")
    sub = parser.add_subparsers(dest="command", metavar="{bench,plan,flops,runs,calibrate,budget,demo}")

    b = sub.add_parser("bench", help="run the built-in benchmark (defaults: every default workload, all algorithms)",
                       description="Plan every built-in workload with dynbatch and the baselines, score all with "
                                   "the same cost model, and print a table (or JSON).")
    b.add_argument("--workloads", default=None,
                   help="comma-separated workload names (default: all default workloads; see --list)")
    b.add_argument("--algorithms", default=None,
                   help="comma-separated subset of algorithms to run (default: all; see --list)")
    b.add_argument("--seeds", type=_positive_int, default=1,
                   help="repeat every workload with seeds 0..N-1 (table shows means; JSON keeps every seed)")
    b.add_argument("--json", action="store_true", help="print the results as JSON on stdout instead of the table")
    b.add_argument("--output", metavar="FILE", default=None, help="also write the JSON results to FILE")
    b.add_argument("--plot", metavar="PNG", default=None,
                   help="write per-rank timelines (one panel per algorithm) of one workload to this image")
    b.add_argument("--plot-workload", default=None, help="workload to plot (default: the first one run)")
    speed = b.add_mutually_exclusive_group()
    speed.add_argument("--speed", dest="speed", action="store_true", default=None,
                       help="time the planning-speed cases (default: with the default workloads only, not with "
                            "--workloads)")
    speed.add_argument("--no-speed", dest="speed", action="store_false", help="skip the planning-speed cases")
    b.add_argument("--adversarial", action="store_true",
                   help="time the adversarial input shapes at 4,096, 16,384 and 65,536 samples (up to 1,024 ranks; "
                        "about a minute) instead of 4,096 only")
    b.add_argument("--speed-repeats", type=_positive_int, default=3,
                   help="timed runs per planning-speed case (median reported; default 3)")
    _add_cost_model_args(b)
    b.add_argument("--gpus-per-node", type=_positive_int, default=None,
                   help="GPUs per node of every workload's layout (default 8)")
    b.add_argument("--list", action="store_true", help="list the workloads and algorithms and exit")
    b.add_argument("--dropins", action="store_true",
                   help="compare each RL trainer's own batching (slime, verl, NeMo-RL, ROLL, Megatron RL) with its "
                        "drop-in (megatron_dynbatch.integrations) instead: modelled step time and cap violations")
    b.add_argument("--budgets", action="store_true",
                   help="compare the auto token budget (the largest that fits --gpu-memory-gb) with hand-set ones "
                        "(the workload's, verl's and ROLL's defaults) on the same batches instead: modelled step time, "
                        "micro-batches, predicted peak memory")
    b.add_argument("--gpu-memory-gb", default="80", metavar="N", help="the card for --budgets, GiB (default 80)")
    prog = b.add_mutually_exclusive_group()
    prog.add_argument("--progress", dest="progress", action="store_true", default=None,
                      help="always show the progress bar (default: only when stderr is a terminal)")
    prog.add_argument("--no-progress", dest="progress", action="store_false", help="never show the progress bar")
    b.set_defaults(func=_cmd_bench)

    p = sub.add_parser("plan", help="plan one global batch read from a file",
                       description="Plan one global batch and print the summary and each rank's micro-batches.")
    p.add_argument("--lengths", required=True, metavar="FILE",
                   help="tokens per sample: .txt (one per line), .json (a list) or .npy")
    p.add_argument("--run", default=None, metavar="PRESET",
                   help="run preset (configs/runs/NAME.yaml or a path): model, layout, budget, balancing, oversize "
                        "policy, FP8 alignment, samples per step and group size; a flag given here must agree with "
                        "it, or --override-run applies it")
    p.add_argument("--override-run", action="store_true",
                   help="with --run: the flags given here replace the preset's values where they differ (without "
                        "it such a flag is an error naming both); the result is checked as a preset file would be")
    p.add_argument("--group-ids", metavar="FILE", default=None,
                   help="one group id per sample (same formats); a group (GRPO prompt) stays on one DP rank")
    _add_layout_args(p)
    add_option_flags(p.add_argument_group("planning options (PlanOptions fields; the help is each field's "
                                          "docstring)"), "cli")
    from ._cli_budget import add_memory_args

    add_memory_args(p.add_argument_group("memory settings for --max-tokens-per-gpu auto (default: a bf16 "
                                         "Megatron-LM run)"))
    p.add_argument("--max-ranks", type=_positive_int, default=32, help="ranks shown in the table (default 32)")
    p.add_argument("--compare", action="store_true",
                   help="also score the baselines (fixed_padded, slime, verl, nemo_rl, ...) on the same batch")
    p.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="also write per-rank timelines of the plan to this image (with --compare: one panel per "
                        "baseline too); needs matplotlib")
    p.set_defaults(func=_cmd_plan)

    f = sub.add_parser("flops", help="FLOPs of a model at given sequence lengths",
                       description="Forward and forward+backward FLOPs, the per-GPU share, and the linear/quadratic "
                                   "coefficients the planner balances.")
    f.add_argument("--model", required=True, help="model preset name or YAML/JSON/config.json path")
    f.add_argument("--seqlen", type=_positive_int, nargs="+", default=[4096],
                   help="one or more sequence lengths (default 4096)")
    _add_layout_args(f, dp=False)
    f.add_argument("--json", action="store_true", help="print JSON")
    f.set_defaults(func=_cmd_flops)

    r = sub.add_parser("runs", help="run presets: list them, show one, or print the Megatron flags one implies",
                       description="Run presets (configs/runs/*.yaml): 'list' the names, 'show NAME' prints one as "
                                   "YAML, 'args NAME' prints the Megatron flags it implies (one shell-quoted line).")
    r.add_argument("action", type=choice(("list", "show", "args")), choices=("list", "show", "args"))
    r.add_argument("preset", nargs="?", default=None, help="run preset name or YAML path (for show / args)")
    r.set_defaults(func=_cmd_runs)

    from ._cli_calibrate import add_calibrate_parser

    add_calibrate_parser(sub, _add_layout_args, _layout)
    from ._cli_budget import add_budget_parser

    add_budget_parser(sub, _add_layout_args, _layout)

    d = sub.add_parser("demo", help="train a tiny GPT with real megatron-core on CPU ranks (needs torch)",
                       description="Runs megatron_dynbatch.demo; arguments after 'demo' are passed to it.")
    d.add_argument("demo_args", nargs=argparse.REMAINDER, help="arguments for the demo (see 'demo --help')")
    d.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``megatron-dynbatch`` console script; returns the exit status."""
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["demo"]:  # everything after 'demo' (including --help) belongs to the demo's own parser
        return _cmd_demo(argparse.Namespace(demo_args=raw[1:]))
    parser = build_parser()
    try:
        args = parser.parse_args(raw)
    except SystemExit as exc:  # argparse usage errors (2) and --help (0)
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help()
        return 0
    args.argv = raw
    try:
        with _cli_warnings():
            return int(args.func(args) or 0)
    except DynBatchConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `megatron-dynbatch bench | head`: the reader left; no traceback for that
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
