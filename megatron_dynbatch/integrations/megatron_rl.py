"""Drop-in for Megatron RL's trajectory packing (``megatron/rl/sequence_packing_utils.py``,
``--rl-use-sequence-packing``): this planner's bins instead of upstream's next-fit bins, same outputs.

Switch it on with one call before ``pretrain()`` in ``train_rl.py``, or with one flag::

    from megatron_dynbatch.integrations.megatron_rl import add_rl_packing_args, install
    install(replace_upstream=True)          # every --rl-sequence-packing-algo now packs with this planner
    # or: extra_args_provider=lambda p: add_rl_packing_args(add_inference_args(p))
    #     and --rl-sequence-packing-algo dynbatch

:func:`install` wraps ``pack_all_trajectories`` (in ``sequence_packing_utils`` and where ``rl_utils`` imported
it). When selected, upstream's OWN ``pack_all_trajectories`` runs -- gathering, ``bin_advantages``,
``PackedSeqParams`` per bin (upstream's ``create_packed_seq_params_for_bin``), ``PackingContext``, logging --
with two names swapped for the call: ``SequencePacker`` is :class:`DynBatchSequencePacker` (same constructor,
same ``pack_sequences`` results: ``[num_bins, bin_size]`` tokens / position ids / loss mask and a
``PackingInfo``), and ``distribute_packed_bins`` deals our rank-major bins with upstream's own ``fifo`` code,
which hands every rank exactly its planned ``M`` bins (``dp * M`` bins in all, so no empty filler bin). The
planning half is :func:`megatron_dynbatch.core.dropin.megatron_rl.plan_rl_bins`.

What the user sees change: fewer bins per rank, none empty (upstream's round-robin / fifo dealing appends
all-pad bins that still run), ranks balanced by modelled time, every bin within ``--seq-length`` and
``--rl-sequence-packing-max-sequences-per-bin``; the packing log names the algorithm ``dynbatch``. Bins stay
``--seq-length`` wide: that is Megatron RL's tensor format (logprob buffers, CUDA graphs), so padding inside a
bin remains. Losses: Megatron RL's GRPO loss is per sequence and token, independent of which bin a sequence is
in.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

from ..core.dropin.megatron_rl import RlBinPlan, bin_seq_starts, plan_rl_bins
from ..core.errors import DynBatchConfigError

__all__ = ["ALGO_NAME", "DynBatchSequencePacker", "actual_lengths", "add_rl_packing_args", "install"]

#: The ``--rl-sequence-packing-algo`` value that selects this planner.
ALGO_NAME = "dynbatch"
_FLAG = "--rl-sequence-packing-algo"
_UPSTREAM = "megatron.rl.sequence_packing_utils"
_INSTALLED: Dict[str, Any] = {}


@dataclass
class _StandInPackingInfo:
    """Megatron RL's ``PackingInfo`` fields, used only where ``megatron.rl`` is absent (tests)."""

    bin_seq_indices: List[List[int]]
    seq_starts: Dict[int, List[int]]
    seq_lengths: List[int]
    seq_to_bin_idx: List[Optional[int]]
    packing_algo: str


def _packing_info_class() -> Any:
    module = sys.modules.get(_UPSTREAM)
    return getattr(module, "PackingInfo", _StandInPackingInfo) if module is not None else _StandInPackingInfo


def actual_lengths(trajs: Any, pad_token: int) -> List[int]:
    """Real length of every row of ``trajs`` ``[n, seq_length]``: one past its last non-pad token (0 for an
    all-pad row) -- Megatron RL's definition."""
    import torch

    if trajs.dim() != 2:
        raise DynBatchConfigError("trajs", f"shape {tuple(trajs.shape)}", "must be [num_sequences, seq_length]",
                                  "pass the gathered trajectories")
    real = trajs != pad_token
    idx = torch.arange(1, trajs.shape[1] + 1, device=trajs.device).expand_as(real)
    return (idx * real).max(dim=1).values.tolist() if trajs.shape[1] else [0] * trajs.shape[0]


class DynBatchSequencePacker:
    """Megatron RL's ``SequencePacker`` interface on this planner (see the module docstring).

    Keyword-only extras (read from Megatron's ``parallel_state`` / ``get_args()`` when not given): ``dp``,
    ``parallel`` (``cp``, ``pp``, ``vpp``: the VPP rule and the cost model), ``model``, ``cost_model``."""

    def __init__(self, bin_size: int, pad_token: int, max_sequences_per_bin: int = 16, seq_length_multiple: int = 1,
                 *, dp: Optional[int] = None, parallel: Any = None, model: Any = None, cost_model: Any = None) -> None:
        self.bin_size = bin_size
        self.pad_token = pad_token
        self.max_sequences_per_bin = max_sequences_per_bin
        self.seq_length_multiple = seq_length_multiple
        self.dp, self.parallel, self.model, self.cost_model = dp, parallel, model, cost_model
        self.last_plan: Optional[RlBinPlan] = None

    def plan(self, seq_lengths: List[int]) -> RlBinPlan:
        dp, parallel, model = self.dp, self.parallel, self.model
        if dp is None or parallel is None:
            from megatron.core import parallel_state as ps

            dp = dp if dp is not None else ps.get_data_parallel_world_size()
            if parallel is None:
                vpp = ps.get_virtual_pipeline_model_parallel_world_size()
                parallel = {"cp": ps.get_context_parallel_world_size(),
                            "pp": ps.get_pipeline_model_parallel_world_size(), "vpp": vpp or 1}
        if model is None:
            model = _model_from_megatron_args()
        self.last_plan = plan_rl_bins(seq_lengths, bin_size=self.bin_size, dp=dp,
                                      seq_length_multiple=self.seq_length_multiple,
                                      max_sequences_per_bin=self.max_sequences_per_bin, parallel=parallel,
                                      model=model, cost_model=self.cost_model)
        return self.last_plan

    def pack_sequences(self, trajs: Any, generation_masks: Any = None) -> Any:
        """``(packed_sequences, position_ids, loss_mask, packing_info)`` as upstream's packer returns them:
        ``[num_bins, bin_size]`` tensors (pad token, 0, 0 outside sequences; the loss mask is 1 on real tokens
        times the generation mask) and a ``PackingInfo`` whose bins are rank-major."""
        import torch

        lengths = actual_lengths(trajs, self.pad_token)
        bins = self.plan(lengths).bins
        mult = self.seq_length_multiple
        tokens = torch.full((len(bins), self.bin_size), self.pad_token, dtype=trajs.dtype, device=trajs.device)
        positions = torch.zeros((len(bins), self.bin_size), dtype=torch.long, device=trajs.device)
        loss_mask = torch.zeros((len(bins), self.bin_size), dtype=torch.float, device=trajs.device)
        starts: Dict[int, List[int]] = {}
        where: List[Optional[int]] = [None] * len(lengths)
        for b, members in enumerate(bins):
            starts[b] = bin_seq_starts(lengths, members, mult)
            for i, start in zip(members, starts[b][:-1], strict=True):  # [-1]: the padded end
                n = lengths[i]
                tokens[b, start:start + n] = trajs[i, :n]
                positions[b, start:start + n] = torch.arange(n, device=trajs.device)
                loss_mask[b, start:start + n] = 1.0 if generation_masks is None else generation_masks[i, :n].float()
                where[i] = b
        info = _packing_info_class()(bin_seq_indices=bins, seq_starts=starts, seq_lengths=lengths,
                                     seq_to_bin_idx=where, packing_algo=ALGO_NAME)
        return tokens, positions, loss_mask, info


def _model_from_megatron_args() -> Any:
    try:
        from megatron.training import get_args

        args = get_args()
    except Exception:  # noqa: BLE001 - no Megatron-LM args: balance tokens
        return None
    if not getattr(args, "padded_vocab_size", None):
        return None
    from ..core.model_spec import ModelSpec

    return ModelSpec.from_megatron(args)


def _rank_major_distribution(original: Callable[..., Any]) -> Callable[..., Any]:
    """Upstream's ``distribute_packed_bins`` for our bins: its ``fifo`` dealing of ``dp * M`` rank-major bins
    gives rank ``r`` bins ``r*M .. r*M+M-1`` -- exactly the plan -- and appends no filler bin."""

    def distribute_packed_bins(packed_trajs: Any, packed_position_ids: Any, packed_loss_mask: Any,
                               packing_info: Any) -> Any:
        if getattr(packing_info, "packing_algo", None) != ALGO_NAME:
            return original(packed_trajs, packed_position_ids, packed_loss_mask, packing_info)
        packing_info.packing_algo = "fifo"
        try:
            out = original(packed_trajs, packed_position_ids, packed_loss_mask, packing_info)
        finally:
            packing_info.packing_algo = ALGO_NAME
        out[3].packing_algo = ALGO_NAME
        return out

    return distribute_packed_bins


@contextlib.contextmanager
def _swapped(module: Any, **names: Any) -> Iterator[None]:
    saved = {k: getattr(module, k) for k in names}
    for k, v in names.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def install(*, replace_upstream: bool = False, **packer_options: Any) -> Callable[[], None]:
    """Route Megatron RL's ``pack_all_trajectories`` through this planner when ``--rl-sequence-packing-algo``
    is ``dynbatch`` (or always, with ``replace_upstream=True``). ``packer_options`` (``model``, ``cost_model``,
    ``parallel``, ``dp``) go to :class:`DynBatchSequencePacker`. Idempotent; returns a function that restores
    upstream's. Needs Megatron-LM's ``megatron.rl`` importable."""
    import importlib

    spu = importlib.import_module(_UPSTREAM)
    _INSTALLED["replace"] = bool(replace_upstream)
    _INSTALLED["options"] = dict(packer_options)
    if "original" in _INSTALLED:
        return _INSTALLED["restore"]
    original_pack, original_distribute = spu.pack_all_trajectories, spu.distribute_packed_bins
    distribute = _rank_major_distribution(original_distribute)

    def packer(*args: Any, **kwargs: Any) -> DynBatchSequencePacker:
        return DynBatchSequencePacker(*args, **{**_INSTALLED["options"], **kwargs})

    def pack_all_trajectories(trajs: Any, generation_masks: Any, inference_logprobs: Any, global_advantages: Any,
                              bin_size: int, max_sequences_per_bin: int, packing_algo: str) -> Any:
        if packing_algo != ALGO_NAME and not _INSTALLED["replace"]:
            return original_pack(trajs, generation_masks, inference_logprobs, global_advantages, bin_size,
                                 max_sequences_per_bin, packing_algo)
        with _swapped(spu, SequencePacker=packer, distribute_packed_bins=distribute):
            return original_pack(trajs, generation_masks, inference_logprobs, global_advantages, bin_size,
                                 max_sequences_per_bin, ALGO_NAME)

    pack_all_trajectories.__wrapped__ = original_pack  # type: ignore[attr-defined]
    users = [spu] + [m for m in (sys.modules.get("megatron.rl.rl_utils"),) if m is not None]
    for m in users:
        m.pack_all_trajectories = pack_all_trajectories

    def restore() -> None:
        for m in users:
            m.pack_all_trajectories = original_pack
        _INSTALLED.clear()

    _INSTALLED.update(original=original_pack, restore=restore)
    return restore


def add_rl_packing_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: lets ``--rl-sequence-packing-algo`` accept ``dynbatch`` and installs
    the drop-in (when ``megatron.rl`` imports). Chain with another provider:
    ``lambda p: add_rl_packing_args(add_inference_args(p))``."""
    from .megatron_packing import extend_scheduler_flag

    if extend_scheduler_flag(parser, ALGO_NAME, flag=_FLAG):
        install(replace_upstream=_INSTALLED.get("replace", False))
    return parser
