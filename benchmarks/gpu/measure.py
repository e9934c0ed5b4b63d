#!/usr/bin/env python
"""MEASURED step times of every benchmark algorithm's plans, on one GPU (or, for testing, the CPU).

For each workload (``megatron-dynbatch bench``'s, or two tiny ones with ``--tiny``) and seed, every algorithm
plans the batch as the benchmark does; then

* every distinct micro-batch of every plan is timed, forward + backward, on a slice of the workload's model
  (``--layers`` decoder layers of one TP rank's widths; ``--model-kind mcore``: a megatron-core ``GPTModel``
  with this package's THD attention, torch's fused varlen flash kernel inside on a GPU; ``torch``: a plain-torch
  decoder of the same widths) -- a micro-batch of a CP group as ONE member's zig-zag share (members ``0`` and
  ``g-1`` timed, the slower counts; compute only, the K/V exchange is not measured);
* the measured seconds are composed into each plan's step (``bench/measured.py``): DP ranks in turn (step =
  slowest rank; 1F1B under PP), dynamic-CP plans by the pool simulation with group synchronisation, upstream's
  hybrid CP by rounds with a barrier after each -- the same composition that, fed modelled times, gives the
  benchmark's modelled step.

The method is that of ``../shared/gpu/README.md`` (sections 1 and 2). The timing core is
:mod:`megatron_dynbatch.measure`; this script is its command line. Writes
``benchmarks/gpu/results/<date>_<device>.json`` (or ``--output``) and prints a table. See
``benchmarks/gpu/README.md`` for running it on a GPU machine.

    python benchmarks/gpu/measure.py --device cpu --tiny --output /tmp/x.json     # seconds, CPU smoke
    python benchmarks/gpu/measure.py --workloads dyncp-longdoc-8b-1mb --seeds 3    # a GPU
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from megatron_dynbatch.core.errors import DynBatchConfigError  # noqa: E402

GPU_WORKLOADS = "grpo-longcot-8b,dyncp-longdoc-8b-1mb,dyncp-longdoc-8b-4mb,dyncp-longcot-64k-8b"
REFERENCE = "dynbatch"  # ratios are this plan's step over each plan's (the fixed-CP plan on dynamic-CP workloads)
METHOD = ("one GPU emulates every rank in turn (../shared/gpu/README.md sections 1-2): each distinct micro-batch "
          "timed forward+backward on {layers} decoder layer(s) of one TP rank's widths ({kind} slice, {dtype}), min "
          "of {repeats} (one untimed run per slice, {warmup} more per micro-batch); a CP group's micro-batch as "
          "one member's zig-zag share (members 0 and g-1, the slower counts; compute only, no K/V exchange); "
          "steps composed by bench/measured.py: DP "
          "ranks per rank (slowest rank, 1F1B under PP), dynamic CP by the pool simulation with group "
          "synchronisation, upstream hybrid CP by rounds with barriers")


# ------------------------------------------------------------------------------------------------ options
def _int_flag(flag: str, raw: Any, low: int, example: str) -> int:
    try:
        value = int(str(raw), 10)
    except ValueError:
        value = None
    if value is None or value < low:
        raise DynBatchConfigError(flag, raw, f"must be an integer >= {low}", f"pass e.g. {flag} {example}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (cuda:N) or cpu")
    p.add_argument("--tiny", action="store_true",
                   help="two tiny tiny-gpt batches, 1 layer, 1 repetition: the whole pipeline in seconds")
    p.add_argument("--output", help="results JSON (default benchmarks/gpu/results/<date>_<device>.json)")
    p.add_argument("--workloads", help=f"comma-separated bench workloads (default {GPU_WORKLOADS}; with --tiny "
                                       "the tiny ones)")
    p.add_argument("--algorithms", help="comma-separated subset of the benchmark's algorithms (default: all that "
                                        "run on each workload)")
    p.add_argument("--model-kind", default="mcore", help="mcore (megatron-core GPTModel slice) or torch")
    p.add_argument("--seeds", default="1", help="batches per workload (seeds 0..N-1)")
    p.add_argument("--layers", help="decoder layers per slice (default 2; 1 with --tiny)")
    p.add_argument("--dtype", help="bf16, fp16 or fp32 (default bf16 on cuda, fp32 on cpu)")
    p.add_argument("--vocab", default="0", help="per-TP-rank vocabulary of an embedding + LM head to include (0: "
                                                "decoder layers only)")
    p.add_argument("--warmup", default="0", help="untimed runs before each micro-batch (each slice also gets one "
                                                 "untimed run before its first)")
    p.add_argument("--repeats", help="timed runs per micro-batch, the minimum counts (default 2: absorbs a first "
                                     "run's allocations; 1 with --tiny)")
    p.add_argument("--documents", help="a document-lengths JSON file (e.g. ../shared/data/"
                                       "document_lengths_wlbllm.json) the long-document batches draw from instead "
                                       "of the bundled distribution: the real file reproduces the shared "
                                       "measurements' batches")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def parse_options(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Validated options; every bad flag is a :class:`DynBatchConfigError` naming it, its value and a fix."""
    from megatron_dynbatch.bench.measured import TINY_WORKLOADS
    from megatron_dynbatch.bench.runner import ALGORITHMS, iter_algorithms
    from megatron_dynbatch.bench.workloads import select_workloads
    from megatron_dynbatch.measure import SliceLayout

    a = _parser().parse_args(list(argv) if argv is not None else None)
    device = a.device
    if not (device == "cpu" or re.fullmatch(r"cuda(:\d+)?", device or "")):
        raise DynBatchConfigError("--device", device, "must be cuda, cuda:N or cpu", "pass --device cuda on a GPU")
    if a.model_kind not in ("mcore", "torch"):
        raise DynBatchConfigError("--model-kind", a.model_kind, "unknown model kind", "use mcore or torch")
    if a.tiny:
        names = [n.strip() for n in (a.workloads or ",".join(TINY_WORKLOADS)).split(",") if n.strip()]
        bad = [n for n in names if n not in TINY_WORKLOADS]
        if bad or not names:
            raise DynBatchConfigError("--workloads", a.workloads, "not a tiny workload (--tiny)",
                                      f"use a subset of {','.join(TINY_WORKLOADS)} or drop --tiny")
        workloads = [TINY_WORKLOADS[n] for n in names]
    else:
        if a.workloads is not None and not a.workloads.strip():
            raise DynBatchConfigError("--workloads", a.workloads, "names no workload", f"use e.g. {GPU_WORKLOADS}")
        workloads = select_workloads(a.workloads or GPU_WORKLOADS)
    algorithms = iter_algorithms(a.algorithms)
    if a.algorithms is not None and not algorithms:
        raise DynBatchConfigError("--algorithms", a.algorithms, "names no algorithm", f"use a subset of {ALGORITHMS}")
    for name in algorithms or ():
        if name not in ALGORITHMS:
            raise DynBatchConfigError("--algorithms", name, "unknown algorithm", f"use a subset of {ALGORITHMS}")
    dtype = a.dtype or ("fp32" if device == "cpu" else "bf16")
    if dtype not in ("bf16", "fp16", "fp32"):
        raise DynBatchConfigError("--dtype", dtype, "unknown dtype", "use bf16, fp16 or fp32")
    documents = None
    if a.documents is not None:
        from megatron_dynbatch.bench.workloads import load_document_lengths

        try:
            documents = load_document_lengths(a.documents)
        except DynBatchConfigError as exc:
            raise DynBatchConfigError("--documents", a.documents, exc.problem, exc.fix) from None
    opts = {
        "documents": documents,
        "device": device, "tiny": a.tiny, "workloads": workloads, "algorithms": algorithms,
        "kind": a.model_kind, "dtype": dtype, "quiet": a.quiet,
        "seeds": _int_flag("--seeds", a.seeds, 1, "3"),
        "layers": _int_flag("--layers", a.layers if a.layers is not None else (1 if a.tiny else 2), 1, "2"),
        "vocab": _int_flag("--vocab", a.vocab, 0, "0"),
        "warmup": _int_flag("--warmup", a.warmup, 0, "1"),
        "repeats": _int_flag("--repeats", a.repeats if a.repeats is not None else (1 if a.tiny else 2), 1, "2"),
    }
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise DynBatchConfigError("--device", device, "CUDA is not available on this machine",
                                      "run on a GPU machine, or pass --device cpu")
    SliceLayout(num_layers=opts["layers"], dtype=dtype, device=device, kind=a.model_kind, vocab_size=opts["vocab"])
    opts["output"] = a.output
    return opts


# ------------------------------------------------------------------------------------------------ running
class _Slices:
    """One slice per (model, tp), each with its cache of timed micro-batches."""

    def __init__(self, opts: Dict[str, Any]) -> None:
        self.opts = opts
        self.built: Dict[str, Any] = {}
        self.caches: Dict[str, Dict[Any, float]] = {}

    def get(self, workload: Any):
        from megatron_dynbatch.measure import SliceLayout, build_slice

        sid = f"{workload.model}/tp{workload.parallel.tp}"
        if sid not in self.built:
            o = self.opts
            self.built[sid] = build_slice(workload.model, SliceLayout(
                num_layers=o["layers"], tp=workload.parallel.tp, dtype=o["dtype"], device=o["device"],
                kind=o["kind"], vocab_size=o["vocab"]))
            self.caches[sid] = {}
        return sid, self.built[sid], self.caches[sid]


def _time_all(sl: Any, cache: Dict[Any, float], items: List[Any], opts: Dict[str, Any], label: str) -> Dict[Any, str]:
    """Time every new item (one at a time, so a micro-batch that does not fit in memory fails alone)."""
    import torch

    from megatron_dynbatch.measure import record_key

    keys = list(dict.fromkeys(record_key(g, ls) for g, ls in items))
    todo = [k for k in keys if k not in cache]
    failed: Dict[Any, str] = {}
    if todo and not cache:  # the slice's first run: kernels load, the allocator grows -- not timed
        sl.prepare(todo[0][0], list(todo[0][1]), 0)()
    t0 = time.perf_counter()
    for n, k in enumerate(todo):
        if not opts["quiet"] and (n % 20 == 0 or n == len(todo) - 1):
            print(f"  {label}: timing micro-batch {n + 1}/{len(todo)} ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
        try:
            sl.time_records([k], warmup=opts["warmup"], repeats=opts["repeats"], cache=cache)
        except torch.cuda.OutOfMemoryError as exc:
            failed[k] = f"out of GPU memory: {str(exc).splitlines()[0]}"
            torch.cuda.empty_cache()
    return failed


def measure_workload(w: Any, seed: int, opts: Dict[str, Any], slices: _Slices) -> Dict[str, Any]:
    """Plan, time and compose one batch; the results-file entry of ``<workload>/s<seed>``."""
    from megatron_dynbatch.bench.measured import layout_cost_model, schedule_of
    from megatron_dynbatch.bench.runner import run_workload
    from megatron_dynbatch.measure import record_key

    rows, plans = run_workload(w, seed, opts["algorithms"], keep_plans=True, documents=opts["documents"])
    batch = w.generate(seed, documents=opts["documents"])
    lengths = batch.lengths
    schedules = {r.algorithm: schedule_of(r.algorithm, plans[(w.name, seed, r.algorithm)], lengths, w)
                 for r in rows if r.ok}
    sid, sl, cache = slices.get(w)
    items = [it for s in schedules.values() for it in s.items()]
    failed = _time_all(sl, cache, items, opts, f"{w.name} seed {seed}")
    cm = layout_cost_model(w)
    tokens = int(lengths.sum())
    run: Dict[str, Any] = {}
    for r in rows:
        if not r.ok:
            run[r.algorithm] = {"step_s": None, "error": r.error}
            continue
        sched = schedules[r.algorithm]
        missing = [failed[record_key(g, ls)] for g, ls in sched.items() if record_key(g, ls) in failed]
        if missing:
            run[r.algorithm] = {"step_s": None, "error": missing[0], "modelled_step_s": r.step_time_s}
            continue
        step = sched.compose(lambda g, ls: cache[record_key(g, ls)], cm)
        run[r.algorithm] = {"step_s": step.step_s, "tokens_per_s": tokens / step.step_s, "imbalance": step.imbalance,
                            "microbatches": step.microbatches, "modelled_step_s": r.step_time_s}
    ref = run.get(REFERENCE, {})
    tag = "vs_fixed_cp" if w.dynamic_cp else f"vs_{REFERENCE}"
    for entry in run.values():
        if entry.get("step_s") and ref.get("step_s"):
            entry[tag] = ref["step_s"] / entry["step_s"]
            entry[f"modelled_{tag}"] = ref["modelled_step_s"] / entry["modelled_step_s"]
    records = [[k[0], list(k[1]), cache[k]] for k in dict.fromkeys(record_key(g, ls) for g, ls in items) if k in cache]
    return {"kind": "dynamic-cp" if w.dynamic_cp else "dp", "layers": opts["layers"], "model": w.model,
            "parallel": w.parallel.to_dict(), "max_tokens_per_gpu": w.max_tokens_per_gpu, "samples": int(lengths.size),
            "tokens": tokens, "batch_source": batch.source, "slice": sid, "widths_per_tp_rank": sl.widths.to_dict(),
            "runs": [run], "microbatches": records}


def _summary(workloads: Dict[str, Any]) -> Dict[str, Any]:
    """Per algorithm over every batch it ran: total step seconds, tokens per second, mean imbalance."""
    acc: Dict[str, Dict[str, float]] = {}
    for entry in workloads.values():
        for name, r in entry["runs"][0].items():
            if r.get("step_s") is None:
                continue
            a = acc.setdefault(name, {"step_s": 0.0, "tokens": 0.0, "imbalance": 0.0, "batches": 0})
            a["step_s"] += r["step_s"]
            a["tokens"] += entry["tokens"]
            a["imbalance"] += r["imbalance"]
            a["batches"] += 1
    return {name: {"step_s": a["step_s"], "tokens_per_s": a["tokens"] / a["step_s"],
                   "imbalance": a["imbalance"] / a["batches"], "batches": int(a["batches"])}
            for name, a in acc.items()}


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def run(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Parse, measure, write the results file, print the table; returns the results."""
    import torch

    opts = parse_options(argv)
    slices = _Slices(opts)
    t0 = time.perf_counter()
    workloads: Dict[str, Any] = {}
    threads = torch.get_num_threads()
    if opts["device"] == "cpu":  # one intra-op thread: a shared CPU's other tenants stall a thread pool
        torch.set_num_threads(1)
    try:
        for w in opts["workloads"]:
            for seed in range(opts["seeds"]):
                workloads[f"{w.name}/s{seed}"] = measure_workload(w, seed, opts, slices)
    finally:
        torch.set_num_threads(threads)
    env = next(iter(slices.built.values())).environment()
    records, record_slices = [], []
    for entry in workloads.values():
        for rec in entry["microbatches"]:
            records.append(rec)
            record_slices.append(entry["slice"])
    result = {
        "device": env["device"], "kernel": env["kernel"], "torch": env["torch"], "megatron_core": env["megatron_core"],
        "date": _dt.date.today().isoformat(),
        "method": METHOD.format(layers=opts["layers"], kind=opts["kind"], dtype=opts["dtype"],
                                repeats=opts["repeats"], warmup=opts["warmup"]),
        "source": f"benchmarks/gpu/measure.py at project commit {_git_commit() or 'unknown'}",
        "command": " ".join(["measure.py"] + list(argv if argv is not None else sys.argv[1:])),
        "layout": {"layers": opts["layers"], "kind": opts["kind"], "dtype": opts["dtype"], "vocab": opts["vocab"],
                   "warmup": opts["warmup"], "repeats": opts["repeats"]},
        "slices": {sid: sl.widths.to_dict() for sid, sl in slices.built.items()},
        "algorithms": _summary(workloads),
        "workloads": workloads,
        # every timed record; microbatch_slice[i] names the slice (model/tp) record i was timed on: fit per slice
        "microbatches": records, "microbatch_slice": record_slices,
        "wall_s": time.perf_counter() - t0,
    }
    path = Path(opts["output"]) if opts["output"] else default_output(env["device"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(format_table(result))
    print(f"wrote {path}")
    return result


def default_output(device: str) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "device"
    if slug.startswith("cpu"):
        slug = "cpu"
    return ROOT / "benchmarks" / "gpu" / "results" / f"{_dt.date.today().isoformat()}_{slug}.json"


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def format_table(result: Dict[str, Any]) -> str:
    lines = [f"{result['device']} | {result['kernel']} | torch {result['torch']} | megatron-core "
             f"{result['megatron_core']} | {result['layout']['layers']} layer(s), {result['layout']['kind']} slice, "
             f"{result['layout']['dtype']}  (MEASURED step seconds of the slice; modelled = the cost model's "
             f"H100 step)"]
    head = f"{'batch':<28} {'algorithm':<19} {'step s':>9} {'x ref':>6} {'modelled x':>10} {'imbal':>6} {'mbs':>5}"
    for name, entry in result["workloads"].items():
        lines += ["", head, "-" * len(head)]
        tag = "vs_fixed_cp" if entry["kind"] == "dynamic-cp" else f"vs_{REFERENCE}"
        for algo, r in entry["runs"][0].items():
            if r.get("step_s") is None:
                lines.append(f"{name:<28} {algo:<19} not run: {r.get('error')}")
                continue
            lines.append(f"{name:<28} {algo:<19} {r['step_s']:>9.4f} {_f(r.get(tag), '.3f'):>6} "
                         f"{_f(r.get('modelled_' + tag), '.3f'):>10} {r['imbalance']:>6.3f} {r['microbatches']:>5}")
    lines.append("")
    lines.append(f"x ref: step of {REFERENCE} (fixed CP on dynamic-CP batches) / this step, measured; modelled x: the "
                 "same ratio of modelled steps; imbal: max/mean busy seconds over ranks (pool GPUs for CP)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        run(argv)
    except DynBatchConfigError as exc:
        print(f"measure.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
