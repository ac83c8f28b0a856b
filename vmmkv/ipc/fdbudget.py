"""The open-file budget of an fd exchange, checked before any driver call.

What an exchange passes is **handles**: one per run (``vmmkv.alloc.geometry``), whatever the
run's size, so the budget counts runs, never bytes: a 25 GiB wake of DeepSeek-V3.2's layer-major
cache in one run per layer segment passes 122 handles to each peer (a PCP 8 wake: 122 x 7 fds
received per rank), where one run per 2 MiB chunk passed 12,566.

An exchange of ``n`` runs among ``world`` ranks runs in rounds (``exchange.exchange_and_map``):
each round a rank exports at most ``round`` runs, sends them to every peer, receives at most
``round`` fds from each peer, maps what it received and closes every fd before the next round
starts. Its peak is therefore about ``world * round`` fds plus ``2 * world`` sockets, whatever
``n``: a wake of thousands of runs at PCP 8 holds a few thousand fds, not the ``world * n``
(hundreds of thousands) of an exchange that held every fd until the end.

What stays open beyond an exchange: nothing on CUDA (an imported or created run is a driver
handle, not an fd); on the host backend one memfd per own run (``Backend.keeps_fds``), so that
the run can be exported to peers later. That backend simulates CUDA's runs, each a physical
allocation of its own whose life ends with its last mapping; a memfd per run keeps that model
exact, and the checks below bound the count.

``exchange_round`` is the check: it returns the per-peer round size that fits under the **hard**
``RLIMIT_NOFILE`` (the soft limit is raised for the exchange and restored after,
``transports._raise_fd_limit``; only a privileged process can raise the hard one), or raises
:class:`FdBudgetError` naming the rank, the device, the step, the run count, the fds needed and
the limit, and how to raise it. ``keep_fds`` raises the soft limit for fds that outlive the
exchange (the host backend's memfds), never above the hard one. Local functions, no collective
step: callers feed the error into the step's agreement so that every rank raises it.
"""

from __future__ import annotations

import logging
import os
import resource

__all__ = ["FdBudgetError", "MIN_ROUND", "ROUND", "exchange_round", "keep_fds", "open_fds"]

log = logging.getLogger(__name__)

ROUND = 256  # the most handles one peer sends in one round (fdpass sends 250 per sendmsg)
MIN_ROUND = 16  # below this, rounds cost more in round trips than the fds they save
SPARE = 64  # fds left for the rest of the process (logs, sockets of the engine) during a step


class FdBudgetError(RuntimeError):
    """A step would need more open files than the hard RLIMIT_NOFILE allows."""


def open_fds() -> int:
    """The number of fds this process holds now."""
    return len(os.listdir("/proc/self/fd"))


def _limits() -> tuple[int, int]:
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _remedy(hard: int) -> str:
    return (
        f"raise the hard open-file limit (now {hard}) for the engine's processes "
        "(`ulimit -Hn N` as root before starting it, LimitNOFILE= in a systemd unit, "
        "`--ulimit nofile=N:N` for docker), or use fewer, larger runs (chunk_bytes=, "
        "run_bytes=)"
    )


def exchange_round(
    *, rank: int, world: int, device: object, what: str, runs: int, kept: int = 0
) -> int:
    """The per-peer round size (``MIN_ROUND`` .. ``ROUND`` fds) for an exchange of ``runs``
    runs (one handle each) among ``world`` ranks, with ``kept`` more fds that stay open after it
    (host backend: the memfds of the runs this step commits); raises :class:`FdBudgetError`
    when even a round of ``MIN_ROUND`` does not fit under the hard limit."""
    _soft, hard = _limits()
    if world <= 1:
        return ROUND
    now = open_fds()
    sockets = 2 * world  # one listener, one connection each way per peer
    if hard == resource.RLIM_INFINITY:
        return ROUND
    free = hard - now - kept - sockets - SPARE
    size = min(ROUND, free // world)
    smallest = min(MIN_ROUND, ROUND)
    if size >= smallest:
        return size
    need = now + kept + sockets + SPARE + world * smallest
    raise FdBudgetError(
        f"rank {rank} ({device}): {what}: {runs} runs (one handle each) among {world} ranks "
        f"need {need} open files at once ({now} open now, {kept} kept for the new runs, {world} x "
        f"{smallest} for the smallest exchange round, {sockets} sockets, {SPARE} spare), "
        f"over the hard RLIMIT_NOFILE of {hard}: {_remedy(hard)}"
    )


def keep_fds(*, rank: int, device: object, what: str, count: int) -> None:
    """Make room under the soft limit for ``count`` more fds that outlive this step (raised up
    to the hard limit, never lowered); :class:`FdBudgetError` when the hard limit is too low."""
    if count <= 0:
        return
    soft, hard = _limits()
    want = open_fds() + count + SPARE
    if soft == resource.RLIM_INFINITY or want <= soft:
        return
    if hard != resource.RLIM_INFINITY and want > hard:
        raise FdBudgetError(
            f"rank {rank} ({device}): {what}: keeping {count} more open files (one per "
            f"committed run on this backend) needs {want}, over the hard RLIMIT_NOFILE of "
            f"{hard}: {_remedy(hard)}"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    log.info("vmmkv: rank %d: RLIMIT_NOFILE soft limit %d -> %d (%s)", rank, soft, want, what)
