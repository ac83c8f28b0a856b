"""The wire format of ``vmmkv.ipc.fdpass``, shared by its sending side (``vmmkv.ipc.fdsend``)
and its receiving side (``vmmkv.ipc.fdrecv``): socket names, the message layout, and the
``SO_PEERCRED`` and fd-closing helpers both ends use. Local, pure (no socket is opened here),
no torch.

Protocol version 1; one connection per (sender, receiver) pair; little-endian:

* sender -> receiver: a 92-byte header ``<4sHHIIQI64s``: magic ``b"VMFD"``, version, flags (0),
  sender rank, receiver rank, payload length, total fd count, nonce (ASCII, NUL-padded); then the
  payload bytes; then ``ceil(fd_count / 250)`` batches, each a ``u32`` count sent by one
  ``sendmsg`` carrying exactly that many fds as ``SCM_RIGHTS`` (Linux allows 253 per message).
* receiver -> sender: one byte ``0x06`` once the whole message has been validated; a connection
  closed without it means the receiver refused the message (its log says why).

The socket name depends only on (nonce, rank): ``b"\\0vmmkv-<nonce>-<rank>"`` in the abstract
namespace.
"""

from __future__ import annotations

import logging
import numbers
import os
import re
import socket
import struct
from collections.abc import Iterable

# Both ends log as the exchange they belong to.
_log = logging.getLogger("vmmkv.ipc.fdpass")

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
_SCM_MAX_FD = 253


def socket_name(nonce: str, rank: int) -> bytes:
    """Abstract ``AF_UNIX`` address ``b"\\0vmmkv-<nonce>-<rank>"`` where ``rank`` listens.

    ``nonce``: 1 to 64 characters of ``[0-9a-zA-Z_-]``; ``rank``: an int >= 0.
    """
    _check_nonce(nonce)
    rank = _check_rank(rank, "rank")
    return b"\0vmmkv-" + nonce.encode("ascii") + b"-" + str(rank).encode("ascii")


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


def _peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of ``sock`` (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


def _close_fds(fds: Iterable[int]) -> None:
    """Close every fd of ``fds``; a failure is logged (DEBUG), never raised."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            _log.debug("closing received fd %d failed", fd, exc_info=True)


def _segments(
    rank: int, peer: int, nonce: bytes, payload: bytes, fds: tuple[int, ...]
) -> list[tuple[bytes, tuple[int, ...]]]:
    """The message from ``rank`` to ``peer`` as its sender writes it: ``(bytes, fds)`` segments
    in order, the fds of a segment sent with its first byte."""
    header = _HEADER.pack(_MAGIC, PROTOCOL_VERSION, 0, rank, peer, len(payload), len(fds), nonce)
    segments: list[tuple[bytes, tuple[int, ...]]] = [(header, ())]
    if payload:
        segments.append((payload, ()))
    for start in range(0, len(fds), FDS_PER_BATCH):
        batch = fds[start : start + FDS_PER_BATCH]
        segments.append((_BATCH.pack(len(batch)), batch))
    return segments
