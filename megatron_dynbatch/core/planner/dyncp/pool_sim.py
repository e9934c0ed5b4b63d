"""Makespan of a dynamic-CP schedule: every GPU of the pool runs ``M`` micro-batch slots; in each slot the pool
is cut into CP groups (consecutive GPUs) and the GPUs of one group run one micro-batch TOGETHER.

Group synchronisation is simulated, not assumed away: a group's micro-batch starts when its LAST member is
free (the CP collectives of every layer need all members), so a member that finished its previous slot early
waits. Vectorised over the pool (``numpy.maximum.reduceat`` over each slot's group boundaries):

* ``pp == 1``: slot after slot, ``start(group) = max(finish of its members)``, ``finish = start + time``;
* ``pp > 1``: Megatron's 1F1B on every pool GPU (:func:`megatron_dynbatch.core.pipeline_sim.simulate_1f1b`'s
  dependency order, forward a third and backward two thirds of ``time / pp`` per stage; every stage holds the
  same plan), each forward and backward operation of a slot synchronised over the slot's group on its stage;
* ``vpp > 1``: the synchronised ``pp == 1`` chain of per-stage times plus the interleaved bubble
  ``(pp - 1) / vpp * mean(stage time)`` of each GPU, stage times as they run (expert lockstep applied; an
  approximation; the interleaved schedule is not simulated operation by operation);
* expert parallelism (``ep > 1``): the ``ep`` DP ranks of an EP group (``ep * cp`` consecutive pool GPUs)
  meet in every MoE layer, so each slot also starts at the EP block's latest member and lasts its longest
  micro-batch.

Returns each GPU's finish time; the step time is their maximum.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from ...cost_model import CostModel, simulate_1f1b_batch


def slot_blocks(group_starts: Sequence[Sequence[int]], pool: int) -> List[np.ndarray]:
    """Per slot, the (sorted, unique) first GPUs of its groups as an int array, from any per-GPU listing."""
    out = []
    for starts in group_starts:
        s = np.unique(np.asarray(starts, dtype=np.int64))
        if s.size == 0 or s[0] != 0 or s[-1] >= pool:
            raise ValueError(f"slot groups {s.tolist()} do not cover a pool of {pool} GPUs")
        out.append(s)
    return out


def _sizes(starts: np.ndarray, pool: int) -> np.ndarray:
    return np.diff(np.append(starts, pool))


def _sync_flat(x: np.ndarray, starts: np.ndarray, sizes: np.ndarray, ep_starts, ep_sizes) -> np.ndarray:
    """``[rows, pool]`` start times, each row's groups (``starts``/``sizes`` over the rows laid end to end) and
    expert-parallel blocks moved to their latest member."""
    flat = np.repeat(np.maximum.reduceat(x.ravel(), starts), sizes)
    if ep_starts is not None:
        flat = np.repeat(np.maximum.reduceat(flat, ep_starts), ep_sizes)
    return flat.reshape(x.shape)


def simulate_pool(times: np.ndarray, blocks: Sequence[np.ndarray], cm: CostModel, ep_width: int = 1) -> np.ndarray:
    """Finish time of every pool GPU. ``times[j, i]``: seconds of GPU ``i``'s slot-``j`` micro-batch (the whole
    pipeline depth, as :meth:`CostModel.group_microbatch_time` gives it); ``blocks[j]``: first GPUs of slot
    ``j``'s groups; ``ep_width``: GPUs per expert-parallel block (1 = none)."""
    t = np.asarray(times, dtype=np.float64)
    if t.ndim != 2:
        raise ValueError("times must be [slots, pool]")
    m, pool = t.shape
    if m == 0:
        return np.zeros(pool)
    sizes = [_sizes(b, pool) for b in blocks]
    # every slot's group starts and sizes in one padded table (-1: no group), for the row-wise synchronisation
    widest = max(b.size for b in blocks)
    start_table = np.full((m, widest), -1, dtype=np.int64)
    size_table = np.zeros((m, widest), dtype=np.int64)
    for j, b in enumerate(blocks):
        start_table[j, :b.size] = b
        size_table[j, :b.size] = sizes[j]
    ep_starts = np.arange(0, pool, ep_width) if ep_width > 1 and pool % ep_width == 0 else None
    ep_sizes = _sizes(ep_starts, pool) if ep_starts is not None else None

    def sync(x: np.ndarray, j) -> np.ndarray:
        if x.ndim == 2:  # row r is slot j[r] (the compressed 1F1B form): one reduction over the rows laid end to end
            rows = np.arange(x.shape[0], dtype=np.int64) * pool
            table = start_table[j]
            real = table >= 0
            return _sync_flat(x, (table + rows[:, None])[real], size_table[j][real],
                              None if ep_starts is None else (ep_starts[None, :] + rows[:, None]).ravel(),
                              None if ep_starts is None else np.tile(ep_sizes, x.shape[0]))
        x = np.repeat(np.maximum.reduceat(x, blocks[j]), sizes[j])
        if ep_starts is not None:
            x = np.repeat(np.maximum.reduceat(x, ep_starts), ep_sizes)
        return x

    def dur(x: np.ndarray) -> np.ndarray:
        if ep_starts is None:
            return x
        return np.repeat(np.maximum.reduceat(x, ep_starts), ep_sizes)

    if cm.pp == 1 or cm.vpp > 1:
        stage = t if cm.pp == 1 else t / cm.pp
        finish = np.zeros(pool)
        locked = []
        for j in range(m):
            locked.append(dur(stage[j]))
            finish = sync(finish, j) + locked[-1]
        if cm.pp > 1:  # the bubble of the stage times as they run (expert lockstep applied), as cost_model's
            finish = finish + (cm.pp - 1) / cm.vpp * np.stack(locked).mean(axis=0)
        return finish
    stage = t / cm.pp
    per_gpu = np.stack([dur(stage[j]) for j in range(m)], axis=1)  # [pool, slots], expert lockstep applied
    return simulate_1f1b_batch(per_gpu, cm.pp, sync=sync)


__all__ = ["simulate_pool", "slot_blocks"]
