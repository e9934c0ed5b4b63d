"""Start-up check: a budget too small for the longest sample a run can produce fails before step 1 -- in the
core (``check_max_seq_len_fits``), in the Megatron flags' validation (which the Megatron-LM hook runs) -- and
warns instead under ``oversize='alone'``."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dynbatch import (DynBatchConfigError, OversizeSampleError, OversizeSampleWarning,
                               check_max_seq_len_fits, plan_global_batch)


def test_fits_and_misses():
    assert check_max_seq_len_fits(4096, max_tokens_per_gpu=4096)
    with pytest.raises(OversizeSampleError, match=r"max_seq_len=4097") as info:
        check_max_seq_len_fits(4097, max_tokens_per_gpu=4096)
    assert "at least 4097" in info.value.fix
    with pytest.warns(OversizeSampleWarning, match="run alone"):
        assert not check_max_seq_len_fits(4097, max_tokens_per_gpu=4096, oversize="alone")


def test_padding_counts():
    # cp=2, budget 4095 x 2 = 8190: a sequence pads to a multiple of 4 (8180 fits); with a trainer's own
    # per-sequence multiple of 16 (verl: tp*cp*2) it pads to 8192 and no longer does
    assert check_max_seq_len_fits(8180, max_tokens_per_gpu=4095, parallel={"cp": 2})
    with pytest.raises(OversizeSampleError, match="longest"):
        check_max_seq_len_fits(8180, max_tokens_per_gpu=4095, parallel={"cp": 2}, sequence_pad_multiple=16,
                               length_field="longest")


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 20_000), st.integers(1, 8_000), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]),
       st.booleans(), st.sampled_from([None, "fp8", 64]), st.sampled_from([None, 8, 24]),
       st.sampled_from([None, 128, 256]))
def test_agrees_with_the_planner(length, budget, cp, tp, sp, fp8, seq_mult, mb_mult):
    """The check passes exactly when the planner would place a sample of that length within the cap."""
    par = {"cp": cp, "tp": tp, "sequence_parallel": sp}
    kw = dict(max_tokens_per_gpu=budget, parallel=par, fp8_alignment=fp8, sequence_pad_multiple=seq_mult,
              microbatch_pad_multiple=mb_mult)
    try:
        fits = check_max_seq_len_fits(length, **kw)
    except OversizeSampleError:
        fits = False
    except DynBatchConfigError as err:  # the budget holds no aligned sequence at all: the planner says so too
        with pytest.raises(DynBatchConfigError, match="smaller than one aligned sequence"):
            plan_global_batch([length], **kw, balance_by_flops=False)
        assert "smaller than one aligned sequence" in str(err)
        return
    if fits:
        plan = plan_global_batch([length], **kw, balance_by_flops=False)
        assert plan.cap_violations == 0
    else:
        with pytest.raises(OversizeSampleError):
            plan_global_batch([length], **kw, balance_by_flops=False)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4096", None, True, np.float64(3.5)])
def test_bad_length_is_named(bad):
    with pytest.raises(DynBatchConfigError, match="max_seq_len"):
        check_max_seq_len_fits(bad, max_tokens_per_gpu=4096)


def _parse(*argv):
    from test_args import megatron_like_parser

    p = megatron_like_parser()
    p.add_argument("--seq-length", type=int, default=None)
    args = p.parse_args(list(argv))
    args.world_size = 8
    return args


def test_validation_refuses_a_seq_length_over_the_budget():
    from megatron_dynbatch.megatron.args import validate_dynamic_batch_args

    ok = _parse("--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--seq-length", "4096")
    validate_dynamic_batch_args(ok)
    bad = _parse("--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--seq-length", "8192")
    with pytest.raises(OversizeSampleError, match=r"--seq-length=8192") as info:
        validate_dynamic_batch_args(bad)
    assert info.value.field == "--max-tokens-per-gpu" and "8192" in info.value.fix
    # the log-prob budget is checked too
    lp = _parse("--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192", "--log-probs-max-tokens-per-gpu", "4096",
                "--seq-length", "8192")
    with pytest.raises(OversizeSampleError, match="--log-probs-max-tokens-per-gpu"):
        validate_dynamic_batch_args(lp)
    # an explicit longest sample wins over --seq-length
    explicit = _parse("--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--seq-length", "8192",
                      "--dynbatch-max-seq-length", "4000")
    validate_dynamic_batch_args(explicit)
    # with CP the padding counts: 4095 tokens pad to 4096 with cp=2, but 4097 -> 4100 needs 2050 per GPU
    cp = _parse("--use-dynamic-batch-size", "--max-tokens-per-gpu", "2048", "--context-parallel-size", "2",
                "--dynbatch-max-seq-length", "4097")
    cp.world_size = 2
    with pytest.raises(OversizeSampleError, match="at least 2050"):
        validate_dynamic_batch_args(cp)
    # oversize='alone' is a decision: a warning, not an error
    alone = _parse("--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--seq-length", "8192",
                   "--dynbatch-oversize", "alone")
    with pytest.warns(OversizeSampleWarning):
        validate_dynamic_batch_args(alone)


def test_validation_refuses_a_bad_max_seq_length_flag():
    from megatron_dynbatch.megatron.args import validate_dynamic_batch_args

    args = _parse("--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--dynbatch-max-seq-length", "0")
    with pytest.raises(DynBatchConfigError, match="--dynbatch-max-seq-length"):
        validate_dynamic_batch_args(args)


def test_without_dynamic_batching_nothing_is_checked():
    from megatron_dynbatch.megatron.args import validate_dynamic_batch_args

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_dynamic_batch_args(_parse("--seq-length", "100000"))
