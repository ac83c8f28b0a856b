"""Bounded-time collectives over a process group's key-value store, with one agreed outcome
per step.

Every step of vmmkv's protocols (request gather, status agreement, barriers) goes through the
group's ``torch.distributed`` store rather than gloo collectives, because a store wait takes a
timeout and the keys that did not arrive name the ranks that are missing. A gloo collective with
a dead or absent peer would block until the group's own (often 30-minute) timeout and could not
say who is missing.

One outcome per step (no split brain). Every step has an outcome key, settled once by
``compare_set`` (the first writer wins, every rank adopts what is stored): ``ok`` may only be
proposed by a rank that saw every rank's key, ``abort`` by a rank whose wait timed out or that
knows the step cannot succeed (:meth:`StoreComm.all_gather` with ``abort=``, or ahead of the
step with :meth:`StoreComm.abort_next`). A rank that arrives
after its peers gave up therefore reads ``abort`` and raises like them, instead of passing the
step on their leftover keys. Waiting ranks also watch the outcome key, so one rank's abort
releases every rank at once. Since every rank runs the same sequence of steps whatever their
outcomes, an aborted step leaves the object usable: the next step lines up on every rank.

Namespaces that cannot skew. A new ``StoreComm`` first joins: every rank posts a fresh random
token; every rank acknowledges the exact set of tokens it read, under a key derived from that
set; the step keys then live under a prefix derived from the agreed set. A rank that failed
before creating its ``StoreComm``, or a stale key of an earlier failed object, can make one join
time out, never line two objects up on each other's keys.

Contract: ``StoreComm`` is created collectively (all ranks of the group, same order of calls,
one creation at a time per ``(group, tag)``); each call is collective and raises
:class:`PeerTimeoutError` naming the missing ranks within ``timeout`` seconds (per call unless a
shorter ``timeout=`` is given). Values must be JSON-serializable (the store is unauthenticated:
nothing read from it is unpickled). Host only, not capture-related. The keys of the last step of
an object stay in the store (a few bytes; their prefix is never reused).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from .._util import delegate, require_timeout

__all__ = ["GroupError", "PeerTimeoutError", "StepAborted", "StoreComm", "check_cpu_group"]

_OK = b"ok"
_GONE = b"-"  # a join key's tombstone: that rank gave up this join
_ABORT = b"abort:"
_POLL_MIN_S = 50e-6
_POLL_MAX_S = 2e-3


class GroupError(RuntimeError):
    """A collective step failed on some rank; raised identically on every rank."""


class PeerTimeoutError(GroupError):
    """Some ranks did not arrive at a collective step within the timeout, or a rank found them
    lost before it (the message says which, and how long into the step)."""

    def __init__(self, message: str, missing: Sequence[int]):
        super().__init__(message)
        self.missing = list(missing)


class StepAborted(GroupError):
    """A rank aborted the step (``all_gather(..., abort=reason)``); every rank raises it."""


def check_cpu_group(group: Any) -> None:
    """Reject groups that cannot run on the CPU (vmmkv exchanges host data over them)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    if group is None:
        group = dist.group.WORLD
    backend = str(dist.get_backend(group)).lower()
    if "gloo" not in backend:
        raise ValueError(
            f"vmmkv needs a CPU-capable process group (gloo); got backend {backend!r}. Pass the "
            "CPU group (e.g. vLLM's `cpu_group`, or dist.new_group(ranks, backend='gloo'))."
        )


class StoreComm:
    """Collectives with timeouts and agreed outcomes over ``group``'s store (module docstring)."""

    def __init__(self, group: Any, timeout: float, *, tag: str = "rdzv") -> None:
        self.timeout = require_timeout("timeout", timeout)
        check_cpu_group(group)
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.global_ranks = list(dist.get_process_group_ranks(self.group))
        # The group's own store is already namespaced by the group; ours goes on top.
        self._store = dist.distributed_c10d._get_process_group_store(self.group)
        self._step = 0
        self._broken = ""  # why collectives on this object can no longer line up
        self._leftover: list[str] = []  # own join keys, deleted once every rank is past them
        self._prefix = self._join(f"vmmkv/{tag}")
        self._since = time.monotonic()  # when this rank finished the group's last step

    def release_group(self) -> None:
        """Local, idempotent: drop the reference to the process group, for an owner that
        closed (no further collective is called). A group the engine destroys is then freed
        at once, its gloo threads joined; kept alive by a closed object in a reference cycle,
        it lived to interpreter exit, where a gloo thread freeing a finished work's tensors
        aborted the process ("terminate called without an active exception")."""
        self.group = None

    # -- properties ------------------------------------------------------------------------
    step = delegate("_step")
    broken = delegate(
        "_broken",
        "'' while usable; otherwise why the ranks can no longer be trusted to be in step.",
    )

    # -- join: an agreed namespace ---------------------------------------------------------
    def _join(self, base: str) -> str:
        what = "join"
        token = secrets.token_hex(16)
        keys = [f"{base}/join/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + self.timeout
        self._set(keys[self.rank], token.encode(), what)
        ok = False
        try:
            tokens = self._join_tokens(keys, deadline, what)
            digest = hashlib.sha256("/".join(tokens).encode()).hexdigest()[:32]
            acks = [f"{base}/ack/{digest}/{r}" for r in range(self.world_size)]
            self._set(acks[self.rank], b"1", what)
            # Every rank that acknowledged under this digest read exactly these tokens: a rank
            # that read a stale token acknowledges under another digest and never lines up.
            missing = self._wait(acks, None, deadline, what)
            if missing:
                raise self._timeout_error(what, missing, self.timeout)
            ok = True
        finally:
            # Once all acknowledged, every rank read our token: delete it. On failure leave a
            # tombstone, which peers read as "not joining" (a stale token would make the next
            # join time out, never line two objects up). Best effort either way.
            if ok:
                self._try_delete(keys[self.rank])
            else:
                self._try_set(keys[self.rank], _GONE)
        self._leftover = [acks[self.rank]]
        return f"{base}/{digest}"

    def _join_tokens(self, keys: list[str], deadline: float, what: str) -> list[str]:
        """Every rank's live join token; PeerTimeoutError naming the ranks that never posted
        one (and those that gave up) at the deadline."""

        def live_tokens() -> list[str] | None:
            if not self._check(keys, what):
                return None
            values = self._get_all(keys, what)
            return None if _GONE in values else [v.decode() for v in values]

        tokens = _poll(live_tokens, deadline)
        if tokens is not None:
            return tokens
        missing = self._missing(keys, what)
        gone = [r for r, k in enumerate(keys) if r not in missing and self._get(k, what) == _GONE]
        err = self._timeout_error(what, missing or gone, self.timeout)
        if missing and gone:
            err = PeerTimeoutError(f"{err} (ranks {gone} gave up waiting)", missing)
        raise err

    # -- collectives -----------------------------------------------------------------------
    def all_gather(
        self,
        obj: Any,
        what: str,
        *,
        timeout: float | None = None,
        abort: str | None = None,
        missing: Sequence[int] = (),
    ) -> list[Any]:
        """Every rank's ``obj`` (JSON-serializable) in rank order, once the step's outcome is
        ``ok``. ``what`` names the step in errors and must be the same on every rank.

        ``timeout`` (seconds, at most the object's) bounds this step's wait. ``abort``: this
        rank knows the step cannot succeed (e.g. a peer vanished during an fd exchange); the
        step is settled as aborted at once and every rank raises :class:`StepAborted` with the
        reason, or, when ``missing`` names the ranks this rank lost (a peer that vanished),
        :class:`PeerTimeoutError` naming them. Raises :class:`PeerTimeoutError` when ranks did not arrive in time (on every
        rank, the late ones included); :class:`GroupError` when ranks are found at different
        steps, after which this object refuses every call."""
        if self._broken:
            raise GroupError(
                f"rank {self.rank}: {what}: refused, an earlier collective of this object "
                f"failed ({self._broken}); close it and create a new one"
            )
        wait_s = self.timeout if timeout is None else min(self.timeout, float(timeout))
        step = self._step
        self._step += 1
        keys = [self._key(step, r) for r in range(self.world_size)]
        outcome_key = self._key(step, "outcome")
        if abort is not None:
            record = self._abort_record(abort, missing, wait_s)
            self._raise_outcome(self._settle(outcome_key, record, what), what)
        self._set(keys[self.rank], json.dumps([what, obj]).encode(), what)
        missing = self._wait(keys, outcome_key, time.monotonic() + wait_s, what)
        proposal = None if not missing else {"by": self.rank, "missing": missing, "waited": wait_s}
        outcome = self._settle(outcome_key, proposal, what)
        if outcome != _OK:
            self._raise_outcome(outcome, what)
        entries = [json.loads(v) for v in self._get_all(keys, what)]
        whats = [w for w, _ in entries]
        if any(w != what for w in whats):
            self._broken = f"ranks out of step at step {step}"
            raise GroupError(
                f"rank {self.rank}: ranks are out of step at collective step {step}: "
                + ", ".join(f"rank {r} at {w!r}" for r, w in enumerate(whats))
            )
        # Every rank is past step-1 now (it wrote this step's key), so nobody reads those keys
        # again; the join keys likewise once the first step succeeded.
        if step > 0:
            self._try_delete(self._key(step - 1, self.rank))
            if self.rank == 0:
                self._try_delete(self._key(step - 1, "outcome"))
        for key in self._leftover:
            self._try_delete(key)
        self._leftover = []
        self._since = time.monotonic()
        return [v for _, v in entries]

    def pending_abort(self) -> str:
        """'' unless the next step was already aborted by some rank (e.g. while this rank was
        busy in an fd exchange); then who aborted it and why. Local, one store lookup."""
        key = self._key(self._step, "outcome")
        if not self._check([key], "pending abort"):
            return ""
        outcome = self._get(key, "pending abort")
        if not outcome.startswith(_ABORT):
            return ""
        record = json.loads(outcome[len(_ABORT) :])
        why = record.get("why") or f"ranks {record.get('missing')} did not arrive"
        return f"rank {record['by']} aborted the step: {why}"

    def abort_next(self, why: str, what: str, *, missing: Sequence[int] = ()) -> None:
        """Settle the next step as aborted now (first writer wins), without taking it: this
        rank's next call, with or without ``abort=``, raises the stored outcome like every other
        rank's. For a rank about to give up in a way its peers would misread (breaking
        connections they are sending on, ``transports._FdTransport``): the cause it settles
        here is the one they adopt. Raises :class:`GroupError` when the store fails."""
        if self._broken:
            return  # the next call refuses anyway, naming why
        record = self._abort_record(why, missing, self.timeout)
        self._settle(self._key(self._step, "outcome"), record, what)

    def _abort_record(self, why: str, missing: Sequence[int], waited: float) -> dict[str, Any]:
        record: dict[str, Any] = {"by": self.rank, "why": str(why)}
        if missing:  # found lost (``why``) this long after the last step, not waited for
            lost_after = round(time.monotonic() - self._since, 3)
            record.update(missing=sorted(missing), waited=waited, lost_after=lost_after)
        return record

    def barrier(self, what: str, *, timeout: float | None = None) -> None:
        self.all_gather(None, what, timeout=timeout)

    def agree(
        self,
        error: BaseException | None,
        what: str,
        *,
        timeout: float | None = None,
        abort: str | None = None,
        missing: Sequence[int] = (),
    ) -> None:
        """Collective status: raises the same :class:`GroupError` on every rank if any rank
        passes an error (the local error is chained on the rank that had it)."""
        try:
            statuses = self.all_gather(
                None if error is None else repr(error),
                what,
                timeout=timeout,
                abort=abort,
                missing=missing,
            )
        except GroupError as exc:
            if error is not None and exc.__cause__ is None:
                exc.__cause__ = error
            raise
        failed = {r: s for r, s in enumerate(statuses) if s is not None}
        if failed:
            detail = "; ".join(f"rank {r}: {s}" for r, s in failed.items())
            raise GroupError(f"{what} failed on group ranks {sorted(failed)}: {detail}") from error

    # -- internals -------------------------------------------------------------------------
    def _key(self, step: int, who: int | str) -> str:
        return f"{self._prefix}/{step}/{who}"

    def _call(self, what: str, doing: str, fn: Any, *args: Any) -> Any:
        """One store operation; a store failure becomes a GroupError naming rank and step."""
        try:
            return fn(*args)
        except Exception as exc:
            raise GroupError(f"rank {self.rank}: {what}: {doing} failed: {exc}") from exc

    def _set(self, key: str, value: bytes, what: str) -> None:
        self._call(what, "writing to the group's store", self._store.set, key, value)

    def _get(self, key: str, what: str) -> bytes:
        return self._get_all([key], what)[0]

    def _get_all(self, keys: list[str], what: str) -> list[bytes]:
        return list(self._call(what, "reading the group's store", self._store.multi_get, keys))

    def _check(self, keys: list[str], what: str) -> bool:
        return bool(self._call(what, "querying the group's store", self._store.check, keys))

    def _missing(self, keys: list[str], what: str) -> list[int]:
        return [r for r, k in enumerate(keys) if not self._check([k], what)]

    def _try_set(self, key: str, value: bytes) -> None:
        try:
            self._store.set(key, value)
        except Exception:  # best effort (the store may be gone with its host)
            pass

    def _try_delete(self, key: str) -> None:
        try:
            self._store.delete_key(key)
        except Exception:  # a leftover key costs a few bytes; never fail a step for it
            pass

    def _wait(self, keys: list[str], outcome_key: str | None, deadline: float, what: str):
        """[] once every key exists; None if the outcome was settled first (adopt it); else
        the missing ranks at the deadline. Polls, so that an abort is seen at once (a
        store ``wait`` cannot also watch the outcome key)."""

        def settled() -> list[int] | None:
            if self._check(keys, what):
                return []
            if outcome_key is not None and self._check([outcome_key], what):
                return [-1]  # adopt the stored outcome
            return None

        state = _poll(settled, deadline)
        if state is None:
            return self._missing(keys, what) or None
        return None if state == [-1] else state

    def _settle(self, outcome_key: str, proposal: dict | None, what: str) -> bytes:
        """Store ``ok`` (proposal None) or ``abort:<proposal>`` unless an outcome is already
        stored; return the stored outcome."""
        value = _OK if proposal is None else _ABORT + json.dumps(proposal).encode()
        stored = self._call(
            what, "settling the step's outcome", self._store.compare_set, outcome_key, "",
            value.decode(),
        )  # fmt: skip
        return bytes(stored)

    def _raise_outcome(self, outcome: bytes, what: str) -> None:
        if not outcome.startswith(_ABORT):
            raise GroupError(f"rank {self.rank}: {what}: unexpected step outcome {outcome!r}")
        record = json.loads(outcome[len(_ABORT) :])
        if "missing" in record:
            raise self._timeout_error(
                what, record["missing"], record["waited"], record["by"], record.get("why"),
                record.get("lost_after"),
            )  # fmt: skip
        raise StepAborted(
            f"rank {self.rank}: {what}: aborted by rank {record['by']}: {record['why']}"
        )

    def _timeout_error(
        self,
        what: str,
        missing: list[int],
        waited: float,
        by: int | None = None,
        why: str | None = None,
        lost_after: float | None = None,
    ) -> PeerTimeoutError:
        """``lost_after``: a rank found them lost (``why``) that many seconds after it finished
        the group's previous step; else nobody knows more than that they did not arrive."""
        seen = "" if by is None or by == self.rank else f" (seen by rank {by})"
        how = (
            f"did not arrive within {waited:.1f} s"
            if lost_after is None
            else f"were lost {lost_after:.2f} s into the step"
        )
        return PeerTimeoutError(
            f"rank {self.rank}: {what}: group ranks {missing} (global ranks "
            f"{[self.global_ranks[m] for m in missing]}) {how}{seen}" + (f": {why}" if why else ""),
            missing,
        )


def _poll(probe: Any, deadline: float) -> Any:
    """``probe()``'s first result that is not None, polled with a growing pause (50 us to
    2 ms); None once ``deadline`` (time.monotonic) has passed."""
    pause = _POLL_MIN_S
    while True:
        result = probe()
        if result is not None or time.monotonic() >= deadline:
            return result
        time.sleep(pause)
        pause = min(_POLL_MAX_S, pause * 2)
