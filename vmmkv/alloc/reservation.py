"""``Reservation``: one virtual address range, owned by one region and held by its views.

Contract:
- ``Reservation(backend, size)`` reserves ``size`` bytes through the backend. The region that
  created it calls ``release()`` once it has unmapped everything (``close()``); every DLPack view
  built over the range calls ``hold()`` when it is made and ``drop()`` from its deleter.
- The range is given back (``backend.free_reservation``) exactly once: when it is released AND
  the last view is gone, whichever comes last. Until then it stays reserved with nothing mapped,
  so a stale view faults instead of reaching whoever reserves next.
- ``drop()`` may run on any thread at any moment (a tensor dies wherever its last reference
  goes). Backends whose ``free_reservation`` is not safe there (``frees_from_any_thread`` False:
  CUDA, where a driver call could land in someone's stream capture) get the free queued instead;
  queued frees run at the next safe point: the next ``Reservation`` created, the next
  ``release()``, or ``free_deferred()``.
- Nothing is freed while the interpreter finalizes (the process exit returns the range).
- Errors: ``release()`` raises the free's error (a later ``release()`` retries); a free from a
  deleter or from the queue cannot raise, so it is logged and the range stays reserved.
"""

from __future__ import annotations

import logging
import threading

from .._util import delegate
from . import driver
from .backend import Backend

__all__ = ["Reservation", "free_deferred"]

log = logging.getLogger(__name__)

_deferred: list[Reservation] = []  # released, viewless, waiting for a safe point to be freed
_deferred_lock = threading.RLock()  # reentrant: see Reservation._lock


def free_deferred() -> None:
    """Free every reservation whose free was queued by a deleter (errors are logged)."""
    while True:
        with _deferred_lock:  # pop one at a time: a deleter may append while we free
            if not _deferred:
                return
            res = _deferred.pop()
        try:
            res._free()
        except Exception as exc:
            log.error("freeing a deferred reservation at %#x: %s", res.base, exc)


class Reservation:
    """A reserved address range shared by its owner and its views (see module doc)."""

    def __init__(self, backend: Backend, size: int) -> None:
        free_deferred()  # a safe point: the caller is about to make a driver call anyway
        self._backend = backend
        self.size = size
        # reentrant: a garbage collection inside a locked section may run a view's deleter
        self._lock = threading.RLock()
        self._views = 0
        self._released = False
        self._freeing = False  # set (under the lock) by the one caller that frees the range
        self._freed = False
        self.base = backend.reserve(size)

    freed = delegate("_freed")
    views = delegate("_views", "Views alive now (each holds the range).")

    def hold(self) -> None:
        """A new view over the range (before it exists, so the range cannot go in between)."""
        with self._lock:
            if self._released:
                raise RuntimeError(f"reservation at {self.base:#x} was released: no new views")
            self._views += 1

    def drop(self) -> None:
        """A view died (its DLPack deleter, any thread). Never raises."""
        with self._lock:
            self._views -= 1
            free = self._claim_free()
        if not free:
            return
        if self._backend.frees_from_any_thread:
            try:
                self._free()
            except Exception as exc:
                log.error("freeing the reservation at %#x after its last view: %s", self.base, exc)
        else:
            with _deferred_lock:
                _deferred.append(self)

    def release(self) -> None:
        """The owner is done (everything unmapped): free now unless views still hold the range.
        Idempotent; raises the free's error, and a later call retries."""
        with self._lock:
            self._released = True
            free = self._claim_free()
        if free:
            self._free()
        free_deferred()

    def _claim_free(self) -> bool:
        """Under the lock: True for the one caller that must free the range now."""
        if self._released and self._views == 0 and not self._freeing and not self._freed:
            self._freeing = True
            return True
        return False

    def _free(self) -> None:
        try:
            if not driver.finalizing():
                self._backend.free_reservation(self.base, self.size)
        except BaseException:
            with self._lock:
                self._freeing = False
            raise
        with self._lock:
            self._freed = True
