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
- One all-gather per store call: the ``world * (T - nlo)`` packed rows (every input's bytes,
  then the slot, one row per token). On CUDA with a ``device_group`` (NCCL): one
  ``all_gather_into_tensor`` on that group, enqueued on the current stream. On the host backend,
  or on CUDA without a device group: gloo over the CPU group (on CUDA staged through host
  memory: it synchronizes, cannot be captured, and is refused during capture). Gloo waits are
  bounded by vmmkv's timeout (the cache's ``timeout``), not the group's.
- Then the same store kernels (``vmmkv.ops.prepare``; on the host backend the same reference)
  with a one-entry destination table, the own replica: the same bytes as direct publication.
- Device work per call: one pack launch (``torch.cat`` into the staging rows; skipped for one
  contiguous input whose slots were gathered already), the all-gather (in place), one slot
  copy (skipped when the gathered mapping holds exactly the gathered rows' slots: no replicated
  rows), one insert launch, plus one for the replicated rows.

Contract: ``store`` is collective over the group (every rank, same order, same ``T``, ``nlo``,
kinds, slot dtype and slot form). With NCCL it takes no host synchronization, no ``.item()``
and no host collective: capture-safe under ``torch.cuda.graph`` (after one eager call, which
sets NCCL up), also when replayed after the cache grew. A rank that breaks the convention is a
contract violation that the path cannot see without a host collective: NCCL then hangs or
corrupts, gloo aborts the process (mismatched sizes) or times out. Invalid inputs raise on the
rank that passed them before any collective; its peers then wait in the all-gather (gloo: up to
vmmkv's timeout; NCCL: until NCCL's own timeout). ``VMMKV_CHECK_PADDING=1``
(read at construction, equal on every rank) adds a bounded host collective before every gather
that compares ``T``, ``nlo``, kinds, slot dtype and form and input validity across ranks and
raises the same diagnosis on every rank (a debug aid: it synchronizes the host).

Staging: eager calls reuse grow-only buffers owned by this object (per stream and row width);
calls under capture allocate theirs from the graph's private pool, which torch keeps for the
graph's replays (so no buffer a graph captured is ever freed under it). ``close`` drops the
buffers (local, idempotent).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import ops
from ._store import check_inputs, own_slots
from ._util import require_int, round_up
from .ops.kv import KVTarget

__all__ = ["GatherPath", "GatherTimeout", "check_padding_enabled", "pad_tokens"]

log = logging.getLogger(__name__)

_ROW_ALIGN = 16  # packed row width and input columns: the kernels' 16-byte vector loads
# one all-gather into a single tensor (newer torch names it all_gather_single)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GatherTimeout(RuntimeError):
    """A gloo all-gather of the fallback did not complete within vmmkv's timeout (a peer is
    gone, or broke the padding convention). The group's collectives are out of step after it."""


def check_padding_enabled() -> bool:
    """``VMMKV_CHECK_PADDING``: '1' turns the debug check on, '0' or unset leaves it off."""
    value = os.environ.get("VMMKV_CHECK_PADDING", "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"VMMKV_CHECK_PADDING must be '0' or '1', got {value!r}")
    return value == "1"


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

    def pieces(self, cols: Sequence[torch.Tensor], pad: torch.Tensor) -> list[torch.Tensor]:
        """``cols`` (uint8 ``[P, w]``, inputs then slot) interleaved with zero padding from
        ``pad`` (uint8 ``[>= P, 16]``), covering exactly ``width`` bytes per row."""
        rows = cols[0].shape[0]
        starts = self.offsets + ([self.slot_offset] if self.slot_bytes else [])
        out, at = [], 0
        for start, col in zip(starts, cols, strict=True):
            if start > at:
                out.append(pad[:rows, : start - at])
            out.append(col)
            at = start + col.shape[1]
        if self.width > at:
            out.append(pad[:rows, : self.width - at])
        return out


class _Staging:
    """Grow-only eager buffers of one row width: packed rows, slots, zero padding."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.slots: dict[torch.dtype, torch.Tensor] = {}
        self.pad: torch.Tensor | None = None


def _buffer(old: torch.Tensor | None, shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    if old is not None and old.shape[0] >= shape[0]:
        return old
    return torch.empty(shape, dtype=dtype, device=device)


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
        self._stores: dict[tuple[Any, ...], Any] = {}  # bindings -> ops.PreparedStore
        self._staging: dict[tuple[int, int], _Staging] = {}
        self._layouts: dict[tuple[int, ...], _Layout] = {}
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
        if self.check_padding and self.world_size > 1:
            self._check_padding(problem, kinds, inputs, tokens, nlo, slot_mapping, gathered)
        if problem is not None:
            raise problem
        store = self.prepare(bindings)
        if self.world_size == 1:
            store.store(inputs, slots, nlo)
            return tokens
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing and self._device_group is None:
            raise RuntimeError(
                f"rank {self.rank}: the gather fallback over gloo (no device_group) cannot run "
                "during CUDA-graph capture: pass an NCCL device_group to ReplicatedKVCache"
            )
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
        and their slots, P = T - nlo."""
        world, per_rank = self.world_size, tokens - nlo
        n = world * per_rank
        own = [t[nlo:tokens].view(torch.uint8) for t in inputs]
        slot_bytes = 0 if gathered is not None else slots.element_size()
        key = (*(c.shape[1] for c in own), slot_bytes)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _Layout(key[:-1], slot_bytes)
        staging = None if capturing else self._staging_for(layout.width)
        old = staging.rows if staging is not None else None
        recv = _buffer(old, (n, layout.width), torch.uint8, self.device)
        if staging is not None:
            staging.rows = recv
        recv = recv[:n]
        if (
            not slot_bytes
            and len(own) == 1
            and own[0].is_contiguous()
            and (own[0].shape[1] == layout.width)
        ):
            send = own[0]  # one contiguous input, slots already gathered: nothing to pack
        else:
            send = recv[self.rank * per_rank : (self.rank + 1) * per_rank]  # in place
            cols = own + ([slots[nlo:tokens].view(torch.uint8).view(per_rank, slot_bytes)]
                          if slot_bytes else [])  # fmt: skip
            pad = self._pad(staging, per_rank)
            torch.cat(layout.pieces(cols, pad), dim=1, out=send)
        self._all_gather(recv, send)
        views = [
            recv[:, off : off + w].view(t.dtype)
            for t, off, w in zip(inputs, layout.offsets, layout.input_bytes, strict=True)
        ]
        return views, self._gathered_slots(recv, slots, gathered, layout, staging, nlo, tokens)

    def _gathered_slots(self, recv, slots, gathered, layout, staging, nlo, tokens):
        """Contiguous slots of the gathered rows (the kernels take a contiguous mapping)."""
        world, n = self.world_size, recv.shape[0]
        if gathered is not None and nlo == 0 and gathered.is_contiguous():
            return gathered  # rank-major already: exactly the gathered rows' slots
        dtype = slots.dtype if gathered is None else gathered.dtype
        old = staging.slots.get(dtype) if staging is not None else None
        buf = _buffer(old, (n,), dtype, self.device)
        if staging is not None:
            staging.slots[dtype] = buf
        buf = buf[:n]
        if gathered is None:
            col = recv[:, layout.slot_offset : layout.slot_offset + layout.slot_bytes]
            buf.copy_(col.view(dtype).view(n))
        else:
            buf.view(world, n // world).copy_(gathered.view(world, tokens)[:, nlo:])
        return buf

    def _staging_for(self, width: int) -> _Staging:
        cuda = self.device.type == "cuda"
        stream = torch.cuda.current_stream(self.device).cuda_stream if cuda else 0
        return self._staging.setdefault((stream, width), _Staging())

    def _pad(self, staging: _Staging | None, rows: int) -> torch.Tensor:
        if staging is not None and staging.pad is not None and staging.pad.shape[0] >= rows:
            return staging.pad
        pad = torch.zeros((rows, _ROW_ALIGN), dtype=torch.uint8, device=self.device)
        if staging is not None:
            staging.pad = pad
        return pad

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
                f"rank {self.rank}: gather fallback: the gloo all-gather of the {what} failed "
                f"or did not complete within {self._timeout.total_seconds():g} s ({exc}); a "
                "peer is gone or broke the padding convention (VMMKV_CHECK_PADDING=1 finds out)"
            ) from exc

    # -- debug check -----------------------------------------------------------------------
    _FIELDS = (
        "inputs valid", "padded token count", "num_local_only", "kinds", "slot form",
        "input bytes per row",
    )  # fmt: skip

    def _check_padding(self, problem, kinds, inputs, tokens, nlo, slot_mapping, gathered):
        """VMMKV_CHECK_PADDING=1: compare this call's shape of the convention across ranks
        with one bounded host collective; raise the same diagnosis on every rank. (A call
        captured in a CUDA graph is checked when captured, not on replay.)"""
        from .ops.formats import STORE_KINDS

        if problem is None:
            src = gathered if gathered is not None else slot_mapping
            form = (2 if gathered is not None else 1) * 100 + src.element_size()
            row = sum(t.shape[1] * t.element_size() for t in inputs)
            mine = [1, tokens, nlo, STORE_KINDS.index(kinds), form, row]
        else:
            mine = [0] * len(self._FIELDS)
        send = torch.tensor(mine, dtype=torch.int64)
        out = torch.empty(self.world_size * len(mine), dtype=torch.int64)
        self._wait(_ALL_GATHER(out, send, group=self._cpu_group, async_op=True), "padding check")
        table = out.view(self.world_size, len(mine)).tolist()
        if problem is not None:
            return  # this rank raises its own error
        bad = [r for r, row in enumerate(table) if row[0] == 0]
        if bad:
            raise ValueError(
                f"rank {self.rank}: gather fallback: ranks {bad} passed invalid inputs (their "
                "error says why); nothing was stored"
            )
        for i, field in enumerate(self._FIELDS[1:], start=1):
            values = [row[i] for row in table]
            if any(v != values[0] for v in values):
                if field == "kinds":
                    values = [STORE_KINDS[v] for v in values]
                elif field == "slot form":
                    values = [f"{('own', 'gathered')[v // 100 - 1]} int{8 * (v % 100)}"
                              for v in values]  # fmt: skip
                listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                raise ValueError(
                    f"rank {self.rank}: gather fallback: {field} differs across ranks ({listing});"
                    " every rank must pass the same padded token count and num_local_only, pad "
                    "uneven inputs with vmmkv.gather.pad_tokens (VMMKV_CHECK_PADDING=1 check)"
                )

    def close(self) -> None:
        self._stores.clear()
        self._staging.clear()
