"""One validated calibration run, before anything is timed: :func:`plan_calibration` -> :class:`CalibrationSetup`.

Shared by ``megatron-dynbatch calibrate`` (its ``--dry-run`` prints exactly this) and the Python API
:func:`megatron_dynbatch.measure.calibrate.calibrate`: the model and the layout to plan for, the slice to time
(``layers`` decoder layers at the per-TP-rank widths of ``tp``; the layer spec -- Transformer Engine or this
package's local THD spec -- is resolved where the slice is built), the grid (:mod:`.grid`) cut to the time limit
(:mod:`.timebox`) and its estimate. Every bad value raises ``DynBatchConfigError`` naming the command-line flag, the
value and the fix. Pure Python + NumPy: a dry run imports neither torch nor megatron-core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from ..checks import as_bool, as_int
from ..errors import DynBatchConfigError
from ..cost_profiles import resolve_profile
from ..memory.fit import memory_grid
from ..model_spec import ModelSpec
from ..parallel import ParallelConfig
from .timebox import fit_to_seconds, point_seconds
from .grid import GridPoint, build_grid, layout_group_sizes

if TYPE_CHECKING:
    from ..model_spec import ModelLike
    from ..parallel import ParallelLike

DEVICES = ("cuda", "cpu")
SPECS = ("auto", "local", "te")
DTYPES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class CalibrationSetup:
    """What a calibration run times and fits (module docstring). ``points`` are timed in order; ``dropped`` did
    not fit ``max_seconds``; ``estimate_s`` includes start-up."""

    model: ModelSpec
    parallel: ParallelConfig
    dynamic_cp: bool
    max_tokens_per_gpu: int
    device: str
    layers: int
    dtype: str
    spec: str
    lm_head: bool
    group_sizes: List[int]
    points: List[GridPoint]
    dropped: List[GridPoint] = field(default_factory=list)
    estimate_s: float = 0.0
    warmup: int = 1
    repeats: int = 3
    max_seconds: Optional[float] = None
    base: Any = "fitted"
    memory: bool = False
    memory_estimate_s: float = 0.0

    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def vocab_per_tp_rank(self) -> int:
        """The LM head's vocabulary on one TP rank (0 without ``lm_head``)."""
        return self.model.padded_vocab_size // self.tp if self.lm_head else 0

    def describe(self) -> List[str]:
        """The lines ``calibrate --dry-run`` prints."""
        m, p = self.model, self.parallel
        lay = f"dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp}" + (" (dynamic CP)" if self.dynamic_cp else "")
        head = " + embedding, LM head and loss" if self.lm_head else ""
        toks = sorted({pt.tokens // pt.group_size for pt in self.points})
        spec = {"auto": "auto (Transformer Engine where installed, else local THD)"}.get(self.spec, self.spec)
        if self.device == "cpu" and self.spec == "auto":
            spec = "local THD (CPU)"
        lines = [f"model: {m.name or 'custom'} ({m.num_layers} layers, hidden {m.hidden_size}); layout {lay}; budget "
                 f"{self.max_tokens_per_gpu} tokens per GPU",
                 f"slice: {self.layers} decoder layer(s) at the tp={p.tp} widths{head}, {self.dtype}, spec "
                 f"{spec}, on {self.device}; {self.warmup} warm-up + {self.repeats} timed run(s) per point",
                 f"grid: {len(self.points)} micro-batch shares on group size(s) "
                 f"{', '.join(map(str, self.group_sizes))}; {toks[0]}..{toks[-1]} tokens per GPU, "
                 f"{min(len(pt.lengths) for pt in self.points)}..{max(len(pt.lengths) for pt in self.points)} "
                 f"sequences each"]
        if self.memory:
            toks = sorted({sum(p[2]) for p in memory_grid(self.max_tokens_per_gpu)})
            lines.append(f"memory: {len(memory_grid(self.max_tokens_per_gpu))} forward+backward peaks on slices of 1 "
                         f"and 2 layers and 1 layer with the LM head, {toks[0]}..{toks[-1]} tokens (about "
                         f"{self.memory_estimate_s:.0f} s): the memory section of the file")
        if self.dropped:
            lines.append(f"  {len(self.dropped)} more point(s) do not fit --max-seconds {self.max_seconds:g} and are "
                         "left out")
        how = "a rough CPU estimate" if self.device == "cpu" else "at the H100 fit; a faster GPU takes less"
        lines.append(f"estimated time: {self.estimate_s:.0f} s ({how})")
        return lines

    def grid_rows(self) -> List[Dict[str, Any]]:
        return [{"group_size": p.group_size, "lengths": list(p.lengths), "kind": p.kind} for p in self.points]


def _device(device: Any) -> str:
    dev = str(device) if isinstance(device, str) else device
    if not isinstance(dev, str) or not (dev in DEVICES or (dev.startswith("cuda:") and dev[5:].isdigit())):
        raise DynBatchConfigError("--device", device, "must be cuda, cuda:N or cpu",
                                  "pass --device cuda on a GPU machine, --device cpu elsewhere")
    return dev


def _choice(value: Any, flag: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise DynBatchConfigError(flag, value, "is not one of the choices", f"pass one of {', '.join(choices)}")
    return str(value)


def plan_calibration(model: ModelLike, *, parallel: ParallelLike = None, max_tokens_per_gpu: Any, device: Any = "cuda",
                     layers: Any = None, dtype: Optional[str] = None, spec: str = "auto", lm_head: Any = False,
                     dynamic_cp: Any = False, group_sizes: Optional[Sequence[Any]] = None,
                     tokens: Optional[Sequence[Any]] = None, seqs: Optional[Sequence[Any]] = None,
                     warmup: Any = 1, repeats: Any = 3, max_seconds: Any = None, base: Any = "fitted",
                     memory: Any = "auto") -> CalibrationSetup:
    """Validate a calibration run and build its grid (module docstring). ``model``: anything
    ``ModelSpec.from_any`` takes (a preset name, a YAML/JSON file, Megatron's args); ``parallel``: the layout to
    plan for (its ``tp`` sets the slice's widths); ``layers``: default 2 (1 for a one-layer model); ``group_sizes``:
    default the layout's
    (:func:`.grid.layout_group_sizes`); ``memory``: also measure peak memory for the file's memory section
    (``"auto"``: on a GPU -- a CPU has no allocator statistics -- or ``True`` / ``False``)."""
    spec_m = ModelSpec.from_any(model)
    if spec_m.num_experts:
        raise DynBatchConfigError("--model", spec_m.name or "model", "MoE layers are not implemented in the timing "
                                  "slices", "calibrate a dense model of the same attention widths")
    if spec_m.multi_latent_attention:
        raise DynBatchConfigError("--model", spec_m.name or "model", "multi-latent attention is not implemented in "
                                  "the timing slices", "calibrate a GQA model of similar widths")
    par = ParallelConfig.from_any(parallel)
    if spec_m.num_attention_heads % par.tp or spec_m.ffn_hidden_size % par.tp:
        raise DynBatchConfigError("--tp", par.tp, f"does not divide the heads ({spec_m.num_attention_heads}) and FFN "
                                  f"width ({spec_m.ffn_hidden_size}) of {spec_m.name or 'the model'}",
                                  "pass the model's tensor-parallel size")
    resolve_profile(base, field="--base")  # refused now, not after timing
    dev = _device(device)
    n_layers = as_int(min(2, spec_m.num_layers) if layers is None else layers, "--layers", minimum=1,
                      maximum=spec_m.num_layers,
                      fix=f"time 1 or 2 decoder layers (at most the model's {spec_m.num_layers})")
    kind = _choice(spec, "--spec", SPECS)
    dt = _choice(dtype if dtype is not None else ("fp32" if dev == "cpu" else "bf16"), "--dtype", DTYPES)
    dyn = as_bool(dynamic_cp, "--dynamic-cp")
    sizes = layout_group_sizes(par, dyn) if group_sizes is None else group_sizes
    if kind == "te" and dev == "cpu":
        raise DynBatchConfigError("--spec", kind, "Transformer Engine runs on CUDA only", "pass --spec local on a CPU")
    n_warm = as_int(warmup, "--warmup", minimum=0, maximum=100, fix="pass e.g. --warmup 1")
    n_rep = as_int(repeats, "--repeats", minimum=1, maximum=100, fix="pass e.g. --repeats 3")
    head = as_bool(lm_head, "--lm-head")
    budget = as_int(max_tokens_per_gpu, "--max-tokens-per-gpu", minimum=1,
                    fix="pass the per-GPU token budget of your training run")
    grid = build_grid(budget, sizes, tokens=tokens, seqs=seqs)
    if kind == "te" and any(p.group_size > 1 for p in grid):
        raise DynBatchConfigError("--spec", kind, "Transformer Engine's context-parallel attention needs its group's "
                                  "GPUs, so a CP share cannot be timed on one GPU", "pass --group-sizes 1 with --spec "
                                  "te (the CP-member terms then keep the base profile's values), or --spec local")
    est = point_seconds(grid, spec_m, measured_layers=n_layers, tp=par.tp, lm_head=head, device=dev, base=base,
                        warmup=n_warm, repeats=n_rep)
    keep, total = fit_to_seconds(grid, est, max_seconds)
    mem = dev != "cpu" if memory == "auto" else as_bool(memory, "--memory")
    if mem and dev == "cpu":
        raise DynBatchConfigError("--memory", True, "peak memory is read from the CUDA allocator, which a CPU has not",
                                  "measure memory on a GPU (--device cuda), or drop --memory")
    mem_s = memory_seconds(spec_m, budget, tp=par.tp, device=dev, base=base) if mem else 0.0
    return CalibrationSetup(model=spec_m, parallel=par, dynamic_cp=dyn, max_tokens_per_gpu=budget, device=dev,
                            layers=n_layers, dtype=dt, spec=kind, lm_head=head,
                            group_sizes=sorted({p.group_size for p in grid}),
                            points=keep, dropped=grid[len(keep):], estimate_s=total + mem_s, warmup=n_warm,
                            repeats=n_rep,
                            max_seconds=None if max_seconds is None else float(max_seconds), base=base,
                            memory=mem, memory_estimate_s=mem_s)


#: building one memory slice (megatron-core model, possibly the LM head), rounded up
MEMORY_SLICE_S = 5.0


def memory_seconds(model: ModelSpec, budget: int, *, tp: int, device: str, base: Any = "fitted") -> float:
    """Estimated seconds of measuring the memory grid: each slice built once, each point run twice."""
    grid = memory_grid(budget)
    est = 0.0
    for layers, head, lengths in grid:
        est += float(point_seconds([GridPoint(1, tuple(lengths))], model, measured_layers=layers, tp=tp, lm_head=head,
                                   device=device, base=base, warmup=1, repeats=1)[0])
    return est + MEMORY_SLICE_S * len({(n, h) for n, h, _ in grid})


__all__ = ["CalibrationSetup", "plan_calibration", "memory_seconds", "DEVICES", "SPECS", "DTYPES"]
