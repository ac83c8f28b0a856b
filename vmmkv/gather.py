"""The gather path of :class:`vmmkv.ReplicatedKVCache` (gather-then-insert): every rank
all-gathers the new rows of the group and inserts all of them into its own replica only.

Convention (the one vLLM's own PCP gather uses):

- Every rank passes the same padded token count ``T`` (padding rows carry slot -1) and the same
  ``num_local_only`` (``nlo``): the leading ``nlo`` rows are replicated (decode tokens, computed
  identically by every rank); they are inserted from the rank's own inputs and never gathered.
  Callers with uneven counts pad first (:func:`pad_tokens`).
- Slots: either this rank's ``slot_mapping`` (``[T]``; then the slots travel with the rows) or
  the engine's already gathered ``gathered_slot_mapping`` (``[world * T]``, rank-major: rank
  ``r``'s rows at ``[r*T, (r+1)*T)``, its replicated rows first); then slots are not gathered.
- One all-gather of rows per store call: the ``world * (T - nlo)`` packed rows (every input's
  bytes, then the slot, one row per token). On CUDA with a ``device_group`` (NCCL): one
  ``all_gather_into_tensor`` on that group, enqueued on the current stream. On the host backend,
  or on CUDA without a device group: gloo over the CPU group (on CUDA staged through host
  memory: it synchronizes, cannot be captured, and is refused during capture), after a
  small header all-gather that checks the convention (below).
- Then the same store kernels (``vmmkv.ops.prepare``; on the host backend the same reference)
  with a one-entry destination table, the own replica: the same bytes as direct publication.
- Device work per call: one pack launch (``torch.cat`` into the staging rows; skipped for one
  contiguous input whose slots were gathered already), the all-gather (in place), one slot
  copy (skipped when the gathered mapping holds exactly the gathered rows' slots: no replicated
  rows), one insert launch, plus one for the replicated rows.

Contract: ``store`` is collective over the group (every rank, same order, same ``T``, ``nlo``,
kinds, slot dtype and slot form).

- Over gloo (the host backend, or CUDA without a device group) every call first all-gathers a
  fixed-size header (input validity, ``T``, ``nlo``, kinds, slot form, bytes per row): the
  path is synchronous there anyway, so one more small host collective buys the check. A rank
  that breaks the convention, or passes invalid inputs, makes every rank raise before anything
  is stored or gathered: the same ``ValueError`` on every rank, naming each rank's ``T`` and
  ``nlo`` and the call (the rank with invalid inputs raises its own error, its peers one that
  names it). The group stays in step: the next valid call works on every rank.
- With NCCL it takes no host synchronization, no ``.item()`` and no host collective:
  capture-safe under ``torch.cuda.graph`` (after one eager call, which sets NCCL up), also when
  replayed after the cache grew. The sizes cannot be checked there: NCCL's all-gather takes its
  count from each rank's own call, a device-side check would run only after a mismatched
  all-gather had hung or written past the rows, and a host check would synchronize every call
  and break capture. vLLM never reaches it uneven: its PCP pads every rank to the same row
  count (its own gather is an equal-size all-gather, and the expanded slot mapping is
  ``[world * T]`` rank-major) and takes ``nlo`` from the scheduler's decode count, the same on
  every rank. A rank that breaks the convention there is a contract violation: NCCL hangs or
  corrupts. Invalid inputs raise on the rank that passed them before any collective; its peers
  then wait in the all-gather until NCCL's own timeout. ``VMMKV_CHECK_PADDING=1`` (read at
  construction, equal on every rank) turns the gloo header check on for NCCL calls too, and
  then they raise as over gloo (a debug aid: it synchronizes the host; a call captured in a
  CUDA graph is checked when captured, not on replay).
- Gloo waits are bounded by vmmkv's timeout (the cache's ``timeout``), not the group's: a peer
  that is gone, or in a different call, raises :class:`GatherTimeout` on the waiting rank.

Staging: eager calls reuse grow-only buffers owned by this object (per stream and row width),
and a plan per call shape (layout, dtypes, slot dtype, ``T - nlo``, ``nlo``): the views of those
buffers that the call sends, receives, hands to the insert and fills with slots, so a repeated
eager call builds no views but its inputs' (host time; see BENCHMARKS.md, "Host time by stage").
A buffer's growth drops every plan over it; at most 64 plans are kept per buffer set (oldest
out). Calls under capture allocate their buffers from the graph's private pool, which torch
keeps for the graph's replays (so no buffer a graph captured is ever freed under it), and keep
no plan. ``close`` drops the buffers and plans (local, idempotent).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import _env, ops
from ._store import check_inputs, own_slots
from ._util import require_int, round_up
from .ops.kv import KVTarget
from .ops.launch import device_ordinal, stream_handle

__all__ = ["GatherPath", "GatherTimeout", "check_padding_enabled", "pad_tokens"]

log = logging.getLogger(__name__)

_ROW_ALIGN = 16  # packed row width and input columns: the kernels' 16-byte vector loads
# one all-gather into a single tensor (newer torch names it all_gather_single)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GatherTimeout(RuntimeError):
    """A gloo all-gather of the fallback did not complete within vmmkv's timeout (a peer is
    gone, or in a different call). The group's collectives are out of step after it."""


def check_padding_enabled() -> bool:
    """``VMMKV_CHECK_PADDING``: '1' turns the debug check on, '0' or unset leaves it off."""
    return _env.check_padding()


def pad_tokens(
    inputs: Sequence[torch.Tensor], slot_mapping: torch.Tensor, tokens: int
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Pad a rank's store inputs to ``tokens`` rows for the gather convention: the first
    ``slot_mapping.numel()`` rows of every input, then zero rows; the slots, then -1 (padding,
    never written). Every rank must pad to the same ``tokens`` (e.g. the group's maximum, which
    engines know from their scheduler). Allocates new tensors: call it outside CUDA-graph
    capture, or pad once into buffers of your own."""
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
        raise TypeError(f"slot_mapping must be a 1-D tensor, got {slot_mapping!r:.60}")
    n = slot_mapping.numel()
    require_int("tokens", tokens, lo=n)
    padded = []
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] < n:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"input {i} must be a 2-D tensor of >= {n} rows, got {got}")
        out = t.new_zeros((tokens, t.shape[1]))
        out[:n] = t[:n]
        padded.append(out)
    slots = slot_mapping.new_full((tokens,), -1)
    slots[:n] = slot_mapping
    return tuple(padded), slots


class _Layout:
    """Columns of a packed row: each input's bytes at a 16-byte aligned offset, then the slot
    (when slots travel with the rows); ``width`` rounded up to 16 bytes."""

    def __init__(self, input_bytes: Sequence[int], slot_bytes: int) -> None:
        offsets, off = [], 0
        for w in input_bytes:
            off = round_up(off, _ROW_ALIGN)
            offsets.append(off)
            off += w
        self.slot_offset = round_up(off, max(slot_bytes, 1)) if slot_bytes else off
        end = self.slot_offset + slot_bytes
        self.offsets = offsets
        self.input_bytes = list(input_bytes)
        self.slot_bytes = slot_bytes
        self.width = round_up(end, _ROW_ALIGN)

    def pieces(
        self, cols: Sequence[torch.Tensor | None], pad: torch.Tensor | None, rows: int
    ) -> list[torch.Tensor | None]:
        """``cols`` (uint8 ``[rows, w]``, inputs then slot; ``None`` keeps a column's place)
        interleaved with zero padding from ``pad`` (uint8 ``[>= rows, 16]``; None where the
        columns leave no gap), covering exactly ``width`` bytes per row."""
        starts = self.offsets + ([self.slot_offset] if self.slot_bytes else [])
        widths = self.input_bytes + ([self.slot_bytes] if self.slot_bytes else [])
        out, at = [], 0
        for start, w, col in zip(starts, widths, cols, strict=True):
            if start > at:
                out.append(pad[:rows, : start - at])
            out.append(col)
            at = start + w
        if self.width > at:
            out.append(pad[:rows, : self.width - at])
        return out


class _Staging:
    """Grow-only eager buffers of one row width, by name ("rows", "pad", or ("slots", dtype)),
    and the plans made over them. Every growth drops the plans, so no plan keeps a replaced
    buffer alive or points into one."""

    def __init__(self) -> None:
        self.buffers: dict[Any, torch.Tensor] = {}
        self.plans: dict[tuple[Any, ...], _Plan] = {}

    def buffer(self, name: Any, rows: int, make) -> torch.Tensor:
        """The buffer ``name`` if it holds ``rows`` rows, else ``make()`` in its place (and the
        plans are dropped)."""
        old = self.buffers.get(name)
        if old is not None and old.shape[0] >= rows:
            return old
        self.plans.clear()
        buf = self.buffers[name] = make()
        return buf


# Plans kept per staging, oldest dropped first. Engines vary their eager token counts from step
# to step (every count is a plan), so the cache must be bounded. A plan is about a dozen tensor
# views of the staging buffers: host memory only, no device memory of its own.
_MAX_PLANS = 64


class _Plan:
    """What one shape of ``_gather`` builds on every call, built once per staging: the views of
    the staging buffers that are sent, received, read by the insert and filled with slots.
    ``pieces`` is the ``torch.cat`` list of the pack, its padding views in place and the
    inputs' (and slot's) places ``None`` (at ``holes``), filled per call. ``no_pack``: one
    input that fills the row alone (no slot, no padding) is sent as it is when contiguous."""

    __slots__ = ("recv", "send", "no_pack", "pieces", "holes", "views", "slot_buf", "slot_dst",
                 "slot_src")  # fmt: skip

    def __init__(self, path: GatherPath, layout: _Layout, staging: _Staging | None,
                 dtypes: tuple[torch.dtype, ...], slot_dtype: torch.dtype, per_rank: int,
                 nlo: int, own_form: bool) -> None:  # fmt: skip
        world, rank, device = path.world_size, path.rank, path.device
        n = world * per_rank
        rows = _grown(staging, "rows", n, lambda: torch.empty(
            (n, layout.width), dtype=torch.uint8, device=device))  # fmt: skip
        self.recv = rows[:n]
        self.send = self.recv[rank * per_rank : (rank + 1) * per_rank]  # in place
        self.no_pack = len(dtypes) == 1 and layout.width == layout.input_bytes[0]
        self.pieces: list[torch.Tensor | None] = []
        self.holes: list[int] = []
        pad = None
        if layout.width > sum(layout.input_bytes) + layout.slot_bytes:
            pad = _grown(staging, "pad", per_rank, lambda: torch.zeros(
                (per_rank, _ROW_ALIGN), dtype=torch.uint8, device=device))  # fmt: skip
        cols = [None] * (len(dtypes) + (1 if layout.slot_bytes else 0))
        for piece in layout.pieces(cols, pad, per_rank):
            if piece is None:
                self.holes.append(len(self.pieces))
            self.pieces.append(piece)
        self.views = [
            self.recv[:, off : off + w].view(dt)
            for dt, off, w in zip(dtypes, layout.offsets, layout.input_bytes, strict=True)
        ]
        # the insert's contiguous slots: the gathered mapping as it is (no replicated rows), or
        # a buffer filled from the slot column (own form) or from the gathered mapping's rows
        self.slot_buf = self.slot_dst = self.slot_src = None
        if own_form or nlo:
            buf = _grown(staging, ("slots", slot_dtype), n, lambda: torch.empty(
                (n,), dtype=slot_dtype, device=device))[:n]  # fmt: skip
            self.slot_buf = buf
            if own_form:
                so, sb = layout.slot_offset, layout.slot_bytes
                self.slot_dst = buf
                self.slot_src = self.recv[:, so : so + sb].view(slot_dtype).view(n)
            else:
                self.slot_dst = buf.view(world, per_rank)


def _grown(staging: _Staging | None, name: Any, rows: int, make) -> torch.Tensor:
    """``staging.buffer(name, rows, make)``; without a staging (capture) a new buffer."""
    return make() if staging is None else staging.buffer(name, rows, make)


class GatherPath:
    """Gather-then-insert into the own replica (see the module docstring)."""

    name = "gather"

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        local_table: torch.Tensor,
        cpu_group: Any,
        device_group: Any,
        timeout: float,
        check_padding: bool,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.check_padding = check_padding
        self._local_table = local_table
        self._cpu_group = cpu_group
        # NCCL where the rows live on a GPU and the caller gave a device group; else gloo
        self._device_group = device_group if device.type == "cuda" else None
        self._timeout = timedelta(seconds=timeout)
        # gloo is synchronous anyway: check every call's header there; NCCL only when asked
        self._checked = check_padding or self._device_group is None
        self._calls = 0  # collective store calls on this path, named in its errors
        self._stores: dict[tuple[Any, ...], Any] = {}  # bindings -> ops.PreparedStore
        self._staging: dict[tuple[int, int], _Staging] = {}
        self._layouts: dict[tuple[int, ...], _Layout] = {}
        # the device whose current stream keys the staging (None on the host backend)
        self._stream_device = device_ordinal(device) if device.type == "cuda" else None
        self.transport = "nccl" if self._device_group is not None else "gloo"
        if device.type == "cuda" and self._device_group is None and world_size > 1:
            log.info(
                "rank %d: gather fallback stages through host memory over gloo (no device "
                "group given): it synchronizes and cannot be captured in a CUDA graph",
                rank,
            )

    def target(self, geometry: dict[str, Any], **tensors: torch.Tensor) -> KVTarget:
        """The target of a bound view: the own replica only."""
        return KVTarget(ptr_table=self._local_table, my_rank=0, **geometry, **tensors)

    def prepare(self, bindings: tuple[Any, ...]) -> Any:
        """The prepared store (``vmmkv.ops.prepare``) of these bindings' own-replica targets,
        built once."""
        store = self._stores.get(bindings)
        if store is None:
            store = ops.prepare(tuple(b.local for b in bindings))
            self._stores[bindings] = store
        return store

    # -- the store -------------------------------------------------------------------------
    def publish(self, bindings, inputs, slot_mapping, nlo, gathered, lane: int) -> int:
        """Same as ``store``: each rank inserted every row itself, no barrier is needed."""
        return self.store(bindings, inputs, slot_mapping, nlo, gathered)

    def store(self, bindings, inputs, slot_mapping, nlo, gathered) -> int:
        """Collective: gather the group's rows and insert them into the own replica. Returns
        this rank's token count ``T`` (as passed, before the gather)."""
        inputs = tuple(inputs)
        kinds = tuple(b.kind for b in bindings)
        problem: Exception | None = None
        tokens = 0
        try:
            slots, gathered = own_slots(slot_mapping, gathered, self.rank, self.world_size)
            rows_entry = bindings[0].local.entry_bytes
            tokens = check_inputs(kinds, rows_entry, inputs, slots, nlo, self.device)
        except (TypeError, ValueError) as exc:
            problem = exc
        capturing = False
        if self.world_size > 1:
            self._calls += 1
            capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if problem is None and capturing and self._device_group is None:
                problem = RuntimeError(
                    f"rank {self.rank} ({self.device}): the gather fallback over gloo (no "
                    "device_group) cannot run during CUDA-graph capture: pass an NCCL "
                    "device_group to ReplicatedKVCache"
                )
            if self._checked:
                self._check_call(problem, kinds, inputs, tokens, nlo, slot_mapping, gathered)
        if problem is not None:
            raise problem
        store = self.prepare(bindings)
        if self.world_size == 1:
            store.store(inputs, slots, nlo)
            return tokens
        if nlo:  # replicated rows: from the own inputs, never gathered
            store.store(inputs, slots[:nlo], 0)
        per_rank = tokens - nlo
        if per_rank == 0:  # every rank has only replicated rows (same T, same nlo)
            return tokens
        cols, all_slots = self._gather(inputs, slots, nlo, tokens, gathered, capturing)
        store.store(cols, all_slots, 0)
        return tokens

    def _gather(self, inputs, slots, nlo, tokens, gathered, capturing):
        """The group's non-replicated rows (``[world * P]`` column views of one packed buffer)
        and their slots, P = T - nlo. Eager calls reuse the plan of their shape (made on its
        first call); under capture the plan is made over new buffers and not kept."""
        per_rank = tokens - nlo
        own_form = gathered is None
        slot_dtype = slots.dtype if own_form else gathered.dtype
        widths = tuple(t.shape[1] * t.element_size() for t in inputs)
        dtypes = tuple(t.dtype for t in inputs)
        lkey = (*widths, slot_dtype.itemsize if own_form else 0)
        layout = self._layouts.get(lkey)
        if layout is None:
            layout = self._layouts[lkey] = _Layout(widths, lkey[-1])
        staging = None if capturing else self._staging_for(layout.width)
        pkey = (lkey, dtypes, slot_dtype, per_rank, nlo)
        plan = staging.plans.get(pkey) if staging is not None else None
        if plan is None:
            plan = _Plan(self, layout, staging, dtypes, slot_dtype, per_rank, nlo, own_form)
            if staging is not None:
                if len(staging.plans) >= _MAX_PLANS:
                    del staging.plans[next(iter(staging.plans))]
                staging.plans[pkey] = plan
        own = inputs if nlo == 0 and all(t.shape[0] == tokens for t in inputs) else [
            t[nlo:tokens] for t in inputs]  # fmt: skip
        send = plan.send
        if plan.no_pack and own[0].is_contiguous():
            send = own[0].view(torch.uint8)  # one contiguous input filling the row: no pack
        else:
            pieces = list(plan.pieces)
            cols = [t.view(torch.uint8) for t in own]
            if own_form:
                cols.append(slots[nlo:tokens].view(torch.uint8).view(per_rank, -1))
            for hole, col in zip(plan.holes, cols, strict=True):
                pieces[hole] = col
            torch.cat(pieces, dim=1, out=send)
        self._all_gather(plan.recv, send)
        if plan.slot_buf is None:
            return plan.views, gathered  # rank-major already: exactly the gathered rows' slots
        if own_form:
            plan.slot_dst.copy_(plan.slot_src)
        else:
            plan.slot_dst.copy_(gathered.view(self.world_size, tokens)[:, nlo:])
        return plan.views, plan.slot_buf

    def _staging_for(self, width: int) -> _Staging:
        stream = stream_handle(self._stream_device) if self._stream_device is not None else 0
        staging = self._staging.get((stream, width))
        if staging is None:
            staging = self._staging[(stream, width)] = _Staging()
        return staging

    def _all_gather(self, recv: torch.Tensor, send: torch.Tensor) -> None:
        gather = _ALL_GATHER
        if self._device_group is not None:
            gather(recv, send, group=self._device_group)
            return
        if self.device.type == "cpu":
            self._wait(gather(recv, send, group=self._cpu_group, async_op=True), "rows")
            return
        host = torch.empty(recv.shape, dtype=torch.uint8)  # gloo staging of device rows
        self._wait(gather(host, send.cpu(), group=self._cpu_group, async_op=True), "rows")
        recv.copy_(host)

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timeout=self._timeout)
        except RuntimeError as exc:
            raise GatherTimeout(
                f"rank {self.rank} ({self.device}): gather fallback, call {self._calls}: the gloo "
                f"all-gather of the {what} failed or did not complete within "
                f"{self._timeout.total_seconds():g} s ({exc}); a peer is gone or in a different "
                "call (the group's calls are out of step)"
            ) from exc

    # -- the header check ------------------------------------------------------------------
    _FIELDS = (
        "inputs valid", "padded token count", "num_local_only", "kinds", "slot form",
        "input bytes per row",
    )  # fmt: skip

    def _check_call(self, problem, kinds, inputs, tokens, nlo, slot_mapping, gathered):
        """Compare this call's shape of the convention across ranks with one bounded host
        collective of a fixed size (which gloo cannot abort on); raise the same diagnosis on
        every rank before anything is stored or gathered."""
        from .ops.formats import STORE_KINDS

        if problem is None:
            src = gathered if gathered is not None else slot_mapping
            form = (2 if gathered is not None else 1) * 100 + src.element_size()
            row = sum(t.shape[1] * t.element_size() for t in inputs)
            kind = STORE_KINDS.index(kinds) if kinds in STORE_KINDS else -1
            mine = [1, tokens, nlo, kind, form, row]
        else:
            mine = [0] * len(self._FIELDS)
        send = torch.tensor(mine, dtype=torch.int64)
        out = torch.empty(self.world_size * len(mine), dtype=torch.int64)
        self._wait(_ALL_GATHER(out, send, group=self._cpu_group, async_op=True), "call header")
        table = out.view(self.world_size, len(mine)).tolist()
        if problem is not None:
            return  # this rank raises its own error
        kinds_s = "+".join(kinds)
        call = f"rank {self.rank} ({self.device}): gather fallback, call {self._calls} ({kinds_s})"
        bad = [r for r, row in enumerate(table) if row[0] == 0]
        if bad:
            raise ValueError(
                f"{call}: ranks {bad} passed invalid inputs (their error says why); nothing "
                "was stored on any rank"
            )
        for i, field in enumerate(self._FIELDS[1:], start=1):
            values = [row[i] for row in table]
            if all(v == values[0] for v in values):
                continue
            if field == "kinds":
                values = [STORE_KINDS[v] if v >= 0 else "other" for v in values]
            elif field == "slot form":
                values = [f"{('own', 'gathered')[v // 100 - 1]} int{8 * (v % 100)}"
                          for v in values]  # fmt: skip
            listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            t_nlo = ", ".join(f"rank {r}: {row[1]}/{row[2]}" for r, row in enumerate(table))
            raise ValueError(
                f"{call}: {field} differs across ranks ({listing}); T/num_local_only by rank: "
                f"{t_nlo}. Nothing was stored on any rank: every rank must pass the same padded "
                "token count and num_local_only (pad uneven inputs with vmmkv.gather.pad_tokens)"
            )

    def close(self) -> None:
        self._stores.clear()
        self._staging.clear()
        # a closed path keeps no process group alive (``StoreComm.release_group`` says why)
        self._cpu_group = self._device_group = None
