"""Input checks and derived per-sample arrays for the planner (pure NumPy).

Every check raises ``DynBatchConfigError`` naming the field or flag, the value and the fix.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Tuple

import numpy as np

from ..alignment import Alignment
from ..cost_model import CostModel
from ..errors import DynBatchConfigError, OversizeSampleError, OversizeSampleWarning
from ..parallel import ParallelConfig

OVERSIZE_POLICIES = ("error", "alone")
BALANCE_MODES = ("flops", "tokens", "time")


def check_lengths(lengths) -> np.ndarray:
    if isinstance(lengths, (str, bytes)) or lengths is None:
        raise DynBatchConfigError("lengths", lengths, "must be a sequence of token counts",
                                  "pass a list or 1-D array of non-negative integers")
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise DynBatchConfigError("lengths", f"array of shape {arr.shape}", "must be one-dimensional",
                                  "pass one token count per sample")
    if arr.size == 0:
        raise DynBatchConfigError("lengths", [], "the global batch is empty", "pass at least dp samples")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        if arr.dtype != object and np.issubdtype(arr.dtype, np.floating):
            bad = int(np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))[0]) \
                if (~np.isfinite(arr) | (arr != np.round(arr))).any() else 0
        else:
            bad = 0
            for i, v in enumerate(arr.tolist()):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    bad = i
                    break
        raise DynBatchConfigError(f"lengths[{bad}]", arr.tolist()[bad], "token counts must be integers",
                                  "pass whole token counts (e.g. len(token_ids)), not floats or strings")
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        bad = int(np.flatnonzero(arr < 0)[0])
        raise DynBatchConfigError(f"lengths[{bad}]", int(arr[bad]), "token counts cannot be negative",
                                  "pass the number of tokens of each sample (>= 0)")
    return arr


def check_budget(max_tokens_per_gpu, par: ParallelConfig, fp8_alignment):
    if isinstance(max_tokens_per_gpu, bool) or not isinstance(max_tokens_per_gpu, (int, np.integer)) \
            or max_tokens_per_gpu < 1:
        raise DynBatchConfigError("--max-tokens-per-gpu", max_tokens_per_gpu, "must be a positive integer",
                                  "pass the per-GPU token budget, e.g. --max-tokens-per-gpu 16384")
    align = Alignment.for_layout(par, fp8_alignment)
    cap = int(max_tokens_per_gpu) * par.cp
    cap_eff = align.effective_cap(cap)
    if cap_eff < align.seq_multiple:
        need = -(-max(align.total_multiple, align.seq_multiple) // par.cp)
        raise DynBatchConfigError(
            "--max-tokens-per-gpu", max_tokens_per_gpu,
            f"the budget ({cap} tokens per micro-batch) is smaller than one aligned sequence (per-sequence "
            f"multiple {align.seq_multiple}, micro-batch multiple {align.total_multiple})",
            f"use --max-tokens-per-gpu >= {need}",
        )
    return cap, align, cap_eff


def balance_mode(balance_by: Optional[str], balance_by_flops: bool, has_model: bool) -> str:
    """``balance_by_flops=True`` balances FLOPs *as time*: each sample's linear and attention FLOPs at the
    efficiency its kernels reach (the cost model), because that is what makes ranks finish together; with
    equal efficiencies it is plain FLOPs. ``balance_by="flops"`` asks for raw FLOPs."""
    if balance_by is None:
        if not balance_by_flops:
            return "tokens"
        return "time" if has_model else "flops"
    if balance_by not in BALANCE_MODES:
        raise DynBatchConfigError("balance_by", balance_by, "unknown balancing mode", f"use one of {BALANCE_MODES}")
    return balance_by


def steps_and_units(n: int, group_ids, samples_per_step, dp: int):
    """Split sample indices into optimizer steps and each step into units (groups or single samples)."""
    if group_ids is not None:
        gids = list(group_ids)
        if len(gids) != n:
            raise DynBatchConfigError("group_ids", f"{len(gids)} ids", f"needs one id per sample ({n})",
                                      "pass group_ids with the same length as lengths")
    if samples_per_step is None:
        bounds = [(0, n)]
    else:
        if isinstance(samples_per_step, bool) or not isinstance(samples_per_step, (int, np.integer)) \
                or samples_per_step < 1:
            raise DynBatchConfigError("samples_per_step", samples_per_step, "must be a positive integer",
                                      "pass the number of samples per optimizer step, or None")
        if n % samples_per_step:
            raise DynBatchConfigError(
                "samples_per_step", samples_per_step, f"does not divide the global batch of {n} samples",
                f"use a divisor of {n} or a global batch that is a multiple of {samples_per_step}")
        bounds = [(s, s + samples_per_step) for s in range(0, n, samples_per_step)]
    out = []
    for step_index, (lo, hi) in enumerate(bounds):
        idx = np.arange(lo, hi, dtype=np.int64)
        if group_ids is None:
            units = None  # one unit per sample
        else:
            order: dict = {}
            for local, gid in enumerate(gids[lo:hi]):
                order.setdefault(gid, []).append(local)
            units = [np.asarray(v, dtype=np.int64) for v in order.values()]
        if (hi - lo if units is None else len(units)) < dp:
            n_units = hi - lo if units is None else len(units)
            what = "groups" if group_ids is not None else "samples"
            raise DynBatchConfigError(
                "len(lengths)" if group_ids is None else "group_ids", f"{n_units} {what}",
                f"optimizer step {step_index} has fewer {what} than dp={dp} ranks, so some rank would get an "
                f"empty micro-batch", f"give every step at least {dp} {what} (larger batch or smaller dp)")
        out.append((idx, units))
    if group_ids is not None and samples_per_step is not None:
        step_of: dict = {}
        for s, (lo, hi) in enumerate(bounds):
            for gid in gids[lo:hi]:
                if step_of.setdefault(gid, s) != s:
                    raise DynBatchConfigError(
                        "group_ids", gid, f"group spans optimizer steps {step_of[gid]} and {s}",
                        "make samples_per_step a multiple of the group size and keep each group's samples adjacent")
    return out


def check_oversize_policy(oversize: str) -> None:
    if oversize not in OVERSIZE_POLICIES:
        raise DynBatchConfigError("oversize", oversize, "unknown oversize-sample policy",
                                  f"use one of {OVERSIZE_POLICIES}")


def resolve_costs(model: Any, par: ParallelConfig, cost_model: Optional[CostModel]) -> Tuple[Any, CostModel]:
    """The model's FLOPs coefficients (``None`` without a model) and the cost model to plan and score with:
    the given one (placed on this layout), else one derived from the model's FLOPs, else a token-only one."""
    coeffs = None
    if model is not None:
        from ..flops import flops_coefficients
        from ..model_spec import ModelSpec

        coeffs = flops_coefficients(ModelSpec.from_any(model))
    if cost_model is not None:
        if not isinstance(cost_model, CostModel):
            raise DynBatchConfigError("cost_model", type(cost_model).__name__, "must be a CostModel",
                                      "build one with CostModel.from_model(...) or load_cost_model(path)")
        return coeffs, cost_model.with_layout(par)
    if coeffs is not None:
        return coeffs, CostModel.from_flops(coeffs.linear, coeffs.quadratic, par)
    return coeffs, CostModel.tokens_only(par)


def sample_flops(coeffs: Any, aligned: np.ndarray, sq: np.ndarray) -> np.ndarray:
    """Forward FLOPs of each sample (zeros without a model)."""
    if coeffs is None:
        return np.zeros(aligned.size)
    return coeffs.linear * aligned + coeffs.quadratic * sq


def oversize_mask(lens: np.ndarray, aligned: np.ndarray, cap_eff: int, align: Alignment, par: ParallelConfig,
                  max_tokens_per_gpu: int, oversize: str) -> np.ndarray:
    """Samples whose aligned slot exceeds the budget; raises (``"error"``) or warns (``"alone"``)."""
    over = aligned > cap_eff
    if over.any():
        first = int(np.flatnonzero(over)[0])
        where = (f"sample {first} has {int(lens[first])} tokens ({int(aligned[first])} after alignment to "
                 f"{align.seq_multiple}) but a micro-batch may hold {cap_eff} (max_tokens_per_gpu="
                 f"{max_tokens_per_gpu} x cp={par.cp}, less alignment); {int(over.sum())} sample(s) are over")
        if oversize == "error":
            need = -(-int(aligned[over].max()) // par.cp)
            raise OversizeSampleError(
                "--max-tokens-per-gpu", max_tokens_per_gpu, where,
                f"raise --max-tokens-per-gpu to at least {need}, truncate the sample, or run it in a micro-batch "
                f"of its own with oversize='alone' (--dynbatch-oversize alone in a Megatron launch, --oversize "
                f"alone for megatron-dynbatch plan)",
            )
        warnings.warn(f"oversize='alone': {where}; each runs alone in its own micro-batch over the budget",
                      OversizeSampleWarning, stacklevel=3)
    return over
