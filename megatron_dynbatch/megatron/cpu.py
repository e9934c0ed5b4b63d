"""Run real megatron-core (0.15-0.19) and Megatron-LM's ``pretrain()`` on CPU with gloo: the shims,
distributed init, and a tiny GPT.

This is the ONE place where the project patches megatron-core / torch for CPU runs. The planner and the data path
never import it; the tests, the demo, ``calibrate``'s megatron-core slice and the whole-model memory bench do, lazily
and only on a CPU device. :func:`install_cpu_shims` is idempotent and changes nothing on a machine where CUDA is
available (there the real code paths are used).

Shims (each was found by running a ``GPTModel`` with the local layer spec through
``get_forward_backward_func()`` and Megatron DDP on CPU with DP=2, TP=2 and PP=2):

1. ``torch.cuda.current_device`` -> ``torch.device("cpu")``. megatron-core allocates attention score
   buffers, RoPE frequencies, DDP grad buffers, TP all-gather outputs and pipeline p2p shape/recv buffers on
   ``torch.cuda.current_device()``; on a CPU build the real function raises.
2. ``torch.cuda.synchronize`` -> no-op. Pipeline p2p communication (and a few parallel_state helpers)
   synchronise the CUDA stream after sends/receives; gloo ops are already synchronous.
3. ``megatron.core.pipeline_parallel.schedules`` creates ``total_num_tokens`` with a literal
   ``device="cuda"``, and megatron-core 0.19's ``distributed/param_and_grad_buffer`` waits on
   ``torch.cuda.current_stream()`` in the grad sync. Those modules' ``torch`` name is replaced by a thin proxy
   whose tensor factories map a CUDA device to the CPU and whose ``torch.cuda`` has no-op streams
   (:class:`_CpuCuda`); every other attribute is the real ``torch``. No other module is affected.
4. ``get_default_causal_mask`` (``transformer/utils.py``, imported by name into ``fusions/fused_softmax``)
   builds the causal mask on ``"cuda"``; both names are rebound to a CPU version (cached per length).
5. The CUDA RNG tracker (``tensor_parallel.random.CudaRNGStatesTracker``) stores and swaps CUDA generator
   states in ``add``/``fork``. It is replaced by :class:`CpuRNGStatesTracker`, which keeps the same
   semantics (named, separately seeded streams; ``fork`` swaps them in and out) on the CPU default generator.
   Any tracker already created is reset so the next ``get_cuda_rng_tracker()`` builds the CPU one.
6. Without Transformer Engine, megatron-core 0.16.1's MoE router refers to an undefined ``te_general_gemm``
   (``transformer/moe/moe_utils.py``); it is defined as ``None``, which selects the plain-torch gating GEMM.
7. Without Transformer Engine, ``megatron.core.extensions.transformer_engine`` still exports MagicMock
   placeholders, so ``transformer/multi_latent_attention.py`` sets ``HAVE_TE = True`` and later calls
   ``isinstance(x, <MagicMock>)`` (a TypeError); ``HAVE_TE`` is set back to ``False`` there, restoring MLA's
   non-TE path. (The alltoall MoE dispatcher still creates a ``torch.cuda.Stream``: MoE on CPU uses the
   allgather dispatcher with fixed lengths.)

Megatron-LM's training loop needs a few more (8-11), in :func:`install_megatron_lm_cpu_shims`.

Not shimmed (use the settings instead): fused kernels (``masked_softmax_fusion``, ``bias_*_fusion``,
``gradient_accumulation_fusion``, ``apply_rope_fusion`` -- all off in :func:`tiny_gpt_config`), DDP
``overlap_grad_reduce`` (CUDA streams), the distributed optimizer and the Megatron optimizer's gradient
clipping (CUDA tensors). ``tiny_gpt_config`` sets ``variable_seq_lengths=True`` (micro-batches of different
lengths under PP) and therefore ``moe_token_dispatcher_type="alltoall"`` (the default ``allgather`` rejects it,
even for dense models). ``tiny_gpt_config`` also sets ``batch_p2p_comm=False`` (megatron-core's default is
True): with ``pp=2`` and VPP a rank's previous and next stage are the same peer, and gloo's
``batch_isend_irecv`` pairs the two same-peer transfers of a bidirectional exchange in posting order, which
crossed activations and gradients and gave WRONG gradients (no error, no hang) even at fixed shapes; plain
``isend``/``irecv`` pair correctly. Pass ``batch_p2p_comm=True`` explicitly to exercise the batched path
(safe on gloo without VPP). Interleaved PP (VPP) on gloo otherwise: with ``pp=2`` variable lengths are
mis-paired in the shape exchange (megatron-core 0.16.1, NVIDIA/Megatron-LM #5100), so the iterator pads
every micro-batch of a rank to one length there; with ``pp>=3`` ``variable_seq_lengths=True`` deadlocked in
the shape exchange in our runs; ``pp=4, vpp=2`` with one fixed length per step (``variable_seq_lengths=False``)
runs. The local ``DotProductAttention`` refuses ``packed_seq_params``; pass ``thd=True`` to
:func:`build_tiny_gpt` to use :class:`megatron_dynbatch.megatron.attention.ThdDotProductAttention` instead.

Sequence and context parallelism need no shim here (they are real layers, not patches), only ``thd=True``:

* ``sequence_parallel=True`` (TP > 1): megatron-core's torch norm (``WrappedTorchNorm``) refuses it, so
  :func:`build_tiny_gpt` then builds a whole block spec
  (:func:`megatron_dynbatch.megatron.specs.get_thd_local_block_spec`) whose layer and final norms are
  :class:`megatron_dynbatch.megatron.norms.SequenceParallelTorchNorm` (torch RMSNorm/LayerNorm with parameters
  marked ``sequence_parallel`` for ``finalize_model_grads``). The embedding scatter, the linear layers'
  all-gather / reduce-scatter and the output gather run on gloo unchanged (torch 2.13's gloo backend supports
  ``all_gather_into_tensor`` and ``reduce_scatter_tensor``).
* ``context_parallel_size > 1``: ``ThdDotProductAttention`` implements CP for THD (all-gather of K/V over the
  CP group); Megatron's THD RoPE is CP-aware already. Unpacked (sbhd) inputs under CP (Megatron-LM's own
  fixed batches) run through the same THD path, one sequence per row, causal masking only.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import os
import types
from typing import Any, Iterator, Optional

import torch

_INSTALLED = False


# --------------------------------------------------------------------------------------------------- shims
def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _noop_synchronize(device: Any = None) -> None:
    return None


def _is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # an int means a CUDA ordinal


class CpuTorchProxy(types.ModuleType):
    """Stands in for ``torch`` inside one megatron module: tensor factories given a CUDA device get the CPU.

    Random factories given a CUDA device draw from :data:`_CUDA_STANDIN_GENERATOR`, not from the CPU default
    generator: on a GPU such draws use the CUDA generator and leave the CPU one -- which
    ``--use-cpu-initialization`` initialises the weights from -- untouched. (Megatron-LM's start-up warms up its
    fused kernels with ``torch.rand(seq_length // cp, ..., device="cuda")``: drawn from the CPU generator, the
    initial weights would depend on the CP / TP layout.) ``pin_memory=True`` is dropped (no pinned memory
    without CUDA)."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like", "empty_like",
                  "rand", "randn", "randint", "randperm", "full_like")
    _RANDOM = ("rand", "randn", "randint", "randperm")

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("torch")
        self._real = real

    def __getattr__(self, name: str) -> Any:
        if name == "cuda":
            return _CpuCuda(self._real.cuda)
        value = getattr(self._real, name)
        if name in self._FACTORIES:
            @functools.wraps(value)
            def factory(*args: Any, **kwargs: Any) -> Any:
                if _is_cuda_device(kwargs.get("device")):
                    kwargs["device"] = "cpu"
                    if name in self._RANDOM and kwargs.get("generator") is None:
                        kwargs["generator"] = _CUDA_STANDIN_GENERATOR
                if kwargs.get("pin_memory"):
                    kwargs["pin_memory"] = False
                return value(*args, **kwargs)

            return factory
        return value


#: What random draws "on the CUDA device" use in a CPU-only process (:class:`CpuTorchProxy`).
_CUDA_STANDIN_GENERATOR = torch.Generator().manual_seed(0)


@functools.lru_cache(maxsize=64)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """Upper-triangular (future positions) boolean mask ``[sq, sq]`` on the CPU."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _make_cpu_tracker_class(base: type) -> type:
    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Megatron's named RNG streams, kept as CPU generator states.

        ``add(name, seed)`` records the CPU generator state after seeding with ``seed``; ``fork(name)`` swaps
        that state in, runs the block, saves the advanced state and restores the outer one -- the same
        contract as the CUDA tracker, so dropout inside TP regions stays rank-specific and reproducible.
        """

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            outer = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


CpuRNGStatesTracker: Optional[type] = None  # set by install_cpu_shims (needs megatron-core)


def install_cpu_shims() -> None:
    """Install the CPU shims listed in the module docstring. Idempotent; a no-op when CUDA is available."""
    global _INSTALLED, CpuRNGStatesTracker
    if _INSTALLED or torch.cuda.is_available():
        return

    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    torch.cuda.synchronize = _noop_synchronize  # type: ignore[assignment]

    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as tutils

    from megatron.core.distributed import param_and_grad_buffer

    for module in (schedules, param_and_grad_buffer):  # literal "cuda" tensors; 0.19+: CUDA streams in grad sync
        if not isinstance(module.torch, CpuTorchProxy):
            module.torch = CpuTorchProxy(torch)

    tutils.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask

    if CpuRNGStatesTracker is None:
        CpuRNGStatesTracker = _make_cpu_tracker_class(mrandom.CudaRNGStatesTracker)
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)

    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False
    _INSTALLED = True


#: megatron-core's optimizer modules and the grad-norm helper, which create tensors with a literal ``device="cuda"``
_OPTIMIZER_MODULES = ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads", "megatron.core.utils")


def install_cpu_optimizer_shims() -> None:
    """Megatron's non-distributed optimizer (``get_megatron_optimizer``) on a CPU: its modules see the CPU
    ``torch`` proxy of shim 3 (no megatron-lm needed, unlike :func:`install_megatron_lm_cpu_shims`; gradient
    clipping stays off, ``clip_grad=0``). Idempotent; a no-op where CUDA is available."""
    install_cpu_shims()
    if torch.cuda.is_available():
        return
    for name in _OPTIMIZER_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, CpuTorchProxy):
            module.torch = CpuTorchProxy(torch)


# ------------------------------------------------------------------------------------------ distributed
def init_cpu_distributed(
    rank: int,
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vpp: Optional[int] = None,
    port: Optional[int] = None,
    *,
    ep: int = 1,
    seed: int = 1234,
    timeout_s: float = 120.0,
    addr: str = "127.0.0.1",
) -> None:
    """Install the shims, start a gloo process group on ``addr``:``port`` (address default 127.0.0.1; pass
    ``os.environ["MASTER_ADDR"]`` under torchrun; port default: ``$MASTER_PORT``, as set by
    :func:`~megatron_dynbatch.megatron.ranks.run_ranks` or torchrun, else 29500) and initialise Megatron's
    ``parallel_state`` (order tp-cp-ep-dp-pp, DP = world / (tp*pp*cp)) and its RNG tracker. Undo with
    :func:`destroy`."""
    install_cpu_shims()
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if world_size % (tp * pp * cp) != 0:
        raise ValueError(f"world_size={world_size} is not divisible by tp*pp*cp={tp * pp * cp}")
    os.environ["MASTER_ADDR"] = str(addr)
    if port is None:
        port = int(os.environ.get("MASTER_PORT", "29500"))
    os.environ["MASTER_PORT"] = str(port)
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    """Tear down ``parallel_state``, the dynamic-CP groups and the default process group (safe to call twice)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..megatron.dynamic_cp import destroy_dynamic_cp_groups

    destroy_dynamic_cp_groups()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- tiny model
def tiny_gpt_config(**overrides: Any):
    """A small fp32 ``TransformerConfig`` that runs on CPU: 2 layers, hidden 64, 4 heads / 2 query groups,
    SwiGLU FFN 128, no dropout, deterministic, every CUDA-only fusion off, ``batch_p2p_comm=False`` (batched
    p2p on gloo gave wrong gradients with PP=2 + VPP; see the module docstring). Parallel sizes are read from
    ``parallel_state`` when it is initialised; ``overrides`` win over everything."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        deterministic_mode=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        variable_seq_lengths=True,
        batch_p2p_comm=False,  # gloo batch_isend_irecv crosses same-peer transfers (PP=2 + VPP): wrong grads
        moe_token_dispatcher_type="alltoall",  # allgather rejects variable_seq_lengths (even without MoE)
    )
    if parallel_state.model_parallel_is_initialized():
        kwargs.update(
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
            context_parallel_size=parallel_state.get_context_parallel_world_size(),
        )
        vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        if vpp is not None:
            kwargs["virtual_pipeline_model_parallel_size"] = vpp
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_tiny_gpt(
    config: Any,
    vocab_size: int = 128,
    max_seq_len: int = 256,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    thd: bool = False,
    *,
    vp_stage: Optional[int] = None,
):
    """A real ``megatron.core.models.gpt.GPTModel`` with the local (non-TE) layer spec and RoPE.

    ``pre_process``/``post_process`` default to this rank's first/last pipeline stage (virtual stage
    ``vp_stage`` under VPP). ``thd=True`` swaps in :class:`~megatron_dynbatch.megatron.attention.ThdDotProductAttention`
    so the model accepts THD ``packed_seq_params`` (and runs context parallelism); with
    ``config.sequence_parallel`` it also uses the sequence-parallel torch norms of
    :mod:`megatron_dynbatch.megatron.norms` (``thd=True`` is then required).
    """
    install_cpu_shims()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    normalization = getattr(config, "normalization", None)
    sequence_parallel = bool(getattr(config, "sequence_parallel", False))
    if sequence_parallel and not thd:
        raise ValueError("build_tiny_gpt(sequence_parallel config) needs thd=True (the sequence-parallel torch "
                         "norms come with the THD local spec)")
    if thd and sequence_parallel:  # a whole block spec: the final norm must support sequence parallelism too
        from megatron_dynbatch.megatron.specs import get_thd_local_block_spec

        spec = get_thd_local_block_spec(config, vp_stage=vp_stage, normalization=normalization)
    elif thd:
        from megatron_dynbatch.megatron.specs import get_thd_local_layer_spec

        spec = get_thd_local_layer_spec(normalization=normalization)
    else:
        spec = get_gpt_layer_local_spec(normalization=normalization)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_seq_len,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type="rope",
        vp_stage=vp_stage,
    )


def wrap_ddp(config: Any, modules: Any) -> Any:
    """Wrap a model (or a list of VPP model chunks) in Megatron's ``DistributedDataParallel`` the way every CPU
    test and the demo run it -- no overlapped grad reduce, no distributed optimizer (neither works on CPU) --
    and point ``config`` at the wrappers' ``no_sync`` and at ``finalize_model_grads``, which is where Megatron
    all-reduces gradients and applies ``calculate_per_token_loss`` scaling. Returns the wrapper(s)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    chunks = modules if isinstance(modules, (list, tuple)) else [modules]
    ddps = [DistributedDataParallel(config=config, module=m, disable_bucketing=v > 0,
                                    ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=False,
                                                                             use_distributed_optimizer=False))
            for v, m in enumerate(chunks)]
    config.no_sync_func = [d.no_sync for d in ddps] if len(ddps) > 1 else ddps[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddps if isinstance(modules, (list, tuple)) else ddps[0]


# ------------------------------------------------------------------------------------ Megatron-LM on CPU
class _CpuStream:
    """A CUDA stream stand-in: the CPU runs everything in program order."""

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        return event


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as seen by one Megatron-LM module in a CPU-only process: ONE device, the CPU. Streams
    are no-ops, memory counters read 0, RNG state is the CPU generator's; everything else is the real
    ``torch.cuda``."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("torch.cuda")
        self._real = real

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    current_device = staticmethod(_cpu_current_device)
    synchronize = staticmethod(_noop_synchronize)
    Stream = _CpuStream

    @staticmethod
    def current_stream(device: Any = None) -> _CpuStream:
        return _CpuStream()

    @staticmethod
    def set_stream(stream: Any) -> None:
        return None

    @staticmethod
    def stream(stream: Any) -> Any:
        return contextlib.nullcontext()

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_stats(device: Any = None) -> dict:
        return {}

    @staticmethod
    def _zero(device: Any = None) -> int:
        return 0

    memory_allocated = max_memory_allocated = memory_reserved = max_memory_reserved = _zero
    device_memory_used = _zero

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        return types.SimpleNamespace(name="cpu", major=0, minor=0, total_memory=0, multi_processor_count=1)

    @staticmethod
    def get_device_capability(device: Any = None) -> tuple:
        return (0, 0)

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def install_megatron_lm_cpu_shims() -> None:
    """The extra shims Megatron-LM's ``pretrain()`` loop (``megatron.training``) needs on a CPU-only machine,
    on top of :func:`install_cpu_shims`. Installed by ``scripts/pretrain_gpt_dynbatch.py`` only when CUDA is
    unavailable. Each was found by running that script under torchrun (gloo, DP=2, TP=2, PP=2, save/load):

    8. ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda=True``; ``pretrain()`` never passes it, so
       the name ``megatron.training.training.initialize_megatron`` is wrapped to pass it.
    9. ``megatron.legacy.fused_kernels.load`` looks for ``nvcc`` to build CUDA kernels: a no-op.
    10. The modules in :data:`_MEGATRON_LM_MODULES` (start-up, the loop, its batch helpers, checkpointing, the
        optimizer and grad-norm helpers, the rerun state machine, RoPE's CP slicing of unpacked batches) see a
        ``torch`` proxy whose tensor factories map ``device="cuda"`` to the CPU (random ones to a generator of
        their own, so that the kernel warm-up at start-up does not shift the CPU generator the weights are
        initialised from; no ``pin_memory``) and whose ``torch.cuda`` is :class:`_CpuCuda`: one device (the CPU;
        ``device_count() == 1`` so that ``parallel_state`` is initialised), no-op streams and ``set_device``,
        zero memory counters, a device without capabilities, CPU RNG state for checkpoints.
    11. ``torch.nn.Module.cuda`` / ``torch.Tensor.cuda`` return the object unchanged (``get_model`` moves the
        model with ``.cuda(current_device)``; the plain batch helper moves batches with ``.cuda()``).

    Not shimmed, set on the command line instead: ``--transformer-impl local``, the ``--no-*-fusion`` flags,
    ``--use-cpu-initialization``, ``--distributed-backend gloo``, ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (asserted for
    TP), ``--ckpt-format torch`` (the ``torch_dist`` save hung on gloo in our runs). The local attention
    refuses THD input: wrap Megatron-LM's ``gpt_builder`` in :func:`thd_gpt_builder`."""
    install_cpu_shims()
    import importlib

    for name in _MEGATRON_LM_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "torch") and not isinstance(module.torch, CpuTorchProxy):
            module.torch = CpuTorchProxy(torch)
    import megatron.training.initialize as minit
    import megatron.training.training as mtrain

    if not getattr(minit.initialize_megatron, "_dynbatch_cpu", False):
        orig = minit.initialize_megatron

        @functools.wraps(orig)
        def initialize_megatron(*a: Any, **k: Any) -> Any:
            k["allow_no_cuda"] = True
            return orig(*a, **k)

        initialize_megatron._dynbatch_cpu = True  # type: ignore[attr-defined]
        mtrain.initialize_megatron = initialize_megatron
    from megatron.legacy import fused_kernels

    fused_kernels.load = _no_fused_kernels
    torch.nn.Module.cuda = _module_stays_on_cpu  # type: ignore[method-assign]
    torch.Tensor.cuda = tensor_stays_on_cpu  # type: ignore[method-assign]


#: The layer (or block) spec :func:`thd_gpt_builder` hands to Megatron-LM's ``gpt_builder`` through ``--spec``.
THD_SPEC: Any = None


def thd_gpt_builder(builder: Any) -> Any:
    """Wrap Megatron-LM's ``gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, ...)`` so
    that it builds the LOCAL spec with :class:`~megatron_dynbatch.megatron.attention.ThdDotProductAttention`
    (megatron-core's local attention refuses packed THD input; on GPU the Transformer Engine spec takes it).
    The spec reaches ``gpt_builder`` through its own ``--spec MODULE NAME`` path (``args.spec`` is pointed at
    :data:`THD_SPEC` for the call and restored after), so every other model argument is Megatron-LM's."""

    @functools.wraps(builder)
    def build(args: Any, pre_process: bool, post_process: bool, vp_stage: Optional[int] = None, config: Any = None,
              **kwargs: Any) -> Any:
        global THD_SPEC
        from megatron.training.arguments import core_transformer_config_from_args

        from megatron_dynbatch.megatron.specs import get_thd_local_block_spec, get_thd_local_layer_spec

        if config is None:
            config = core_transformer_config_from_args(args)
        if getattr(config, "sequence_parallel", False):
            THD_SPEC = get_thd_local_block_spec(config, vp_stage=vp_stage)
        else:
            THD_SPEC = get_thd_local_layer_spec(normalization=getattr(config, "normalization", None))
        saved = getattr(args, "spec", None)
        args.spec = [__name__, "THD_SPEC"]
        try:
            return builder(args, pre_process, post_process, vp_stage=vp_stage, config=config, **kwargs)
        finally:
            args.spec = saved

    return build


def _no_fused_kernels(args: Any) -> None:
    return None


def _module_stays_on_cpu(self: Any, device: Any = None) -> Any:
    return self


def tensor_stays_on_cpu(self: Any, device: Any = None, non_blocking: bool = False, **k: Any) -> Any:
    return self


_MEGATRON_LM_MODULES = (
    "megatron.training.initialize",
    "megatron.training.training",
    "megatron.training.utils",
    "megatron.training.checkpointing",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",
    "megatron.core.models.common.embeddings.rope_utils",
)
