"""The timing core (megatron_dynbatch.measure) on CPU: real megatron-core and plain-torch slices built and timed,
CP member shares emulated, records deduplicated; hostile inputs refused with DynBatchConfigError. No timing
assertions (CPU timings on a shared machine mean nothing) -- only that real work ran and was timed."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from megatron_dynbatch.core.errors import DynBatchConfigError  # noqa: E402
from megatron_dynbatch.measure import (EmulatedCPGroup, SliceLayout, SliceWidths, build_slice,  # noqa: E402
                                       record_key, share_geometry, time_call)
from megatron_dynbatch.measure.share import emulated_gather  # noqa: E402

CPU = dict(num_layers=1, dtype="fp32", device="cpu")


# ------------------------------------------------------------------------------------------ hostile input
@pytest.mark.parametrize("kwargs,field", [
    ({"num_layers": 0}, "layout.num_layers"), ({"num_layers": "2"}, "layout.num_layers"),
    ({"tp": 0}, "layout.tp"), ({"tp": 1.5}, "layout.tp"), ({"vocab_size": -1}, "layout.vocab_size"),
    ({"seed": -3}, "layout.seed"), ({"dtype": "fp8"}, "layout.dtype"), ({"kind": "jax"}, "layout.kind"),
    ({"device": "gpu"}, "layout.device"), ({"device": "cuda:x"}, "layout.device"), ({"device": None}, "layout.device"),
])
def test_layout_refuses_bad_fields(kwargs, field):
    with pytest.raises(DynBatchConfigError, match=field.replace(".", r"\.")):
        SliceLayout(**kwargs)


@pytest.mark.parametrize("model,layout,field", [
    ("qwen3-30b-a3b", {}, "model.num_experts"),
    ("deepseek-v3", {}, "model.num_experts"),
    ("tiny-gpt", {"tp": 3}, "layout.tp"),
    ({"num_layers": 2, "hidden_size": 96, "num_attention_heads": 6, "num_query_groups": 3, "ffn_hidden_size": 192,
      "vocab_size": 128}, {"tp": 2}, "layout.tp"),  # 3 query groups over tp=2
])
def test_widths_refuse_models_the_slices_cannot_build(model, layout, field):
    with pytest.raises(DynBatchConfigError, match=field.replace(".", r"\.")):
        SliceWidths.of(model, SliceLayout(**layout))


def test_widths_split_per_tp_rank():
    w = SliceWidths.of("llama-3.1-8b", SliceLayout(tp=2, vocab_size=64128))
    assert (w.hidden_size, w.heads, w.groups, w.kv, w.ffn, w.swiglu, w.vocab) == (4096, 16, 4, 128, 7168, True, 64128)
    w = SliceWidths.of("llama-3.1-8b", SliceLayout(tp=16))  # fewer query groups than TP ranks: one per rank
    assert (w.heads, w.groups, w.ffn) == (2, 1, 896)


def test_build_slice_refuses_bad_layouts():
    with pytest.raises(DynBatchConfigError, match="layout_kwargs"):
        build_slice("tiny-gpt", SliceLayout(**CPU), tp=2)
    with pytest.raises(DynBatchConfigError, match="layout"):
        build_slice("tiny-gpt", {"num_layers": 1})
    if not torch.cuda.is_available():
        with pytest.raises(DynBatchConfigError, match="CUDA is not available"):
            build_slice("tiny-gpt", SliceLayout(num_layers=1, device="cuda", kind="torch"))


@pytest.mark.parametrize("group_size,lengths,member,field", [
    (0, [4], 0, "group_size"), (2.0, [4], 0, "group_size"), (1, [], 0, "lengths"), (1, [-1], 0, "lengths"),
    (1, [1.5], 0, "lengths"), (1, "abc", 0, "lengths"), (1, None, 0, "lengths"), (2, [4], 2, "member"),
    (2, [4], -1, "member"),
])
def test_share_refuses_bad_requests(group_size, lengths, member, field):
    with pytest.raises(DynBatchConfigError, match=field):
        share_geometry(group_size, lengths, member)


@pytest.mark.parametrize("warmup,repeats,field", [(-1, 1, "warmup"), (0, 0, "repeats"), (0, "3", "repeats")])
def test_time_call_refuses_bad_counts(warmup, repeats, field):
    with pytest.raises(DynBatchConfigError, match=field):
        time_call(lambda: None, torch.device("cpu"), warmup=warmup, repeats=repeats)


# ------------------------------------------------------------------------------------------ pieces
def test_share_geometry_is_the_zig_zag_share():
    geo = share_geometry(2, [13, 3], 1)  # slots 16 and 4 (multiples of 2g=4); member 1: chunks 1 and 2
    assert geo.cu_seqlens == [0, 13, 16] and geo.cu_seqlens_padded == [0, 16, 20] and geo.max_seqlen == 16
    assert geo.rows.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 17, 18]
    assert geo.positions.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 1, 2]
    assert geo.local_tokens == 10 and geo.group.size() == 2 and geo.group.rank() == 1


def test_emulated_gather_places_this_members_rows_and_keeps_gradients():
    x = torch.randn(3, 2, requires_grad=True)
    out = emulated_gather(x, EmulatedCPGroup(4, 2))
    assert out.shape == (12, 2) and torch.equal(out[6:9], x) and (out[:6] == 0).all() and (out[9:] == 0).all()
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones(3, 2))
    assert emulated_gather(x, EmulatedCPGroup(1, 0)) is x


def test_time_call_runs_warmup_then_repeats():
    calls = []
    times = time_call(lambda: calls.append(1), torch.device("cpu"), warmup=2, repeats=3)
    assert len(calls) == 5 and len(times) == 3 and all(t >= 0 for t in times)


def test_record_key_normalises_order():
    assert record_key(2, [3, 9, 1]) == (2, (9, 3, 1))


# ------------------------------------------------------------------------------------------ real slices
@pytest.fixture(scope="module", params=["torch", "mcore"])
def tiny_slice(request):
    if request.param == "mcore":
        pytest.importorskip("megatron.core")
    return build_slice("tiny-gpt", SliceLayout(kind=request.param, **CPU))


def _finite_positive(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_microbatch_and_cp_shares_are_timed(tiny_slice):
    assert _finite_positive(tiny_slice.time_microbatch([40, 17, 3], warmup=0, repeats=1))
    for g in (2, 4):
        for member in range(g):
            assert _finite_positive(tiny_slice.time_share(g, [40, 17, 0], member, warmup=0, repeats=1))
    assert _finite_positive(tiny_slice.time_microbatch([0], group_size=2, warmup=0, repeats=1))  # padding only


def test_a_share_runs_a_real_backward(tiny_slice):
    params = [p for p in tiny_slice.impl.model.parameters()] if tiny_slice.layout.kind == "mcore" \
        else list(tiny_slice.impl.parameters())
    for p in params:
        p.grad = None
    tiny_slice.prepare(2, [30, 9], 1)()
    grads = [p.grad for p in params if p.requires_grad]
    assert grads and all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0


def test_records_are_deduplicated_and_cached(tiny_slice):
    seen = []
    cache = {}
    items = [(1, [5, 30]), (2, [64]), (1, [30, 5]), (2, [64])]
    recs = tiny_slice.time_records(items, warmup=0, repeats=1, cache=cache, progress=lambda i, n, k: seen.append(k))
    assert [r[:2] for r in recs] == [[1, [30, 5]], [2, [64]]] and all(_finite_positive(r[2]) for r in recs)
    assert len(seen) == 2
    again = tiny_slice.time_records(items[:1], cache=cache, progress=lambda i, n, k: seen.append(k))
    assert again == recs[:1] and len(seen) == 2  # served from the cache


def test_environment_names_what_was_measured(tiny_slice):
    env = tiny_slice.environment()
    assert env["device"].startswith("CPU") and env["torch"] == torch.__version__
    assert env["widths_per_tp_rank"]["heads"] == 4 and env["layout"]["kind"] == tiny_slice.layout.kind
    if tiny_slice.layout.kind == "torch":
        assert env["kernel"].startswith("reference_varlen_attn") and env["megatron_core"] is None
    else:
        assert env["kernel"] == "ThdDotProductAttention per-sequence torch loop" and env["megatron_core"]


@pytest.mark.parametrize("kind", ["torch", "mcore"])
def test_slice_with_embedding_and_lm_head(kind):
    if kind == "mcore":
        pytest.importorskip("megatron.core")
    sl = build_slice("tiny-gpt", SliceLayout(kind=kind, vocab_size=64, **CPU))
    assert _finite_positive(sl.time_microbatch([20, 7], group_size=2, warmup=0, repeats=1))


def test_mcore_slice_uses_the_emulated_cp_attention(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron_dynbatch.megatron.attention import ThdDotProductAttention

    sl = build_slice("tiny-gpt", SliceLayout(kind="mcore", **CPU))
    cores = [m for m in sl.impl.model.modules() if isinstance(m, ThdDotProductAttention)]
    assert cores and all(type(m).__name__ == "EmulatedCPAttention" for m in cores)
    groups = []
    real = type(cores[0])._cp_gather

    def spy(self, kv, group):
        groups.append(group)
        return real(self, kv, group)

    monkeypatch.setattr(type(cores[0]), "_cp_gather", spy)
    sl.prepare(4, [33, 8], 3)()
    assert len(groups) == 1 and isinstance(groups[0], EmulatedCPGroup) and groups[0].rank() == 3


def test_world_of_one_refuses_a_split_parallel_state(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state as ps

    from megatron_dynbatch.measure.mcore_slice import ensure_world_of_one

    ensure_world_of_one(torch.device("cpu"), 1)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 2)
    with pytest.raises(DynBatchConfigError, match="parallel_state"):
        ensure_world_of_one(torch.device("cpu"), 1)
