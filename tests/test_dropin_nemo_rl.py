"""NeMo-RL drop-in: ``get_packer`` keeps NeMo-RL's packer contract (every index once, no bin over the capacity,
``min_bin_count`` and ``bin_count_multiple`` met, no empty bin, empty input -> no bins, ``ValueError`` for an
unknown algorithm, an oversized sequence, too few sequences or bad constructor arguments) and adds ours: with
NeMo-RL's own round-robin dealing (bin ``j`` to rank ``j % shards``) every rank gets the same number of bins and
a balanced share."""

from __future__ import annotations

import enum
import re
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dynbatch import DynBatchConfigError
from megatron_dynbatch.integrations.nemo_rl import DynBatchSequencePacker, PackingAlgorithm, get_packer


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
    with pytest.raises(ValueError, match="Cannot create 4 bins with only 3 sequences"):
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
        assert f"bins with only {len(lengths)} sequences" in str(err), str(err)
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
    with pytest.raises(ValueError, match="Cannot create 3 bins with only 2 sequences") as exc:
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
    except ValueError as err:
        assert theirs is None and re.search(rf"Cannot create \d+ bins with only {len(lengths)} sequences", str(err))
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


# ------------------------------------------------------------------ issue 28 item 2: NeMo-RL's class and words
NEMO_RL_ALGORITHMS = "nemo_rl.data.packing.algorithms"


def _stand_in_nemo_rl(monkeypatch):
    """A stand-in of NeMo-RL's packing module (its abstract ``SequencePacker``) where NeMo-RL would be."""
    from megatron_dynbatch.testing.peer_types import NemoRLSequencePacker

    module = types.ModuleType(NEMO_RL_ALGORITHMS)
    module.SequencePacker = NemoRLSequencePacker
    monkeypatch.setitem(sys.modules, NEMO_RL_ALGORITHMS, module)
    return NemoRLSequencePacker


@pytest.mark.parametrize("algorithm", list(PackingAlgorithm))
def test_the_packer_is_nemo_rl_s_sequence_packer_where_nemo_rl_is(monkeypatch, algorithm):
    """NeMo-RL's own ``test_get_packer`` checks ``isinstance(get_packer(...), SequencePacker)`` with ITS abstract
    class; the drop-in used to return a class of its own only. With NeMo-RL (here its stand-in) loaded, the
    packer is both ours and NeMo-RL's, runs our planning (``pack`` and NeMo-RL's ``_pack_implementation``) and
    keeps NeMo-RL's attributes."""
    base = _stand_in_nemo_rl(monkeypatch)
    packer = get_packer(algorithm, 100, min_bin_count=2, bin_count_multiple=2)
    assert isinstance(packer, base) and isinstance(packer, DynBatchSequencePacker)
    lengths = [10, 20, 30, 40, 50, 60, 70, 80, 90]
    bins = packer.pack(lengths)
    check_bins(bins, lengths, 100, 2, 2)
    assert packer._pack_implementation(lengths) == bins and type(get_packer(algorithm, 50)) is type(packer)
    assert (packer.bin_capacity, packer.min_bin_count, packer.bin_count_multiple) == (100, 2, 2)


def test_without_nemo_rl_the_packer_is_ours(monkeypatch):
    monkeypatch.setitem(sys.modules, NEMO_RL_ALGORITHMS, None)  # "import nemo_rl..." raises ImportError
    assert type(get_packer("concatenative", 100)) is DynBatchSequencePacker


@pytest.mark.parametrize("lengths, kw, bins", [([50, 50], {"min_bin_count": 3}, 3),
                                               ([50, 50], {"bin_count_multiple": 4}, 4),
                                               ([50, 50, 50], {"min_bin_count": 3, "bin_count_multiple": 2}, 4),
                                               ([100] * 5, {"bin_count_multiple": 2}, 6)])
def test_too_few_sequences_in_nemo_rl_s_words_beside_our_fix(lengths, kw, bins):
    """NeMo-RL's ``test_insufficient_sequences_for_constraints`` matches ``Cannot create N bins with only M
    sequences``: the drop-in's ValueError carries those words (N as NeMo-RL counts it here: the model of NeMo-RL's
    packer agrees) and still names the field and a fix. The last case: every sequence fills a bin, so five bins
    over two ranks need six."""
    from megatron_dynbatch.testing.peer_models import nemo_rl_pack

    words = f"Cannot create {bins} bins with only {len(lengths)} sequences"
    with pytest.raises(ValueError, match=words):
        nemo_rl_pack(lengths, 100, kw.get("min_bin_count"), kw.get("bin_count_multiple"))
    with pytest.raises(DynBatchConfigError, match=words) as exc:
        get_packer(PackingAlgorithm.CONCATENATIVE, 100, **kw).pack(lengths)
    assert exc.value.field == "sequence_lengths" and "provide more sequences" in exc.value.fix


def _nemo_rl_own():
    return pytest.importorskip(
        NEMO_RL_ALGORITHMS, exc_type=ImportError,
        reason="NeMo-RL is not importable: put its source (NVIDIA-NeMo/RL; the packing module needs only the "
               "standard library) on PYTHONPATH to check the drop-in against NeMo-RL's own classes")


def test_against_nemo_rl_s_own_sequence_packer_and_words():
    """Issue 28 item 2 against NeMo-RL's own module: ``get_packer`` returns an instance of NeMo-RL's
    ``SequencePacker`` for every member of NeMo-RL's enum, and where NeMo-RL's own packer refuses too few
    sequences, so does the drop-in, in the same words."""
    theirs = _nemo_rl_own()
    for algorithm in theirs.PackingAlgorithm:
        assert isinstance(get_packer(algorithm, 100), theirs.SequencePacker)
    rng = np.random.default_rng(28)
    for _ in range(200):
        lengths = rng.integers(1, 101, int(rng.integers(1, 12))).tolist()
        kw = {"min_bin_count": int(rng.choice([0, 2, 5, 9])), "bin_count_multiple": int(rng.choice([1, 2, 4]))}
        try:
            theirs.get_packer(theirs.PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING, 100, **kw).pack(lengths)
        except ValueError as err:
            assert "Cannot create" in str(err)
            with pytest.raises(ValueError, match=rf"Cannot create \d+ bins with only {len(lengths)} sequences"):
                get_packer(theirs.PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING, 100, **kw).pack(lengths)
