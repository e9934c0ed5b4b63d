"""NeMo-RL drop-in: ``get_packer`` keeps NeMo-RL's packer contract (every index once, no bin over the capacity,
``min_bin_count`` and ``bin_count_multiple`` met, no empty bin, empty input -> no bins, ``ValueError`` for an
unknown algorithm, an oversized sequence, too few sequences or bad constructor arguments) and adds ours: with
NeMo-RL's own round-robin dealing (bin ``j`` to rank ``j % shards``) every rank gets the same number of bins and
a balanced share."""

from __future__ import annotations

import enum

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


# ------------------------------------------------------------------ issue 20: NeMo-RL's own call shapes and types
class NemoRLPackingAlgorithm(enum.Enum):
    """A second enum with NeMo-RL's members -- what ``nemo_rl.data.packing.algorithms.PackingAlgorithm`` is to us:
    a different class with the same names and values."""

    CONCATENATIVE = "concatenative"
    FIRST_FIT_DECREASING = "first_fit_decreasing"
    FIRST_FIT_SHUFFLE = "first_fit_shuffle"
    MODIFIED_FIRST_FIT_DECREASING = "modified_first_fit_decreasing"


@pytest.mark.parametrize("algorithm", list(NemoRLPackingAlgorithm) + [a.value for a in NemoRLPackingAlgorithm]
                         + [a.name.lower() for a in NemoRLPackingAlgorithm] + ["First_Fit_Shuffle"])
def test_nemo_rl_s_own_enum_and_strings_select_the_packer(algorithm):
    """NeMo-RL's packing tests call ``get_packer(PackingAlgorithm.X, ...)`` with NeMo-RL's enum; its config
    passes the name as a string. Every one is accepted by name or value."""
    packer = get_packer(algorithm, 100)
    bins = packer.pack([10, 20, 30, 40, 50, 60, 70, 80, 90])
    check_bins(bins, [10, 20, 30, 40, 50, 60, 70, 80, 90], 100)
    assert packer.algorithm in {a.value for a in PackingAlgorithm}


@pytest.mark.parametrize("bad", [object(), "best_fit", None, 3, enum.Enum("Other", "BEST_FIT").BEST_FIT])
def test_anything_else_is_a_value_error_listing_the_algorithms(bad):
    with pytest.raises(ValueError, match="unknown packing algorithm.*MODIFIED_FIRST_FIT_DECREASING"):
        get_packer(bad, 100)


def test_lengths_as_nemo_rl_holds_them_and_errors_in_nemo_rl_s_words():
    """NeMo-RL keeps input lengths in a tensor (``torch.tensor(input_lens)``) and pads them per sequence; an empty
    chunk gives no bins. Errors are ValueErrors naming ``sequence_lengths`` / ``bin_capacity``, never the
    planner's ``lengths`` / ``--max-tokens-per-gpu``."""
    torch = pytest.importorskip("torch")
    packer = get_packer("modified_first_fit_decreasing", 8192, min_bin_count=2, bin_count_multiple=2)
    lens = torch.tensor([1200, 3000, 800, 4000, 2500, 100])
    assert packer.pack(lens) == packer.pack(lens.tolist())
    assert packer.pack(torch.tensor([], dtype=torch.long)) == [] and packer.pack(np.zeros(0)) == []
    with pytest.raises(ValueError, match=r"sequence_lengths\[1\]=2\.5"):
        packer.pack([100, 2.5])
    with pytest.raises(ValueError, match="bin_capacity=100: sequence 1 has length 150"):
        get_packer("first_fit_decreasing", 100).pack(torch.tensor([50, 150, 70]))
    with pytest.raises(ValueError, match="cannot fill 3 bins") as exc:
        get_packer("concatenative", 100, min_bin_count=3).pack([50, 50])
    assert exc.value.field == "sequence_lengths"


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=0, max_size=40), st.sampled_from([3000, 4096, 10000]),
       st.sampled_from([None, 1, 2, 4]), st.sampled_from([None, 0, 3, 8]))
def test_same_structure_as_nemo_rl_s_own_packer(lengths, capacity, multiple, min_bins):
    """Random lengths through the drop-in and through a model of NeMo-RL's own modified first-fit decreasing
    packer with its bin-count adjustment (:mod:`megatron_dynbatch.testing.peer_models`): every index once, no bin
    over the capacity or empty, at least ``min_bin_count`` bins and a multiple of ``bin_count_multiple``, no bins
    for no sequences, ours planning whenever NeMo-RL does. What differs, stated: the count is not NeMo-RL's (ours
    is the planner's -- fewer or more bins; NeMo-RL's is first-fit's raised to the rules), and dealt round-robin
    ours give every rank the same number of bins."""
    from megatron_dynbatch.testing.peer_models import nemo_rl_pack

    try:
        theirs = nemo_rl_pack(lengths, capacity, min_bins, multiple)
    except ValueError:
        theirs = None
    try:
        bins = get_packer("modified_first_fit_decreasing", capacity, min_bin_count=min_bins,
                          bin_count_multiple=multiple).pack(lengths)
    except ValueError:
        assert theirs is None
        return
    if not lengths:
        assert bins == [] == theirs
        return
    check_bins(bins, lengths, capacity, min_bins, multiple)
    if multiple:
        assert len({len(r) for r in deal(bins, multiple)}) == 1
    if theirs is not None:
        check_bins(theirs, lengths, capacity, min_bins, multiple)


def test_the_step_structure_is_the_caller_s():
    """NeMo-RL packs each global-batch chunk separately and runs one optimizer step per chunk: the bins of one call
    cover exactly that chunk, so the number of steps cannot change (the hazard issue 20 item 8 found in ROLL)."""
    chunks = [[500, 300, 200, 100], [900, 50, 60, 70]]
    packer = get_packer("modified_first_fit_decreasing", 1000, min_bin_count=2, bin_count_multiple=2)
    for chunk in chunks:
        assert sorted(i for b in packer.pack(chunk) for i in b) == list(range(len(chunk)))
