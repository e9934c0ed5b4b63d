"""Our scheduler inside Megatron-Core's OWN sequence-packing path: ``data_schedule.py`` of ``MEGATRON_LM_DIR``.

Runs only when ``MEGATRON_LM_DIR`` points at a Megatron-LM checkout whose ``megatron.core.datasets.data_schedule``
has ``DpBalancedScheduler`` (``main`` or ``dev``, Aug 2026) and imports here (it needs ``triton``); otherwise it
skips with the reason. Everything runs in a fresh interpreter with that checkout first on ``PYTHONPATH``:

* the grouping contract, against upstream's class on the same inputs (no ranks): every id once, CP peers share a
  pack, equal counts, the count a multiple of ``microbatch_group_size_per_vp_stage`` when upstream would round to
  it, the budget and ``max_num_seqs``;
* a real training run on 2 gloo ranks (DP=2): a tiny GPT, upstream's ``wrap_data_iterator`` with its
  ``dp_balanced`` scheduler vs ours (``integrations.megatron_packing.wrap_data_iterator``; on ``dev`` also
  registered and selected through upstream's own ``wrap_data_iterator``), upstream's
  ``get_batch_on_this_rank_for_sequence_packing``, ``calculate_per_token_loss``, Megatron DDP, SGD: the losses
  and gradient norms of every step equal upstream's, and so do upstream's returned sums.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MLM = os.environ.get("MEGATRON_LM_DIR")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

_PROBE = r"""
from megatron_dynbatch.megatron.compat import packing_scheduler_api
api = packing_scheduler_api()
print("KEYS", api.map_keys, api.takes_max_num_seqs, api.why or "-")
"""


def _python(code: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (MLM, str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def upstream():
    if not MLM:
        pytest.skip("MEGATRON_LM_DIR is not set: these tests run Megatron-Core's own data_schedule.py from a "
                    "Megatron-LM checkout (main or dev, Aug 2026); see docs/integration.md")
    res = _python(_PROBE, timeout=300)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("KEYS")), None)
    if res.returncode or line is None:
        pytest.skip(f"megatron.core from MEGATRON_LM_DIR={MLM} does not import here: "
                    f"{(res.stderr.strip().splitlines() or ['?'])[-1]} (Megatron-LM needs e.g. triton)")
    _, keys, takes, why = line.split(" ", 3)
    if keys == "None" and why != "-":
        pytest.skip(f"no DpBalancedScheduler in MEGATRON_LM_DIR={MLM}: {why}")
    return {"map_keys": keys, "max_num_seqs": takes == "True"}


_CONTRACT = r"""
import random
from megatron.core.datasets import data_schedule as ds
from megatron_dynbatch.integrations import megatron_packing as mp
from megatron_dynbatch.megatron.compat import packing_scheduler_api
takes = packing_scheduler_api().takes_max_num_seqs
ours_cls = mp.scheduler_class()
rng = random.Random(7)
checked = 0
for trial in range(60):
    dp, cp = rng.choice([1, 2, 4]), rng.choice([1, 2])
    group = rng.choice([None, 2, 3])
    budget = rng.choice([256, 512])
    max_seqs = rng.choice([None, 3]) if takes else None
    n = rng.randint(dp * (group or 1) * 2, 40)
    lens = [2 * cp * rng.randint(1, budget // (2 * cp)) for _ in range(n)]
    pairs = list(enumerate(lens))
    extra = {"max_num_seqs": max_seqs} if takes else {}
    try:
        up = ds.DpBalancedScheduler(budget, cp, dp, group, **extra).get_groups_and_subsamples(pairs)
    except AssertionError:
        up = None  # upstream could not round its count (too few samples to split)
    ours = ours_cls(budget, cp, dp, group, max_num_seqs=max_seqs)
    ours._config = type("C", (), {"virtual_pipeline_model_parallel_size": 2 if group else None,
                                  "pipeline_model_parallel_size": 2 if group else 1})()
    groups = ours.get_groups_and_subsamples(pairs)
    ids = sorted(i for g in groups for d in range(dp) for i in g[d * cp])
    assert ids == list(range(n)), (trial, ids)
    for g in groups:
        assert len(g) == dp * cp
        for d in range(dp):
            assert all(g[d * cp + c] == g[d * cp] for c in range(cp)), "CP peers must share a pack"
            assert g[d * cp], "no empty micro-batch"
            assert sum(lens[i] for i in g[d * cp]) <= budget * cp, "over the budget"
            if max_seqs:
                assert len(g[d * cp]) <= max_seqs, "over max_num_seqs"
    if group:
        assert len(groups) % group == 0, ("count rule", len(groups), group)
    if up is not None:
        assert len(up[0]) == dp * cp and (not group or len(up) % group == 0)
    checked += 1
print("CHECKED", checked)
"""


def test_grouping_keeps_upstreams_contract(upstream):
    res = _python(_CONTRACT, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "CHECKED 60" in res.stdout


_TRAIN = r"""
import json
from megatron_dynbatch.megatron.ranks import run_ranks
from megatron_dynbatch.testing import upstream_packing as up
STEPS = %(steps)r
if __name__ == "__main__":
    out = {name: run_ranks(up.train, 2, name, STEPS, 256, 0.05, %(tp)r, %(pp)r, %(pad)r, %(cp)r, timeout=900)
           for name in %(names)r}
    print("RESULT", json.dumps(out))
"""


#: ``STEPS[s][d]``: the sample lengths DP rank ``d`` loads in step ``s`` (budget 256).
STEPS = [[[120, 30, 200, 64, 10, 90, 17, 150], [33, 250, 60, 40, 128, 12, 70, 5]],
         [[256, 3, 9, 100, 100, 40, 60, 7], [80, 81, 82, 1, 2, 200, 30, 11]],
         [[64, 64, 64, 64, 200, 190, 180, 170], [5, 6, 7, 8, 9, 10, 11, 250]]]


def _train(names, pad=None, steps=STEPS, tp=1, pp=1, cp=1):
    res = _python(_TRAIN % {"names": names, "pad": pad, "steps": steps, "tp": tp, "pp": pp, "cp": cp})
    assert res.returncode == 0, res.stderr[-6000:]
    return json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT"))[len("RESULT "):])


def test_losses_equal_upstream_schedulers_on_the_same_data(upstream):
    names = ["dp_balanced", "dynbatch"] + (["registered"] if upstream["map_keys"] == "names" else [])
    _assert_same_losses(_train(names), names)


def _assert_same_losses(out, names):
    base = out["dp_balanced"]
    for name in names[1:]:
        for r in range(2):
            for s, (mine, theirs) in enumerate(zip(out[name][r]["steps"], base[r]["steps"])):
                assert mine["loss"] == pytest.approx(theirs["loss"], rel=2e-6, abs=0), (name, r, s)
                assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=2e-6), (name, r, s)
                for key in ("seqlen_sum", "seqlen_sq_sum", "tokens"):
                    assert mine[key] == theirs[key], (name, key, s)
                assert max(mine["microbatch_tokens"]) <= 256
                assert len(mine["microbatch_tokens"]) == mine["num_microbatches"]
        for s in range(len(base[0]["steps"])):  # both ranks ran the same count and saw the same loss
            assert out[name][0]["steps"][s]["num_microbatches"] == out[name][1]["steps"][s]["num_microbatches"]
            assert out[name][0]["steps"][s]["loss"] == out[name][1]["steps"][s]["loss"]
    losses = [st["loss"] for st in out["dynbatch"][0]["steps"]]
    assert losses[-1] < losses[0]  # it trains


def test_upstreams_post_packing_padding_is_counted_in_the_budget(upstream):
    """Megatron-LM ``dev`` pads each packed micro-batch after the grouping (``pad_packed_seq_alignment``): to a
    multiple of 96 rows here, on a 256-token budget. Ours counts that padding (no micro-batch above 256 rows
    after it; upstream's next-fit packs fill to 256 and are padded to 288) and keeps upstream's losses."""
    if upstream["map_keys"] != "names":
        pytest.skip("pad_packed_seq_alignment is Megatron-LM dev's (Aug 2026); MEGATRON_LM_DIR has no name-keyed map")
    steps = [[[120, 30, 150, 64, 10, 90, 17, 150], [33, 190, 60, 40, 128, 12, 70, 5]],
             [[192, 3, 9, 100, 100, 40, 60, 7], [80, 81, 82, 1, 2, 180, 30, 11]]]
    names = ["dp_balanced", "dynbatch", "registered"]
    out = _train(names, pad=96, steps=steps)
    _assert_same_losses(out, names)
    for name in names[1:]:
        rows = [t for r in range(2) for st in out[name][r]["steps"] for t in st["microbatch_tokens"]]
        assert max(rows) <= 256 and all(t % 96 == 0 for t in rows), (name, rows)


@pytest.mark.parametrize("tp,pp,cp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "cp2"])
def test_losses_equal_upstream_under_tensor_pipeline_and_context_parallelism(upstream, tp, pp, cp):
    """The same through upstream's path on 2 ranks with DP=1: TP=2 (upstream broadcasts the packed batch to the
    TP peer), PP=2 (upstream sends each micro-batch's metadata down the pipeline; the loss lives on the last
    stage) or CP=2 (upstream slices each micro-batch zig-zag -- TE's index kernel, or its plain-torch twin
    without TE -- and the THD attention runs the ring; sequences are multiples of 2*cp, as upstream's datasets
    pad them). Every rank's gradient norm and the last stage's loss equal upstream's ``dp_balanced`` run."""
    names = ["dp_balanced", "dynbatch"] + (["registered"] if upstream["map_keys"] == "names" else [])
    # DP=1: one rank loads both ranks' samples; under CP each rounded up to a multiple of 2*cp
    steps = [[[-(-n // (2 * cp)) * 2 * cp for n in sum(per_rank, [])]] for per_rank in STEPS]
    out = _train(names, steps=steps, tp=tp, pp=pp, cp=cp)
    base = out["dp_balanced"]
    for name in names[1:]:
        for r in range(2):
            for s, (mine, theirs) in enumerate(zip(out[name][r]["steps"], base[r]["steps"])):
                assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=2e-6), (name, r, s)
                if r == 1 or pp == 1:  # the last pipeline stage (both ranks under TP) computes the loss
                    assert mine["loss"] == pytest.approx(theirs["loss"], rel=2e-6, abs=0), (name, r, s)
                assert mine["num_microbatches"] == out[name][1 - r]["steps"][s]["num_microbatches"]
                assert max(mine["microbatch_tokens"]) <= 256
