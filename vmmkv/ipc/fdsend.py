"""The sending side of one ``vmmkv.ipc.fdpass`` exchange: one connection per peer, each
connected (retried until the peer listens), checked (``SO_PEERCRED``: the listener must be the
peer's pid and our uid), written (header, payload, fd batches as ``SCM_RIGHTS``) and
acknowledged. Local, no torch; driven by the exchange's ``selectors`` loop in the calling thread.

Contract:
- ``_Sender`` owns its sockets; the fds it sends stay the caller's (never closed here: the
  kernel holds its own reference to fds in flight).
- It never raises for a peer: a peer that cannot be reached or refuses ends in state
  ``"failed"`` with a ``reason``; the exchange decides. A local socket error (``socket()``
  failing, e.g. EMFILE) propagates as ``OSError``.
"""

from __future__ import annotations

import array
import errno
import logging
import os
import selectors
import socket
import time
from dataclasses import dataclass
from functools import partial

from .fdwire import _ACK, _peer_credentials, _segments, socket_name

# One logger for the whole exchange, both its ends.
_log = logging.getLogger("vmmkv.ipc.fdpass")

_RETRY_MIN_S = 0.005
_RETRY_MAX_S = 0.05
# Errors that mean "the peer is not listening yet" (or its backlog is momentarily full).
_RETRYABLE_CONNECT = frozenset({errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN})


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


class _Sender:
    """Sends ``messages[peer] = (payload, fds)`` to every peer (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        nonce: str,
        messages: dict[int, tuple[bytes, tuple[int, ...]]],
        pids: tuple[int, ...],
    ) -> None:
        self.rank = rank
        self.nonce = nonce
        self.pids = pids
        self.uid = os.getuid()
        nonce_bytes = nonce.encode("ascii")
        self.outgoing = {
            peer: _Outgoing(peer, _segments(rank, peer, nonce_bytes, payload, fds))
            for peer, (payload, fds) in sorted(messages.items())
        }
        self.sel: selectors.BaseSelector | None = None  # the exchange's, set before start_due

    def settled(self) -> bool:
        """Every message was acknowledged or failed."""
        return all(out.state in ("done", "failed") for out in self.outgoing.values())

    def waits(self) -> list[float]:
        """When the connections waiting to connect or to resume sending are due."""
        return [
            out.not_before for out in self.outgoing.values() if out.state == "connect" or out.paused
        ]

    def close(self) -> None:
        for out in self.outgoing.values():
            if out.sock is not None:
                out.sock.close()
                out.sock = None

    def start_due(self, now: float) -> None:
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
