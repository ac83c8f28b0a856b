"""The receiving side of one ``vmmkv.ipc.fdpass`` exchange: the listening socket, the
connections it accepts, their checks (``SO_PEERCRED``, the header) and the acknowledgement.
Local, no torch; driven by the exchange's ``selectors`` loop in the calling thread.

Contract:
- ``_Receiver`` owns its listener, every accepted connection and every fd received: the fds of a
  complete message sit in ``received`` until the exchange hands them to its caller, else
  ``close_received`` closes them. Fds of a connection that is refused or dropped are closed at
  once.
- A refusal (a stranger's pid or uid, a bad header, a forged rank, a second message from one
  rank) closes that connection and logs why (one WARNING per pid and exchange); the real
  sender may still connect. The receiver ends the exchange only with the exchange's own error
  (``error``, built from the whole exchange's state) when it cannot go on: a name another
  process holds, an ``accept`` failure, fds lost to ``MSG_CTRUNC``; a local socket error
  propagates as ``OSError``, which the exchange reports.
"""

from __future__ import annotations

import array
import errno
import logging
import os
import selectors
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from .fdwire import (
    _ACK,
    _BATCH,
    _HEADER,
    _MAGIC,
    _SCM_MAX_FD,
    MAX_FDS_PER_MESSAGE,
    MAX_PAYLOAD_BYTES,
    PROTOCOL_VERSION,
    _close_fds,
    _peer_credentials,
    socket_name,
)

# One logger for the whole exchange, both its ends.
_log = logging.getLogger("vmmkv.ipc.fdpass")

_RECV_CHUNK = 1 << 16


class _Refused(Exception):
    """An incoming connection breaks the protocol or the security rules."""


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


class _Receiver:
    """Receives one message from every rank of ``expect`` (see the module docstring); ``error``
    builds the exchange's error (an ``FdExchangeError``) from a short ``what``."""

    def __init__(
        self,
        rank: int,
        nonce: str,
        expect: frozenset[int],
        pids: tuple[int, ...],
        error: Callable[[str], Exception],
    ) -> None:
        self.rank = rank
        self.nonce = nonce
        self.nonce_bytes = nonce.encode("ascii")
        self.expect = expect
        self.pids = pids
        self.pid_set = frozenset(pids)
        self.uid = os.getuid()
        self.error = error
        self.anc_space = socket.CMSG_SPACE(_SCM_MAX_FD * array.array("i").itemsize)
        self.sel: selectors.BaseSelector | None = None  # the exchange's, set before listen
        self.listener: socket.socket | None = None
        self.incoming: list[_Incoming] = []
        self.claimed: dict[int, _Incoming] = {}
        self.received: dict[int, tuple[bytes, list[int]]] = {}
        self.dropped: dict[int, str] = {}  # why a started message from a rank was dropped
        self.warned: set[int] = set()  # pids already warned about: one warning each

    def done(self) -> bool:
        """Every expected message arrived."""
        return len(self.received) == len(self.expect)

    def missing(self) -> list[int]:
        """The expected ranks whose message has not arrived, sorted."""
        return sorted(self.expect - self.received.keys())

    def close_connections(self) -> None:
        """Close every accepted connection and the fds of its partial message."""
        for conn in self.incoming:
            conn.sock.close()
            _close_fds(conn.fds)
            conn.fds = []
        self.incoming.clear()
        self.claimed.clear()

    def close_listener(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def close_received(self) -> None:
        """Close the fds of every complete message (the exchange failed: nobody takes them)."""
        for _payload, fds in self.received.values():
            _close_fds(fds)
        self.received.clear()

    def listen(self) -> None:
        name = socket_name(self.nonce, self.rank)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener = listener
        listener.setblocking(False)
        try:
            listener.bind(name)
        except OSError as exc:
            holders = _socket_holders(name) if exc.errno == errno.EADDRINUSE else []
            who = f"held by pids {holders}" if holders else "another exchange with this nonce?"
            raise self.error(f"could not listen on {name!r} ({exc.strerror}; {who})") from exc
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
                raise self.error(f"failed to accept a connection ({exc.strerror})") from exc
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
            raise self.error(
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
