"""Shared fixtures (kept minimal)."""

from __future__ import annotations

import os

import pytest

try:
    from hypothesis import settings
except ImportError:  # the planner-only checks run without the test extra
    settings = None

# Property tests draw their examples from a fixed seed by default, so that the test command (and CI) gives the same
# verdict on the same code; ``HYPOTHESIS_PROFILE=explore`` draws fresh random examples each run, for hunting (a
# failure found there goes into the test as an ``@example``, and so into every later run).
if settings is not None:
    settings.register_profile("default", derandomize=True, print_blob=True)
    settings.register_profile("explore", derandomize=False, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def megatron_world1():
    """megatron-core initialised in THIS process as a world of one gloo rank (CPU shims installed).

    Session-scoped: torch.distributed can be initialised once per process. Tests that need other layouts
    spawn ranks with ``megatron_dynbatch.megatron.ranks.run_ranks`` instead.
    """
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    from megatron_dynbatch.megatron import cpu as megatron_cpu
    from megatron_dynbatch.megatron.ranks import free_port

    if dist.is_initialized():  # someone else set it up; reuse it if it is a world of one
        if dist.get_world_size() != 1:
            pytest.skip("torch.distributed already initialised with world_size > 1 in this process")
        megatron_cpu.install_cpu_shims()
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel()
        yield
        return
    megatron_cpu.init_cpu_distributed(0, 1, port=free_port())
    yield
    megatron_cpu.destroy()


@pytest.fixture(scope="session")
def cuda_world1():
    """megatron-core's parallel_state as a world of one (NCCL) on a GPU, unless this process already has one
    (the GPU test files; skipped where CUDA is missing by their own marks)."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_dynbatch.megatron.ranks import free_port

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        pytest.skip("torch.distributed already initialised with world_size > 1")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield


@pytest.fixture
def memory_model_calls(monkeypatch):
    """Counts evaluations of the memory model (``core.memory.peak.stage_terms``, wherever it was imported): a
    deterministic measure of the work behind a budget, in place of a wall-clock bound (timings live in the
    benchmark, ``benchmarks/memory_speed.py``). The list holds one entry per call."""
    from megatron_dynbatch.core.memory import budget, guard, peak

    calls: list = []
    real = peak.stage_terms

    def counted(*args, **kwargs):
        calls.append(args[:2])
        return real(*args, **kwargs)

    for module in (peak, budget, guard):
        monkeypatch.setattr(module, "stage_terms", counted)
    return calls
