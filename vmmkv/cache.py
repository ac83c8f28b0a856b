"""``ReplicatedKVCache``: the engine-facing object (region + rendezvous + kernels).

Contract:
- Collective (every rank of ``cpu_group``, same order): the constructor, ``grow``, ``shrink``,
  the stores in gather mode (they all-gather), ``barrier`` in direct mode (every rank must call
  it for the same lane the same number of times).
- Local: ``allocate``, ``bind``, ``stats``, ``close`` (idempotent; a peer may be dead).
- Capture-safe (``torch.cuda.graph``) once warmed up: direct stores and ``barrier`` on CUDA.
  Not capture-safe: ``grow``/``shrink`` (refused during capture), the gather fallback (it
  exchanges token counts on the host), ``stats`` (it reads a device counter).
- Views returned by ``allocate`` and ``bind`` are invalid after ``close``.

Selection (``VMMKV_DIRECT``, or the ``direct`` argument, which wins): ``auto`` (default) publishes
directly when every rank mapped every peer, otherwise falls back to gather-then-insert with one
log line saying why; ``1`` asks for direct and warns when it falls back; ``0`` always gathers.
Both paths produce identical bytes: the gather path runs the same kernels (or, on the host
backend, the same reference) with a one-entry destination table, the own replica.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import ops
from .alloc.driver import finalizing
from .alloc.region import run_all
from .ipc import DirectUnsupported, SymmetricRegion
from .ipc.comm import check_cpu_group
from .ops import host as host_ops
from .ops.kv import KVTarget
from .ops.reference import INDEXER_ENTRY_BYTES, MLA_ENTRY_BYTES

__all__ = ["Binding", "ReplicatedKVCache", "resolve_direct"]

log = logging.getLogger("vmmkv")

_ALLOC_ALIGN = 256
_KINDS = {"fp8_ds_mla": MLA_ENTRY_BYTES, "indexer_k": INDEXER_ENTRY_BYTES, "rows": None}
_STORE_KINDS = (("fp8_ds_mla",), ("indexer_k",), ("rows",), ("fp8_ds_mla", "indexer_k"))
# (dtype, width) of each input a store of that kind takes; "rows" takes uint8 [T, entry]
_INPUTS = {
    "fp8_ds_mla": ((torch.bfloat16, 512), (torch.bfloat16, 64)),
    "indexer_k": ((torch.bfloat16, 128),),
    "rows": ((torch.uint8, None),),
}


def resolve_direct(direct: bool | None) -> str:
    """'auto', '1' or '0' from the argument (wins) or ``VMMKV_DIRECT``."""
    if direct is not None:
        if not isinstance(direct, bool):
            raise TypeError(f"direct must be None, True or False, got {direct!r}")
        return "1" if direct else "0"
    value = os.environ.get("VMMKV_DIRECT", "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"VMMKV_DIRECT must be 'auto', '0' or '1', got {value!r}")
    return value


@dataclass(frozen=True)
class Binding:
    """A bound layer view: what the store methods take. ``direct`` is None in gather mode."""

    name: str
    kind: str
    view: torch.Tensor
    local: KVTarget
    direct: KVTarget | None


class _GroupBarrier:
    """Host-backend barrier: writes to shared host mappings are ordered by a gloo barrier."""

    def __init__(self, group: Any):
        self.group = group

    def arrive_and_wait(self, lane: int = 0) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        pass


class ReplicatedKVCache:
    """Replicated KV cache over a PCP group (see the module docstring for the contracts)."""

    def __init__(
        self,
        cpu_group: Any,
        capacity_bytes: int,
        device: Any = None,
        *,
        device_group: Any = None,
        initial_bytes: int | None = None,
        chunk_bytes: int | None = None,
        lanes: int = 1,
        direct: bool | None = None,
        timeout: float = 60.0,
        barrier_timeout: float | None = None,
        backend: str = "auto",
    ) -> None:
        check_cpu_group(cpu_group)
        if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
            raise ValueError(f"lanes must be an int >= 1, got {lanes!r}")
        self.mode_requested = resolve_direct(direct)
        if barrier_timeout is None:
            barrier_timeout = float(os.environ.get("VMMKV_BARRIER_TIMEOUT", "10"))
        self._cpu_group = cpu_group
        self._device_group = device_group
        self._lanes = lanes
        self._lock = threading.Lock()
        self._closed = False
        self._next_offset = 0
        self._bytes_issued = 0
        self._tokens = 0
        self._barriers = 0
        self.why_not_direct = ""
        kw = dict(chunk_bytes=chunk_bytes, backend=backend, timeout=timeout)
        initial = 0 if initial_bytes is None else initial_bytes
        sr = None
        if self.mode_requested == "0":
            self.why_not_direct = "direct publication disabled (VMMKV_DIRECT=0 or direct=False)"
        else:
            try:
                sr = SymmetricRegion(capacity_bytes, device, cpu_group, initial_bytes=initial, **kw)
            except DirectUnsupported as exc:
                self.why_not_direct = str(exc)
        if sr is None:
            sr = SymmetricRegion(
                capacity_bytes, device, cpu_group, initial_bytes=initial, map_peers=False, **kw
            )
        self._sr = sr
        self.direct = sr.mapped
        if not self.direct:
            msg = f"vmmkv: gather-then-insert fallback: {self.why_not_direct}"
            asked = self.mode_requested == "1"
            if asked:
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
            log.log(logging.WARNING if asked else logging.INFO, msg)
        else:
            log.info("vmmkv: direct publication to %d ranks", sr.world_size)
        self.error_counter = torch.zeros(1, dtype=torch.int32, device=sr.device)
        self._barrier: Any = None
        try:
            if sr.device.type == "cuda":
                # Load every kernel now: a module loaded lazily while a barrier spins would wait
                # for that barrier, and loading is not capture-safe.
                ops.warm_up(sr.device)
            if self.direct and sr.device.type == "cuda":
                need = lanes * 2 * sr.world_size * 4
                if need > sr.peers.signal_bytes:
                    raise ValueError(
                        f"lanes={lanes} needs {need} signal bytes, more than the "
                        f"{sr.peers.signal_bytes} of the signal region"
                    )
                self._barrier = ops.DeviceBarrier(
                    sr.peers.signal_table,
                    None,
                    sr.rank,
                    sr.world_size,
                    lanes,
                    sr.device,
                    timeout_s=barrier_timeout,
                )
            elif self.direct:
                self._barrier = _GroupBarrier(cpu_group)
        except BaseException:
            sr.close()
            raise

    # -- properties ------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._sr.rank

    @property
    def world_size(self) -> int:
        return self._sr.world_size

    @property
    def device(self) -> torch.device:
        return self._sr.device

    @property
    def backend(self) -> str:
        return self._sr.region.backend

    @property
    def capacity_bytes(self) -> int:
        return self._sr.capacity_bytes

    @property
    def committed_bytes(self) -> int:
        return self._sr.committed_bytes

    @property
    def chunk_bytes(self) -> int:
        return self._sr.region.chunk_bytes

    @property
    def lanes(self) -> int:
        return self._lanes

    @property
    def region(self) -> SymmetricRegion:
        return self._sr

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: ReplicatedKVCache is closed")

    # -- memory ----------------------------------------------------------------------------
    def allocate(self, nbytes: int, device: Any = None) -> torch.Tensor:
        """1-D int8 view of the next ``nbytes`` of the region (256-byte aligned). Usable as
        vLLM's ``buffer_allocator(nbytes, device)``; only the committed prefix may be touched."""
        self._check_open()
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"allocate: nbytes must be an int > 0, got {nbytes!r}")
        if device is not None and torch.device(device) != self.device:
            dev = torch.device(device)
            if not (dev.type == self.device.type and dev.index is None):
                raise ValueError(f"allocate: device {dev} is not the cache's device {self.device}")
        with self._lock:
            start = -(-self._next_offset // _ALLOC_ALIGN) * _ALLOC_ALIGN
            if start + nbytes > self.capacity_bytes:
                raise ValueError(
                    f"allocate: {nbytes} bytes at offset {start} exceed the capacity "
                    f"{self.capacity_bytes} ({self.capacity_bytes - start} left)"
                )
            self._next_offset = start + nbytes
        return self._sr.region.tensor(torch.int8)[start : start + nbytes]

    def bind(self, name: str, view: torch.Tensor, kind: str) -> Binding:
        """Validate a layer view ``[num_blocks, block_size, entry]`` inside the region and
        return the :class:`Binding` the store methods take.

        ``kind``: ``"fp8_ds_mla"`` (entry 656), ``"indexer_k"`` (132, blocks contiguous: the
        values and scales are split inside each block) or ``"rows"`` (any entry size)."""
        self._check_open()
        if kind not in _KINDS:
            raise ValueError(f"bind: kind must be one of {list(_KINDS)}, got {kind!r}")
        if not isinstance(view, torch.Tensor):
            raise TypeError(f"bind: view must be a torch.Tensor, got {type(view).__name__}")
        if view.dtype not in (torch.uint8, torch.int8):
            raise TypeError(f"bind {name!r}: view must be uint8 or int8, got {view.dtype}")
        if view.dim() != 3:
            raise ValueError(
                f"bind {name!r}: view must be [num_blocks, block_size, entry], got "
                f"shape {list(view.shape)}"
            )
        num_blocks, block_size, entry = view.shape
        want = _KINDS[kind]
        if want is not None and entry != want:
            raise ValueError(
                f"bind {name!r}: a {kind} view has entries of {want} bytes, got {entry}"
            )
        if view.stride(2) != 1:
            raise ValueError(f"bind {name!r}: entries must be contiguous, strides {view.stride()}")
        if kind == "indexer_k" and view.stride(1) != entry:
            raise ValueError(
                f"bind {name!r}: an indexer_k block must be contiguous (stride {entry} between "
                f"tokens), got strides {view.stride()}"
            )
        if view.device != self.device:
            raise ValueError(f"bind {name!r}: view is on {view.device}, cache on {self.device}")
        base = self._sr.region.base_ptr
        offset = view.data_ptr() - base
        block_stride, entry_stride = view.stride(0), view.stride(1)
        if kind == "indexer_k":
            extent = block_size * entry
        else:
            extent = (block_size - 1) * entry_stride + entry
        end = offset + (num_blocks - 1) * block_stride + extent if num_blocks else offset
        if offset < 0 or end > self.capacity_bytes:
            raise ValueError(
                f"bind {name!r}: view spans region bytes [{offset}, {end}), outside "
                f"[0, {self.capacity_bytes}): views must come from this cache's allocate()"
            )
        cache = view.view(torch.uint8) if view.dtype == torch.int8 else view
        geometry = dict(
            kind=kind,
            offset_bytes=offset,
            num_blocks=num_blocks,
            block_size=block_size,
            block_stride=block_stride,
            entry_stride=entry_stride,
            entry_bytes=entry,
            committed_bytes=self._sr.committed_table,
            error_counter=self.error_counter,
            cache=cache,
        )
        local = KVTarget(ptr_table=self._sr.local_table, my_rank=0, **geometry)
        direct = None
        if self.direct:
            direct = KVTarget(ptr_table=self._sr.ptr_table, my_rank=self.rank, **geometry)
        return Binding(name, kind, cache, local, direct)

    def grow(self, committed_bytes: int) -> int:
        """Collective: grow every replica's committed prefix to ``committed_bytes`` (rounded up
        to chunks). Allowed after graph capture; refused during capture. Returns the size."""
        self._check_open()
        return self._sr.resize(committed_bytes, direction="grow")

    def shrink(self, committed_bytes: int) -> int:
        """Collective: shrink every replica's committed prefix (e.g. to sleep). Blocks beyond it
        are never written afterwards (kernels read the bound from device memory)."""
        self._check_open()
        return self._sr.resize(committed_bytes, direction="shrink")

    # -- stores ----------------------------------------------------------------------------
    def _use_direct(self, mode: str | None) -> bool:
        self._check_open()
        if mode is None:
            return self.direct
        if mode == "gather":
            return False
        if mode == "direct":
            if not self.direct:
                raise RuntimeError(
                    f"rank {self.rank}: direct mode unavailable: {self.why_not_direct}"
                )
            return True
        raise ValueError(f"mode must be None, 'direct' or 'gather', got {mode!r}")

    def store_ds_mla(self, b: Binding, kv_c, k_pe, slot_mapping, *, num_local_only=0, mode=None):
        """fp8_ds_mla rows of ``kv_c [T,512]`` + ``k_pe [T,64]`` (bf16) into every replica."""
        self._store((b,), (kv_c, k_pe), slot_mapping, num_local_only, mode)

    def store_indexer_k(self, b: Binding, k, slot_mapping, *, num_local_only=0, mode=None):
        """Indexer keys ``k [T,128]`` (bf16, ue8m0 scales) into every replica."""
        self._store((b,), (k,), slot_mapping, num_local_only, mode)

    def store_layer(
        self,
        mla: Binding,
        idx: Binding,
        kv_c,
        k_pe,
        k,
        slot_mapping,
        *,
        num_local_only=0,
        mode=None,
    ):
        """Both caches of one layer in one launch."""
        self._store((mla, idx), (kv_c, k_pe, k), slot_mapping, num_local_only, mode)

    def publish_rows(self, b: Binding, rows, slot_mapping, *, num_local_only=0, mode=None):
        """Already formatted rows ``[T, entry]`` (uint8) into every replica."""
        self._store((b,), (rows,), slot_mapping, num_local_only, mode)

    def _store(self, bindings, inputs, slot_mapping, nlo, mode) -> None:
        for b in bindings:
            if not isinstance(b, Binding):
                raise TypeError(f"expected a Binding from bind(), got {type(b).__name__}")
        kinds = tuple(b.kind for b in bindings)
        if kinds not in _STORE_KINDS:
            raise ValueError(f"this store takes bindings of kinds {_STORE_KINDS}, got {kinds}")
        direct = self._use_direct(mode)
        if direct:
            targets = tuple(b.direct for b in bindings)
        else:
            inputs, slot_mapping, nlo = self._gather(bindings, inputs, slot_mapping, nlo)
            targets = tuple(b.local for b in bindings)
        _dispatch(kinds, targets, inputs, slot_mapping, nlo)  # validates in direct mode
        self._tokens += slot_mapping.numel()
        if direct:  # the gather path writes no peer memory
            entry = sum(b.local.entry_bytes for b in bindings)
            self._bytes_issued += (slot_mapping.numel() - nlo) * (self.world_size - 1) * entry

    def _check_inputs(self, bindings, inputs, slot_mapping, nlo) -> int:
        """The checks the kernels make, done before the gather's collectives (a rank that
        raised inside them would leave its peers waiting). Returns the token count."""
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
            raise TypeError(f"slot_mapping must be a 1-D tensor, got {slot_mapping!r:.60}")
        if slot_mapping.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
        tokens = slot_mapping.numel()
        if isinstance(nlo, bool) or not isinstance(nlo, int) or not 0 <= nlo <= tokens:
            raise ValueError(f"num_local_only must be an int in [0, {tokens}], got {nlo!r}")
        specs = [s for b in bindings for s in _INPUTS[b.kind]]
        if bindings[0].kind == "rows":
            specs = [(torch.uint8, bindings[0].local.entry_bytes)]
        if len(inputs) != len(specs):
            raise ValueError(f"expected {len(specs)} input tensors, got {len(inputs)}")
        for i, (t, (dtype, width)) in enumerate(zip(inputs, specs, strict=True)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"input {i} must be a tensor, got {type(t).__name__}")
            if t.dtype != dtype:
                raise TypeError(f"input {i} must be {dtype}, got {t.dtype}")
            if t.dim() != 2 or t.shape[1] != width or t.shape[0] < tokens:
                raise ValueError(f"input {i} must be [>= {tokens}, {width}], got {list(t.shape)}")
        for t in (*inputs, slot_mapping):
            if t.device != self.device:
                raise ValueError(f"inputs must be on {self.device}, got one on {t.device}")
        return tokens

    def _gather(self, bindings, inputs, slot_mapping, nlo):
        """All-gather the non-replicated tokens of every rank (padded with slot -1) and return
        inputs holding: own replicated tokens first (local only), then every rank's tokens.
        A rank whose inputs are invalid still joins the token-count exchange (announcing -1),
        so every rank raises instead of waiting."""
        problem = None
        try:
            tokens = self._check_inputs(bindings, inputs, slot_mapping, nlo)
        except (TypeError, ValueError) as exc:
            problem, tokens = exc, 0
        if self.world_size == 1:
            if problem is not None:
                raise problem
            return inputs, slot_mapping, nlo
        count = torch.tensor([-1 if problem else tokens - nlo], dtype=torch.int64)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(counts, count, group=self._cpu_group)
        if problem is not None:
            raise problem
        bad = [r for r, c in enumerate(counts) if int(c) < 0]
        if bad:
            raise ValueError(
                f"rank {self.rank}: gather fallback: ranks {bad} passed invalid inputs (their "
                "error says why); nothing was stored"
            )
        rows = [t[:tokens] for t in inputs]
        widths = [r.shape[1] * r.element_size() for r in rows]
        slots = slot_mapping.reshape(-1).to(torch.int64)
        # one byte matrix per token: every input's bytes then the slot (gloo lacks bf16)
        packed = torch.cat(
            [
                r.contiguous().view(torch.uint8).reshape(tokens, w)
                for r, w in zip(rows, widths, strict=True)
            ]
            + [slots.view(torch.uint8).reshape(tokens, 8)],
            dim=1,
        )
        width = packed.shape[1]
        tmax = max(int(c) for c in counts)
        out = packed[:0]
        if tmax:
            pad = torch.zeros(tmax, width, dtype=torch.uint8, device=packed.device)
            pad[:, width - 8 :] = torch.tensor([-1], dtype=torch.int64).view(torch.uint8)
            pad[: tokens - nlo] = packed[nlo:]
            if self._device_group is not None:
                out = torch.empty(
                    self.world_size * tmax, width, dtype=torch.uint8, device=pad.device
                )
                dist.all_gather_into_tensor(out, pad, group=self._device_group)
            else:
                parts = [
                    torch.empty(tmax, width, dtype=torch.uint8) for _ in range(self.world_size)
                ]
                dist.all_gather(parts, pad.cpu(), group=self._cpu_group)
                out = torch.cat(parts).to(packed.device)
        allrows = torch.cat([packed[:nlo], out])
        cols, start = [], 0
        for r, w in zip(rows, widths, strict=True):
            cols.append(allrows[:, start : start + w].contiguous().view(r.dtype))
            start += w
        new_slots = allrows[:, start:].contiguous().view(torch.int64).reshape(-1)
        return tuple(cols), new_slots, nlo

    def barrier(self, lane: int = 0) -> None:
        """Direct mode: every rank's earlier stores are visible in every replica afterwards
        (device-side system-scope barrier on CUDA; capture-safe). Gather mode: nothing to
        wait for (each rank inserted everything itself), returns at once."""
        self._check_open()
        if isinstance(lane, bool) or not isinstance(lane, int) or not 0 <= lane < self._lanes:
            raise ValueError(f"lane must be an int in [0, {self._lanes}), got {lane!r}")
        if self._barrier is None:
            return
        self._barrier.arrive_and_wait(lane)
        self._barriers += 1

    def stats(self) -> dict[str, int]:
        """Host-side counters, plus the device out-of-range counter (synchronizes).

        ``peer_bytes_issued``: entry bytes sent to peers by direct stores, counted on the host
        from the token counts (padding slots included, out-of-range ones too); 0 in gather
        mode. ``out_of_range_slots``: tokens the kernels skipped, once per cache a token
        targeted (``store_layer`` counts a bad slot twice: MLA and Indexer)."""
        self._check_open()
        return {
            "tokens_stored": self._tokens,
            "peer_bytes_issued": self._bytes_issued,
            "barriers": self._barriers,
            "out_of_range_slots": int(self.error_counter.item()),
            "committed_bytes": self.committed_bytes,
        }

    def close(self) -> None:
        """Local and idempotent: barrier resources, peer mappings, then the own region."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # Synchronize before freeing the barrier's host-mapped diagnostic page: a barrier still
        # in flight (e.g. spinning on a dead peer until its timeout) writes into it.
        steps = [] if finalizing() else [self._sr.region.synchronize]
        steps += [self._barrier.close] if self._barrier else []
        run_all([*steps, self._sr.close])

    def __enter__(self) -> ReplicatedKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _dispatch(kinds, targets, inputs, slot_mapping, nlo) -> None:
    """CUDA targets go to the fused kernels; CPU targets (host backend) to the reference
    applied to every destination of the table (the same bytes, see vmmkv.ops.host)."""
    impl = host_ops if targets[0].device.type == "cpu" else ops
    if kinds == ("fp8_ds_mla",):
        impl.store_ds_mla(targets[0], *inputs, slot_mapping, num_local_only=nlo)
    elif kinds == ("indexer_k",):
        impl.store_indexer_k(targets[0], *inputs, slot_mapping, num_local_only=nlo)
    elif kinds == ("rows",):
        impl.publish_rows(targets[0], *inputs, slot_mapping, num_local_only=nlo)
    else:
        impl.store_layer(targets[0], targets[1], *inputs, slot_mapping, num_local_only=nlo)
