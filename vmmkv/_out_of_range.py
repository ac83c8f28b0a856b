"""The out-of-range count of :class:`vmmkv.ReplicatedKVCache`: the device counter the store
kernels increment for every slot they skip (beyond its view, or in a block beyond the committed
size), and the one WARNING per cache that reports it.

``OutOfRange`` owns the counter (``counter``: an int32 tensor of one element on the cache's
device, given to every bound target; also ``ReplicatedKVCache.error_counter``) and the
once-per-cache flag. Local. Reading the counter synchronizes with the device, so it is read at
host synchronization points only (``stats``, after a resize, at ``close``), never on the store
path and never during a stream capture. Nothing to close. Messages go to the logger the caller
passes (the cache's, ``vmmkv.cache``).
"""

from __future__ import annotations

import logging

import torch

__all__ = ["OutOfRange"]


class OutOfRange:
    """The skipped-slot counter of one cache and its once-per-cache WARNING."""

    def __init__(self, rank: int, device: torch.device, log: logging.Logger) -> None:
        self.rank, self.device, self._log = rank, device, log
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self._warned = False  # logged once per cache, at a host sync point

    def read(self) -> int:
        """The count so far (synchronizes with the device)."""
        return int(self.counter.item())

    def warn(self, skipped: int | None = None) -> None:
        """Log once per cache that stores skipped out-of-range slots (``skipped``: the count
        just read, else read here unless a capture is under way)."""
        if self._warned:
            return
        if skipped is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return
            skipped = self.read()
        if skipped:
            self._warned = True
            self._log.warning(
                "vmmkv rank %d (%s): the stores skipped %d out-of-range slots so far (a slot "
                "beyond its view, or in a block beyond the committed size: grow or grow_blocks "
                "before storing there); these rows were written nowhere. stats()"
                "['out_of_range_slots'] has the count; this warning is logged once per cache",
                self.rank, self.device, skipped,
            )  # fmt: skip

    def warn_at_close(self) -> None:
        """``warn`` as a teardown step: a diagnostic, it never fails the teardown."""
        try:
            self.warn()
        except Exception as exc:
            self._log.debug(
                "vmmkv rank %d: reading the out-of-range counter at close: %s", self.rank, exc
            )
