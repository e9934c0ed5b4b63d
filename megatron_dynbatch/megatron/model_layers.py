"""How many transformer layers this rank's model holds: what a per-rank measurement (online calibration's
timings, the memory guard's peaks) covers."""

from __future__ import annotations

from typing import Any

__all__ = ["rank_layers"]


def rank_layers(model: Any) -> int:
    """Decoder layers of ``model`` (a module or the list of VPP chunks), each unwrapped through ``.module``
    (Megatron's DDP, Float16Module) to the part with a ``decoder``; 0 when none is found."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    layers = 0
    for chunk in chunks:
        inner = chunk
        while hasattr(inner, "module") and not hasattr(inner, "decoder"):
            inner = inner.module
        decoder = getattr(inner, "decoder", None)
        layers += len(getattr(decoder, "layers", ())) if decoder is not None else 0
    return layers
