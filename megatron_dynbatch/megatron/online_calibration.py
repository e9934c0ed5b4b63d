"""Online calibration on a Megatron rank: time each micro-batch during training, refit the cost model every N
steps, and hand every rank the same refitted model.

:class:`OnlineCalibrator` joins :class:`~.step_timer.MicroBatchTimer` (CUDA events around each micro-batch's forward
and backward, read once after the step's last backward; ``perf_counter`` on a CPU) with the torch-free
:class:`~megatron_dynbatch.core.calibration.online.OnlineCalibration` (window, refit, log):

* :meth:`OnlineCalibrator.step` wraps one schedule call; afterwards each micro-batch's seconds become a record
  ``[group size, sample lengths, seconds]`` (group size: the layout's ``cp``, or the micro-batch's own group under
  dynamic CP) of this rank's slice (:meth:`OnlineCalibrator.slice_info`: the decoder layers of this rank's model
  chunks, its TP size, the LM head on the last pipeline stage). Under pipeline parallelism a rank sees only its
  stage's forward + backward of a micro-batch: the fit is per layer (``measured_layers`` = this stage's layers), so
  the shared per-layer profile scales to the whole model (``CostModel.from_model`` multiplies by all its layers)
  and each stage's share is ``t_mb / pp`` as the cost model assumes; the last stage's LM head is accounted by its
  FLOPs;
* :meth:`OnlineCalibrator.end_step` counts the step and, every ``interval`` steps, refits: each rank fits its own
  window, then ONE all-reduce (SUM, float64, every rank of the world) of an 11-number vector per rank
  (:func:`~megatron_dynbatch.core.calibration.online.profile_vector`) gives every rank the same sum, from which every
  rank builds the same profile and the same ``CostModel`` -- so the plan, computed independently on every rank,
  stays identical with no other communication. The refit line is printed on global rank 0.

Losses and gradients are untouched: the timer only brackets megatron-core's own calls, and a new cost model only
regroups later batches under the same hard budget.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np

from ..core.calibration.online import DEFAULT_INTERVAL, DEFAULT_WINDOW, OnlineCalibration, RefitLog
from ..core.calibration.records import SliceInfo
from .collectives import all_reduce_vector, rank0_print
from .model_layers import rank_layers
from .step_timer import MicroBatchTimer


def records_of(iterator: Any, step: Optional[int], seconds: Sequence[float]) -> List[List[Any]]:
    """This rank's records of one step: micro-batch ``k`` of ``step`` -> ``[group size, lengths, seconds[k]]``;
    ``[]`` when the count does not match (a schedule that did not run this plan's micro-batches)."""
    js = list(iterator.step_range(step))
    if len(js) != len(seconds):
        return []
    plan, row, lens = iterator.plan, iterator.row, np.asarray(iterator.lengths)
    out = []
    for j, s in zip(js, seconds, strict=True):
        idx = plan.micro_batches[row][j]
        g = plan.group_size(row, j)
        out.append([int(g), [int(lens[i]) for i in idx], float(s)])
    return out


class TimingRecorder:
    """Records one training step's micro-batches (``records``) and what they cover (``slice``) without refitting:
    what a Ray actor sends its driver (:func:`megatron_dynbatch.integrations.ray.train_on_shard` with
    ``record_timings=True``). Pass it as ``calibrator=`` to ``dynamic_forward_backward``; ``num_layers`` /
    ``pp`` / ``tp`` are the fallbacks when the model does not show its decoder layers / when ``parallel_state`` is not
    initialised."""

    cost_model = None

    def __init__(self, *, num_layers: int = 1, pp: int = 1, tp: int = 1, device: Any = None) -> None:
        self.num_layers, self.pp, self.tp, self.device = int(num_layers), int(pp), int(tp), device
        self.records: List[List[Any]] = []
        self.slice: Optional[SliceInfo] = None

    def slice_info(self, model: Any) -> SliceInfo:
        """What this rank's recorded seconds cover (module docstring)."""
        layers = rank_layers(model)
        tp, last = self.tp, True
        try:
            from megatron.core import parallel_state as ps

            if ps.model_parallel_is_initialized():
                tp, last = ps.get_tensor_model_parallel_world_size(), ps.is_pipeline_last_stage(ignore_virtual=True)
        except ImportError:  # pragma: no cover
            pass
        return SliceInfo(layers or max(1, self.num_layers // self.pp), tp, bool(last))

    @contextlib.contextmanager
    def step(self, model: Any, iterator: Any, step: Optional[int] = None) -> Iterator[None]:
        """Record the micro-batches of one training schedule call."""
        timer = MicroBatchTimer(self.device)
        with timer.recording():
            yield
        self.records = records_of(iterator, step, timer.read())
        self.slice = self.slice_info(model)

    def end_step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def payload(self) -> Dict[str, Any]:
        """``{"slice": {...}, "records": [...]}``: what ``OnlineCalibration.add_timings`` takes."""
        return {"slice": None if self.slice is None else dict(self.slice.__dict__), "records": list(self.records)}


class OnlineCalibrator:
    """Online calibration of one Megatron rank (module docstring). ``model`` / ``parallel``: what the planner plans
    (a ``ModelSpec`` or anything ``ModelSpec.from_any`` takes; the layout); ``interval``: refit every this many
    recorded steps; ``window``: recent records kept per rank; ``base``: the cost model until the first refit
    (a profile name, a cost-model file, a ``CostModel``; default ``"fitted"``); ``log``: refit lines (default:
    printed on global rank 0); ``merge``: the cross-rank SUM (default: an all-reduce over the world)."""

    def __init__(self, model: Any, parallel: Any = None, *, interval: Any = DEFAULT_INTERVAL,
                 window: Any = DEFAULT_WINDOW, base: Any = None, skip_steps: Any = 1,
                 log: Optional[Callable[[str], None]] = rank0_print,
                 merge: Optional[Callable[[np.ndarray], np.ndarray]] = None, device: Any = None) -> None:
        import torch.distributed as dist

        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.state = OnlineCalibration(model, parallel, interval=interval, window=window, skip_steps=skip_steps,
                                       base=base, ranks=ranks, merge=merge or all_reduce_vector, log=log)
        par = self.state.parallel
        self.recorder = TimingRecorder(num_layers=self.state.model.num_layers, pp=par.pp, tp=par.tp, device=device)

    @property
    def cost_model(self) -> Any:
        """The refitted model (``None`` before the first successful refit: plan with your configured one)."""
        return self.state.cost_model

    @property
    def history(self) -> List[RefitLog]:
        return self.state.history

    def slice_info(self, model: Any) -> SliceInfo:
        """What this rank's recorded seconds cover (module docstring)."""
        return self.recorder.slice_info(model)

    @contextlib.contextmanager
    def step(self, model: Any, iterator: Any, step: Optional[int] = None) -> Iterator[None]:
        """Record the micro-batches of one training schedule call (skipped during the warm-up steps)."""
        if not self.state.recording:
            yield
            return
        with self.recorder.step(model, iterator, step):
            yield
        self.state.add(self.recorder.records, self.recorder.slice)

    def end_step(self, plan: Any = None, lengths: Any = None, options: Any = None) -> Optional[RefitLog]:
        """Count the finished optimizer step; refit every ``interval`` steps (a collective: call it on every
        rank). Returns the refit's log entry, or ``None``; ``options``: the ResolvedOptions the step was planned
        with (the log's re-planned time)."""
        return self.state.end_step(plan, lengths, options)


__all__ = ["OnlineCalibrator", "TimingRecorder", "records_of"]
