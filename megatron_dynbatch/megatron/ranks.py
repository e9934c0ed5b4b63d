"""Spawn ``world_size`` local processes that each run ``fn(rank, world_size, *args)``; collect the results.

Used by multi-rank tests and the demo. Each child gets ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` set to a
free TCP port chosen by the parent, so ``init_cpu_distributed(rank, world_size, ...)`` needs no port argument.
A child's exception comes back as its formatted traceback inside :class:`RankFailure`; the other ranks are
killed right away (they would otherwise wait in a collective until the gloo timeout).
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, List, Optional


class RankFailure(RuntimeError):
    """One or more ranks raised, crashed or timed out. The message holds each failing rank's traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(fn: Callable[..., Any], rank: int, world_size: int, args: tuple, port: int, threads: int,
           results: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        import torch

        if threads > 0:
            torch.set_num_threads(threads)
        out = fn(rank, world_size, *args)
        payload = ("ok", pickle.dumps(out))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        payload = ("error", traceback.format_exc())
    results.put((rank,) + payload)


def _dead_or_late(procs: list, outputs: dict, deadline: float, timeout: float) -> dict:
    """Ranks that exited without reporting, or every unfinished rank once the deadline has passed."""
    errors = {}
    for r, p in enumerate(procs):
        if r not in outputs and not p.is_alive() and p.exitcode not in (None, 0):
            errors[r] = f"rank {r} died with exit code {p.exitcode} before reporting (killed or crashed)"
    if not errors and time.monotonic() > deadline:
        for r in range(len(procs)):
            if r not in outputs:
                errors[r] = f"rank {r} still running after timeout={timeout}s (hang or too slow)"
    return errors


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads_per_rank: int = 1,
    port: Optional[int] = None,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return the per-rank results.

    ``fn`` and ``args`` must be picklable (``fn`` defined at module level); each return value must be
    picklable. ``threads_per_rank`` sets ``torch.set_num_threads`` in each child (oversubscribing a small CPU
    machine makes gloo runs much slower); 0 leaves torch's default. Raises :class:`RankFailure` with the
    children's tracebacks if any rank raises, dies or is still running after ``timeout`` seconds.
    """
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be >= 1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = port or free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, args, port, threads_per_rank, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()

    outputs: dict = {}
    errors: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size and not errors:
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue_mod.Empty:
                errors.update(_dead_or_late(procs, outputs, deadline, timeout))
                continue
            if status == "ok":
                outputs[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
        if errors:  # collect any other tracebacks that are already on their way
            grace = time.monotonic() + 1.0
            while time.monotonic() < grace:
                try:
                    rank, status, payload = results.get(timeout=0.1)
                except queue_mod.Empty:
                    continue
                if status != "ok":
                    errors[rank] = payload
    finally:
        for p in procs:
            if errors and p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()

    if errors:
        details = "\n".join(f"----- rank {r} -----\n{msg}" for r, msg in sorted(errors.items()))
        raise RankFailure(f"{len(errors)} of {world_size} ranks failed in {getattr(fn, '__name__', fn)}:\n{details}")
    return [outputs[r] for r in range(world_size)]
