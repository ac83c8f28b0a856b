"""How one exchange of the rendezvous or a resize (``vmmkv.ipc.exchange``) moves runs between
ranks: POSIX fds over abstract Unix sockets (``_FdTransport``, ``vmmkv.ipc.fdpass``: one host),
or values through the group's store (``_ValueTransport``, ``BY_VALUE_HANDLES``: CUDA fabric
handles, the host simulation's shm names). The protocol around both (descriptions, abort
notices, mapping, agreement, rollback) is ``exchange.exchange_and_map`` with
``exchange.exchange_then_agree``.

Collective or local: ``exchange`` is the only step that talks to peers (fds: point to point
with every peer; values: one collective step of the store); the caller runs it on every rank
between two collective points, a rank that cannot take part included. Everything else is local.

Ownership: ``discard`` closes the fds this rank exported, sent or not; ``release`` closes every
received fd, mapped or not, and restores the RLIMIT_NOFILE soft limit that the fd exchange
raised (``_raise_fd_limit``); ``finish`` removes the by-value exports (``release_values``) and
runs on every rank after the agreement. A transport maps into the caller's ``PeerRegion`` s and
owns none of them.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Callable
from typing import Any

from ..alloc import Chunk, PeerRegion, VirtualRegion
from . import fdbudget, fdpass
from .comm import GroupError, PeerTimeoutError, StoreComm
from .errors import ExchangeLost, as_rendezvous_error

__all__ = ["BY_VALUE_HANDLES"]

# the rendezvous and its parts log under one name, the module they were split from
log = logging.getLogger("vmmkv.ipc.peers")

# Handle types whose runs travel as values through the group's store (no socket, no fd).
BY_VALUE_HANDLES = ("fabric", "shm_name")
_ONE_ROUND = 1 << 30
_MIN_EXCHANGE_S = 0.05  # a rank that reaches its exchange at the deadline still tries once


class _Transport:
    """How one exchange moves runs (one handle each) between ranks; the protocol around it
    (``exchange.exchange_and_map``: descriptions, abort notices, validation, mapping, agreement and
    rollback) is the same for both. ``export``: a committed run's handle to send (the
    caller ``discard``-s those it does not send); ``exchange``: send ``body`` and the handles
    to every peer, get theirs (``{peer: (body, handles)}``), raising ``FdExchangeError`` or
    :class:`ExchangeLost` (with ``peers_lost``) when peers vanished; ``map`` a received handle;
    ``release`` every received handle (mapped or not) once mapping is over; ``finish`` after
    the agreement, on every rank."""

    what = ""

    def __init__(
        self,
        comm: StoreComm,
        region: VirtualRegion,
        nonce: str,
        pids: list[int],
        *,
        deadline: float | None = None,
        liveness: Callable[[], tuple[int, str] | None] | None = None,
    ) -> None:
        self.comm, self.region, self.nonce, self.pids = comm, region, nonce, pids
        self.deadline, self.liveness = deadline, liveness

    def timeout(self, round_no: int = 0) -> float:
        """Seconds round ``round_no`` of the exchange may still take. Round r ends
        ``min(1 s, timeout / 4) / (r + 1)`` before the step's ``deadline`` (the agreement's,
        ``exchange.exchange_then_agree``): a rank still exchanging (a peer that never sent) then
        settles the step naming the peers it lost while the ranks that finished their exchange
        still wait in the agreement; with one deadline for both, those ranks could settle first
        and name the late rank as missing too. A rank that lost a peer in round r is still in
        round r while the others wait for it in round r + 1: the later round ends later, so the
        rank that lost the peer settles first and the others adopt its cause. Without a
        deadline: the group's timeout."""
        if self.deadline is None:
            return self.comm.timeout
        grace = min(1.0, self.comm.timeout / 4) / (round_no + 1)
        return max(_MIN_EXCHANGE_S, self.deadline - grace - time.monotonic())

    def round_size(self, count: int) -> int:
        """The most handles this rank can take from each peer in one round of an exchange of
        ``count`` own handles (``exchange.exchange_and_map`` uses the smallest any rank offers);
        raises ``FdBudgetError`` when no round fits."""
        raise NotImplementedError

    def export(self, owner: VirtualRegion, chunk: Chunk) -> Any:
        raise NotImplementedError

    def discard(self, handles: list[Any]) -> None:
        pass

    def exchange(
        self, body: bytes, handles: list[Any], others: list[int], per_peer: int, *, round_no: int
    ) -> dict[int, tuple[bytes, list[Any]]]:
        """One round: send ``body`` and ``handles`` to every rank of ``others`` and return what
        each sent; ``per_peer``: the most handles one peer may send in this round; ``round_no``:
        the round's number, the same on every rank."""
        raise NotImplementedError

    def map(self, peer: PeerRegion, handle: Any, chunk: Chunk) -> None:
        raise NotImplementedError

    def release(self, received: dict[int, tuple[bytes, list[Any]]]) -> None:
        pass

    def finish(self) -> None:
        pass


class _FdTransport(_Transport):
    """POSIX fds over abstract Unix sockets (``vmmkv.ipc.fdpass``): one host."""

    what = "fd exchange"

    def round_size(self, count: int) -> int:
        return fdbudget.exchange_round(
            rank=self.comm.rank, world=self.comm.world_size, device=self.region.device,
            what=self.what, runs=count,
        )  # fmt: skip

    def export(self, owner: VirtualRegion, chunk: Chunk) -> int:
        return owner.export_chunk(chunk)

    def discard(self, handles: list[Any]) -> None:
        for fd in handles:
            os.close(fd)

    def exchange(
        self, body: bytes, handles: list[Any], others: list[int], per_peer: int, *, round_no: int
    ) -> dict[int, tuple[bytes, list[Any]]]:
        # The RLIMIT_NOFILE soft limit is raised for the exchange if needed, and restored by
        # ``release`` once the received fds are closed. Sized by what the peers may send, not
        # by what this rank sends: a rank that cannot take part sends nothing but must still
        # receive its peers' fds, or the truncated message would hide its own cause.
        self._restore = _raise_fd_limit((max(len(handles), per_peer) + 1) * (len(others) + 1))
        try:
            return fdpass.exchange_fds(
                rank=self.comm.rank,
                nonce=f"{self.nonce}-{round_no}",  # one socket name per round
                outgoing={p: (body, handles) for p in others},
                expect_from=others,
                pids=self.pids,
                timeout=self.timeout(round_no),
                cancel=self.comm.pending_abort,  # a peer that gave up releases us at once
                liveness=self.liveness,  # a peer whose process is gone, at once too
                on_error=self._give_up,
            )
        except BaseException:
            restore, self._restore = self._restore, None  # release() must not restore again
            restore()
            raise

    def _give_up(self, exc: fdpass.FdExchangeError) -> None:
        """Settle the step that follows the exchange (``exchange.exchange_then_agree``'s
        agreement) with this rank's cause while its connections are still open: a peer whose
        message we had not read yet sees its connection reset when we close and would settle
        the step naming this rank as lost, though this rank only gave up because another peer
        died (once seen in CI: three ranks, the last killed after its exchange; rank 0 named
        rank 1). Settled first, our cause is the one every rank raises. The agreement then
        settles the same record again, which changes nothing (first writer wins)."""
        self.comm.abort_next(str(exc), self.what, missing=exc.peers_lost)

    def map(self, peer: PeerRegion, handle: Any, chunk: Chunk) -> None:
        peer.map_fd(handle, chunk)

    def release(self, received: dict[int, tuple[bytes, list[Any]]]) -> None:
        try:
            for _, fds in received.values():
                for fd in fds:
                    os.close(fd)
        finally:
            restore, self._restore = getattr(self, "_restore", None), None
            if restore is not None:
                restore()


class _ValueTransport(_Transport):
    """By-value handles (``BY_VALUE_HANDLES``: CUDA fabric handles, the host simulation's shm
    names) through the group's store, one collective step; the exports are removed by
    ``finish`` (``release_values(nonce)``), which every rank runs after the agreement, so a
    dead exporter's names go too."""

    what = "handle exchange"

    def round_size(self, count: int) -> int:
        return _ONE_ROUND  # values hold no fd: every handle travels in one store step

    def export(self, owner: VirtualRegion, chunk: Chunk) -> bytes:
        return owner.export_chunk_value(chunk, self.nonce)

    def exchange(
        self, body: bytes, handles: list[Any], others: list[int], per_peer: int, *, round_no: int
    ) -> dict[int, tuple[bytes, list[Any]]]:
        mine = [body.decode(), [h.hex() for h in handles]]
        try:
            got = self.comm.all_gather(
                mine, "by-value handle exchange", timeout=self.timeout(round_no)
            )
        except PeerTimeoutError as exc:
            raise ExchangeLost(str(exc), exc.missing) from None
        except GroupError as exc:
            raise as_rendezvous_error(exc) from None
        return {p: (got[p][0].encode(), [bytes.fromhex(v) for v in got[p][1]]) for p in others}

    def map(self, peer: PeerRegion, handle: Any, chunk: Chunk) -> None:
        peer.map_value(handle, chunk)

    def finish(self) -> None:
        try:
            self.region.release_values(self.nonce)
        except Exception as exc:  # logged: the exchange's own outcome is the one raised
            log.error("rank %d: removing by-value exports failed: %s", self.comm.rank, exc)


def _raise_fd_limit(needed: int) -> Callable[[], None]:
    """Raise the RLIMIT_NOFILE soft limit (up to the hard one) so that ``needed`` more fds fit
    (a receiver holds every fd of an exchange until it has mapped them); returns the undo,
    which restores the caller's limit once those fds are closed (select() users of the
    process keep their FD_SETSIZE world)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = len(os.listdir("/proc/self/fd")) + needed + 64
    if soft == resource.RLIM_INFINITY or want <= soft:
        return lambda: None
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    log.info("vmmkv: RLIMIT_NOFILE soft limit %d -> %d for an fd exchange", soft, new)

    def restore() -> None:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        except (OSError, ValueError) as exc:
            log.warning("vmmkv: could not restore RLIMIT_NOFILE to %d: %s", soft, exc)

    return restore
