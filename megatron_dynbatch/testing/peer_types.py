"""Stand-ins for the RL trainers' data types, for tests and the CPU examples of the drop-ins (verl, slime, ROLL and
NeMo-RL are not installable here). Written from their public interfaces -- only what the drop-ins touch:

* :class:`DataProto`: ``batch`` (a mapping of tensors with a leading batch dimension, standing in for a
  ``TensorDict``), ``non_tensor_batch`` (NumPy object arrays), ``meta_info``; ``from_dict``,
  ``from_single_dict``, ``slice`` (sharing ``meta_info``), ``reorder`` (in place), ``len`` -- verl's and
  ROLL's DataProto agree on these -- and ``concat`` as ROLL's (read Aug 2026: its ``meta_info`` merge);
* :func:`grpo_batch`: a right-padded ``[b, s]`` batch (``input_ids``, ``attention_mask``) with a ``uid`` per
  prompt group, like the rollouts both trainers hand to their batching;
* :func:`slime_args`: a namespace with the fields slime's ``build_dp_schedule`` reads;
* :class:`NemoRLSequencePacker`: NeMo-RL's abstract ``SequencePacker`` (``nemo_rl/data/packing/algorithms.py``),
  the base class its ``get_packer`` returns instances of and its tests check with ``isinstance``;
* the trainers' configs as their start-up memory checks read them (the keys the drop-ins read, with the
  trainers' defaults, read Aug 2026): :func:`verl_config` (verl's PPO Megatron trainer config, an OmegaConf
  ``DictConfig`` there: keys and attributes -- :class:`AttrDict`), :func:`roll_worker_config` (a ROLL
  ``WorkerConfig``: attributes, its ``strategy_config`` a dict), :func:`nemo_rl_config` (NeMo-RL's master config,
  plain dicts as NeMo-RL passes them); ``overrides`` by dotted path.
"""

from __future__ import annotations

import abc
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Set

import numpy as np


class DataProto:
    """A minimal verl/ROLL ``DataProto``."""

    def __init__(self, batch: Optional[Dict[str, Any]] = None, non_tensor_batch: Optional[Dict[str, Any]] = None,
                 meta_info: Optional[Dict[str, Any]] = None) -> None:
        self.batch = dict(batch or {})
        self.non_tensor_batch = dict(non_tensor_batch or {})
        self.meta_info = dict(meta_info or {})

    @classmethod
    def from_dict(cls, tensors: Dict[str, Any], non_tensors: Optional[Dict[str, Any]] = None,
                  meta_info: Optional[Dict[str, Any]] = None) -> "DataProto":
        return cls(tensors, {k: np.asarray(v, dtype=object) for k, v in (non_tensors or {}).items()}, meta_info)

    @classmethod
    def from_single_dict(cls, data: Dict[str, Any], meta_info: Optional[Dict[str, Any]] = None) -> "DataProto":
        import torch

        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, others, meta_info)

    def __len__(self) -> int:
        for v in self.batch.values():
            return int(v.shape[0])
        for v in self.non_tensor_batch.values():
            return len(v)
        return 0

    def slice(self, start: Optional[int] = None, end: Optional[int] = None) -> "DataProto":
        """Rows ``start:end``; like verl's and ROLL's, the slice SHARES ``meta_info`` with this batch (a write
        into the slice's ``meta_info`` is a write into the caller's)."""
        sl = slice(start, end)
        out = type(self)({k: v[sl] for k, v in self.batch.items()},
                         {k: v[sl] for k, v in self.non_tensor_batch.items()})
        out.meta_info = self.meta_info
        return out

    @staticmethod
    def concat(data: List["DataProto"], *, global_keys: Optional[Set[str]] = None) -> "DataProto":
        """ROLL's ``DataProto.concat`` as its callers see it: one part comes back as it is (the same object, so
        the same ``meta_info``); several are joined end to end (non-tensor fields as object arrays) under a NEW
        ``meta_info``: the first part's keys, and each key of ``global_keys`` (default ``{"metrics"}``) that a
        part holds gathered over the parts -- a dict per sub-key (scalars into a list of the parts' values,
        lists and arrays end to end, as lists), any other value as the list of the parts' values."""
        import torch

        if len(data) == 1:
            return data[0]
        meta = dict(data[0].meta_info)
        for key in {"metrics"} if global_keys is None else global_keys:
            values = [d.meta_info.get(key) for d in data]
            present = [v for v in values if v is not None]
            if not present:
                continue
            if isinstance(present[0], dict):
                gathered: Dict[str, Any] = {}
                for v in present:
                    for sub, x in v.items():
                        gathered.setdefault(sub, []).append(x)
                for sub, xs in gathered.items():
                    try:
                        gathered[sub] = (np.array(xs) if np.isscalar(xs[0]) else np.concatenate(xs, axis=0)).tolist()
                    except (ValueError, TypeError):
                        pass  # kept as the list of the parts' values
                meta[key] = gathered
            else:
                meta[key] = values
        keys = data[0].batch.keys()
        tensors = {k: torch.cat([d.batch[k] for d in data]) for k in keys}
        non_tensors = {}
        for k in data[0].non_tensor_batch:
            joined = [x for d in data for x in d.non_tensor_batch[k]]
            non_tensors[k] = np.empty(len(joined), dtype=object)
            non_tensors[k][:] = joined
        return DataProto(tensors, non_tensors, meta)

    def reorder(self, indices: Any) -> None:
        idx = np.asarray(indices.tolist() if hasattr(indices, "tolist") else indices, dtype=np.int64)
        import torch

        t = torch.as_tensor(idx)
        self.batch = {k: v[t] for k, v in self.batch.items()}
        self.non_tensor_batch = {k: v[idx] for k, v in self.non_tensor_batch.items()}


def grpo_batch(lengths: Sequence[int], group_size: int = 1, width: Optional[int] = None, vocab: int = 1000,
               seed: int = 0) -> DataProto:
    """A right-padded batch of token ids (``input_ids``, ``attention_mask``, ``position_ids``) with one ``uid`` per
    group of ``group_size`` consecutive samples and each sample's own index in ``sample_id``."""
    import torch

    lens = [int(x) for x in lengths]
    width = int(width if width is not None else max(lens + [1]))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lens), width), generator=g)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    ids = ids * mask
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(width).expand(len(lens), width)},
        {"uid": [f"prompt-{i // group_size}" for i in range(len(lens))], "sample_id": list(range(len(lens)))})


def slime_args(**overrides: Any) -> SimpleNamespace:
    """slime's args for ``build_dp_schedule`` (dynamic batch size on; a small Megatron model)."""
    base = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=4096, micro_batch_size=1, balance_data=True,
                balance_by_flops=False, data_pad_size_multiplier=128, tensor_model_parallel_size=1,
                pipeline_model_parallel_size=1, sequence_parallel=False, num_layers=2, hidden_size=64,
                num_attention_heads=4, ffn_hidden_size=128, kv_channels=16, vocab_size=256, num_query_groups=4,
                group_query_attention=False, swiglu=True, num_experts=None, rollout_max_prompt_len=None,
                rollout_max_response_len=None, seq_length=None)
    base.update(overrides)
    return SimpleNamespace(**base)


class NemoRLSequencePacker(abc.ABC):
    """NeMo-RL's abstract ``SequencePacker`` as its callers see it: built with ``(bin_capacity, collect_metrics,
    min_bin_count, bin_count_multiple)``, ``pack`` runs the abstract ``_pack_implementation`` (every concrete
    packer defines it), so the class itself cannot be instantiated."""

    def __init__(self, bin_capacity: int, collect_metrics: bool = False, min_bin_count: Optional[int] = None,
                 bin_count_multiple: Optional[int] = None) -> None:
        self.bin_capacity, self.collect_metrics = bin_capacity, collect_metrics
        self.min_bin_count, self.bin_count_multiple = min_bin_count, bin_count_multiple

    @abc.abstractmethod
    def _pack_implementation(self, sequence_lengths: Sequence[int]) -> list:
        """The bins of one packing."""

    def pack(self, sequence_lengths: Sequence[int]) -> list:
        return self._pack_implementation(sequence_lengths)


# ------------------------------------------------------------------------------------- trainer configs
class AttrDict(dict):
    """A dict whose keys are attributes too, as an OmegaConf ``DictConfig`` reads."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def _attr(value: Any) -> Any:
    return AttrDict({k: _attr(v) for k, v in value.items()}) if isinstance(value, dict) else value


def _override(root: Any, overrides: Optional[Dict[str, Any]]) -> Any:
    for path, value in (overrides or {}).items():
        *parents, last = path.split(".")
        node = root
        for key in parents:
            node = node[key] if isinstance(node, dict) else getattr(node, key)
        if isinstance(node, dict):
            node[last] = _attr(value)
        else:
            setattr(node, last, value)
    return root


def verl_config(overrides: Optional[Dict[str, Any]] = None) -> AttrDict:
    """verl's PPO trainer config on the Megatron backend, dynamic batch size on (verl's defaults otherwise:
    ``ppo_max_token_len_per_gpu`` 16384, the log-prob budgets equal to it, the distributed optimizer, no
    recompute, bf16, 1 node of 8 GPUs)."""
    megatron = {"param_offload": False, "grad_offload": False, "optimizer_offload": False,
                "tensor_model_parallel_size": 1, "expert_model_parallel_size": 1, "expert_tensor_parallel_size": None,
                "pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
                "context_parallel_size": 1, "sequence_parallel": True, "use_distributed_optimizer": True,
                "override_transformer_config": {"recompute_granularity": None, "recompute_method": None,
                                                "recompute_num_layers": None},
                "dtype": "bfloat16"}
    log_prob = {"log_prob_use_dynamic_bsz": True, "log_prob_max_token_len_per_gpu": 16384}
    cfg = {"actor_rollout_ref": {
        "actor": {"strategy": "megatron", "megatron": megatron, "use_dynamic_bsz": True,
                  "ppo_max_token_len_per_gpu": 16384, "ppo_mini_batch_size": 256, "use_kl_loss": False},
        "ref": {"strategy": "megatron", **log_prob, "megatron": dict(megatron)},
        "rollout": dict(log_prob), "model": {"path": "~/models/deepseek-llm-7b-chat"}},
        "algorithm": {"use_kl_in_reward": False},
        "data": {"max_prompt_length": 512, "max_response_length": 512},
        "trainer": {"n_gpus_per_node": 8, "nnodes": 1}}
    return _override(_attr(cfg), overrides)


def roll_worker_config(overrides: Optional[Dict[str, Any]] = None) -> SimpleNamespace:
    """A ROLL ``actor_train`` worker config on Megatron with dynamic batching in training and inference (ROLL's
    Dynamic Batching guide's example budgets: 8192 in training, 16384 in inference), 8 workers."""
    cfg = SimpleNamespace(
        use_dynamic_batching_in_train=True, max_tokens_per_microbatch_in_train=8192,
        sequence_length_round_in_train=64, use_dynamic_batching_in_infer=True,
        max_tokens_per_microbatch_in_infer=16384, sequence_length_round_in_infer=64, world_size=8,
        model_args=SimpleNamespace(model_name_or_path="Qwen/Qwen2.5-7B-Instruct", dtype="bf16"),
        strategy_args=SimpleNamespace(strategy_name="megatron_train", strategy_config={
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
            "expert_model_parallel_size": 1, "use_distributed_optimizer": True,
            "recompute_granularity": "full", "sequence_parallel": True}))
    return _override(cfg, overrides)


def nemo_rl_config(overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """NeMo-RL's master config (``policy``, ``cluster``) with a Megatron policy and sequence packing on, 1 node of 8
    GPUs."""
    cfg = {"policy": {
        "model_name": "Qwen/Qwen3-8B", "precision": "bfloat16", "max_total_sequence_length": 8192,
        "megatron_cfg": {"enabled": True, "activation_checkpointing": False, "tensor_model_parallel_size": 1,
                         "pipeline_model_parallel_size": 1, "context_parallel_size": 1, "sequence_parallel": False,
                         "expert_tensor_parallel_size": 1, "expert_model_parallel_size": 1,
                         "optimizer": {"use_distributed_optimizer": True, "optimizer_cpu_offload": False,
                                       "bf16": True, "fp16": False},
                         "distributed_data_parallel_config": {"grad_reduce_in_fp32": False}},
        "sequence_packing": {"enabled": True, "train_mb_tokens": 16384, "logprob_mb_tokens": 16384,
                             "algorithm": "modified_first_fit_decreasing"},
        "dynamic_batching": {"enabled": False}},
        "cluster": {"gpus_per_node": 8, "num_nodes": 1}}
    return _override(cfg, overrides)
