#!/usr/bin/env python
"""MEASURED peak memory of a whole model on one GPU against the memory model, and the largest budget that fits.

1. The memory profile: by default (``--profile calibrate``) ``calibrate``'s memory measurement runs first, in
   this process -- 1- and 2-layer slices and a 1-layer slice with the LM head, fitted
   (:func:`megatron_dynbatch.measure.memory.measure_memory`) -- so the prediction checked is the calibrated one;
   ``--profile analytic`` checks the shape-derived numbers instead, ``--profile FILE`` a calibration file's.
2. The whole model of ``--model`` (a dense preset that fits one GPU; random weights), megatron-core ``GPTModel``
   through this package's THD path (:mod:`megatron_dynbatch.measure.whole_model`), Megatron's DDP and optimizer,
   mixed precision (bf16 weights, fp32 gradients and master weights on a GPU).
3. The auto budget: :func:`megatron_dynbatch.core.memory.choose_budget` for this card (``--gpu-memory-gb``, default
   what torch reports) and this run's memory settings (one GPU: optimizer state not sharded; ``--reserve-gb``
   1 -- no NCCL communicators to speak of -- and ``--headroom`` 0.1).
4. Real optimizer steps, each one micro-batch of ``tokens`` tokens (sequences of ``--seq-len``): first at the auto
   budget, then upward by real attempts -- a CUDA out-of-memory error is caught, the state cleaned, the cache
   emptied -- to the largest budget that actually fits (:func:`megatron_dynbatch.measure.budget_search.
   search_largest_fit`). Each attempt's allocator peak (``torch.cuda.max_memory_allocated`` over the whole step:
   forward, backward, optimizer step) is recorded with the predicted peak (reserve excluded: the allocator does
   not see it).

5. The first-step memory probe (:mod:`megatron_dynbatch.megatron.probe`) at the auto budget, before the search:
   one synthetic micro-batch, forward + backward, on the same model; its measured peak is set against the whole
   step's at the same budget (``probe``: measured, predicted, kept or lowered, ``probe_over_step``) -- the probe
   must see what the real step will use (no optimizer step in it: the step's own temporaries come after).

Writes JSON: device, model, auto budget, largest fitting budget, ``records`` of ``{tokens, fits,
measured_peak_bytes, predicted_peak_bytes, analytic_peak_bytes, rel_error}`` for every size tried, and the checks
(the auto budget fits and is >= 85% of the largest that fits; predicted within 5% of measured at every size;
the probe's peak within 5% of the whole step's).

``--device cpu --tiny`` runs the same pipeline on the CPU with ``tiny-gpt`` through the reader seam: a
deterministic fake reader (:class:`megatron_dynbatch.megatron.memory_reader.FakeMemoryReader`) reports the real resident
tensors plus activations 3% above the analytic model's, and "runs out of memory" above a small fake card. Its
numbers only show the pipeline works.

    python benchmarks/gpu/memory.py --device cpu --tiny --output /tmp/memory_tiny.json
    python benchmarks/gpu/memory.py --model qwen3-0.6b --output $OUT/memory_qwen3_0.6b.json        # a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from megatron_dynbatch.core.errors import DynBatchConfigError  # noqa: E402

#: what the GPU run is checked against (benchmarks/gpu/README.md)
AUTO_OF_LARGEST = 0.85
MAX_REL_ERROR = 0.05
#: the CPU fake's activations over the analytic model's, and its card: resident + this many tokens' worth
FAKE_EXCESS = 1.03
FAKE_CARD_TOKENS = 2048


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (cuda:N) or cpu")
    p.add_argument("--tiny", action="store_true",
                   help="tiny-gpt, short sequences, a fake card: the pipeline in seconds")
    p.add_argument("--model", default=None, help="a dense model preset that fits one GPU (default qwen3-0.6b; "
                                                 "tiny-gpt with --tiny)")
    p.add_argument("--output", default=None, help="results JSON (default benchmarks/gpu/results/memory_<model>.json)")
    p.add_argument("--gpu-memory-gb", default=None, help="the card, GiB (default: what torch reports; --tiny: fake)")
    p.add_argument("--profile", default="calibrate", help="calibrate (measure slices first), analytic, or a FILE")
    p.add_argument("--seq-len", default=None, help="tokens per sequence (default 4096; 64 with --tiny)")
    p.add_argument("--reserve-gb", default=None, help="GiB outside the allocator (default 1; 0 with --tiny)")
    p.add_argument("--headroom", default="0.1", help="fraction of the card left free (default 0.1)")
    p.add_argument("--multiple", default=None, help="budget granularity, tokens (default 256; 16 with --tiny)")
    p.add_argument("--max-attempts", default="14", help="real steps in the upward search (default 14)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def _num(flag: str, raw: Any, kind: type, low: float) -> Any:
    try:
        v = kind(str(raw))
    except ValueError:
        v = None
    if v is None or not v >= low or v != v:
        raise DynBatchConfigError(flag, raw, f"must be a number >= {low}", f"pass e.g. {flag} {max(low, 1)}")
    return v


def parse_options(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Validated options; every bad flag is a :class:`DynBatchConfigError` naming it, its value and a fix."""
    from megatron_dynbatch.core.model_spec import ModelSpec

    a = _parser().parse_args(list(argv) if argv is not None else None)
    dev = a.device
    if not (dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
        raise DynBatchConfigError("--device", dev, "must be cuda, cuda:N or cpu", "pass --device cuda on a GPU")
    if dev == "cpu" and not a.tiny:
        raise DynBatchConfigError("--device", dev, "a CPU has no allocator peak to measure a real model by",
                                  "run on a GPU, or pass --tiny for the CPU pipeline check (fake reader)")
    model = ModelSpec.from_any(a.model or ("tiny-gpt" if a.tiny else "qwen3-0.6b"))
    if model.num_experts or model.multi_latent_attention:
        raise DynBatchConfigError("--model", model.name, "MoE and MLA models are not built here",
                                  "pass a dense preset that fits one GPU, e.g. qwen3-0.6b or qwen3-1.7b")
    return {
        "device": dev, "tiny": a.tiny, "model": model, "output": a.output, "quiet": a.quiet, "profile": a.profile,
        "gpu_memory_gb": None if a.gpu_memory_gb is None else _num("--gpu-memory-gb", a.gpu_memory_gb, float, 1e-6),
        "seq_len": int(_num("--seq-len", a.seq_len or (64 if a.tiny else 4096), int, 1)),
        "reserve_gb": _num("--reserve-gb", a.reserve_gb or (0 if a.tiny else 1), float, 0),
        "headroom": _num("--headroom", a.headroom, float, 0),
        "multiple": int(_num("--multiple", a.multiple or (16 if a.tiny else 256), int, 1)),
        "max_attempts": int(_num("--max-attempts", a.max_attempts, int, 1)),
        "dtype": "fp32" if dev == "cpu" else "bf16",
    }


def _say(opts: Dict[str, Any], text: str) -> None:
    if not opts["quiet"]:
        print(text, file=sys.stderr, flush=True)


def _profile(opts: Dict[str, Any], reader_for_slices: Any) -> Any:
    """The memory profile to predict with (module docstring, step 1)."""
    from megatron_dynbatch.core.memory import MemoryProfile, fit_memory_records, load_memory_profile
    from megatron_dynbatch.measure.memory import measure_memory

    m = opts["model"]
    if opts["profile"] == "analytic":
        return MemoryProfile.analytic(m)
    if opts["profile"] != "calibrate":
        prof = load_memory_profile(opts["profile"])
        if prof is None:
            raise DynBatchConfigError("--profile", opts["profile"], "has no memory section",
                                      "calibrate on a GPU (it writes one), or pass --profile calibrate")
        return prof
    budget = max(opts["multiple"], min(16384, 4 * opts["seq_len"]))
    records, env = measure_memory(m, tp=1, dtype=opts["dtype"], device=opts["device"], max_tokens_per_gpu=budget,
                                  reader=reader_for_slices)
    return fit_memory_records(records, m, None, fitted_on={"device": env.get("device"), "dtype": opts["dtype"],
                                                           "by": "benchmarks/gpu/memory.py"}).profile


def _fake_truth(m: Any, settings: Any) -> Dict[str, float]:
    """The CPU fake's coefficients: the analytic model's, activations and head FAKE_EXCESS above."""
    from megatron_dynbatch.core.memory import MemoryProfile

    a = MemoryProfile.analytic(m, None, settings)
    return {"workspace": 65536.0, "layer": a.layer_bytes * FAKE_EXCESS, "backward_extra": 0.05 * a.layer_bytes,
            "head": a.head_bytes * FAKE_EXCESS}


def _probe(wm: Any, tokens: int, reader: Any, card_bytes: float, settings: Any, profile: Any,
           opts: Dict[str, Any]) -> Dict[str, Any]:
    """The first-step memory probe at the auto budget (module docstring, step 4): its measured and predicted
    peak and its decision; ``oom`` when the probe itself ran out of memory."""
    from megatron_dynbatch.core.errors import DynBatchConfigError as ConfigError

    try:
        r = wm.probe(tokens, reader=reader, card_bytes=card_bytes, settings=settings, profile=profile,
                     multiple=opts["multiple"])
    except ConfigError as exc:  # the probe's out-of-memory error
        wm.recover()
        _say(opts, f"probe at {tokens} tokens: {exc}")
        return {"tokens": tokens, "oom": True, "measured_peak_bytes": None, "predicted_peak_bytes": None,
                "decision": "out of memory", "budget_after": None, "line": str(exc)}
    wm.recover()
    _say(opts, r.line())
    return {"tokens": r.tokens, "oom": False, "measured_peak_bytes": r.measured_peak_bytes,
            "predicted_peak_bytes": r.predicted_peak_bytes, "decision": r.reason, "budget_after": r.new_budget,
            "line": r.line()}


def run(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """The whole pipeline (module docstring); returns the results (also written to ``--output``)."""
    opts = parse_options(argv)
    t0 = time.perf_counter()
    import torch

    from megatron_dynbatch.core.memory import choose_budget, peak_memory
    from megatron_dynbatch.core.memory.settings import GiB
    from megatron_dynbatch.measure.budget_search import search_largest_fit
    from megatron_dynbatch.megatron.memory_reader import CudaPeakReader, FakeMemoryReader, MemoryProbe
    from megatron_dynbatch.measure.timer import device_name
    from megatron_dynbatch.measure.whole_model import WholeModel, device_memory_gb

    m, dev = opts["model"], opts["device"]
    if dev == "cpu":
        torch.set_num_threads(1)
    _say(opts, f"building {m.name} on {dev} ...")
    wm = WholeModel(m, device=dev, dtype=opts["dtype"], seq_len=opts["seq_len"])
    settings = wm.settings(reserve_gb=opts["reserve_gb"], headroom=opts["headroom"])
    wm.step(min(opts["seq_len"], 256))  # optimizer state and gradients allocated: resident from here on
    truth = None
    if dev == "cpu":
        truth = _fake_truth(m, settings)
        slices_reader: Any = FakeMemoryReader.from_coefficients(**truth)
        resident = wm.resident_bytes()
        whole_extra = lambda p: truth["workspace"] + p.tokens * (  # noqa: E731
            m.num_layers * truth["layer"] + max(truth["head"], truth["backward_extra"]))
        card_gb = opts["gpu_memory_gb"] or (resident + whole_extra(MemoryProbe(m.num_layers, True,
                                                                               FAKE_CARD_TOKENS))) / GiB
        reader: Any = FakeMemoryReader(whole_extra, base=resident, capacity=card_gb * GiB)
    else:
        slices_reader = reader = CudaPeakReader(dev)
        card_gb = opts["gpu_memory_gb"] or device_memory_gb(dev)
    profile = _profile(opts, slices_reader)
    auto = choose_budget(m, None, card_gb, settings=settings, profile=profile, multiple=opts["multiple"])
    _say(opts, f"auto budget {auto.tokens_per_gpu} tokens on {card_gb:.4g} GiB ({profile.source} profile)")
    probe = _probe(wm, auto.tokens_per_gpu, reader, card_gb * GiB, settings, profile, opts)
    records: List[Dict[str, Any]] = []

    def attempt(tokens: int) -> bool:
        pred = peak_memory(m, None, tokens, settings=settings, profile=profile).allocated_bytes
        analytic = peak_memory(m, None, tokens, settings=settings).allocated_bytes
        rec: Dict[str, Any] = {"tokens": tokens, "fits": False, "measured_peak_bytes": None,
                               "predicted_peak_bytes": int(pred), "analytic_peak_bytes": int(analytic)}
        oom = False
        try:
            reading = reader.measure(lambda: wm.step(tokens), MemoryProbe(m.num_layers, True, tokens))
        except torch.OutOfMemoryError:
            oom = True
        if oom:
            wm.recover()
        else:
            rec.update(fits=True, measured_peak_bytes=int(reading.peak),
                       rel_error=(pred - reading.peak) / reading.peak)
            wm.recover()  # empty the cache: each attempt starts from the resident state
        _say(opts, f"  {tokens:>8} tokens: " + (f"peak {reading.peak / 2 ** 20:.1f} MiB, predicted "
                                               f"{pred / 2 ** 20:.1f}" if not oom else "out of memory"))
        records.append(rec)
        return not oom

    found = search_largest_fit(attempt, auto.tokens_per_gpu, multiple=opts["multiple"],
                               max_attempts=opts["max_attempts"])
    fitting = [r for r in records if r["fits"]]
    worst = max((abs(r["rel_error"]) for r in fitting), default=None)
    auto_fits = bool(records and records[0]["fits"])
    largest = found.largest_fit
    ratio = auto.tokens_per_gpu / largest if largest else None
    step_peak = records[0]["measured_peak_bytes"] if records and records[0]["tokens"] == probe["tokens"] else None
    probe["step_peak_bytes"] = step_peak
    probe["probe_over_step"] = (probe["measured_peak_bytes"] / step_peak
                                if step_peak and probe["measured_peak_bytes"] is not None else None)
    env = {"device": device_name(torch.device(dev)), "torch": torch.__version__}
    try:
        import megatron.core

        env["megatron_core"] = getattr(megatron.core, "__version__", None)
    except ImportError:  # pragma: no cover
        env["megatron_core"] = None
    return {
        **env, "model": m.name, "dtype": opts["dtype"], "seq_len": opts["seq_len"], "gpu_memory_gb": card_gb,
        "reader": "fake (CPU pipeline check)" if dev == "cpu" else "torch.cuda.max_memory_allocated",
        "settings": settings.to_dict(), "profile": {"source": profile.source, "fitted_on": profile.fitted_on},
        "auto_budget": auto.tokens_per_gpu, "auto_predicted_peak_gb": auto.breakdown.peak_gb,
        "largest_fitting_budget": largest, "smallest_failing_budget": found.smallest_fail,
        "auto_over_largest": ratio, "records": records, "probe": probe,
        "checks": {"auto_fits": auto_fits, "auto_at_least_85pct_of_largest": ratio is not None and
                   ratio >= AUTO_OF_LARGEST, "max_abs_rel_error": worst,
                   "within_5pct": worst is not None and worst <= MAX_REL_ERROR,
                   "search_bracketed": found.smallest_fail is not None,
                   "probe_within_5pct_of_step": probe["probe_over_step"] is not None and
                   abs(probe["probe_over_step"] - 1.0) <= MAX_REL_ERROR},
        "wall_s": time.perf_counter() - t0,
    }


def format_summary(res: Dict[str, Any]) -> str:
    c = res["checks"]
    lines = [f"{res['model']} on {res['device']} ({res['reader']}), card {res['gpu_memory_gb']:.4g} GiB, "
             f"{res['profile']['source']} memory profile",
             f"auto budget {res['auto_budget']} tokens; largest that fits {res['largest_fitting_budget']} "
             f"(first failure {res['smallest_failing_budget']}); auto / largest "
             + (f"{res['auto_over_largest']:.3f}" if res["auto_over_largest"] else "-"),
             f"{'tokens':>9} {'measured MiB':>13} {'predicted MiB':>14} {'error':>7}"]
    for r in res["records"]:
        meas = f"{r['measured_peak_bytes'] / 2 ** 20:13.1f}" if r["fits"] else f"{'OOM':>13}"
        err = f"{r['rel_error']:+7.1%}" if r["fits"] else f"{'':>7}"
        lines.append(f"{r['tokens']:>9} {meas} {r['predicted_peak_bytes'] / 2 ** 20:14.1f} {err}")
    pr = res["probe"]
    if pr["measured_peak_bytes"] is not None:
        step = (f"{pr['step_peak_bytes'] / 2 ** 20:.1f} MiB" if pr["step_peak_bytes"] else "-")
        lines.append(f"first-step probe at {pr['tokens']} tokens: peak {pr['measured_peak_bytes'] / 2 ** 20:.1f} MiB "
                     f"(whole step {step}; probe / step "
                     + (f"{pr['probe_over_step']:.3f}" if pr["probe_over_step"] else "-")
                     + f"), budget {pr['decision']}")
    else:
        lines.append(f"first-step probe at {pr['tokens']} tokens: {pr['decision']}")
    lines.append(f"checks: auto fits {c['auto_fits']}; auto >= {AUTO_OF_LARGEST:.0%} of largest "
                 f"{c['auto_at_least_85pct_of_largest']}; max |error| "
                 + (f"{c['max_abs_rel_error']:.1%}" if c["max_abs_rel_error"] is not None else "-")
                 + f" (within {MAX_REL_ERROR:.0%}: {c['within_5pct']}); probe within {MAX_REL_ERROR:.0%} of the "
                 f"step: {c['probe_within_5pct_of_step']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        res = run(argv)
    except DynBatchConfigError as exc:
        print(f"memory.py: error: {exc}", file=sys.stderr)
        return 2
    opts_out = parse_options(argv)["output"]
    out = Path(opts_out) if opts_out else ROOT / "benchmarks" / "gpu" / "results" / f"memory_{res['model']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    print(format_summary(res))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
