"""Spawn a local process group for the CLI commands (demo, bench): one process per rank, a
gloo group over loopback, one report dict per rank back through a queue. Never hangs: a rank
that dies without reporting is reported as failed; the overall timeout kills every rank."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

RankFn = Callable[[int, int, dict[str, Any]], dict[str, Any]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: RankFn, rank: int, world: int, port: int, opts: dict, q: Any) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=datetime.timedelta(seconds=opts.get("group_timeout", 300)),
        )
        try:
            rep = fn(rank, world, opts)
        finally:
            dist.destroy_process_group()
        q.put((rank, rep))
    except BaseException as exc:
        q.put(
            (
                rank,
                {"rank": rank, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"},
            )
        )
        raise SystemExit(1) from exc


def spawn_group(fn: RankFn, world: int, opts: dict[str, Any], timeout: float) -> list[dict]:
    """Run ``fn(rank, world, opts)`` in ``world`` spawned ranks; reports in rank order."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world, port, opts, q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    reports: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    gone_since: dict[int, float] = {}
    try:
        while len(reports) < world:
            try:
                rank, rep = q.get(timeout=0.5)
                reports[rank] = rep
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(
                    f"timed out after {timeout:.0f}s; reports from {sorted(reports)}"
                )
            for i, p in enumerate(procs):
                if p.exitcode is not None and i not in reports:
                    # exited without a report (killed): give its queue a moment first
                    if now - gone_since.setdefault(i, now) > 2.0:
                        reports[i] = {"rank": i, "error": f"rank {i} died (exit {p.exitcode})"}
    finally:
        grace_end = time.monotonic() + (30.0 if len(reports) == world else 0.0)
        for p in procs:  # ranks that reported get a shared grace to exit; the rest are killed
            p.join(max(0.0, grace_end - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join()
    return [reports[r] for r in range(world)]
