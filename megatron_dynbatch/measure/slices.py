"""Build a model slice and time micro-batches on it: the entry points of :mod:`megatron_dynbatch.measure`.

A :class:`ModelSlice` wraps one built slice (:class:`~.mcore_slice.McoreSlice` or
:class:`~.torch_decoder.TorchDecoderSlice`) and times forward + backward of

* one CP member's share (:meth:`ModelSlice.time_share`; ``group_size=1``: a whole micro-batch), the minimum
  over ``repeats`` after ``warmup`` untimed runs (:func:`~.timer.time_call`);
* a micro-batch on a group (:meth:`ModelSlice.time_microbatch`): members ``0`` and ``g-1`` are timed and the
  slower counts (their shares hold the cheapest and the dearest chunk pairs when sequences are unpadded);
* many micro-batches (:meth:`ModelSlice.time_records`), each distinct ``(group_size, lengths)`` once: records
  ``[group_size, lengths, seconds]`` -- the format of ``../shared/gpu/*_microbatches.json`` and of
  ``benchmarks/gpu/results/*.json``, what a cost-model fit reads.

Lengths are normalised to descending order (the packed order does not change the work), so one record serves
every micro-batch with the same multiset of lengths. Seconds are those of the slice (``layout.num_layers``
layers of one TP rank), not of the whole model.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from ..core.errors import DynBatchConfigError
from .layout import SliceLayout, SliceWidths
from .share import check_share, share_geometry
from .timer import device_name, time_call

#: one timing record: ``[group_size, lengths (descending), seconds]``
Record = List[Any]
Key = Tuple[int, Tuple[int, ...]]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def record_key(group_size: int, lengths: Sequence[int]) -> Key:
    """``(group_size, lengths in descending order)``: the identity of a timed micro-batch (after validation)."""
    lens = check_share(group_size, lengths, 0)
    return int(group_size), tuple(sorted(lens, reverse=True))


class ModelSlice:
    """One model slice on one device, and its timing (module docstring). Build it with :func:`build_slice`."""

    def __init__(self, model: Any, layout: SliceLayout) -> None:
        self.layout = layout
        self.widths = SliceWidths.of(model, layout)
        self.device = torch.device(layout.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise DynBatchConfigError("layout.device", layout.device, "CUDA is not available on this machine",
                                      "pass device='cpu' (or run on a GPU machine)")
        dtype = _DTYPES[layout.dtype]
        if layout.kind == "mcore":
            from .mcore_slice import McoreSlice

            self.impl: Any = McoreSlice(self.widths, layout, self.device, dtype)
        else:
            from .torch_decoder import TorchDecoderSlice

            torch.manual_seed(layout.seed)
            self.impl = TorchDecoderSlice(self.widths, layout.num_layers, device=self.device, dtype=dtype)
        self.dtype = dtype
        self._generator = torch.Generator().manual_seed(layout.seed)

    # ------------------------------------------------------------------ one share
    def prepare(self, group_size: int, lengths: Sequence[int], member: int = 0) -> Callable[[], None]:
        """Inputs of member ``member``'s share built now; the callable runs one forward + backward."""
        return self.impl.prepare(share_geometry(group_size, lengths, member), self._generator)

    def time_share(self, group_size: int, lengths: Sequence[int], member: int = 0, *, warmup: int = 1,
                   repeats: int = 3) -> float:
        """Minimum seconds over ``repeats`` of one member's forward + backward."""
        return min(time_call(self.prepare(group_size, lengths, member), self.device, warmup=warmup,
                             repeats=repeats))

    def time_microbatch(self, lengths: Sequence[int], group_size: int = 1, *, warmup: int = 1,
                        repeats: int = 3) -> float:
        """Seconds of a micro-batch of ``lengths`` on a group of ``group_size`` GPUs: the slower of members
        ``0`` and ``group_size - 1``."""
        members = sorted({0, int(group_size) - 1}) if isinstance(group_size, int) and group_size >= 1 else [0]
        return max(self.time_share(group_size, lengths, m, warmup=warmup, repeats=repeats) for m in members)

    def time_records(self, items: Iterable[Tuple[int, Sequence[int]]], *, warmup: int = 1, repeats: int = 3,
                     cache: Optional[Dict[Key, float]] = None,
                     progress: Optional[Callable[[int, int, Key], None]] = None) -> List[Record]:
        """One record ``[group_size, lengths, seconds]`` per distinct ``(group_size, lengths)`` of ``items`` (in
        first-seen order). ``cache`` (key -> seconds, see :func:`record_key`) is read and filled, so several
        calls time each micro-batch once; ``progress(i, n, key)`` is called before each new timing."""
        cache = {} if cache is None else cache
        keys: List[Key] = []
        seen = set()
        for g, lens in items:
            k = record_key(g, lens)
            if k not in seen:
                seen.add(k)
                keys.append(k)
        todo = [k for k in keys if k not in cache]
        for i, k in enumerate(todo):
            if progress is not None:
                progress(i, len(todo), k)
            cache[k] = self.time_microbatch(list(k[1]), k[0], warmup=warmup, repeats=repeats)
        return [[k[0], list(k[1]), float(cache[k])] for k in keys]

    # ------------------------------------------------------------------ what was measured
    @property
    def kernel_name(self) -> str:
        """The attention kernel this slice runs."""
        probe = torch.empty(1, self.widths.heads, self.widths.kv, device=self.device, dtype=self.dtype)
        if self.layout.kind == "torch":
            return self.impl.kernel.name
        if self.layout.spec == "te":
            return "Transformer Engine TEDotProductAttention (THD)"
        from ..megatron.varlen import default_varlen_kernel

        kernel = default_varlen_kernel()
        if kernel is not None and kernel.accepts(probe):
            return kernel.name
        return "ThdDotProductAttention per-sequence torch loop"

    def environment(self) -> Dict[str, Any]:
        """Device, kernel, library versions, layout and widths: the header of a results file."""
        try:
            from importlib.metadata import version

            mcore: Optional[str] = version("megatron-core")
        except Exception:  # noqa: BLE001 - not installed as a distribution (e.g. on PYTHONPATH)
            mcore = None
        if mcore is None and self.layout.kind == "mcore":
            import megatron.core

            mcore = getattr(megatron.core, "__version__", "unknown")
        return {"device": device_name(self.device), "kernel": self.kernel_name, "torch": torch.__version__,
                "megatron_core": mcore if self.layout.kind == "mcore" else None, "layout": self.layout.to_dict(),
                "widths_per_tp_rank": self.widths.to_dict()}


def build_slice(model: Any, layout: Union[SliceLayout, None] = None, **layout_kwargs: Any) -> ModelSlice:
    """A :class:`ModelSlice` of ``model`` (``ModelSpec``, preset name or dict of Megatron fields) with
    ``layout`` (or ``SliceLayout(**layout_kwargs)``)."""
    if layout is None:
        layout = SliceLayout(**layout_kwargs)
    elif layout_kwargs:
        raise DynBatchConfigError("layout_kwargs", sorted(layout_kwargs), "given together with a SliceLayout",
                                  "pass either layout=SliceLayout(...) or its fields as keywords")
    if not isinstance(layout, SliceLayout):
        raise DynBatchConfigError("layout", type(layout).__name__, "is not a SliceLayout",
                                  "pass SliceLayout(num_layers=..., tp=..., dtype=..., device=..., kind=...)")
    return ModelSlice(model, layout)


__all__ = ["ModelSlice", "Record", "build_slice", "record_key"]
