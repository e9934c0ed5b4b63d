"""The Megatron RL drop-in (``integrations/megatron_rl.py``, planning half ``core/dropin/megatron_rl.py``).

The structural contract of upstream's packing outputs is one checker (:func:`check_rank_bins`), applied to our
packer run alone (torch only: a faithful model of what ``pack_sequences`` must return) and -- when
``MEGATRON_LM_DIR`` points at a Megatron-LM checkout -- to upstream's OWN ``pack_all_trajectories`` on 2 gloo
ranks, with its ``fifo`` and ``round-robin`` packers and with our drop-in installed: the checker holds for all
three, ours has equal counts and no empty bin.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dynbatch import DynBatchConfigError
from megatron_dynbatch.core.dropin.megatron_rl import bin_seq_starts, plan_rl_bins
from megatron_dynbatch.core.errors import OversizeSampleError

ROOT = Path(__file__).resolve().parents[1]
MLM = os.environ.get("MEGATRON_LM_DIR")


# ------------------------------------------------------------------------------------------ planning half
@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 64), min_size=1, max_size=80), dp=st.integers(1, 4),
       cp=st.sampled_from([1, 2]), limit=st.sampled_from([None, 1, 3, 50]))
def test_bins_keep_megatron_rl_contract(lengths, dp, cp, limit):
    lengths = lengths * dp
    mult = 2 * cp if cp > 1 else 1
    try:
        res = plan_rl_bins(lengths, bin_size=64, dp=dp, seq_length_multiple=mult, max_sequences_per_bin=limit,
                           parallel={"cp": cp})
    except DynBatchConfigError as exc:
        assert limit is not None and "max-sequences-per-bin" in exc.field  # the limit cannot be met
        return
    assert len(res.bins) == dp * res.per_rank and all(res.bins)
    assert sorted(i for b in res.bins for i in b) == list(range(len(lengths)))
    for b in res.bins:
        assert bin_seq_starts(lengths, b, mult)[-1] <= 64
        assert limit is None or len(b) <= limit
    for r in range(dp):  # rank-major: rank r's bins are the plan's rank r
        assert res.rank_bins(r) == [list(mb) for mb in res.plan.micro_batches[r]]


def test_bins_balance_attention_and_use_fewer_bins_than_next_fit():
    rng = np.random.default_rng(3)
    lens = np.minimum(rng.lognormal(7.0, 1.0, 512).astype(int) + 64, 8192)
    res = plan_rl_bins(lens, bin_size=8192, dp=8, model="qwen3-8b")
    assert res.per_rank * 8 >= -(-int(lens.sum()) // 8192)
    assert res.plan.imbalance < 1.02
    assert max(len(b) for b in res.bins) <= 50


@pytest.mark.parametrize("bad, field", [
    (dict(seq_lengths=[], bin_size=64, dp=1), "lengths"),
    (dict(seq_lengths=[5, 6], bin_size=64, dp=4), "trajectories"),
    (dict(seq_lengths=[5, 6], bin_size=0, dp=1), "bin_size"),
    (dict(seq_lengths=[5, 6], bin_size=63, dp=1, seq_length_multiple=4, parallel={"cp": 2}), "bin_size"),
    (dict(seq_lengths=[5, 6], bin_size=64, dp=1, seq_length_multiple=2, parallel={"cp": 2}), "seq_length_multiple"),
    (dict(seq_lengths=[5, -1], bin_size=64, dp=1), "lengths"),
    (dict(seq_lengths=[5, 6], bin_size=64, dp=np.float64(1.5)), "dp"),
    (dict(seq_lengths=[5, 6], bin_size=64, dp=1, max_sequences_per_bin=0), "max-sequences-per-bin"),
])
def test_hostile_inputs_name_the_field(bad, field):
    with pytest.raises(DynBatchConfigError) as exc:
        plan_rl_bins(**bad)
    assert field in exc.value.field


def test_oversize_and_degenerate_batches():
    with pytest.raises(OversizeSampleError, match="--seq-length"):
        plan_rl_bins([10, 10**9], bin_size=64, dp=1)
    res = plan_rl_bins(np.array([0, 0, 0, 0]), bin_size=8, dp=np.int64(2))  # all-pad rows still get a bin
    assert res.per_rank >= 1 and sorted(i for b in res.bins for i in b) == [0, 1, 2, 3]
    import torch

    res = plan_rl_bins(torch.tensor([3, 4, 5, 6]), bin_size=torch.tensor(8).item(), dp=2)
    assert sum(len(b) for b in res.bins) == 4


# ------------------------------------------------------------------------------------------ the contract
def check_rank_bins(rows, gen, bins, seq_length, mult, max_per_bin):
    """Upstream's per-bin layout: each sequence at its aligned start with its own tokens, positions 0..n-1,
    loss mask = generation mask on it; pad / 0 / 0 elsewhere; starts end with the padded end; at most
    ``max_per_bin`` sequences and ``seq_length`` tokens. Returns the sequences placed."""
    placed = []
    for b in bins:
        members, starts = b["members"], b["starts"]
        if not members:  # upstream's filler bin: all pad, no loss
            assert starts == [] and not any(b["tokens"]) and not any(b["loss_mask"])
            continue
        assert len(starts) == len(members) + 1 and len(members) <= max_per_bin
        assert starts[-1] <= seq_length
        covered = np.zeros(seq_length, dtype=bool)
        for i, s in zip(members, starts):
            n = int(np.flatnonzero(np.asarray(rows[i]) != 0).max() + 1) if any(rows[i]) else 0
            assert s % mult == 0
            assert b["tokens"][s:s + n] == rows[i][:n]
            assert b["positions"][s:s + n] == list(range(n))
            assert b["loss_mask"][s:s + n] == [float(x) for x in gen[i][:n]]
            covered[s:s + n] = True
            placed.append(i)
        assert all(t == 0 for t, c in zip(b["tokens"], covered) if not c)
        assert all(m == 0 for m, c in zip(b["loss_mask"], covered) if not c)
    return placed


def _bins_of(tokens, positions, mask, info):
    return [{"members": list(m), "starts": list(info.seq_starts[k]), "tokens": tokens[k].tolist(),
             "positions": positions[k].tolist(), "loss_mask": mask[k].tolist()}
            for k, m in enumerate(info.bin_seq_indices)]


def test_packer_outputs_keep_the_contract_without_megatron():
    import torch

    from megatron_dynbatch.integrations.megatron_rl import DynBatchSequencePacker, actual_lengths
    from megatron_dynbatch.testing.upstream_rl import make_rows

    lengths = [60, 10, 33, 5, 64, 20, 7, 40, 2, 50, 64, 3, 16, 16, 30, 45, 9, 12, 1, 28]
    trajs, gen = make_rows(lengths, 64, seed=0)
    assert actual_lengths(trajs, 0) == lengths
    for cp in (1, 2):
        mult = 2 * cp if cp > 1 else 1
        packer = DynBatchSequencePacker(64, 0, max_sequences_per_bin=4, seq_length_multiple=mult, dp=2,
                                        parallel={"cp": cp})
        tokens, positions, mask, info = packer.pack_sequences(trajs, gen)
        assert tokens.shape == (len(info.bin_seq_indices), 64) and tokens.dtype == torch.long
        assert mask.dtype == torch.float32 and positions.dtype == torch.long
        placed = check_rank_bins(trajs.tolist(), gen.int().tolist(), _bins_of(tokens, positions, mask, info), 64,
                                 mult, 4)
        assert sorted(placed) == list(range(len(lengths)))
        assert info.packing_algo == "dynbatch" and info.seq_lengths == lengths
        assert all(info.seq_to_bin_idx[i] == k for k, m in enumerate(info.bin_seq_indices) for i in m)
        assert len(info.bin_seq_indices) % 2 == 0 and all(info.bin_seq_indices)
    with pytest.raises(DynBatchConfigError, match="trajs"):
        packer.pack_sequences(torch.zeros(3, dtype=torch.long))


def test_flag_accepts_dynbatch_on_a_megatron_style_parser():
    from megatron_dynbatch.integrations.megatron_packing import extend_scheduler_flag

    parser = argparse.ArgumentParser()
    parser.add_argument("--rl-sequence-packing-algo", choices=["fifo", "round-robin"], default="fifo")
    assert extend_scheduler_flag(parser, "dynbatch", flag="--rl-sequence-packing-algo")
    assert parser.parse_args(["--rl-sequence-packing-algo", "dynbatch"]).rl_sequence_packing_algo == "dynbatch"


# ------------------------------------------------------------------------------------------ upstream's own code
_RUN = r"""
import json
from megatron_dynbatch.megatron.ranks import run_ranks
from megatron_dynbatch.testing import upstream_rl as ur
L = [[60, 10, 33, 5, 64, 20, 7, 40, 2, 50], [64, 3, 16, 16, 30, 45, 9, 12, 1, 28]]
if __name__ == "__main__":
    out = {a: run_ranks(ur.pack, 2, a, L, 64, 4, a == "dynbatch", timeout=600)
           for a in ("fifo", "round-robin", "dynbatch")}
    print("RESULT", json.dumps(out))
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_upstream_pack_all_trajectories_with_and_without_the_dropin():
    if not MLM:
        pytest.skip("MEGATRON_LM_DIR is not set: this test runs Megatron RL's own pack_all_trajectories from a "
                    "Megatron-LM checkout (main, Aug 2026); see docs/integration.md")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (MLM, str(ROOT), os.environ.get("PYTHONPATH")) if p))
    probe = subprocess.run([sys.executable, "-W", "ignore", "-c", "import typing; typing.override = getattr(typing, "
                            "'override', lambda f: f); import megatron.rl.sequence_packing_utils"],
                           capture_output=True, text=True, env=env, timeout=300)
    if probe.returncode:
        pytest.skip(f"megatron.rl from MEGATRON_LM_DIR={MLM} does not import here: "
                    f"{(probe.stderr.strip().splitlines() or ['?'])[-1]} (it needs e.g. triton)")
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", _RUN], capture_output=True, text=True, env=env,
                         timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-5000:]
    out = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT"))[len("RESULT "):])
    counts = {}
    for algo, ranks in out.items():
        shapes = {tuple(r["shape"]) for r in ranks}
        assert len(shapes) == 1, (algo, shapes)  # equal bin counts on every rank, [bins, seq_length]
        placed = []
        for r in ranks:
            assert r["algo"] == algo
            placed += check_rank_bins(r["trajs"], r["gen"], r["bins"], 64, 1, 4)
            for b in r["bins"]:
                assert b["advantages"] == [r["advantages"][i] for i in b["members"]]
                if b["members"]:  # upstream's PackedSeqParams: real lengths, then the padded tail
                    assert b["cu_seqlens"][len(b["members"])] == b["starts"][-1]
        assert sorted(placed) == list(range(20)), algo
        counts[algo] = shapes.pop()[0]
    assert all(b["members"] for r in out["dynbatch"] for b in r["bins"])  # no empty filler bin
    assert any(not b["members"] for r in out["fifo"] for b in r["bins"])  # upstream pads a rank with one here
    assert counts["dynbatch"] < counts["fifo"] == counts["round-robin"]
