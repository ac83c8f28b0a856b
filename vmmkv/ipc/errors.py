"""The errors of the rendezvous and of the resize protocol (``vmmkv.ipc.peers``,
``vmmkv.ipc.symmetric``, ``vmmkv.ipc.resize``), all :class:`vmmkv.ipc.comm.GroupError` s.

Each is the agreed outcome of a collective step, raised on every rank of the group, except
:class:`ExchangeLost` and :class:`PeerAborted`: a transport raises those on one rank during an
exchange, and ``exchange.exchange_then_agree`` turns them into the agreed outcome.
``as_rendezvous_error`` gives a ``GroupError`` of ``vmmkv.ipc.comm`` its rendezvous flavour.
No state, nothing to close.
"""

from __future__ import annotations

from .comm import GroupError, PeerTimeoutError

__all__ = [
    "ConfigMismatch",
    "DirectUnsupported",
    "ExchangeLost",
    "PeerAborted",
    "RendezvousError",
    "RendezvousTimeout",
    "as_rendezvous_error",
]


class RendezvousError(GroupError):
    """The rendezvous or a resize failed; raised on every rank of the group."""


class RendezvousTimeout(RendezvousError, PeerTimeoutError):
    """Some ranks did not arrive at a step of the rendezvous or a resize (``missing`` names
    them); raised on every rank that got there, late ones included."""

    def __init__(self, message: str, missing: list[int]):
        PeerTimeoutError.__init__(self, message, missing)


class ExchangeLost(RendezvousError):
    """The by-value exchange timed out: ``peers_lost`` did not arrive (like
    ``fdpass.FdExchangeError`` for the fd transport)."""

    def __init__(self, message: str, peers_lost: list[int]):
        super().__init__(message)
        self.peers_lost = list(peers_lost)


class PeerAborted(RendezvousError):
    """Peers announced in the fd exchange that they cannot take part; they report their own
    cause in the agreement that follows, so receivers of the notice add no error of theirs."""


class ConfigMismatch(RendezvousError):
    """The ranks' requests disagree (capacity, chunk size, mode, ...): the caller's
    configuration differs between ranks; raised identically on every rank."""


class DirectUnsupported(RendezvousError):
    """Peer mapping is impossible for this group (several NVLink domains, several hosts with fd
    handles, no P2P between two devices, no native atomics); raised identically on every rank,
    so callers can fall back to gather-then-insert together."""


def as_rendezvous_error(exc: GroupError) -> RendezvousError:
    """The rendezvous/resize flavour of a collective failure (timeouts keep ``missing``)."""
    if isinstance(exc, RendezvousError):
        return exc
    if isinstance(exc, PeerTimeoutError):
        return RendezvousTimeout(str(exc), exc.missing)
    return RendezvousError(str(exc))
