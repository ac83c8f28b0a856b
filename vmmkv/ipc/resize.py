"""How a ``SymmetricRegion`` (``vmmkv.ipc.symmetric``) is sized: its layout (a committed prefix
or a block layout), the bound table its kernels read, and the collective resize protocol
(docs/design.md, "Resize protocol") that grows or shrinks every rank's region together.

Contract:
- ``Resizer`` is composed by one ``SymmetricRegion``. It borrows that region's ``StoreComm``, its
  ``VirtualRegion``, its lock (which also orders ``close``) and, per call, its ``PeerMap``; it
  closes none of them. It owns the layout, ``table`` (the device int64 bound table the region
  exposes as ``committed_table``) and ``broken``.
- Collective (every rank of the group, same order of calls): ``resize``, ``resize_set`` (a
  block set: a grow to the union of the old and new sets, then a shrink to the new one) and
  ``set_block_layout``. Each gathers every rank's request first (a bad one raises on every rank:
  the offending rank its own TypeError/ValueError/RuntimeError, the others
  :class:`RendezvousError` naming it) and ends with one outcome on every rank
  (``vmmkv.ipc.comm``). Local: ``commit_initial`` (before the region's first collective step),
  ``check_fds`` and the layouts (geometry; ``commit``/``decommit`` call the driver).
- Not capture-safe: a resize commits, maps and unmaps memory, writes the bound table and
  synchronizes; ``resize`` refuses on every rank while the calling thread captures a CUDA
  stream. Kernels read ``table`` on every launch, so what was captured before a resize is
  bounded by the new size without new arguments.
- A failed grow (an out-of-memory at any run, a failed mapping of any peer's run) rolls every
  rank back to the old size (peers' new runs unmapped first, then the own ones decommitted),
  every rank raising the same error, and leaves the group usable. A failed shrink leaves the bound
  lowered and ``broken`` set (as does a rollback that itself failed): every later resize is
  refused on every rank.
- fd budget (``vmmkv.ipc.fdbudget``): a step that commits or exchanges runs (one handle each,
  whatever its size) first checks that its exchange rounds and the fds its runs keep (host
  backend: one memfd each) fit under the hard open-file limit (``check_fds``), raising
  ``FdBudgetError`` before any driver call; ``set_block_layout`` checks a full grow of every
  block so.
- The layouts (``vmmkv.ipc.layouts``) say which chunks and runs a size needs.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

import torch

from .. import _blockset as blockset
from .._blockset import BlockSet
from .._util import ceil_div, run_all
from ..alloc import Chunk, VirtualRegion
from . import fdbudget
from .comm import GroupError, StoreComm
from .errors import ConfigMismatch, RendezvousError, as_rendezvous_error
from .exchange import exchange_then_agree
from .layouts import (
    _check_layout,
    _layout_differences,
    _Prefix,
    _Segments,
    _show,
    _show_size,
    _size_words,
    planned_runs,
)
from .peers import PeerMap

__all__ = ["Resizer"]

# One logger for all a SymmetricRegion reports, its resizes included.
log = logging.getLogger("vmmkv.ipc.symmetric")


# --------------------------------------------------------------------------------------------
# the collective resize
# --------------------------------------------------------------------------------------------


class Resizer:
    """The size of one ``SymmetricRegion``'s region and the protocol that changes it (see the
    module docstring). ``peers``, passed to ``resize``, is the region's ``PeerMap`` (None when
    peers are not mapped)."""

    def __init__(self, comm: StoreComm, region: VirtualRegion, lock: threading.Lock) -> None:
        self._comm = comm
        self.region = region
        self._lock = lock
        self.layout: _Prefix | _Segments = _Prefix(region)
        self.table: torch.Tensor | None = None  # the bound table, made by commit_initial
        self.broken = ""  # why resizes are refused: a failed shrink or rollback left mappings
        self.fd_world = 1  # ranks that exchange fds (commit_initial sets it)

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def block_layout(self) -> _Segments | None:
        """The block layout, or None while the region is sized by its committed prefix."""
        layout = self.layout
        return layout if isinstance(layout, _Segments) else None

    def bound_for(self, start: int, end: int, what: str) -> torch.Tensor:
        """Local: ``SymmetricRegion.bound_for``."""
        layout = self.block_layout
        if layout is None:
            return self.table
        i = layout.containing(start, end)
        if i is None:
            raise ValueError(
                f"{what}: region bytes [{start}, {end}) lie inside no single segment of the "
                f"block layout ({layout.describe()}); a view must stay inside one segment"
            )
        return self.table[i : i + 1]

    def describe_committed(self) -> str:
        """Local: ``SymmetricRegion.describe_committed``."""
        layout = self.block_layout
        total = self.region.committed_bytes
        if layout is not None:
            n = blockset.as_prefix(layout.set)
            held = f"{n}" if n is not None else f"the block set {_show(layout.set)}"
            return (
                f"with a block layout, {held} of {layout.max_blocks} blocks of each of "
                f"its {len(layout.segments)} segments are committed ({total} bytes in chunks of "
                f"{self.region.chunk_bytes}, {len(self.region.chunks())} runs)"
            )
        return f"the committed prefix is {total} of {self.region.capacity_bytes} bytes"

    def commit_initial(self, initial_bytes: int, *, world: int) -> None:
        """Local, before the region's first collective step: check the fd budget (``world``
        ranks exchange fds), commit the initial prefix and make the bound table."""
        region = self.region
        self.fd_world = world
        # A full grow of the prefix may come later: refuse now, before anything is committed,
        # a hard open-file limit that could never hold its runs (a block layout checks its own
        # full grow when it is set).
        full = ceil_div(region.capacity_bytes, region.run_bytes)
        self.check_fds("setting up", full, world=world, keep=False)
        initial = len(planned_runs(self.layout, initial_bytes))
        self.check_fds("the initial commit", initial, world=world)
        self.layout.commit(initial_bytes)
        self.layout.moved(initial_bytes)
        self.table = torch.full(
            (1,), region.committed_bytes, dtype=torch.int64, device=region.device
        )

    def check_fds(self, what: str, runs: int, *, world: int, keep: bool = True) -> None:
        """Before a step commits or exchanges ``runs`` runs, one handle each whatever its size
        (``vmmkv.ipc.fdbudget``): raise ``FdBudgetError`` when its exchange rounds and the fds
        its runs keep (host backend: one memfd each) cannot fit under the hard limit; with
        ``keep`` (the step commits them now) also make room under the soft limit for the fds
        kept."""
        kept = runs if self.region.keeps_fds else 0
        fdbudget.exchange_round(
            rank=self.rank, world=world, device=self.region.device, what=what, runs=runs,
            kept=kept,
        )  # fmt: skip
        if keep:
            fdbudget.keep_fds(rank=self.rank, device=self.region.device, what=what, count=kept)

    # -- block layout ----------------------------------------------------------------------
    def set_block_layout(self, segments: Any, max_blocks: int, refuse: str) -> None:
        """Collective: ``SymmetricRegion.set_block_layout``."""
        checked: tuple[tuple[int, int], ...] = ()
        table = None
        problem, kind = "", type(None)
        try:
            checked = _check_layout(segments, max_blocks, self.region.capacity_bytes)
        except (TypeError, ValueError) as exc:
            problem, kind = str(exc), type(exc)
        if not problem:
            state = self._layout_refused(refuse)
            if state:
                problem, kind = f"refused: {state}", RuntimeError
        if not problem:
            try:  # local setup before the step that settles the outcome
                table = torch.tensor(
                    [off for off, _ in checked], dtype=torch.int64, device=self.region.device
                )
            except Exception as exc:
                problem, kind = f"creating the bound table failed: {exc!r}", RuntimeError
        if not problem:
            # a full grow of every block must fit the open-file budget, as the prefix's must
            # at setup: refused now, not at the first large grow
            full = planned_runs(_Segments(self.region, checked, max_blocks), ((0, max_blocks),))
            try:
                self.check_fds("a full grow of the block layout", len(full),
                               world=self.fd_world, keep=False)  # fmt: skip
            except fdbudget.FdBudgetError as exc:
                problem, kind = str(exc), fdbudget.FdBudgetError
        with self._lock:
            request = (None if problem else [max_blocks, [list(seg) for seg in checked]], problem)
            reqs = self._gather(request, "block layout")
            self._raise_problems(reqs, problem, kind, "set_block_layout rejected")
            layouts = [layout for layout, _ in reqs]
            if any(layout != layouts[0] for layout in layouts):
                raise ConfigMismatch(
                    f"set_block_layout (rank {self.rank} of {self._comm.world_size}): the layout "
                    f"must be identical on every rank: {_layout_differences(layouts)}"
                )
            self.layout = _Segments(self.region, checked, max_blocks)
            self.table = table

    def _layout_refused(self, refuse: str) -> str:
        if refuse:
            return refuse
        if isinstance(self.layout, _Segments):
            return "a block layout is already set (it is set once)"
        if self.region.committed_bytes:
            return (
                f"{self.region.committed_bytes} bytes are committed; a block layout is set "
                "while nothing is (initial_bytes=0, before any grow)"
            )
        if self.broken:
            return f"unusable after {self.broken}; close it"
        return ""

    # -- collective resize -----------------------------------------------------------------
    def resize(
        self, size: Any, direction: str | None, *, blocks: bool, peers: PeerMap | None
    ) -> int:
        """Collective: ``SymmetricRegion.resize`` (``blocks=False``) or ``resize_blocks``
        (the block set ``[0, size)``; returns its top)."""
        if blocks:
            return blockset.top(self.resize_set(size, direction, peers=peers))
        problem, kind = self._resize_problem(size, direction, blocks)
        with self._lock:
            # A fresh nonce per exchange names its sockets: unpredictable before this step.
            request = (None if problem else size, problem, secrets.token_hex(16))
            reqs = self._gather(request, "resize request")
            self._raise_problems(reqs, problem, kind, "resize rejected")
            sizes = [size for size, _, _ in reqs]
            if any(size != sizes[0] for size in sizes):
                raise RendezvousError(
                    f"resize: the target size ({self.layout.unit}) must be identical on all "
                    "ranks, got " + ", ".join(f"rank {r}: {n}" for r, n in enumerate(sizes))
                )
            layout = self.layout
            current = layout.current()
            if layout.rounded(size) > current:
                self._grow(current, size, reqs[0][2], peers)
            elif layout.rounded(size) < current:
                self._shrink(size, peers)
            return layout.current()

    def resize_set(self, request: Any, direction: str | None, *, peers: PeerMap | None) -> BlockSet:
        """Collective: ``SymmetricRegion.resize_block_set`` (``request`` a block set) or
        ``resize_blocks`` (``request`` an int ``n``: the prefix ``[0, n)``). A change that both
        adds and drops blocks runs as a grow to the union of the old and the new set, then a
        shrink to the new one: each phase keeps its failure rule (a failed grow leaves every
        rank at the old set, a failed shrink leaves ``broken``)."""
        target, problem, kind = self._set_problem(request, direction)
        with self._lock:
            # A fresh nonce per exchange names its sockets: unpredictable before this step.
            shown = request if isinstance(request, int) and not problem else None
            wire = None if problem else [list(iv) for iv in target]
            reqs = self._gather((wire, problem, secrets.token_hex(16), shown), "resize request")
            self._raise_problems(reqs, problem, kind, "resize rejected")
            sets = [tuple(tuple(iv) for iv in req[0]) for req in reqs]
            if any(s != sets[0] for s in sets):
                show = [req[3] if req[3] is not None else req[0] for req in reqs]
                differ = [r for r, s in enumerate(sets) if s != sets[0]]
                raise RendezvousError(
                    "resize: the target block set must be identical on all ranks (ranks "
                    f"{differ} differ from rank 0), got "
                    + ", ".join(f"rank {r}: {n}" for r, n in enumerate(show))
                )
            layout = self.layout
            old = layout.current()
            grown = blockset.union(old, target)
            if grown != old:
                self._grow(old, grown, reqs[0][2], peers)
            if target != grown:
                self._shrink(target, peers)
            return layout.current()

    def _set_problem(self, request: Any, direction: str | None) -> tuple[BlockSet, str, type]:
        """(the canonical target set, '', None) when this rank's block request is valid, else
        ((), reason, exception type)."""
        layout = self.layout
        if not isinstance(layout, _Segments):
            why = "no block layout is set: resize by bytes (resize; ReplicatedKVCache.grow/shrink)"
            return (), why, RuntimeError
        if isinstance(request, int) and not isinstance(request, bool):
            if not 0 <= request <= layout.limit:
                return (), f"blocks={request} outside [0, {layout.limit}]", ValueError
            target = blockset.prefix(request)
            name = f"{request}"
        elif isinstance(request, bool) or not isinstance(request, (tuple, list)):
            what = "blocks must be an int or a block set ((start, end), ...)"
            return (), f"{what}, got {type(request).__name__}", TypeError
        else:
            try:
                target = blockset.block_set(request, layout.limit, "block set")
            except (TypeError, ValueError) as exc:
                return (), str(exc), type(exc)
            name = f"the block set {_show(target)}"
        if direction not in (None, "grow", "shrink"):
            return (), f"direction must be None, 'grow' or 'shrink', got {direction!r}", ValueError
        current = layout.current()
        plain = blockset.as_prefix(current) is not None and blockset.as_prefix(target) is not None
        if direction == "grow" and not blockset.is_subset(current, target):
            lost = "" if plain else f" (it drops {_show(blockset.difference(current, target))})"
            below = f"below the committed {_show_size(current)}{lost}"
            return (), f"grow to {name} is {below}; use shrink", ValueError
        if direction == "shrink" and not blockset.is_subset(target, current):
            gained = "" if plain else f" (it adds {_show(blockset.difference(target, current))})"
            above = f"above the committed {_show_size(current)}{gained}"
            return (), f"shrink to {name} is {above}; use grow", ValueError
        if self.region.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return (), "refused during CUDA stream capture (resize before or after)", RuntimeError
        if self.broken:
            return (), f"unusable after {self.broken}; close it", RuntimeError
        return target, "", type(None)

    def _gather(self, request: Any, what: str) -> list[Any]:
        try:
            return self._comm.all_gather(request, what)
        except GroupError as exc:
            raise as_rendezvous_error(exc) from None

    def _raise_problems(self, reqs: list[Any], problem: str, kind: type, what: str) -> None:
        """Every rank raises when any request carries a problem: this rank's own with ``kind``,
        the others' as RendezvousError naming them."""
        problems = {r: req[1] for r, req in enumerate(reqs) if req[1]}
        if problems:
            msg = f"{what}: " + "; ".join(f"rank {r}: {p}" for r, p in problems.items())
            raise (kind if problem else RendezvousError)(msg)

    def _resize_problem(self, size: Any, direction: str | None, blocks: bool) -> tuple[str, type]:
        """('', None) when this rank's resize request is valid, else (reason, exception type)."""
        layout = self.layout
        name = "blocks" if blocks else "committed_bytes"
        if blocks != isinstance(layout, _Segments):
            why = (
                "no block layout is set: resize by bytes (resize; ReplicatedKVCache.grow/shrink)"
                if blocks
                else "a block layout is set: resize by blocks (resize_blocks; "
                "ReplicatedKVCache.grow_blocks/shrink_blocks), not by a byte prefix"
            )
            return why, RuntimeError
        if isinstance(size, bool) or not isinstance(size, int):
            return f"{name} must be an int, got {type(size).__name__}", TypeError
        if not 0 <= size <= layout.limit:
            return f"{name}={size} outside [0, {layout.limit}]", ValueError
        if direction not in (None, "grow", "shrink"):
            return f"direction must be None, 'grow' or 'shrink', got {direction!r}", ValueError
        current = layout.current()
        if direction == "grow" and size < current:
            return f"grow to {size} is below the committed {current}; use shrink", ValueError
        if direction == "shrink" and size > current:
            return f"shrink to {size} is above the committed {current}; use grow", ValueError
        if self.region.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return "refused during CUDA stream capture (resize before or after)", RuntimeError
        if self.broken:
            return f"unusable after {self.broken}; close it", RuntimeError
        return "", type(None)

    def _grow(self, current: Any, size: Any, nonce: str, peers: PeerMap | None) -> None:
        layout = self.layout
        what = f"grow to {_size_words(size, layout.unit)}"
        deadline = time.monotonic() + self._comm.timeout
        added: list[Chunk] = []
        error: Exception | None = None
        bounds = None
        doing = "building the new bounds"
        try:
            # The new bounds are built before the agreement: after it, nothing that can fail
            # on one rank alone may stand between the agreement and the bounds' device write.
            bounds = self._bounds_tensor(layout, size)
            world = 1 if peers is None or peers.by_value else self._comm.world_size
            doing = "the open-file check"
            self.check_fds(what, len(planned_runs(layout, size)), world=world)
            doing = "the local commit"
            added = layout.commit(size)
        except Exception as exc:
            error = RendezvousError(
                f"rank {self._comm.rank} ({self.region.device}): {what}: {doing} failed: {exc!r}"
            )
            error.__cause__ = exc
        try:
            if peers is None:
                self._comm.agree(error, f"{what} (local commit)")
            else:
                exchange_then_agree(
                    self._comm,
                    f"{what} (peer mapping)",
                    lambda err: peers.exchange_new(added, nonce, err, deadline),
                    error,
                    deadline,
                    finish=lambda: peers.finish_exchange(nonce),
                )
        except GroupError as exc:
            self._release_local(current, peers)
            raise as_rendezvous_error(exc) from error
        self._set_bounds(layout, size, bounds)

    def _release_local(self, current: Any, peers: PeerMap | None) -> None:
        """Roll a failed grow back to ``current``: peers' new chunks first, then our own. Errors
        are logged, not raised: the grow's own error is the one the caller raises."""
        layout = self.layout
        steps = [lambda: layout.decommit(current)]
        if peers is not None:
            steps.insert(0, lambda: layout.unmap_peers(peers, current))
        try:
            run_all(steps)
        except Exception as exc:
            # Chunks that stayed mapped stay on the books, but the next grow would find them
            # in its way: refuse further resizes, as after a failed shrink.
            self.broken = f"a failed grow rollback ({exc})"
            log.error("rank %d: rolling back a failed grow: %s", self.rank, exc)

    def _shrink(self, size: Any, peers: PeerMap | None) -> None:
        # Kernels stop writing past the new bounds from here on. If anything below fails, the
        # bounds stay lowered (writes beyond them are skipped and counted, never faulting) and
        # the object refuses further resizes: some ranks may have unmapped their peers' chunks.
        layout = self.layout
        self._set_bounds(layout, size)
        try:
            self.region.synchronize()
            self._comm.barrier("shrink: all ranks idle")
            error = None
            try:
                if peers is not None:
                    layout.unmap_peers(peers, size)
            except Exception as exc:
                error = exc
            self._comm.agree(error, "shrink: peers unmapped")
            layout.decommit(size)
        except BaseException as exc:
            self.broken = f"a failed shrink to {_size_words(size, layout.unit)} ({exc})"
            if isinstance(exc, GroupError):
                raise as_rendezvous_error(exc) from exc
            raise

    @staticmethod
    def _bounds_tensor(layout: _Prefix | _Segments, size: Any) -> torch.Tensor:
        return torch.tensor(layout.bounds(size), dtype=torch.int64)

    def _set_bounds(
        self, layout: _Prefix | _Segments, size: Any, bounds: torch.Tensor | None = None
    ) -> None:
        """Every element of the bound table in one device write, then a synchronize."""
        if bounds is None:
            bounds = self._bounds_tensor(layout, size)
        self.table.copy_(bounds)
        layout.moved(size)
        if self.region.device.type == "cuda":
            torch.cuda.synchronize(self.region.device)
