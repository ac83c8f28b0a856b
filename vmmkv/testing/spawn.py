"""The one multi-process spawner of vmmkv's tests, tools and benchmarks: run a module-level
function once per rank in spawned processes, optionally inside a gloo group.

``run_world_raw`` never hangs and never leaves a child behind: each child runs in its own
session (process group) and dies with the parent (``PR_SET_PDEATHSIG``); after the timeout every
child still running is terminated, then killed with its process group. Local to the caller (it
is not a collective); the caller owns nothing afterwards: every child is reaped, every pipe
closed.

A child's stderr (fd 2) goes through a pipe that the parent drains while it waits (so a chatty
child never blocks on it) and forwards to its own fd 2 as it comes; the parent keeps the last
lines. A child that dies without a result is reported with its exit code or the name of the
signal that killed it (``SIGSEGV``...) and the last ``STDERR_TAIL_LINES`` lines of its stderr;
a timed-out child with those lines too. With ``PYTHONFAULTHANDLER=1`` in the environment (the
children inherit it) a crash also leaves the Python stack of the crashing thread in those lines.

Rendezvous: :func:`world_store` is the one way ranks find each other. The spawning process hosts
the world's ``torch.distributed`` store itself, a ``TCPStore`` bound to a port the kernel picks
(port 0) and held until the world is done, so no port is chosen free and bound again later (no
race with another run). The ranks join it as clients through torchrun's agent-store contract
(``WorldStore.env``: ``TORCHELASTIC_USE_AGENT_STORE``, ``MASTER_ADDR``, ``MASTER_PORT``), whether
they call ``init_process_group(init_method=WorldStore.init_method)`` themselves, go through a
library that builds ``tcp://127.0.0.1:<port>`` from ``WorldStore.port`` (vLLM's
``init_distributed_environment``), or are joined by ``run_world_raw(init_group=True)``. One store
serves one world and one default group at a time: a rank that destroys its group and creates
another in the same world would meet the first group's keys.

Environment of the children: this is the one place that turns NVLink multicast off for the
libraries a rank may load (``MULTICAST_OFF``: NCCL, torch symmetric memory, NVSHMEM); vmmkv itself
never creates multicast objects. A variable already set in the parent's environment keeps its
value; ``env`` is applied last and wins over both. ``CUDA_VISIBLE_DEVICES`` is passed through
untouched. This module imports no torch at import time (:func:`world_store` imports it when
called): children import it only after their environment is set (``fn`` and ``args`` travel
pickled and are unpickled in the child after that).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import get_context
from multiprocessing.connection import wait
from typing import Any

from .._util import require_int, require_timeout

__all__ = [
    "MULTICAST_OFF",
    "STDERR_TAIL_LINES",
    "RankResult",
    "WorldStore",
    "capture_logs",
    "run_world",
    "run_world_raw",
    "world_store",
]

# Set in every child unless already set: no NVLink multicast objects from the libraries a rank
# loads (NCCL's NVLS, torch symmetric memory, NVSHMEM).
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

_TERMINATE_GRACE_S = 2.0
STDERR_TAIL_LINES = 20
_TAIL_BYTES = 1 << 16  # what the parent keeps of a child's stderr (the tail is cut from it)
_DRAIN_S = 1.0  # how long the parent reads what a child left in its stderr pipe after exit
_PR_SET_PDEATHSIG = 1


@dataclass
class RankResult:
    """What one rank gave back: ``value`` when ``ok``, else the traceback or reason in
    ``error``; ``exitcode`` of its process (None if it never started; ``-N``: killed by signal
    ``N``); ``stderr_tail``: the last ``STDERR_TAIL_LINES`` lines of its stderr."""

    rank: int
    ok: bool
    value: Any
    error: str
    exitcode: int | None
    stderr_tail: str = ""  # the last lines the child wrote to its stderr


_STORE_HOST = "127.0.0.1"


@dataclass(frozen=True)
class WorldStore:
    """The address of a world's store, hosted by the process inside :func:`world_store`:
    ``port`` (bound for the store's whole life), ``init_method`` (``tcp://127.0.0.1:<port>``)
    and ``env``, the variables a rank needs in its environment to join it as a client."""

    port: int

    @property
    def init_method(self) -> str:
        return f"tcp://{_STORE_HOST}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "MASTER_ADDR": _STORE_HOST,
            "MASTER_PORT": str(self.port),
        }


@contextlib.contextmanager
def world_store(timeout: float = 300.0) -> Iterator[WorldStore]:
    """Host one world's ``torch.distributed`` store in this process for the block: a
    ``TCPStore`` server on 127.0.0.1, on a port the kernel picks when it binds (never a port
    chosen beforehand). Ranks started in the block with ``WorldStore.env`` join it as clients.
    ``timeout``: the store's own wait limit. The block's end shuts the server down; the ranks
    must be done with it by then. Local; imports torch."""
    from torch.distributed import TCPStore

    timeout = require_timeout("timeout", timeout)
    server = TCPStore(
        _STORE_HOST, 0, None, True, timedelta(seconds=timeout), wait_for_workers=False
    )
    try:
        yield WorldStore(server.port)
    finally:
        del server


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
    init_method: str,
    init_group: bool,
    timeout: float,
    env: dict[str, str],
    parent_pid: int,
    stderr_conn: Any,
) -> None:
    os.dup2(stderr_conn.fileno(), 2)  # the parent forwards it and keeps the last lines
    stderr_conn.close()
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
                    init_method=init_method,
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
    rank, in rank order. With ``init_group`` each child joins a gloo group over loopback first,
    on a store this process hosts (:func:`world_store`; its timeout is ``timeout`` too). ``env``:
    extra environment variables of the children.
    A rank that raised, died or timed out has ``ok=False`` and the reason in ``error``."""
    require_int("world_size", world_size, lo=1)
    timeout = require_timeout("timeout", timeout)
    try:
        fn_and_args = pickle.dumps((fn, tuple(args)))
    except Exception as exc:
        raise TypeError(
            f"fn must be a module-level function and args picklable (spawn): {exc}"
        ) from exc
    if not init_group:
        return _run_children(fn_and_args, world_size, timeout, "", dict(env or {}))
    with world_store(timeout) as store:
        env = {**store.env, **(env or {})}
        return _run_children(fn_and_args, world_size, timeout, store.init_method, env)


def _run_children(
    fn_and_args: bytes, world_size: int, timeout: float, init_method: str, env: dict[str, str]
) -> list[RankResult]:
    """The children of :func:`run_world_raw`; ``init_method`` empty: no group."""
    init_group = bool(init_method)
    ctx = get_context("spawn")
    readers: list[Any] = []
    err_readers: list[Any] = []
    tails = [_Tail() for _ in range(world_size)]
    procs: list[Any] = []
    values: dict[int, tuple[bool, Any, str]] = {}
    timed_out: set[int] = set()
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            err_reader, err_writer = ctx.Pipe(duplex=False)
            err_readers.append(err_reader)
            proc = ctx.Process(
                target=_child_main,
                args=(
                    rank,
                    world_size,
                    fn_and_args,
                    writer,
                    init_method,
                    init_group,
                    timeout,
                    env,
                    os.getpid(),
                    err_writer,
                ),
                name=f"rank{rank}",
            )
            proc.start()
            writer.close()
            err_writer.close()
            readers.append(reader)
            procs.append(proc)
        deadline = time.monotonic() + timeout
        open_readers = {readers[r]: r for r in range(world_size)}
        running = {procs[r].sentinel: r for r in range(world_size)}
        open_errs = {err_readers[r]: r for r in range(world_size)}
        while open_readers or running:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for ready in wait([*open_readers, *running, *open_errs], timeout=remaining):
                if ready in open_errs:
                    if not tails[open_errs[ready]].read(ready):
                        del open_errs[ready]
                elif ready in open_readers:
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
        drain_end = time.monotonic() + _DRAIN_S
        for rank, err_reader in enumerate(err_readers):
            tails[rank].drain(err_reader, drain_end)
        for reader in [*readers, *err_readers]:
            reader.close()
    results = []
    for rank, exitcode in enumerate(exitcodes):
        tail = tails[rank].lines()
        if rank in timed_out:
            note = " (it had sent a result but did not exit)" if rank in values else ""
            error = f"timed out after {timeout:g}s{note}" + _with_tail(tail)
            results.append(RankResult(rank, False, None, error, exitcode, tail))
        elif rank in values:
            ok, value, error = values[rank]
            results.append(RankResult(rank, ok, value, error, exitcode, tail))
        else:
            error = f"{_death(exitcode)} without a result" + _with_tail(tail)
            results.append(RankResult(rank, False, None, error, exitcode, tail))
    return results


def _death(exitcode: int | None) -> str:
    """How a child ended, in words: its exit code, or the signal that killed it."""
    if exitcode is None:
        return "never started"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name} (exit code {exitcode})"
    return f"exited with code {exitcode}"


def _with_tail(tail: str) -> str:
    if not tail:
        return "; it wrote nothing to stderr"
    return f"; the last lines of its stderr:\n{tail}"


class _Tail:
    """The parent's side of one child's stderr pipe: forwards what comes to the parent's fd 2
    and keeps the last ``_TAIL_BYTES`` bytes."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def read(self, conn: Any) -> bool:
        """Read what is there (the pipe is readable); False at end of file."""
        try:
            data = os.read(conn.fileno(), 1 << 16)
        except OSError:
            return False
        if not data:
            return False
        _forward(data)
        self._buf += data
        del self._buf[: max(0, len(self._buf) - _TAIL_BYTES)]
        return True

    def drain(self, conn: Any, deadline: float) -> None:
        """Read what a finished child left in the pipe, until end of file or ``deadline`` (a
        grandchild may still hold the pipe open)."""
        while time.monotonic() < deadline and conn.poll(max(0.0, deadline - time.monotonic())):
            if not self.read(conn):
                return

    def lines(self) -> str:
        text = self._buf.decode("utf-8", errors="replace")
        return "\n".join(text.rstrip("\n").splitlines()[-STDERR_TAIL_LINES:])


def _forward(data: bytes) -> None:
    """Write ``data`` to the parent's fd 2 (where the child's stderr went before the pipe)."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(2, view) :]
        except OSError:
            return  # the parent's stderr is gone: keep the tail anyway


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
