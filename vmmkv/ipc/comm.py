"""Bounded-time collectives over a process group's key-value store.

Every step of vmmkv's protocols (request gather, status agreement, barriers) goes through the
group's ``torch.distributed`` store rather than gloo collectives, because a store wait takes a
timeout and the keys that did not arrive name the ranks that are missing. A gloo collective with
a dead or absent peer would block until the group's own (often 30-minute) timeout and could not
say who is missing.

Contract: ``StoreComm`` is created collectively (all ranks of the group, same order of calls);
each call is collective and raises :class:`PeerTimeoutError` naming the missing ranks after
``timeout`` seconds. Not capture-related (host only).
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["GroupError", "PeerTimeoutError", "StoreComm", "check_cpu_group"]


class GroupError(RuntimeError):
    """A collective step failed on some rank; raised identically on every rank."""


class PeerTimeoutError(GroupError):
    """Some ranks did not arrive at a collective step within the timeout."""

    def __init__(self, message: str, missing: Sequence[int]):
        super().__init__(message)
        self.missing = list(missing)


_generations: dict[str, int] = {}
_gen_lock = threading.Lock()


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


def _group_key(group: Any) -> str:
    name = getattr(group, "group_name", None)
    if not name:
        name = "ranks-" + "-".join(str(r) for r in dist.get_process_group_ranks(group))
    return name


class StoreComm:
    """Collectives with timeouts over ``group``'s store (see module docstring)."""

    def __init__(self, group: Any, timeout: float, *, tag: str = "rdzv") -> None:
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        check_cpu_group(group)
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.global_ranks = list(dist.get_process_group_ranks(self.group))
        self.timeout = float(timeout)
        key = f"{_group_key(self.group)}/{tag}"
        with _gen_lock:
            gen = _generations.get(key, 0)
            _generations[key] = gen + 1
        # The group's own store is already namespaced by the group; add ours on top.
        self._store = dist.distributed_c10d._get_process_group_store(self.group)
        self._prefix = f"vmmkv/{tag}/{gen}"
        self._step = 0
        self._broken = ""  # why collectives on this object can no longer line up

    @property
    def step(self) -> int:
        return self._step

    def _key(self, step: int, rank: int) -> str:
        return f"{self._prefix}/{step}/{rank}"

    @property
    def broken(self) -> str:
        """'' while usable; otherwise why the ranks can no longer be trusted to be in step."""
        return self._broken

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj`` in rank order; ``what`` names the step in errors and must be
        the same on every rank: ranks found at different steps raise, and so does every later
        call on this object (after a timeout too), since their keys would no longer match."""
        if self._broken:
            raise GroupError(
                f"rank {self.rank}: {what}: refused, an earlier collective of this object "
                f"failed ({self._broken}); close it and create a new one"
            )
        step = self._step
        self._step += 1
        keys = [self._key(step, r) for r in range(self.world_size)]
        try:
            self._store.set(keys[self.rank], pickle.dumps((what, obj)))
        except Exception as exc:
            raise GroupError(
                f"rank {self.rank}: {what}: the group's store is unreachable: {exc}"
            ) from exc
        deadline = time.monotonic() + self.timeout
        try:
            self._store.wait(keys, timedelta(seconds=self.timeout))
        except Exception as exc:
            missing = self._missing(keys)
            if not missing:  # the store itself failed (e.g. its host died)
                raise GroupError(
                    f"rank {self.rank}: {what}: waiting on the group's store failed: {exc}"
                ) from exc
            waited = self.timeout - max(0.0, deadline - time.monotonic())
            self._broken = f"{what}: ranks {missing} missing"
            raise PeerTimeoutError(
                f"rank {self.rank}: {what}: group ranks {missing} (global ranks "
                f"{[self.global_ranks[m] for m in missing]}) did not arrive within "
                f"{waited:.1f} s",
                missing,
            ) from exc
        entries = [pickle.loads(self._store.get(k)) for k in keys]
        whats = [w for w, _ in entries]
        if any(w != what for w in whats):
            self._broken = f"ranks out of step at step {step}"
            raise GroupError(
                f"rank {self.rank}: ranks are out of step at collective step {step}: "
                + ", ".join(f"rank {r} at {w!r}" for r, w in enumerate(whats))
            )
        values = [v for _, v in entries]
        if step > 0:  # every rank is past step-1 now, so nobody reads our old key again
            try:
                self._store.delete_key(self._key(step - 1, self.rank))
            except Exception:  # a leftover key costs a few bytes; never fail a step for it
                pass
        return values

    def _missing(self, keys: list[str]) -> list[int]:
        missing = []
        for r, k in enumerate(keys):
            try:
                if not self._store.check([k]):
                    missing.append(r)
            except Exception:
                return []
        return missing

    def barrier(self, what: str) -> None:
        self.all_gather(None, what)

    def agree(self, error: BaseException | None, what: str) -> None:
        """Collective status: raises the same :class:`GroupError` on every rank if any rank
        passes an error (the local error is chained on the rank that had it)."""
        statuses = self.all_gather(None if error is None else repr(error), what)
        failed = {r: s for r, s in enumerate(statuses) if s is not None}
        if failed:
            detail = "; ".join(f"rank {r}: {s}" for r, s in failed.items())
            raise GroupError(f"{what} failed on group ranks {sorted(failed)}: {detail}") from error
