"""The one multi-process spawner of vmmkv's tests, tools and benchmarks: run a module-level
function once per rank in spawned processes, optionally inside a gloo group.

``run_world_raw`` never hangs and never leaves a child behind: each child runs in its own
session (process group) and dies with the parent (``PR_SET_PDEATHSIG``); after the timeout every
child still running is terminated, then killed with its process group. Local to the caller (it
is not a collective); the caller owns nothing afterwards: every child is reaped, every pipe
closed.

Environment of the children: this is the one place that turns NVLink multicast off for the
libraries a rank may load (``MULTICAST_OFF``: NCCL, torch symmetric memory, NVSHMEM); vmmkv itself
never creates multicast objects. A variable already set in the parent's environment keeps its
value; ``env`` is applied last and wins over both. ``CUDA_VISIBLE_DEVICES`` is passed through
untouched. This module imports no torch: children import it only after their environment is
set (``fn`` and ``args`` travel pickled and are unpickled in the child after that).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import get_context
from multiprocessing.connection import wait
from typing import Any

from .._util import require_int, require_timeout

__all__ = [
    "MULTICAST_OFF",
    "RankResult",
    "capture_logs",
    "free_port",
    "run_world",
    "run_world_raw",
]

# Set in every child unless already set: no NVLink multicast objects from the libraries a rank
# loads (NCCL's NVLS, torch symmetric memory, NVSHMEM).
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

_TERMINATE_GRACE_S = 2.0
_PR_SET_PDEATHSIG = 1


@dataclass
class RankResult:
    """What one rank gave back: ``value`` when ``ok``, else the traceback or reason in
    ``error``; ``exitcode`` of its process (None if it never started)."""

    rank: int
    ok: bool
    value: Any
    error: str
    exitcode: int | None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _child_main(
    rank: int,
    world_size: int,
    fn_and_args: bytes,
    conn: Any,
    port: int,
    init_group: bool,
    timeout: float,
    env: dict[str, str],
    parent_pid: int,
) -> None:
    try:
        os.setsid()  # own process group, so the parent can kill whatever this child starts
    except OSError:
        pass
    _die_with_parent(parent_pid)
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    os.environ.update(env)
    try:
        try:
            fn, args = pickle.loads(fn_and_args)
            if init_group:
                import torch.distributed as dist

                dist.init_process_group(
                    "gloo",
                    rank=rank,
                    world_size=world_size,
                    init_method=f"tcp://127.0.0.1:{port}",
                    timeout=timedelta(seconds=timeout),
                )
            try:
                value = fn(rank, world_size, *args)
            finally:
                if init_group:
                    dist.destroy_process_group()
        except BaseException:
            conn.send((False, None, traceback.format_exc()))
            return
        try:
            conn.send((True, value, ""))
        except Exception:
            conn.send(
                (False, None, "the return value could not be sent:\n" + traceback.format_exc())
            )
    finally:
        conn.close()


def run_world_raw(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    timeout: float = 60.0,
    init_group: bool = True,
    env: dict[str, str] | None = None,
) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; one result per
    rank, in rank order. With ``init_group`` each child joins a gloo group over loopback first
    (its timeout is ``timeout`` too). ``env``: extra environment variables of the children.
    A rank that raised, died or timed out has ``ok=False`` and the reason in ``error``."""
    require_int("world_size", world_size, lo=1)
    timeout = require_timeout("timeout", timeout)
    try:
        fn_and_args = pickle.dumps((fn, tuple(args)))
    except Exception as exc:
        raise TypeError(
            f"fn must be a module-level function and args picklable (spawn): {exc}"
        ) from exc
    ctx = get_context("spawn")
    port = free_port() if init_group else 0
    readers: list[Any] = []
    procs: list[Any] = []
    values: dict[int, tuple[bool, Any, str]] = {}
    timed_out: set[int] = set()
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child_main,
                args=(
                    rank,
                    world_size,
                    fn_and_args,
                    writer,
                    port,
                    init_group,
                    timeout,
                    dict(env or {}),
                    os.getpid(),
                ),
                name=f"rank{rank}",
            )
            proc.start()
            writer.close()
            readers.append(reader)
            procs.append(proc)
        deadline = time.monotonic() + timeout
        open_readers = {readers[r]: r for r in range(world_size)}
        running = {procs[r].sentinel: r for r in range(world_size)}
        while open_readers or running:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for ready in wait([*open_readers, *running], timeout=remaining):
                if ready in open_readers:
                    rank = open_readers.pop(ready)
                    try:
                        values[rank] = ready.recv()
                    except (EOFError, OSError):
                        pass  # died without a result
                else:
                    rank = running.pop(ready)
        for reader, rank in open_readers.items():  # a child that exited right at the deadline
            if rank not in running and reader.poll(0):
                try:
                    values[rank] = reader.recv()
                except (EOFError, OSError):
                    pass
        timed_out = set(running.values())
    finally:
        exitcodes = _reap(procs)
        for reader in readers:
            reader.close()
    results = []
    for rank, exitcode in enumerate(exitcodes):
        if rank in timed_out:
            note = " (it had sent a result but did not exit)" if rank in values else ""
            results.append(
                RankResult(rank, False, None, f"timed out after {timeout:g}s{note}", exitcode)
            )
        elif rank in values:
            ok, value, error = values[rank]
            results.append(RankResult(rank, ok, value, error, exitcode))
        else:
            results.append(
                RankResult(
                    rank, False, None, f"exited with code {exitcode} without a result", exitcode
                )
            )
    return results


def _signal_group(proc: Any, sig: int) -> None:
    """Send ``sig`` to the child's process group (itself and whatever it started); only call
    while the child is unreaped, so that its pid and group id cannot have been reused."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # not a group leader yet (setsid not reached)
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass


def _has_exited(pid: int) -> bool:
    """True once the child exited, without reaping it (WNOWAIT)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _reap(procs: list[Any]) -> list[int | None]:
    """Terminate, then kill every child still running together with its process group; join
    and close all; return their exit codes."""
    alive = [p for p in procs if p.pid is not None and p.exitcode is None]
    for proc in alive:
        _signal_group(proc, signal.SIGTERM)
    grace_end = time.monotonic() + _TERMINATE_GRACE_S
    while time.monotonic() < grace_end and not all(_has_exited(p.pid) for p in alive):
        time.sleep(0.02)
    for proc in alive:
        _signal_group(proc, signal.SIGKILL)
    exitcodes = []
    for proc in procs:
        if proc.pid is not None:
            proc.join()
        exitcodes.append(proc.exitcode)
        proc.close()
    return exitcodes


def run_world(fn: Callable[..., Any], world_size: int, **kw: Any) -> list[Any]:
    """``run_world_raw`` that returns the values in rank order, or raises ``AssertionError``
    with the traceback or exit code of every failed rank."""
    results = run_world_raw(fn, world_size, **kw)
    failed = [r for r in results if not r.ok]
    if failed:
        report = "\n\n".join(
            f"--- rank {r.rank} (exitcode {r.exitcode}) ---\n{r.error.rstrip()}" for r in failed
        )
        raise AssertionError(f"{len(failed)} of {world_size} ranks failed:\n{report}")
    return [r.value for r in results]


def capture_logs(name: str = "vmmkv") -> list[str]:
    """Collect the messages logged under ``name`` (INFO and above) into the returned list."""
    import logging

    records: list[str] = []

    class _Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger(name)
    logger.addHandler(_Grab())
    logger.setLevel(logging.INFO)
    return records
