"""Items, optimizer steps and units: how a global batch is cut up before packing (pure NumPy).

* **Items** are what a micro-batch holds. Normally one item is one sample; with ``microbatch_group_ids`` the
  samples sharing an id are merged into one item (their slot lengths, weights and squared lengths add up), so
  the group lands in one micro-batch -- verl's ``force_group_size`` (the chosen / rejected pair of a reward
  model in one forward). An item counts as its number of samples for ``equal_samples_per_rank``.
* **Optimizer steps** split the batch: ``samples_per_step`` (consecutive samples) or ``rollouts_per_step`` with
  ``rollout_ids`` (slime counts its global batch in rollouts, and one rollout can emit several samples: a step
  holds exactly ``rollouts_per_step`` rollouts in first-occurrence order, whatever their sample counts).
  An item or a ``group_ids`` group never spans two steps.
* **Units** are what the rank assignment moves: an item, or every item of one ``group_ids`` group (a GRPO
  prompt group stays on one DP rank).

Without the new knobs the result is exactly the historical one: item ``i`` is sample ``i``, a step is a
contiguous slice, units follow first occurrence inside the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np

from ..checks import as_bool, as_int
from ..errors import DynBatchConfigError
from .inputs import check_group_ids


@dataclass
class Items:
    """Samples merged into items. ``members is None``: item ``i`` is sample ``i``."""

    n_samples: int
    members: Optional[List[np.ndarray]] = None

    @property
    def count(self) -> int:
        return self.n_samples if self.members is None else len(self.members)

    def sizes(self) -> Optional[np.ndarray]:
        """Samples per item (``None`` when every item is one sample)."""
        return None if self.members is None else np.array([m.size for m in self.members], dtype=np.int64)

    def reduce(self, values: np.ndarray) -> np.ndarray:
        """Per-item sums of a per-sample array."""
        if self.members is None:
            return values
        item_of = np.empty(self.n_samples, dtype=np.int64)
        for k, m in enumerate(self.members):
            item_of[m] = k
        out = np.bincount(item_of, weights=values.astype(np.float64), minlength=len(self.members))
        return out.round().astype(values.dtype) if np.issubdtype(values.dtype, np.integer) else out

    def samples_of(self, items: List[int]) -> List[int]:
        """Sample indices of these items, in item order (members ascending)."""
        if self.members is None:
            return [int(i) for i in items]
        return [int(s) for k in items for s in self.members[k].tolist()]


def build_items(n: int, microbatch_group_ids: Any) -> Tuple[Items, Optional[list]]:
    """``Items`` for ``microbatch_group_ids`` (one id per sample; ``None``: one item per sample) and the checked
    ids. Items are ordered by the first sample of each group."""
    if microbatch_group_ids is None:
        return Items(n), None
    ids = check_group_ids(microbatch_group_ids, n, field="microbatch_group_ids")
    order: dict = {}
    for i, g in enumerate(ids):
        order.setdefault(g, []).append(i)
    return Items(n, [np.asarray(v, dtype=np.int64) for v in order.values()]), ids


def split_steps(items: Items, dp: int, *, group_ids: Any = None, samples_per_step: Any = None,
                rollout_ids: Any = None, rollouts_per_step: Any = None, equal_samples: Any = False,
                mb_ids: Optional[list] = None) -> List[Tuple[np.ndarray, Optional[List[np.ndarray]]]]:
    """Per optimizer step: ``(item indices, units)`` with units as local item indices (``None``: one unit per
    item). Raises ``DynBatchConfigError`` for a step with fewer units than ranks, a group or item spanning
    steps, and (``equal_samples``) a step whose samples do not divide by ``dp``."""
    n = items.n_samples
    equal = as_bool(equal_samples, "equal_samples_per_rank")
    gids = check_group_ids(group_ids, n) if group_ids is not None else None
    step_of, n_steps = step_of_sample(n, samples_per_step, rollout_ids, rollouts_per_step)
    members = items.members
    if members is None:
        item_step = step_of
        item_gid = gids
    else:
        item_step = np.array([step_of[m[0]] for m in members], dtype=np.int64)
        for k, m in enumerate(members):
            if (step_of[m] != item_step[k]).any():
                raise DynBatchConfigError("microbatch_group_ids", mb_ids[int(m[0])],
                                          "a micro-batch group spans two optimizer steps",
                                          "keep each micro-batch group inside one step (adjacent samples)")
        item_gid = None
        if gids is not None:
            item_gid = []
            for k, m in enumerate(members):
                g = gids[int(m[0])]
                if any(gids[int(i)] != g for i in m[1:]):
                    raise DynBatchConfigError("microbatch_group_ids", mb_ids[int(m[0])],
                                              "a micro-batch group spans two group_ids groups (ranks)",
                                              "give the samples of one micro-batch group the same group id")
                item_gid.append(g)
    sizes = items.sizes()
    out = []
    for s, idx in enumerate(indices_by_step(item_step, n_steps)):
        if item_gid is None:
            units = None
        else:
            order: dict = {}
            for local, k in enumerate(idx.tolist()):
                order.setdefault(item_gid[k], []).append(local)
            units = [np.asarray(v, dtype=np.int64) for v in order.values()]
        n_units = idx.size if units is None else len(units)
        if n_units < dp:
            what = "groups" if gids is not None else "samples"
            raise DynBatchConfigError(
                "len(lengths)" if gids is None else "group_ids", f"{n_units} {what}",
                f"optimizer step {s} has fewer {what} than dp={dp} ranks, so some rank would get an "
                f"empty micro-batch", f"give every step at least {dp} {what} (larger batch or smaller dp)")
        if equal:
            n_step = idx.size if sizes is None else int(sizes[idx].sum())
            if n_step % dp:
                raise DynBatchConfigError(
                    "equal_samples_per_rank", True,
                    f"optimizer step {s} has {n_step} samples, which dp={dp} ranks cannot share equally",
                    f"give every step a multiple of {dp} samples, or pass equal_samples_per_rank=False")
        out.append((idx, units))
    if gids is not None and n_steps > 1:
        first: dict = {}
        for i in np.argsort(step_of, kind="stable").tolist():
            g, s = gids[i], int(step_of[i])
            if first.setdefault(g, s) != s:
                raise DynBatchConfigError(
                    "group_ids", g, f"group spans optimizer steps {first[g]} and {s}",
                    "make samples_per_step a multiple of the group size and keep each group's samples adjacent"
                    if rollout_ids is None else "keep each group's samples inside one step's rollouts")
    return out


def step_of_sample(n: int, samples_per_step: Any = None, rollout_ids: Any = None,
                   rollouts_per_step: Any = None) -> Tuple[np.ndarray, int]:
    """``(step of every sample, number of steps)`` for ``samples_per_step`` or ``rollout_ids`` with
    ``rollouts_per_step`` (one step when all are ``None``); a ``DynBatchConfigError`` when they do not divide
    the batch. Shared by the fixed-layout split (:func:`split_steps`) and dynamic CP."""
    if rollouts_per_step is not None or rollout_ids is not None:
        if samples_per_step is not None:
            raise DynBatchConfigError("samples_per_step", samples_per_step,
                                      "steps are counted either in samples or in rollouts, not both",
                                      "pass samples_per_step, or rollout_ids with rollouts_per_step")
        if rollout_ids is None or rollouts_per_step is None:
            missing = "rollouts_per_step" if rollout_ids is not None else "rollout_ids"
            raise DynBatchConfigError(missing, None, "rollout_ids and rollouts_per_step go together",
                                      "pass both (one rollout id per sample and the rollouts per optimizer step)")
        rps = as_int(rollouts_per_step, "rollouts_per_step", minimum=1,
                     fix="pass the number of rollouts per optimizer step (slime's --global-batch-size)")
        rids = check_group_ids(rollout_ids, n, field="rollout_ids")
        rank_of: dict = {}
        per_sample = np.array([rank_of.setdefault(r, len(rank_of)) for r in rids], dtype=np.int64)
        n_rollouts = len(rank_of)
        if n_rollouts % rps:
            raise DynBatchConfigError(
                "rollouts_per_step", rps, f"does not divide the {n_rollouts} rollouts of the batch",
                f"use a divisor of {n_rollouts}, or drop the trailing {n_rollouts % rps} rollouts first "
                "(slime's build_dp_schedule does: megatron_dynbatch.integrations.slime)")
        return per_sample // rps, n_rollouts // rps
    if samples_per_step is None:
        return np.zeros(n, dtype=np.int64), 1
    sps = as_int(samples_per_step, "samples_per_step", minimum=1,
                 fix="pass the number of samples per optimizer step, or None")
    if n % sps:
        raise DynBatchConfigError(
            "samples_per_step", sps, f"does not divide the global batch of {n} samples",
            f"use a divisor of {n} or a global batch that is a multiple of {sps}")
    return np.arange(n, dtype=np.int64) // sps, n // sps


def indices_by_step(step_of: np.ndarray, n_steps: int) -> List[np.ndarray]:
    """The indices of every step ``0 .. n_steps - 1`` in increasing order (what ``np.flatnonzero(step_of == s)``
    gives for each ``s``, as int64 arrays of their own), in one stable sort for all steps instead of one pass
    per step."""
    order = np.argsort(step_of, kind="stable")
    bounds = np.cumsum(np.bincount(step_of, minlength=n_steps))[:-1]
    return [part.astype(np.int64) for part in np.split(order, bounds)]
