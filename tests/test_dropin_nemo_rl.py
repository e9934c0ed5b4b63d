"""NeMo-RL drop-in: ``get_packer`` keeps NeMo-RL's packer contract (every index once, no bin over the capacity,
``min_bin_count`` and ``bin_count_multiple`` met, no empty bin, empty input -> no bins, ``ValueError`` for an
unknown algorithm, an oversized sequence, too few sequences or bad constructor arguments) and adds ours: with
NeMo-RL's own round-robin dealing (bin ``j`` to rank ``j % shards``) every rank gets the same number of bins and
a balanced share."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dynbatch.integrations.nemo_rl import PackingAlgorithm, get_packer


def deal(bins, shards):
    """NeMo-RL's ``shard_by_batch_size``: bin ``j`` to rank ``j % shards``."""
    return [bins[r::shards] for r in range(shards)]


def check_bins(bins, lengths, capacity, min_bin_count=None, multiple=None):
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b for b in bins)
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    if min_bin_count:
        assert len(bins) >= min_bin_count
    if multiple:
        assert len(bins) % multiple == 0


def test_empty_input_gives_no_bins():
    assert get_packer("modified_first_fit_decreasing", 100).pack([]) == []
    assert get_packer("first_fit_decreasing", 100, min_bin_count=4, bin_count_multiple=4).pack(np.array([])) == []


@pytest.mark.parametrize("name", ["concatenative", "FIRST_FIT_DECREASING", "first_fit_shuffle",
                                  PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING])
def test_every_nemo_rl_algorithm_name_is_accepted(name):
    packer = get_packer(name, 10, min_bin_count=2, bin_count_multiple=2)
    bins = packer.pack([4, 1, 3, 2, 1, 3, 4, 5])
    check_bins(bins, [4, 1, 3, 2, 1, 3, 4, 5], 10, 2, 2)
    assert packer.bin_capacity == 10 and packer.min_bin_count == 2 and packer.bin_count_multiple == 2


def test_errors_are_value_errors():
    with pytest.raises(ValueError, match="algorithm"):
        get_packer("best_fit", 10)
    with pytest.raises(ValueError, match="min_bin_count"):
        get_packer("concatenative", 10, min_bin_count=-1)
    with pytest.raises(ValueError, match="bin_count_multiple"):
        get_packer("concatenative", 10, bin_count_multiple=0)
    with pytest.raises(ValueError, match="sequence 1 has length 11"):
        get_packer("concatenative", 10).pack([3, 11])
    with pytest.raises(ValueError, match="cannot fill 4 bins"):
        get_packer("concatenative", 10, min_bin_count=4, bin_count_multiple=2).pack([3, 3, 3])
    with pytest.raises(ValueError, match="max_seq_len"):
        get_packer("concatenative", 4096, max_seq_len=5000)


def test_round_robin_gives_every_rank_its_planned_share():
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 4000, 64).tolist()
    bins = get_packer("modified_first_fit_decreasing", 8192, min_bin_count=4, bin_count_multiple=4).pack(lengths)
    ranks = deal(bins, 4)
    assert len({len(r) for r in ranks}) == 1
    loads = [sum(lengths[i] for b in r for i in b) for r in ranks]
    assert max(loads) / (sum(loads) / 4) < 1.02


def test_vpp_rule_through_the_parallel_argument():
    lengths = [500] * 40
    packer = get_packer("modified_first_fit_decreasing", 1000, min_bin_count=2, bin_count_multiple=2,
                        parallel={"pp": 4, "vpp": 2, "microbatch_group_size_per_vp_stage": 6})
    bins = packer.pack(lengths)
    m = len(bins) // 2
    assert m >= 6 and (m % 6 == 0 or m % 6 >= 4)


def test_metrics_interface():
    packer = get_packer("modified_first_fit_decreasing", 100, collect_metrics=True)
    bins = packer.pack([50, 50, 30, 70])
    assert packer.compute_metrics([50, 50, 30, 70], bins)["num_bins"] == len(bins)
    assert packer.get_aggregated_metrics()["num_sequences"] == 4
    packer.reset_metrics()
    assert packer.get_aggregated_metrics() == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=0, max_size=80), st.sampled_from([3000, 4096, 10000]),
       st.sampled_from([None, 1, 2, 4, 8]), st.sampled_from([None, 0, 1, 4, 9]), st.booleans())
def test_packer_contract_on_random_lengths(lengths, capacity, multiple, min_bins, with_model):
    packer = get_packer("modified_first_fit_decreasing", capacity, min_bin_count=min_bins,
                        bin_count_multiple=multiple, model="tiny-gpt" if with_model else None)
    need = max(multiple or 1, min_bins or 0)
    if lengths and len(lengths) < need:
        with pytest.raises(ValueError):
            packer.pack(lengths)
        return
    try:
        bins = packer.pack(lengths)
    except ValueError as err:  # every rank needs as many sequences as bins
        assert "without leaving one empty" in str(err), str(err)
        return
    if not lengths:
        assert bins == []
        return
    check_bins(bins, lengths, capacity, min_bins, multiple)
    if multiple:
        assert len({len(r) for r in deal(bins, multiple)}) == 1
