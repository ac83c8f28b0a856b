"""Pass file descriptors between the processes of one host (Linux only; no CUDA, no torch).

``exchange_fds`` is the transport under ``rendezvous()``: every rank of a group sends one
message ``(payload, fds)`` to each peer it names and receives one message from each peer it
expects, over ``AF_UNIX`` stream sockets in the abstract namespace (``socket_name``). All sockets
are driven by one ``selectors`` loop in the calling thread: no thread is started.

Contract
--------
* Collective among the ranks that name each other: the call returns once every expected message
  arrived and every outgoing message was acknowledged by its receiver.
* Ownership: the caller keeps every fd passed in ``outgoing``; ``exchange_fds`` never closes
  them, and the caller may close them as soon as the call returned or raised (fds in flight hold
  their own reference). The caller owns every fd in the returned dict and must close each
  exactly once; they are opened close-on-exec.
* On any error (``FdExchangeError``, ``KeyboardInterrupt``, ...) every fd received so far is
  closed, and the listening socket and every connection are closed before the exception leaves.
* ``timeout`` is one deadline for the whole exchange; nothing blocks past it. On expiry the
  ``FdExchangeError`` names the rank, the nonce, ``missing_from`` (ranks whose message never
  arrived) and ``unreachable`` (peers that did not acknowledge ours), with a reason for each.
  ``liveness`` (optional) ends it sooner, naming a peer whose process is gone.
* Giving up: ``on_error`` (optional) sees the ``FdExchangeError`` before any socket closes, so
  the caller can publish the cause (e.g. settle the step's outcome) before the peers' half-read
  connections break and they take the reset for this rank's fault.
* Security: the receiver reads ``SO_PEERCRED`` of every accepted connection and refuses it
  (closes it and logs one warning per pid and exchange) unless the uid is ours, the pid is in
  ``pids`` (the rendezvous rejects duplicates; tests may run ranks as threads), equals
  ``pids[sender]`` for the rank the header claims, the header's nonce and receiver rank are ours,
  the sender is in ``expect_from`` and has not delivered already. The sender checks the
  listener's ``SO_PEERCRED`` pid and uid against ``pids[peer]`` and ours before sending anything.
  Local socket failures (e.g. EMFILE) raise ``FdExchangeError`` too; a name already bound by
  another process raises at once, naming the holder's pid where /proc shows it. Hence all ranks
  must share one PID namespace (and one network namespace, for the abstract socket names).
* The socket name depends only on (nonce, rank): a nonce must be used by one exchange at a time
  per group. Callers use a fresh random nonce per exchange (abstract names are visible in
  /proc/net/unix, so a predictable one could be bound first by any local user).

Structure: this module checks the arguments and runs the exchange (``_Exchange``: the deadline,
the ``selectors`` loop, the ``cancel``/``liveness`` polls, the error and the cleanup). The
exchange drives its two ends over one selector: ``vmmkv.ipc.fdsend._Sender`` (a connection to
every peer it sends to) and ``vmmkv.ipc.fdrecv._Receiver`` (the listener and the connections it
accepts). The wire format (``PROTOCOL_VERSION``) is described in ``vmmkv.ipc.fdwire``.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import selectors
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from .fdrecv import _Receiver
from .fdsend import _Sender
from .fdwire import _BATCH as _BATCH  # the wire format, for tests that forge messages
from .fdwire import _HEADER as _HEADER
from .fdwire import _MAGIC as _MAGIC
from .fdwire import (
    MAX_FDS_PER_MESSAGE,
    MAX_PAYLOAD_BYTES,
    PROTOCOL_VERSION,
    _check_nonce,
    _check_rank,
    _is_int,
    socket_name,
)

__all__ = ["FdExchangeError", "PROTOCOL_VERSION", "exchange_fds", "socket_name"]

_log = logging.getLogger(__name__)
_CANCEL_POLL_S = 0.02


class FdExchangeError(RuntimeError):
    """The exchange did not complete. ``missing_from``: ranks whose message never arrived;
    ``unreachable``: peers that did not acknowledge our message. Both sorted. ``peers_lost``:
    the peers to blame when the exchange timed out or a peer's connection failed (a vanished
    peer); empty when the cause is local (socket limits, a squatted name) or a cancel."""

    def __init__(
        self,
        message: str,
        *,
        missing_from: Iterable[int] = (),
        unreachable: Iterable[int] = (),
        peers_lost: Iterable[int] = (),
    ) -> None:
        super().__init__(message)
        self.missing_from: list[int] = sorted(missing_from)
        self.unreachable: list[int] = sorted(unreachable)
        self.peers_lost: list[int] = sorted(peers_lost)

    def __reduce__(self):  # keep the fields when the error crosses a process boundary
        return (type(self), (str(self),), dict(self.__dict__))


def exchange_fds(
    *,
    rank: int,
    nonce: str,
    outgoing: Mapping[int, tuple[bytes, Sequence[int]]],
    expect_from: Iterable[int],
    pids: Sequence[int],
    timeout: float,
    cancel: Callable[[], str] | None = None,
    liveness: Callable[[], tuple[int, str] | None] | None = None,
    on_error: Callable[[FdExchangeError], None] | None = None,
) -> dict[int, tuple[bytes, list[int]]]:
    """Send ``outgoing[p] = (payload, fds)`` to every peer ``p`` and receive one message from
    every rank in ``expect_from``; return ``{sender: (payload, fds)}`` for every expected rank.

    ``pids[r]`` is the pid of rank ``r`` (``pids[rank]`` must be this process). ``timeout``
    (seconds, > 0) bounds the whole call. ``cancel``: polled every ~20 ms while waiting; a
    non-empty string it returns ends the exchange at once with ``FdExchangeError`` (e.g. a
    peer already gave up the step this exchange belongs to). ``liveness``: polled likewise;
    ``(peer, why)`` once a peer's process is gone (``vmmkv._util.pid_liveness``) ends the
    exchange at once with ``FdExchangeError`` whose ``peers_lost`` is ``[peer]``: whether or
    not that peer still owes this rank a message, the step the exchange belongs to cannot
    succeed. ``on_error``: called with the ``FdExchangeError`` this call is about to raise,
    while every socket is still open (an exception it raises is logged and dropped): a peer
    whose message this rank has not read yet sees its connection reset once we close, and
    takes that for this rank's fault; a caller that settles the step's outcome with the real
    cause here (the rendezvous does, ``transports._FdTransport``) makes that peer adopt it
    instead. Raises ``FdExchangeError`` on timeout, refusal, a lost peer or a local socket
    failure; ``ValueError``/``TypeError`` on bad input before any socket exists;
    ``RuntimeError`` off Linux. See the module docstring for ownership, ``vmmkv.ipc.fdwire``
    for the wire format.
    """
    if not sys.platform.startswith("linux"):
        raise RuntimeError(
            f"vmmkv.ipc.fdpass needs Linux (SCM_RIGHTS, SO_PEERCRED, abstract AF_UNIX "
            f"sockets); this is {sys.platform!r}"
        )
    rank = _check_rank(rank, "rank")
    _check_nonce(nonce)
    pids = _check_pids(pids, rank)
    messages = _check_outgoing(outgoing, rank, len(pids))
    expect = _check_expect_from(expect_from, rank, len(pids))
    timeout = _check_timeout(timeout)
    for name, fn in (("cancel", cancel), ("liveness", liveness), ("on_error", on_error)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")
    return _Exchange(rank, nonce, messages, expect, pids, timeout, cancel, liveness, on_error).run()


# ----------------------------------------------------------------------------- validation


def _check_pids(pids: object, rank: int) -> tuple[int, ...]:
    if not isinstance(pids, Sequence) or isinstance(pids, (str, bytes, bytearray)):
        raise TypeError(f"pids must be a sequence of ints, got {type(pids).__name__} {pids!r}")
    for r, pid in enumerate(pids):
        if not _is_int(pid):
            raise TypeError(f"pids[{r}] must be an int, got {type(pid).__name__} {pid!r}")
        if pid <= 0:
            raise ValueError(f"pids[{r}] must be a pid > 0, got {pid!r}")
    if len(pids) <= rank:
        raise ValueError(f"pids has {len(pids)} entries; expected more than rank {rank}")
    if pids[rank] != os.getpid():
        raise ValueError(
            f"pids[{rank}] must be this process's pid {os.getpid()} (rank {rank} is the "
            f"caller), got {pids[rank]!r}"
        )
    return tuple(int(p) for p in pids)


def _check_peer(peer: object, rank: int, world: int, what: str) -> int:
    peer = _check_rank(peer, what)
    if peer == rank:
        raise ValueError(f"{what} is the caller's own rank {rank}; expected another rank")
    if peer >= world:
        raise ValueError(
            f"{what} is {peer}, but pids has only {world} entries (ranks 0..{world - 1})"
        )
    return peer


def _check_outgoing(
    outgoing: object, rank: int, world: int
) -> dict[int, tuple[bytes, tuple[int, ...]]]:
    if not isinstance(outgoing, Mapping):
        raise TypeError(
            f"outgoing must be a mapping peer -> (payload, fds), got {type(outgoing).__name__}"
        )
    messages: dict[int, tuple[bytes, tuple[int, ...]]] = {}
    for key, message in outgoing.items():
        peer = _check_peer(key, rank, world, f"outgoing peer {key!r}")
        if not isinstance(message, (tuple, list)) or len(message) != 2:
            raise TypeError(
                f"outgoing[{peer}] must be a (payload: bytes, fds: sequence of int) pair, "
                f"got {type(message).__name__} {message!r:.200}"
            )
        payload, fds = message
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"outgoing[{peer}] payload must be bytes, got {type(payload).__name__}")
        payload = bytes(payload)
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise ValueError(
                f"outgoing[{peer}] payload has {len(payload)} bytes; at most "
                f"{MAX_PAYLOAD_BYTES} allowed"
            )
        if not isinstance(fds, Sequence) or isinstance(fds, (str, bytes, bytearray)):
            raise TypeError(
                f"outgoing[{peer}] fds must be a sequence of ints, got {type(fds).__name__}"
            )
        if len(fds) > MAX_FDS_PER_MESSAGE:
            raise ValueError(
                f"outgoing[{peer}] has {len(fds)} fds; at most {MAX_FDS_PER_MESSAGE} allowed"
            )
        for fd in fds:
            if not _is_int(fd):
                raise TypeError(
                    f"outgoing[{peer}] fds must be ints, got {type(fd).__name__} {fd!r}"
                )
            try:
                os.fstat(fd)
            except OSError as exc:
                raise ValueError(
                    f"outgoing[{peer}] fd {fd} is not an open file descriptor ({exc.strerror})"
                ) from None
        messages[peer] = (payload, tuple(int(fd) for fd in fds))
    return messages


def _check_expect_from(expect_from: object, rank: int, world: int) -> frozenset[int]:
    if isinstance(expect_from, (str, bytes, bytearray)) or not isinstance(expect_from, Iterable):
        raise TypeError(
            f"expect_from must be an iterable of ranks, got {type(expect_from).__name__}"
        )
    expect: set[int] = set()
    for value in expect_from:
        peer = _check_peer(value, rank, world, f"expect_from rank {value!r}")
        if peer in expect:
            raise ValueError(f"expect_from names rank {peer} twice; expected distinct ranks")
        expect.add(peer)
    return frozenset(expect)


def _check_timeout(timeout: object) -> float:
    if not isinstance(timeout, numbers.Real) or isinstance(timeout, bool):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    return float(timeout)


# ----------------------------------------------------------------------------- the exchange


class _Exchange:
    """One call of ``exchange_fds``: its deadline, its polls and its outcome. ``sender`` and
    ``receiver`` are its two ends; ``run`` drives both through one selector and, whatever
    happens, closes every socket before it returns or raises (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        nonce: str,
        messages: dict[int, tuple[bytes, tuple[int, ...]]],
        expect: frozenset[int],
        pids: tuple[int, ...],
        timeout: float,
        cancel: Callable[[], str] | None = None,
        liveness: Callable[[], tuple[int, str] | None] | None = None,
        on_error: Callable[[FdExchangeError], None] | None = None,
    ) -> None:
        self.rank = rank
        self.cancel = cancel
        self.liveness = liveness
        self.on_error = on_error
        self.next_cancel_check = 0.0
        self.nonce = nonce
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.sender = _Sender(rank, nonce, messages, pids)
        self.receiver = _Receiver(rank, nonce, expect, pids, self._error)
        self.sel: selectors.BaseSelector | None = None

    # -- driver

    def run(self) -> dict[int, tuple[bytes, list[int]]]:
        succeeded = False
        try:
            self.sel = self.sender.sel = self.receiver.sel = selectors.DefaultSelector()
            self.receiver.listen()
            while not self._settled():
                now = time.monotonic()
                if now >= self.deadline:
                    raise self._error(f"timed out after {self.timeout:g}s", peers=True)
                if self.polled and now >= self.next_cancel_check:
                    self.next_cancel_check = now + _CANCEL_POLL_S
                    self._poll_peers()
                self.sender.start_due(now)
                wake = min([self.deadline] + self.sender.waits())
                if self.polled:
                    wake = min(wake, self.next_cancel_check)
                for key, _mask in self.sel.select(max(0.0, wake - time.monotonic())):
                    key.data()
            if any(out.state == "failed" for out in self.sender.outgoing.values()):
                raise self._error("failed", peers=True)
            succeeded = True
            return dict(self.receiver.received)
        except FdExchangeError as exc:
            self._report(exc)
            raise
        except OSError as exc:  # a local socket failure (EMFILE, ENOBUFS, ...)
            error = self._error(f"failed locally ({exc})")
            self._report(error)
            raise error from exc
        finally:
            self._close_all(keep_received=succeeded)

    def _report(self, error: FdExchangeError) -> None:
        """``on_error(error)`` before ``_close_all`` breaks the connections (see exchange_fds)."""
        if self.on_error is None:
            return
        try:
            self.on_error(error)
        except Exception as exc:  # the exchange's own error is the one raised
            _log.error("rank %d: on_error for %r failed: %s", self.rank, self.nonce, exc)

    @property
    def polled(self) -> bool:
        return self.cancel is not None or self.liveness is not None

    def _poll_peers(self) -> None:
        """``cancel`` then ``liveness``; raises when either ends the exchange."""
        reason = self.cancel() if self.cancel is not None else ""
        if reason:
            raise self._error(f"cancelled ({reason})")
        gone = self.liveness() if self.liveness is not None else None
        if gone is not None:
            peer, why = gone
            raise self._error(f"lost a peer ({why})", lost=[peer])

    def _settled(self) -> bool:
        return self.receiver.done() and self.sender.settled()

    def _error(
        self, what: str, *, peers: bool = False, lost: list[int] | None = None
    ) -> FdExchangeError:
        outgoing = self.sender.outgoing
        dropped = self.receiver.dropped
        missing = self.receiver.missing()
        undelivered = sorted(p for p, out in outgoing.items() if out.state != "done")
        message = (
            f"rank {self.rank}, nonce {self.nonce!r}: fd exchange {what}; still expecting "
            f"messages from ranks {missing}; could not deliver to ranks {undelivered}"
        )
        if undelivered:
            reasons = "; ".join(f"rank {p}: {outgoing[p].reason}" for p in undelivered)
            message += f" ({reasons})"
        notes = [f"rank {r}: {dropped[r]}" for r in missing if r in dropped]
        if notes:
            message += f"; dropped incoming messages ({'; '.join(notes)})"
        # blame the ranks whose message never came and those our connection failed to; a peer
        # that merely had not acknowledged yet (it gave up at the same deadline) is not lost
        failed = {p for p, out in outgoing.items() if out.state == "failed"}
        if lost is None:
            lost = sorted(set(missing) | failed) if peers else []
        return FdExchangeError(
            message, missing_from=missing, unreachable=undelivered, peers_lost=lost
        )

    def _close_all(self, *, keep_received: bool) -> None:
        """Incoming connections, outgoing ones, the listener, the selector; the received fds
        too unless they go to the caller."""
        self.receiver.close_connections()
        self.sender.close()
        self.receiver.close_listener()
        if self.sel is not None:
            self.sel.close()
            self.sel = None
        if not keep_received:
            self.receiver.close_received()
