"""docs/troubleshooting.md lists every message the package raises: the list between its ``<!-- messages -->``
markers is what ``scripts/messages_index.py`` renders from the raise sites (each ``DynBatchConfigError`` and its
kinds built in ``megatron_dynbatch/``), so a new or changed message fails here until the list is rewritten
(``python scripts/messages_index.py --write``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _index():
    spec = importlib.util.spec_from_file_location("messages_index", ROOT / "scripts" / "messages_index.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_troubleshooting_lists_every_raised_message():
    idx = _index()
    assert idx.current() is not None, "docs/troubleshooting.md has no <!-- messages --> list"
    assert idx.current() == idx.render(), ("docs/troubleshooting.md's list of messages is stale: run "
                                           "python scripts/messages_index.py --write")


def test_the_walk_finds_the_raise_sites_it_should():
    """The walk sees the kinds of error, literal and f-string messages, and keyword arguments."""
    idx = _index()
    sites = idx.raise_sites()
    flat = [e for entries in sites.values() for e in entries]
    assert len(flat) > 300
    assert ("max_tokens_per_gpu", "is required (the per-GPU token budget) / is neither a number of tokens nor 'auto'",
            "pass max_tokens_per_gpu=<tokens>, e.g. 16384, or 'auto' with gpu_memory_gb=") in flat
    assert "megatron_dynbatch/core/planner/options.py" in sites
    assert not any(p.startswith("megatron_dynbatch/testing/") for p in sites)
