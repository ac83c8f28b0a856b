"""Small internal helpers shared by every layer (no torch, no CUDA): argument checks,
teardown, and the read-only property that passes an owned object's attribute through.
Internal: not part of the public API.
"""

from __future__ import annotations

import logging
import math
import operator
import os
from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "ceil_div",
    "delegate",
    "delegates",
    "pid_liveness",
    "require_int",
    "require_timeout",
    "round_up",
    "run_all",
]

log = logging.getLogger(__name__)


def require_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``[lo, hi]``; else TypeError/ValueError naming
    ``name``, the value got and the range expected."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if hi is None:
            want = f">= {lo}"
        elif lo is None:
            want = f"<= {hi}"
        else:
            want = f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {want}, got {value}")
    return value


def require_timeout(name: str, value: object) -> float:
    """A finite, positive number of seconds (bools, NaN and inf are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0``."""
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``a``."""
    return ceil_div(a, multiple) * multiple


def delegate(path: str, doc: str | None = None) -> property:
    """A read-only property returning ``self.<path>``, a dotted attribute path such as
    ``"_comm.world_size"``: what an owner passes through of the objects it holds (or of its
    own private state)."""
    return property(operator.attrgetter(path), doc=doc)


def delegates(owner: str, *names: str) -> tuple[property, ...]:
    """``delegate(f"{owner}.{name}")`` for each of ``names``, in order: the attributes an owner
    passes through of one object it holds, unpacked at class level."""
    return tuple(delegate(f"{owner}.{name}") for name in names)


def run_all(steps: Iterable[Callable[[], None]]) -> None:
    """Run every step even if some fail; raise the first error afterwards (teardown)."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as exc:  # noqa: B902 - teardown must finish every step
            if first is None:
                first = exc
            else:
                log.error("vmmkv teardown: further error suppressed: %s", exc)
    if first is not None:
        raise first


def pid_liveness(pids: Sequence[int], rank: int) -> Callable[[], tuple[int, str] | None]:
    """A ``liveness`` callable for peers that are processes of this host and PID namespace:
    ``(peer, why)`` once a peer's process is gone (no such pid, a zombie, or a reused pid with
    another start time). Peers whose /proc entry cannot be read at creation are not watched."""

    def start_time(pid: int) -> tuple[str, int] | None:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            return None
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        return fields[0], int(fields[19])  # state, starttime

    watched = {}
    for peer, pid in enumerate(pids):
        if peer != rank and pid != os.getpid():
            got = start_time(pid)
            if got is not None:
                watched[peer] = (pid, got[1])

    def check() -> tuple[int, str] | None:
        for peer, (pid, started) in watched.items():
            got = start_time(pid)
            if got is None or got[0] in ("Z", "X") or got[1] != started:
                return peer, f"peer rank {peer}'s process (pid {pid}) is gone"
        return None

    return check
