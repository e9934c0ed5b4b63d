"""Time every micro-batch's forward and backward on this rank during one schedule call, without a sync per
micro-batch.

:class:`MicroBatchTimer` wraps megatron-core's module-level ``schedules.forward_step`` and
``schedules.backward_step`` (every schedule -- no pipelining, 1F1B, interleaved -- calls them by name for each
micro-batch; :func:`~.compat.schedule_step_functions` probes for them) for the duration of :meth:`recording`:

* **marks**: on CUDA a timing event recorded on the current stream before and after each call (asynchronous: the
  GPU stamps it when it reaches it, so the span is the GPU's time for that forward or backward, waits for received
  activations excluded -- they are stream waits issued before the call); on a CPU ``time.perf_counter``;
* **which micro-batch**: the ``k``-th forward call with a given model chunk is micro-batch ``k`` of the step (each
  chunk runs its micro-batches in order); a backward call is matched to its forward by the identity of the output
  tensor the schedule hands back (held until then, so the identity cannot be reused);
* **reading**: :meth:`read` synchronises once -- on the last event, after the step's last backward -- and returns
  each micro-batch's forward + backward seconds summed over its chunks (this rank's share of it: its pipeline
  stage, its TP widths, its CP share).

Nothing else changes: the wrapped functions are called with the same arguments and their results returned
unchanged, so losses and gradients are bit-identical with and without the timer; the originals are restored when
:meth:`recording` exits, also on an exception.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, Iterator, List, Tuple

from ..core.errors import DynBatchConfigError
from .compat import schedule_step_functions


class MicroBatchTimer:
    """Per-micro-batch forward + backward times of one schedule call on ``device`` (module docstring)."""

    def __init__(self, device: Any = None) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
        self._spans: Dict[int, List[Tuple[Any, Any]]] = {}
        self._count: Dict[int, int] = {}
        self._pending: Dict[int, Tuple[int, Any]] = {}
        self._last: Any = None

    def _mark(self) -> Any:
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._last = event
            return event
        return time.perf_counter()

    @contextlib.contextmanager
    def recording(self) -> Iterator["MicroBatchTimer"]:
        """Wrap the schedules' step functions while the block runs (one schedule call)."""
        schedules = schedule_step_functions()
        if schedules is None:
            raise DynBatchConfigError("--dynbatch-online-calibration", True, "this megatron-core has no module-level "
                                      "schedules.forward_step / backward_step to time micro-batches with",
                                      "drop the flag (calibrate offline: megatron-dynbatch calibrate)")
        fwd, bwd = schedules.forward_step, schedules.backward_step
        self._spans, self._count, self._pending = {}, {}, {}

        def forward_step(*args: Any, **kwargs: Any) -> Any:
            chunk = id(args[2] if len(args) > 2 else kwargs.get("model"))
            k = self._count.get(chunk, 0)
            self._count[chunk] = k + 1
            start = self._mark()
            out = fwd(*args, **kwargs)
            self._spans.setdefault(k, []).append((start, self._mark()))
            tensor = out[0] if isinstance(out, tuple) else out
            self._pending[id(tensor)] = (k, tensor)
            return out

        def backward_step(input_tensor: Any, output_tensor: Any, *args: Any, **kwargs: Any) -> Any:
            entry = self._pending.pop(id(output_tensor), None)
            start = self._mark()
            out = bwd(input_tensor, output_tensor, *args, **kwargs)
            if entry is not None:
                self._spans[entry[0]].append((start, self._mark()))
            return out

        schedules.forward_step, schedules.backward_step = forward_step, backward_step
        try:
            yield self
        finally:
            schedules.forward_step, schedules.backward_step = fwd, bwd
            self._pending.clear()

    def read(self) -> List[float]:
        """Seconds of each micro-batch (forward + backward, over its chunks), in micro-batch order; one
        synchronisation on CUDA."""
        if not self._spans:
            return []
        if self.cuda:
            self._last.synchronize()  # recorded last on the stream: every earlier event is done too
            return [sum(a.elapsed_time(b) for a, b in self._spans[k]) / 1e3 for k in sorted(self._spans)]
        return [sum(b - a for a, b in self._spans[k]) for k in sorted(self._spans)]


__all__ = ["MicroBatchTimer"]
