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

Wire format, protocol version 1; one connection per (sender, receiver) pair; little-endian:

* sender -> receiver: a 92-byte header ``<4sHHIIQI64s``: magic ``b"VMFD"``, version, flags (0),
  sender rank, receiver rank, payload length, total fd count, nonce (ASCII, NUL-padded); then the
  payload bytes; then ``ceil(fd_count / 250)`` batches, each a ``u32`` count sent by one
  ``sendmsg`` carrying exactly that many fds as ``SCM_RIGHTS`` (Linux allows 253 per message).
* receiver -> sender: one byte ``0x06`` once the whole message has been validated; a connection
  closed without it means the receiver refused the message (its log says why).
"""

from __future__ import annotations

import array
import errno
import logging
import math
import numbers
import os
import re
import selectors
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

__all__ = ["FdExchangeError", "PROTOCOL_VERSION", "exchange_fds", "socket_name"]

_log = logging.getLogger(__name__)
_CANCEL_POLL_S = 0.02

PROTOCOL_VERSION = 1
FDS_PER_BATCH = 250
MAX_PAYLOAD_BYTES = 1 << 30
MAX_FDS_PER_MESSAGE = 1 << 20

_MAGIC = b"VMFD"
_HEADER = struct.Struct("<4sHHIIQI64s")
_BATCH = struct.Struct("<I")
_ACK = b"\x06"
_NONCE_RE = re.compile(r"[0-9A-Za-z_-]{1,64}")
_MAX_RANK = (1 << 31) - 1
_RECV_CHUNK = 1 << 16
_SCM_MAX_FD = 253
_RETRY_MIN_S = 0.005
_RETRY_MAX_S = 0.05
# Errors that mean "the peer is not listening yet" (or its backlog is momentarily full).
_RETRYABLE_CONNECT = frozenset({errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN})


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


def socket_name(nonce: str, rank: int) -> bytes:
    """Abstract ``AF_UNIX`` address ``b"\\0vmmkv-<nonce>-<rank>"`` where ``rank`` listens.

    ``nonce``: 1 to 64 characters of ``[0-9a-zA-Z_-]``; ``rank``: an int >= 0.
    """
    _check_nonce(nonce)
    rank = _check_rank(rank, "rank")
    return b"\0vmmkv-" + nonce.encode("ascii") + b"-" + str(rank).encode("ascii")


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
    ``RuntimeError`` off Linux. See the module docstring for ownership and the wire format.
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


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_rank(value: object, what: str) -> int:
    if not _is_int(value):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= int(value) <= _MAX_RANK:
        raise ValueError(f"{what} must be in [0, {_MAX_RANK}], got {value!r}")
    return int(value)


def _check_nonce(nonce: object) -> None:
    if not isinstance(nonce, str):
        raise TypeError(f"nonce must be a str, got {type(nonce).__name__} {nonce!r}")
    if not _NONCE_RE.fullmatch(nonce):
        raise ValueError(
            f"nonce must be 1 to 64 characters of [0-9a-zA-Z_-], got {nonce!r} "
            f"({len(nonce)} characters)"
        )


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


class _Refused(Exception):
    """An incoming connection breaks the protocol or the security rules."""


@dataclass(eq=False)
class _Outgoing:
    peer: int
    segments: list[tuple[bytes, tuple[int, ...]]]
    state: str = "connect"  # connect -> send -> ack -> done | failed
    sock: socket.socket | None = None
    segment: int = 0
    offset: int = 0
    not_before: float = 0.0  # next connect attempt, or end of an ETOOMANYREFS back-off
    paused: bool = False
    attempts: int = 0
    warned_squatter: bool = False
    reason: str = "never connected"


@dataclass(eq=False)
class _Incoming:
    sock: socket.socket
    pid: int
    uid: int
    buf: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)
    sender: int | None = None
    payload_len: int = 0
    fd_count: int = 0
    payload: bytes | None = None
    announced: int = 0
    bytes_seen: int = 0


def _peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


def _close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            _log.debug("closing received fd %d failed", fd, exc_info=True)


def _segments(
    rank: int, peer: int, nonce: bytes, payload: bytes, fds: tuple[int, ...]
) -> list[tuple[bytes, tuple[int, ...]]]:
    header = _HEADER.pack(_MAGIC, PROTOCOL_VERSION, 0, rank, peer, len(payload), len(fds), nonce)
    segments: list[tuple[bytes, tuple[int, ...]]] = [(header, ())]
    if payload:
        segments.append((payload, ()))
    for start in range(0, len(fds), FDS_PER_BATCH):
        batch = fds[start : start + FDS_PER_BATCH]
        segments.append((_BATCH.pack(len(batch)), batch))
    return segments


class _Exchange:
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
        self.nonce_bytes = nonce.encode("ascii")
        self.expect = expect
        self.pids = pids
        self.pid_set = frozenset(pids)
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.anc_space = socket.CMSG_SPACE(_SCM_MAX_FD * array.array("i").itemsize)
        self.outgoing = {
            peer: _Outgoing(peer, _segments(rank, peer, self.nonce_bytes, payload, fds))
            for peer, (payload, fds) in sorted(messages.items())
        }
        self.sel: selectors.BaseSelector | None = None
        self.listener: socket.socket | None = None
        self.incoming: list[_Incoming] = []
        self.claimed: dict[int, _Incoming] = {}
        self.received: dict[int, tuple[bytes, list[int]]] = {}
        self.dropped: dict[int, str] = {}  # why a started message from a rank was dropped
        self.uid = os.getuid()
        self.warned: set[int] = set()  # pids already warned about: one warning each

    # -- driver

    def run(self) -> dict[int, tuple[bytes, list[int]]]:
        succeeded = False
        try:
            self.sel = selectors.DefaultSelector()
            self._listen()
            while not self._settled():
                now = time.monotonic()
                if now >= self.deadline:
                    raise self._error(f"timed out after {self.timeout:g}s", peers=True)
                if self.polled and now >= self.next_cancel_check:
                    self.next_cancel_check = now + _CANCEL_POLL_S
                    self._poll_peers()
                self._start_due(now)
                wake = min(
                    [self.deadline]
                    + [
                        out.not_before
                        for out in self.outgoing.values()
                        if out.state == "connect" or out.paused
                    ]
                )
                if self.polled:
                    wake = min(wake, self.next_cancel_check)
                for key, _mask in self.sel.select(max(0.0, wake - time.monotonic())):
                    key.data()
            if any(out.state == "failed" for out in self.outgoing.values()):
                raise self._error("failed", peers=True)
            succeeded = True
            return dict(self.received)
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
        return len(self.received) == len(self.expect) and all(
            out.state in ("done", "failed") for out in self.outgoing.values()
        )

    def _error(
        self, what: str, *, peers: bool = False, lost: list[int] | None = None
    ) -> FdExchangeError:
        missing = sorted(self.expect - self.received.keys())
        undelivered = sorted(p for p, out in self.outgoing.items() if out.state != "done")
        message = (
            f"rank {self.rank}, nonce {self.nonce!r}: fd exchange {what}; still expecting "
            f"messages from ranks {missing}; could not deliver to ranks {undelivered}"
        )
        if undelivered:
            reasons = "; ".join(f"rank {p}: {self.outgoing[p].reason}" for p in undelivered)
            message += f" ({reasons})"
        notes = [f"rank {r}: {self.dropped[r]}" for r in missing if r in self.dropped]
        if notes:
            message += f"; dropped incoming messages ({'; '.join(notes)})"
        # blame the ranks whose message never came and those our connection failed to; a peer
        # that merely had not acknowledged yet (it gave up at the same deadline) is not lost
        failed = {p for p, out in self.outgoing.items() if out.state == "failed"}
        if lost is None:
            lost = sorted(set(missing) | failed) if peers else []
        return FdExchangeError(
            message, missing_from=missing, unreachable=undelivered, peers_lost=lost
        )

    def _close_all(self, *, keep_received: bool) -> None:
        for conn in self.incoming:
            conn.sock.close()
            _close_fds(conn.fds)
            conn.fds = []
        self.incoming.clear()
        self.claimed.clear()
        for out in self.outgoing.values():
            if out.sock is not None:
                out.sock.close()
                out.sock = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.sel is not None:
            self.sel.close()
            self.sel = None
        if not keep_received:
            for _payload, fds in self.received.values():
                _close_fds(fds)
            self.received.clear()

    # -- listening side

    def _listen(self) -> None:
        name = socket_name(self.nonce, self.rank)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener = listener
        listener.setblocking(False)
        try:
            listener.bind(name)
        except OSError as exc:
            holders = _socket_holders(name) if exc.errno == errno.EADDRINUSE else []
            who = f"held by pids {holders}" if holders else "another exchange with this nonce?"
            raise self._error(f"could not listen on {name!r} ({exc.strerror}; {who})") from exc
        listener.listen(max(64, 2 * len(self.expect)))
        self.sel.register(listener, selectors.EVENT_READ, self._on_accept)

    def _on_accept(self) -> None:
        while True:
            try:
                sock, _addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno == errno.ECONNABORTED:
                    continue
                raise self._error(f"failed to accept a connection ({exc.strerror})") from exc
            sock.setblocking(False)
            pid, uid, _gid = _peer_credentials(sock)
            if pid not in self.pid_set or uid != self.uid:
                self._warn_refused(
                    pid,
                    f"refused a connection from pid {pid} (uid {uid}): not a member of the "
                    f"group (pids {list(self.pids)}, uid {self.uid})",
                )
                sock.close()
                continue
            conn = _Incoming(sock, pid, uid)
            self.incoming.append(conn)
            self.sel.register(sock, selectors.EVENT_READ, partial(self._on_incoming, conn))

    def _warn_refused(self, pid: int, message: str) -> None:
        """One WARNING per offending pid and exchange, DEBUG afterwards: a sender retries every
        few milliseconds, and a refusal loop must not flood the log."""
        level = logging.DEBUG if pid in self.warned else logging.WARNING
        self.warned.add(pid)
        _log.log(level, "rank %d: %s", self.rank, message)

    def _on_incoming(self, conn: _Incoming) -> None:
        try:
            data, ancdata, flags, _addr = conn.sock.recvmsg(
                _RECV_CHUNK, self.anc_space, socket.MSG_CMSG_CLOEXEC
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(conn, f"receive failed ({exc.strerror})", warn=True)
            return
        # Take ownership of every fd that came before looking at anything else.
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
                conn.fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            soft, hard = _nofile_limits()
            try:
                held = str(len(os.listdir("/proc/self/fd")))
            except OSError:  # EMFILE: not one fd left to list them with
                held = "all its"
            self._drop(conn, "file descriptors were truncated (MSG_CTRUNC)", warn=True)
            raise self._error(
                f"lost file descriptors from pid {conn.pid} (MSG_CTRUNC): its message carries "
                f"{conn.fd_count} fds and this process held {held} open files, against an "
                f"RLIMIT_NOFILE soft limit of {soft} and hard limit of {hard}: raise the limits "
                "or send fewer fds per message"
            )
        if not data:
            self._drop(
                conn,
                "closed the connection before the message was complete",
                warn=conn.bytes_seen > 0,
            )
            return
        conn.bytes_seen += len(data)
        conn.buf += data
        try:
            complete = self._parse(conn)
        except _Refused as exc:
            self._drop(conn, f"refused: {exc}", warn=True)
            return
        if complete:
            self._complete(conn)

    def _parse(self, conn: _Incoming) -> bool:
        """Consume ``conn.buf``; True once the whole message arrived and checked out."""
        buf = conn.buf
        if conn.sender is None:
            if len(buf) < _HEADER.size:
                return False
            magic, version, _flags, sender, receiver, payload_len, fd_count, nonce = (
                _HEADER.unpack_from(buf)
            )
            if magic != _MAGIC:
                raise _Refused(f"bad magic {magic!r}, expected {_MAGIC!r}")
            if version != PROTOCOL_VERSION:
                raise _Refused(f"protocol version {version}, expected {PROTOCOL_VERSION}")
            nonce = nonce.rstrip(b"\0")
            if nonce != self.nonce_bytes:
                raise _Refused(f"header nonce {nonce!r} is not ours")
            if receiver != self.rank:
                raise _Refused(f"message is addressed to rank {receiver}")
            if sender not in self.expect:
                raise _Refused(f"rank {sender} is not one we expect ({sorted(self.expect)})")
            if self.pids[sender] != conn.pid:
                raise _Refused(f"claims to be rank {sender}, whose pid is {self.pids[sender]}")
            if sender in self.received or sender in self.claimed:
                raise _Refused(f"rank {sender} already has a connection")
            if payload_len > MAX_PAYLOAD_BYTES or fd_count > MAX_FDS_PER_MESSAGE:
                raise _Refused(f"announces {payload_len} payload bytes and {fd_count} fds")
            conn.sender = sender
            conn.payload_len = payload_len
            conn.fd_count = fd_count
            self.claimed[sender] = conn
            del buf[: _HEADER.size]
        if conn.payload is None:
            if len(buf) < conn.payload_len:
                return False
            conn.payload = bytes(buf[: conn.payload_len])
            del buf[: conn.payload_len]
        while conn.announced < conn.fd_count and len(buf) >= _BATCH.size:
            (count,) = _BATCH.unpack_from(buf)
            del buf[: _BATCH.size]
            if not 1 <= count <= _SCM_MAX_FD or conn.announced + count > conn.fd_count:
                raise _Refused(
                    f"bad fd batch of {count} after {conn.announced} of {conn.fd_count} fds"
                )
            conn.announced += count
        if len(conn.fds) > conn.fd_count:
            raise _Refused(f"sent {len(conn.fds)} fds but announced {conn.fd_count}")
        if conn.announced < conn.fd_count:
            return False
        if buf:
            raise _Refused(f"{len(buf)} bytes after the end of the message")
        if len(conn.fds) != conn.fd_count:
            raise _Refused(f"sent {len(conn.fds)} fds but announced {conn.fd_count}")
        return True

    def _complete(self, conn: _Incoming) -> None:
        sender = conn.sender
        assert sender is not None and conn.payload is not None
        self.received[sender] = (conn.payload, conn.fds)
        conn.fds = []
        del self.claimed[sender]
        try:
            conn.sock.send(_ACK, socket.MSG_NOSIGNAL)
        except OSError as exc:
            _log.debug("rank %d: could not acknowledge rank %d: %s", self.rank, sender, exc)
        self._forget(conn)

    def _drop(self, conn: _Incoming, reason: str, *, warn: bool) -> None:
        log = _log.warning if warn else _log.debug
        claim = "" if conn.sender is None else f" (rank {conn.sender})"
        log("rank %d: dropped the connection from pid %d%s: %s", self.rank, conn.pid, claim, reason)
        if conn.sender is not None and self.claimed.get(conn.sender) is conn:
            del self.claimed[conn.sender]
            self.dropped[conn.sender] = reason
        _close_fds(conn.fds)
        conn.fds = []
        self._forget(conn)

    def _forget(self, conn: _Incoming) -> None:
        self.sel.unregister(conn.sock)
        conn.sock.close()
        self.incoming.remove(conn)

    # -- sending side

    def _start_due(self, now: float) -> None:
        for out in self.outgoing.values():
            if out.not_before > now:
                continue
            if out.state == "connect":
                self._connect(out, now)
            elif out.paused:
                out.paused = False
                self.sel.register(out.sock, selectors.EVENT_WRITE, partial(self._on_send, out))

    def _retry_later(self, out: _Outgoing, now: float, reason: str) -> None:
        out.attempts += 1
        out.not_before = now + min(_RETRY_MAX_S, _RETRY_MIN_S * (1 << min(out.attempts, 4)))
        out.reason = reason

    def _connect(self, out: _Outgoing, now: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        err = sock.connect_ex(socket_name(self.nonce, out.peer))
        if err in _RETRYABLE_CONNECT:
            sock.close()
            self._retry_later(
                out, now, f"not listening ({errno.errorcode.get(err, err)} on every attempt)"
            )
            return
        if err != 0:
            sock.close()
            self._fail(out, f"connect failed ({os.strerror(err)})")
            return
        pid, uid, _gid = _peer_credentials(sock)
        if pid != self.pids[out.peer] or uid != self.uid:
            sock.close()
            if not out.warned_squatter:
                out.warned_squatter = True
                _log.warning(
                    "rank %d: the socket of rank %d is held by pid %d (uid %d), not by its "
                    "pid %d (uid %d); not sending, retrying until the deadline",
                    self.rank,
                    out.peer,
                    pid,
                    uid,
                    self.pids[out.peer],
                    self.uid,
                )
            self._retry_later(
                out, now, f"its socket is held by pid {pid} (uid {uid}), not {self.pids[out.peer]}"
            )
            return
        out.sock = sock
        out.state = "send"
        out.reason = "connected, message not fully sent"
        self.sel.register(sock, selectors.EVENT_WRITE, partial(self._on_send, out))

    def _on_send(self, out: _Outgoing) -> None:
        while out.segment < len(out.segments):
            data, fds = out.segments[out.segment]
            ancdata = []
            if fds and out.offset == 0:
                ancdata = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            try:
                sent = out.sock.sendmsg(
                    [memoryview(data)[out.offset :]], ancdata, socket.MSG_NOSIGNAL
                )
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno == errno.ETOOMANYREFS:
                    # Too many fds of this user in flight; receivers are draining them.
                    self.sel.unregister(out.sock)
                    out.paused = True
                    out.not_before = time.monotonic() + _RETRY_MIN_S
                    out.reason = "too many fds in flight (ETOOMANYREFS) until the deadline"
                    return
                self._fail(
                    out,
                    f"the connection broke while sending ({exc.strerror}): it refused the message "
                    f"or gave up (see its log)",
                )
                return
            # A partial write already carried the fds (Linux attaches them to the first byte).
            out.offset += sent
            if out.offset == len(data):
                out.segment += 1
                out.offset = 0
        out.state = "ack"
        out.reason = "message sent, never acknowledged"
        self.sel.modify(out.sock, selectors.EVENT_READ, partial(self._on_ack, out))

    def _on_ack(self, out: _Outgoing) -> None:
        try:
            reply = out.sock.recv(len(_ACK) + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(
                out,
                f"the connection broke before the acknowledgement ({exc.strerror}): it refused "
                f"the message or gave up (see its log)",
            )
            return
        if reply == _ACK:
            out.state = "done"
            out.reason = ""
            self._release(out)
        elif not reply:
            self._fail(
                out,
                "it closed the connection without acknowledging: it refused the message or gave up "
                "(see its log)",
            )
        else:
            self._fail(out, f"unexpected reply {reply!r}")

    def _fail(self, out: _Outgoing, reason: str) -> None:
        out.state = "failed"
        out.reason = reason
        self._release(out)

    def _release(self, out: _Outgoing) -> None:
        if out.sock is not None:
            if not out.paused:
                self.sel.unregister(out.sock)
            out.sock.close()
            out.sock = None
        out.paused = False


def _nofile_limits() -> tuple[int, int]:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _socket_holders(name: bytes) -> list[int]:
    """Pids of the processes holding the abstract socket ``name`` (best effort: /proc shows
    only the processes this user may inspect)."""
    wanted = "@" + name[1:].decode("ascii", "replace")
    inodes = set()
    try:
        with open("/proc/net/unix") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if len(parts) >= 8 and parts[7] == wanted:
                    inodes.add(parts[6])
    except OSError:
        return []
    holders = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                link = os.readlink(f"/proc/{entry}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    holders.append(int(entry))
                    break
        except OSError:
            continue
    return sorted(holders)
