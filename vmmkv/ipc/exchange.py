"""One exchange of runs between the ranks of a group, and the agreement that settles it: what the
rendezvous (``vmmkv.ipc.peers``) and every grow (``vmmkv.ipc.resize``) run between two
collective points.

- ``exchange_and_map``: every rank sends its runs (each one handle: an fd or a by-value
  handle, with its offset and size) to every peer over a transport (``vmmkv.ipc.transports``)
  and maps the runs each peer sent at the same offsets of its ``PeerRegion``, in rounds that
  bound the fds held at once (``vmmkv.ipc.fdbudget``), whatever the runs' sizes.
- ``exchange_then_agree``: the exchange, then the step's agreement (one outcome on every rank),
  then the transport's cleanup, on every rank whatever happened.

Collective or local: both run on every rank of the group between two collective points, a
rank that cannot take part included (it sends abort notices, so its peers stop at once); the
agreement is the collective step that settles the outcome. Not capture-safe (driver calls).
Ownership: the exchange maps into the caller's ``PeerRegion`` s and owns none of them; on a
failure what it mapped stays recorded there for the caller's rollback; the transport closes
every fd it exported or received (``discard``, ``release``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from ..alloc import Chunk, PeerRegion, VirtualRegion
from ..alloc import driver as drv
from . import fdpass
from .comm import GroupError, StoreComm
from .errors import ExchangeLost, PeerAborted, RendezvousError, as_rendezvous_error
from .transports import _Transport

__all__ = ["exchange_and_map", "exchange_then_agree"]


def exchange_and_map(
    comm: StoreComm,
    chunks: list[Chunk],
    peers: dict[int, PeerRegion],
    transport: _Transport,
    *,
    signal: VirtualRegion | None,
    signal_peers: dict[int, PeerRegion] | None,
    local_error: Exception | None = None,
) -> None:
    """Send our runs ``chunks`` (one handle each, whatever its size; and the signal chunk) to
    every peer and map theirs at the same offsets, over
    ``transport`` (fds over sockets or values over the store: the same protocol).

    Rounds, so that the fds held at once stay bounded whatever the run count
    (``vmmkv.ipc.fdbudget``): round 0 carries each rank's description (its runs, signal chunk
    and largest round it can afford, or an abort notice) and no handles; every rank then knows
    the same round size (the smallest offered) and round count (enough for the largest run
    list). Each later round exports the next slice of the own handles, sends it to every peer,
    closes the own exports, maps the slice each peer sent and closes those fds before the next
    round. Every rank runs every round: a rank that fails on the way (an export or a mapping)
    sends abort notices and no handles in the rounds left, and so does a rank that received
    one, so the ranks stay in step and all of them raise (the failing one its cause, the others
    :class:`PeerAborted`, which the agreement resolves into that cause).

    Local work only, between two collective points of the caller; the caller always goes on to
    the agreement that follows (and then ``transport.finish()``). A rank that cannot take part
    (``local_error``) sends its abort notice in round 0, so its peers stop at once. Transport
    failures (a peer vanished) raise ``FdExchangeError`` / :class:`ExchangeLost`. On error,
    whatever this call mapped stays recorded in the PeerRegions (the caller rolls back with
    ``unmap_from`` or ``unmap_outside``)."""
    others = [r for r in range(comm.world_size) if r != comm.rank]
    if not others:
        if local_error is not None:
            raise RendezvousError(f"rank {comm.rank}: {local_error}") from local_error
        return
    region = transport.region
    items: list[tuple[VirtualRegion, Chunk]] = [(region, c) for c in chunks]
    desc: dict[str, Any] = {"chunks": [[c.offset, c.size] for c in chunks]}
    if signal is not None and local_error is None:
        sig = signal.chunks()[0]
        items.append((signal, sig))
        desc["signal"] = [sig.offset, sig.size]
    if local_error is None:
        try:
            desc["round"] = transport.round_size(len(items))
        except Exception as exc:
            local_error = exc
    failure: Exception | None = local_error  # this rank's own cause, if any
    if failure is not None:
        desc = {"abort": repr(failure)}
    received = transport.exchange(json.dumps(desc).encode(), [], others, 0, round_no=0)
    transport.release(received)
    descs = {peer: json.loads(body.decode()) for peer, (body, _) in received.items()}
    aborted = {peer: d["abort"] for peer, d in descs.items() if "abort" in d}
    todo: dict[int, list[tuple[PeerRegion, Chunk]]] = {}
    rounds, size = 0, 0
    if failure is None and not aborted:
        size = min([desc["round"]] + [d["round"] for d in descs.values()])
        longest = max([len(items)] + [_handle_count(d) for d in descs.values()])
        rounds = -(-longest // size)
        for peer in others:
            d = descs[peer]
            todo[peer] = [(peers[peer], Chunk(off, sz)) for off, sz in d["chunks"]]
            if signal_peers is not None and "signal" in d:
                todo[peer].append((signal_peers[peer], Chunk(*d["signal"])))
    for k in range(rounds):
        mine = items[k * size : (k + 1) * size] if failure is None and not aborted else []
        handles: list[Any] = []
        try:
            try:
                for owner, chunk in mine:
                    handles.append(transport.export(owner, chunk))
            except Exception as exc:
                failure = exc
                transport.discard(handles)
                handles = []
            body = {"abort": repr(failure)} if failure is not None else {}
            got = transport.exchange(
                json.dumps(body).encode(), handles, others, size, round_no=k + 1
            )
        finally:
            transport.discard(handles)
        try:
            for peer, (pbody, _) in got.items():
                why = json.loads(pbody.decode()).get("abort")
                if why is not None:
                    aborted.setdefault(peer, why)
            if failure is None and not aborted:
                _map_round(comm, transport, todo, got, k * size, size)
        except Exception as exc:
            failure = failure or exc
        finally:
            transport.release(got)
    if failure is not None:
        if failure is local_error:  # the caller's own step failed: it names it
            raise RendezvousError(
                f"rank {comm.rank}: did not take part in the {transport.what}: {failure!r}"
            ) from failure
        if isinstance(failure, RendezvousError):
            raise failure
        raise RendezvousError(
            f"rank {comm.rank}: could not take part in the {transport.what}: {failure!r}"
        ) from failure
    if aborted:
        raise PeerAborted(
            f"rank {comm.rank}: peers could not take part in the {transport.what}: "
            + "; ".join(f"rank {p}: {why}" for p, why in sorted(aborted.items()))
        )


def _handle_count(desc: dict[str, Any]) -> int:
    return len(desc["chunks"]) + (1 if "signal" in desc else 0)


def _map_round(
    comm: StoreComm,
    transport: _Transport,
    todo: dict[int, list[tuple[PeerRegion, Chunk]]],
    got: dict[int, tuple[bytes, list[Any]]],
    start: int,
    size: int,
) -> None:
    """Map the handles each peer sent in one round: its runs ``[start, start + size)``."""
    region = transport.region
    for peer, (_, handles) in sorted(got.items()):
        want = todo[peer][start : start + size]
        if len(handles) != len(want):
            raise RendezvousError(
                f"rank {comm.rank}: rank {peer} sent {len(handles)} handles, expected "
                f"{len(want)} in this round"
            )
        for (target, chunk), handle in zip(want, handles, strict=True):
            try:
                transport.map(target, handle, chunk)
            except (drv.CudaError, OSError, ValueError) as exc:
                raise RendezvousError(
                    f"rank {comm.rank} ({region.device}): mapping a run of rank {peer} "
                    f"({chunk}, {region.handle_type}) failed: {exc}"
                ) from exc


def exchange_then_agree(
    comm: StoreComm,
    what: str,
    exchange: Callable[[Exception | None], None],
    local_error: Exception | None,
    deadline: float,
    finish: Callable[[], None] | None = None,
) -> None:
    """Run ``exchange(local_error)`` then the step's agreement, then ``finish()`` (e.g.
    removing by-value exports), on every rank whatever happened: local failures become the
    agreed error (every rank raises naming the cause); a transport failure (a peer vanished)
    settles the agreement at once as a timeout naming the lost ranks, so no rank waits a second
    timeout (and ``peers="auto"`` does not fall back over a dead peer); the fd transport settles
    it before its sockets close (``_FdTransport._give_up``), so that a peer whose connection
    that breaks adopts the cause instead of naming this rank. The agreement waits at
    most until ``deadline`` (at least one second); the exchange ends a grace before it
    (``_Transport.timeout``) or at once when a peer's process is gone (fd handles), so a rank
    stuck exchanging with a lost peer settles the step naming that peer before the ranks that
    finished exchanging time out and name it too. Raises :class:`RendezvousError`
    (:class:`RendezvousTimeout` for missing ranks)."""
    error: BaseException | None = local_error
    abort, lost = None, []
    try:
        try:
            exchange(local_error)
        except (fdpass.FdExchangeError, ExchangeLost) as exc:  # a timeout naming lost peers
            abort, lost = str(exc), exc.peers_lost
        except PeerAborted:
            pass  # the aborting ranks name their cause in the agreement, which then fails
        except Exception as exc:
            if local_error is None or exc.__cause__ is not local_error:
                error = exc  # else the exchange only relayed the caller's error: agree on it
        try:
            comm.agree(
                error, what, abort=abort, missing=lost,
                timeout=max(1.0, deadline - time.monotonic()),
            )  # fmt: skip
        except GroupError as exc:
            raise as_rendezvous_error(exc) from error
    finally:
        if finish is not None:
            finish()
