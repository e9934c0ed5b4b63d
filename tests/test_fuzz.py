"""Hostile input for every public entry point: whole classes of values, not single examples.

For ``plan_global_batch``, ``RunConfig``, ``ModelSpec``, ``DynamicBatchIterator`` and the CLI, random draws from
catalogues of awkward values -- NumPy scalars of every integer dtype, booleans, floats (integral or not, NaN,
inf), strings, ``None``, nested and ragged containers, mappings, sets, generators, huge magnitudes (``2**62``,
``2**64``, uint64 values) and degenerate batches -- must either give a valid result or raise a ``ValueError``
subclass (``DynBatchConfigError``) whose message names the field and gives a fix. Never another exception type,
never a silently wrong plan, and never a hang (hypothesis' deadline is off; the adversarial *time* bounds live in
``megatron-dynbatch bench``, see docs/benchmarks.md).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from megatron_dynbatch import DynBatchConfigError, ModelSpec, RunConfig, plan_global_batch

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
HOSTILE_SCALARS = [
    None, True, False, np.bool_(True), 0, -1, 1, 2, 7, 2 ** 31, 2 ** 40, 2 ** 40 + 1, 2 ** 62, 2 ** 63, 2 ** 64,
    -(2 ** 63), 1.0, 2.5, float("nan"), float("inf"), -0.0, "8", "", "abc", b"8", [1], (1,), {"a": 1}, {1}, object(),
    np.float64(4.0), np.int64(4), np.uint64(2 ** 63 + 5), np.int8(-3), np.array(3), np.array([3]),
]


def mostly(valid, hostile=None):
    """``valid`` about five times in six, else a hostile scalar: every field is hostile now and then, and most
    draws reach deep into the planner."""
    return st.one_of(valid, valid, valid, valid, valid,
                     hostile if hostile is not None else st.sampled_from(HOSTILE_SCALARS))


def _integers():
    return st.one_of(st.integers(-5, 10_000), st.sampled_from([2 ** 40, 2 ** 40 + 1, 2 ** 62, 2 ** 64]))


@st.composite
def length_inputs(draw):
    kind = draw(st.sampled_from(["list"] * 4 + ["tuple", "array", "array", "dtype", "mixed", "nested",
                                                 "hostile_elem", "scalar", "empty", "range"]))
    n = draw(st.integers(1, 40))
    vals = draw(st.lists(st.integers(0, 5000), min_size=n, max_size=n))
    if kind == "list":
        return vals
    if kind == "tuple":
        return tuple(vals)
    if kind == "array":
        return np.asarray(vals)
    if kind == "dtype":
        dt = draw(st.sampled_from(INT_DTYPES + [np.float32, np.float64, np.bool_, object]))
        return np.asarray(vals).astype(dt)
    if kind == "mixed":  # NumPy scalars of assorted dtypes inside a list
        return [draw(st.sampled_from(INT_DTYPES))(v % 120) for v in vals]
    if kind == "nested":
        return [vals[: max(1, n // 2)], vals[n // 2:]] if draw(st.booleans()) else [[v] for v in vals]
    if kind == "hostile_elem":
        i = draw(st.integers(0, n - 1))
        vals = list(vals)
        vals[i] = draw(st.sampled_from(HOSTILE_SCALARS))
        return vals
    if kind == "scalar":
        return draw(st.sampled_from(HOSTILE_SCALARS))
    if kind == "range":
        return range(1, n + 1)
    return []


@st.composite
def parallel_inputs(draw):
    if draw(st.integers(0, 19)) == 0:
        return draw(st.sampled_from([None, [], "dp=2", 3, {"dpp": 2}, {"dp": None}]))
    d = {}
    for key in ("dp", "tp", "pp", "cp", "ep", "vpp"):
        if draw(st.integers(0, 3)) == 0:
            d[key] = draw(st.one_of(st.integers(1, 4), st.integers(1, 4),
                                    st.sampled_from([np.int64(2), np.uint8(2), np.int32(1)]),
                                    st.sampled_from(HOSTILE_SCALARS)))
    if draw(st.integers(0, 3)) == 0:
        d["sequence_parallel"] = draw(st.sampled_from([True, False, np.bool_(True), True, False, "no", 1]))
    return d


def _check_plan_or_error(fn, n_samples=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plan = fn()
        except DynBatchConfigError as exc:
            msg = str(exc)
            assert "Fix:" in msg and "=" in msg.split(":")[0], msg
            event(f"error: {exc.field.split('[')[0]}")
            return None
    event("planned")
    if n_samples is not None:
        plan.validate(n_samples)
        over = set(plan.oversize_samples)
        for rank, toks in zip(plan.micro_batches, plan.microbatch_tokens):
            for mb, t in zip(rank, toks):
                assert t <= plan.cap or (len(mb) == 1 and mb[0] in over)
    return plan


@SETTINGS
@given(lengths=length_inputs(), parallel=parallel_inputs(),
       budget=mostly(st.one_of(st.integers(1, 10_000), _integers())),
       groups=st.sampled_from(["none", "ok", "hostile", "short", "numpy"]),
       hostile_group=st.sampled_from(HOSTILE_SCALARS),
       extra=st.fixed_dictionaries({}, optional={
           "num_microbatches": mostly(st.integers(-1, 6)),
           "samples_per_step": mostly(st.integers(-1, 8)),
           "fp8_alignment": st.sampled_from([None, "fp8", "mxfp8", "nvfp4", "fp9", 16, np.int64(16), 0, True, 2.0,
                                             10 ** 6]),
           "oversize": st.sampled_from(["error", "alone", "ALONE", None, 1]),
           "balance_by": st.sampled_from([None, "tokens", "flops", "time", "bogus", 3]),
           "balance_by_flops": st.sampled_from([True, False, np.bool_(False), "no", 0, None]),
           "refine_rounds": st.sampled_from([None, 0, 3, -1, 2.0, np.int32(2)]),
           # the drop-in knobs (integrations/): valid now and then, hostile now and then
           "equal_samples_per_rank": st.sampled_from([True, False, np.bool_(True), "yes", 1, None]),
           "min_num_microbatches": mostly(st.integers(-1, 9)),
           "num_microbatches_multiple": mostly(st.integers(-1, 5)),
           "sequence_pad_multiple": st.sampled_from([None, 1, 2, 8, 16, 0, -2, 2.0, 2 ** 21, np.int64(4), "8"]),
           "microbatch_pad_multiple": st.sampled_from([None, 1, 128, 256, 0, 2 ** 40, True, np.uint16(64)]),
           "microbatch_group_ids": st.sampled_from(["pairs", "hostile", "short", None, [None]]),
           "rollouts": st.sampled_from(["ok", "ok", "no_ids", "hostile_count", "both"]),
       }))
def test_plan_global_batch_hostile(lengths, parallel, budget, groups, hostile_group, extra):
    n = len(lengths) if isinstance(lengths, (list, tuple, range)) or \
        (isinstance(lengths, np.ndarray) and lengths.ndim == 1) else None
    kwargs = dict(parallel=parallel, max_tokens_per_gpu=budget, **extra)
    if "balance_by_flops" not in kwargs and "balance_by" not in kwargs:
        kwargs["balance_by_flops"] = False
    mb_kind = kwargs.pop("microbatch_group_ids", None)
    rollouts = kwargs.pop("rollouts", None)
    if n and mb_kind == "pairs":
        kwargs["microbatch_group_ids"] = [i // 2 for i in range(n)]
    elif n and mb_kind == "hostile":
        kwargs["microbatch_group_ids"] = [hostile_group] * n
    elif mb_kind == "short":
        kwargs["microbatch_group_ids"] = [0]
    elif mb_kind is not None:
        kwargs["microbatch_group_ids"] = mb_kind
    if n and rollouts == "ok":
        kwargs.update(rollout_ids=[i // 3 for i in range(n)], rollouts_per_step=1)
    elif rollouts == "no_ids":
        kwargs["rollouts_per_step"] = 2
    elif n and rollouts == "hostile_count":
        kwargs.update(rollout_ids=[i // 3 for i in range(n)], rollouts_per_step=hostile_group)
    elif n and rollouts == "both":
        kwargs.update(rollout_ids=list(range(n)), rollouts_per_step=1, samples_per_step=1)
    if n:
        if groups == "ok":
            kwargs["group_ids"] = [i // 2 for i in range(n)]
        elif groups == "numpy":
            kwargs["group_ids"] = np.arange(n) // 2
        elif groups == "hostile":
            kwargs["group_ids"] = [hostile_group] + [i for i in range(1, n)]
        elif groups == "short":
            kwargs["group_ids"] = list(range(max(0, n - 1)))
    _check_plan_or_error(lambda: plan_global_batch(lengths, **kwargs), n_samples=n)


@SETTINGS
@given(n=st.integers(1, 60), dp=st.integers(1, 6), budget=st.integers(1, 3000),
       dtype=st.sampled_from(INT_DTYPES), seed=st.integers(0, 2 ** 16),
       dp_kind=st.sampled_from([int, np.int64, np.int32, np.uint16]))
def test_valid_inputs_of_any_integer_dtype_plan_or_explain(n, dp, budget, dtype, seed, dp_kind):
    """Every integer dtype and NumPy-scalar layout is accepted like the plain-int equivalent."""
    rng = np.random.default_rng(seed)
    hi = min(int(np.iinfo(dtype).max), 2 * budget)
    lengths = rng.integers(0, max(1, hi), size=n).astype(dtype)
    a = _check_plan_or_error(lambda: plan_global_batch(lengths, parallel={"dp": dp_kind(dp)},
                                                       max_tokens_per_gpu=dtype(min(budget, hi)) if hi >= budget
                                                       else budget, balance_by_flops=False), n_samples=n)
    b = _check_plan_or_error(lambda: plan_global_batch([int(x) for x in lengths], parallel={"dp": dp},
                                                       max_tokens_per_gpu=int(min(budget, hi)) if hi >= budget
                                                       else budget, balance_by_flops=False), n_samples=n)
    assert (a is None) == (b is None)
    if a is not None:
        assert a.micro_batches == b.micro_batches


MODEL_FIELDS = ["num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                "num_query_groups", "kv_channels", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                "moe_layer_freq", "swiglu", "multi_latent_attention", "mtp_num_layers", "padded_vocab_size",
                "make_vocab_size_divisible_by", "name", "bogus_field"]


@SETTINGS
@given(field=st.sampled_from(MODEL_FIELDS), value=st.sampled_from(HOSTILE_SCALARS + [np.int64(8), 64, 3]))
def test_model_spec_hostile_field(field, value):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256)
    base[field] = value
    spec = _check_plan_or_error(lambda: ModelSpec.from_dict(base))
    if spec is not None:
        assert ModelSpec.from_dict(spec.to_dict()) == spec  # round trip stays exact (no NumPy scalars stored)
        for f in ("num_layers", "hidden_size", "num_attention_heads"):
            assert type(getattr(spec, f)) is int


RUN_FIELDS = ["max_tokens_per_gpu", "log_probs_max_tokens_per_gpu", "samples_per_step", "group_size", "balance_by",
              "oversize", "loss_mode", "fp8_alignment", "megatron_args", "name", "description", "model", "parallel",
              "dynamic_cp", "max_seq_len"]


@SETTINGS
@given(field=st.sampled_from(RUN_FIELDS), value=st.sampled_from(HOSTILE_SCALARS + [np.int64(8192), 16, "tokens"]))
def test_run_config_hostile_field(field, value):
    base = {"name": "t", "model": "tiny-gpt", "parallel": {"dp": 2}, "max_tokens_per_gpu": 4096}
    base[field] = value
    rc = _check_plan_or_error(lambda: RunConfig.from_dict(base))
    if rc is not None:
        import yaml

        yaml.safe_dump(rc.to_dict())  # only plain Python values inside
        rc.plan_options()


@SETTINGS
@given(layout=st.fixed_dictionaries({"dp": st.integers(1, 4), "cp": st.sampled_from([1, 2, 4]),
                                     "pp": st.sampled_from([1, 1, 2, 4, 3])}),
       dynamic_cp=st.sampled_from([True] * 16 + [False, np.bool_(True), "true", 1, None]),
       # at most one of these makes the run unusable for dynamic CP (in rare draws)
       conflict=st.sampled_from([{}] * 10 + [{"group_size": 2}, {"balance_by": "tokens"}, {"vpp": 2},
                                             {"megatron_args": ["--hybrid-context-parallel"]},
                                             {"megatron_args": ["--dynbatch-dynamic-cp"]}]),
       lengths=st.lists(st.integers(0, 9000), min_size=1, max_size=24))
def test_run_config_dynamic_cp_plans_or_explains(layout, dynamic_cp, conflict, lengths):
    """Any combination of dynamic_cp with layouts, groups, balancing and Megatron flags: a clear error naming the
    field at construction, or a run whose planner kwargs plan (a DynamicCPPlan exactly when it is on)."""
    conflict = dict(conflict)
    if "vpp" in conflict:
        layout = {**layout, "vpp": conflict.pop("vpp")}
    data = {"name": "t", "model": "qwen3-0.6b", "parallel": layout, "max_tokens_per_gpu": 4096,
            "dynamic_cp": dynamic_cp, **conflict}
    group_size = conflict.get("group_size")
    rc = _check_plan_or_error(lambda: RunConfig.from_dict(data))
    if rc is None:
        return
    assert type(rc.options.dynamic_cp) is bool
    assert ("--dynbatch-dynamic-cp" in rc.to_megatron_args()) == rc.options.dynamic_cp
    n = len(lengths) - len(lengths) % (group_size or 1)
    if n == 0:
        return
    opts = rc.plan_options()
    plan = _check_plan_or_error(lambda: plan_global_batch(lengths[:n], opts, group_ids=rc.group_ids(n)))
    if plan is not None:
        from megatron_dynbatch import DynamicCPPlan

        assert isinstance(plan, DynamicCPPlan) == rc.options.dynamic_cp
        plan.validate(n)


def test_cli_never_raises_on_hostile_flags(tmp_path, capsys):
    from megatron_dynbatch.cli import main

    good = tmp_path / "l.txt"
    good.write_text("\n".join(str(v) for v in [100, 200, 300, 400]))
    bad = tmp_path / "bad.txt"
    bad.write_text("10\n2.5\nabc\n")
    huge = tmp_path / "huge.txt"
    huge.write_text(f"{2 ** 70}\n5\n")
    cases = [
        ["plan", "--lengths", str(good), "--max-tokens-per-gpu", "0"],
        ["plan", "--lengths", str(good), "--max-tokens-per-gpu", str(2 ** 62), "--cp", "4"],
        ["plan", "--lengths", str(bad), "--max-tokens-per-gpu", "100"],
        ["plan", "--lengths", str(huge), "--max-tokens-per-gpu", "100"],
        ["plan", "--lengths", str(tmp_path / "missing.txt"), "--max-tokens-per-gpu", "100"],
        ["plan", "--lengths", str(good), "--max-tokens-per-gpu", "100", "--dp", "9"],
        ["plan", "--lengths", str(good), "--max-tokens-per-gpu", "100", "--num-microbatches", "3"],
        ["plan", "--lengths", str(good), "--max-tokens-per-gpu", "100", "--fp8", "fp9"],
        ["plan", "--lengths", str(good), "--max-tokens-per-gpu", "100", "--vpp", "2"],
        ["plan", "--lengths", str(good), "--max-tokens-per-gpu", "100", "--model", "no-such-model"],
        ["plan", "--lengths", str(good), "--max-tokens-per-gpu", "100", "--dynamic-cp"],
        ["plan", "--lengths", str(good), "--max-tokens-per-gpu", "10", "--dp", "2", "--dynamic-cp"],
        ["plan", "--lengths", str(huge), "--max-tokens-per-gpu", "100", "--dp", "2", "--dynamic-cp"],
        ["plan", "--lengths", str(good), "--max-tokens-per-gpu", "100", "--dp", "2", "--dynamic-cp",
         "--num-microbatches", "9"],
        ["plan", "--lengths", str(good), "--max-tokens-per-gpu", "100", "--dp", "2", "--dynamic-cp", "--group-ids",
         str(good)],
        ["plan", "--lengths", str(good), "--max-tokens-per-gpu", "100", "--dp", "2", "--dynamic-cp=yes"],
        ["plan", "--lengths", str(good), "--run", "qwen3-8b-grpo", "--dynamic-cp"],
        ["flops", "--model", "tiny-gpt", "--seqlen", "-5"],
        ["bench", "--workloads", "nope"],
        ["bench", "--seeds", "0"],
        ["nonsense"],
    ]
    for argv in cases:
        rc = main(argv)
        out = capsys.readouterr()
        assert rc == 2, (argv, rc, out.out[-300:])
        assert "error" in out.err, argv


@pytest.mark.parametrize("group_value", [None, [1], {"a": 1}, float("nan")])
def test_iterator_rejects_bad_group_ids(group_value):
    torch = pytest.importorskip("torch")
    from megatron_dynbatch import DynamicBatchIterator

    samples = [{"tokens": torch.arange(5)}, {"tokens": torch.arange(7)}]
    with pytest.raises(DynBatchConfigError, match=r"group_ids\[0\]"):
        DynamicBatchIterator(samples, dp_rank=0, group_ids=[group_value, 1], parallel={"dp": 1},
                             max_tokens_per_gpu=64, balance_by_flops=False)


@SETTINGS
@given(n_tokens=st.lists(st.integers(0, 70), min_size=1, max_size=12),
       budget=st.one_of(st.integers(-1, 200), st.sampled_from(HOSTILE_SCALARS)),
       dp_rank=st.sampled_from([0, 1, -1, np.int64(0), True, None, 5]))
def test_iterator_hostile_inputs(n_tokens, budget, dp_rank):
    torch = pytest.importorskip("torch")
    from megatron_dynbatch import DynamicBatchIterator

    samples = [{"tokens": torch.arange(max(n, 0))} for n in n_tokens]

    def build():
        it = DynamicBatchIterator(samples, dp_rank=dp_rank, parallel={"dp": 2}, max_tokens_per_gpu=budget,
                                  balance_by_flops=False)
        for _ in it:  # packing every micro-batch of this rank must work
            pass
        return it.plan

    _check_plan_or_error(build, n_samples=len(samples))


def test_plans_are_identical_across_processes():
    """Deterministic with no communication: two fresh interpreters (different hash seeds) plan the same."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, numpy as np; from megatron_dynbatch import plan_global_batch; "
            "rng = np.random.default_rng(7); lens = rng.integers(1, 3000, 500).tolist(); "
            "g = [str(i // 4) for i in range(500)]; "
            "p = plan_global_batch(lens, model='qwen3-8b', parallel={'dp': 8, 'pp': 2}, max_tokens_per_gpu=4096, "
            "group_ids=g); print(json.dumps(p.micro_batches))")
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        outs.append(json.loads(res.stdout))
    assert outs[0] == outs[1]
