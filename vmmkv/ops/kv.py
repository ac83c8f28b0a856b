"""Fused KV stores into every replica (docs/design.md, "KV byte formats").

Contract:
- A :class:`KVTarget` describes one layer view (kind, where it sits in every replica's region,
  block geometry) plus three device tensors the kernels use: ``committed_bytes`` (int64 [1], the
  region's committed size, read by the kernel on every launch so the cache may grow after
  CUDA-graph capture), ``error_counter`` (int32 [1], incremented once per token skipped for an
  out-of-range or uncommitted block) and ``cache`` (the uint8 tensor the custom ops declare
  mutated, for torch's dependency tracking: any tensor whose memory contains the view in the
  own replica). The caller owns and keeps alive every tensor and the mapped regions; nothing
  here allocates device memory or frees anything.
- CONTRACT with the engine-facing cache (torch.compile ordering): ``cache`` is the one uint8
  tensor over the WHOLE own region (``SymmetricRegion.region.tensor()``, made once and reused),
  the same tensor object for every target, the ``fence`` of the ``DeviceBarrier``, and the base
  of every cache view the model reads. torch.compile tracks aliasing by storage, so then every
  store, publish and barrier op mutates the storage the attention reads, and a compiled graph
  keeps store -> barrier -> read in order and never drops a barrier. Two targets whose caches
  are different views of one storage work eagerly, but a compiled graph copies one of them
  (the ops then refuse to run, see below).
- ``store_ds_mla``/``store_indexer_k``/``store_layer``/``publish_rows``/``publish_layer``
  (``store_layer`` + barrier in one launch) take an MLA target of either MLA kind
  (``fp8_ds_mla``: raw tile scales; ``fp8_ds_mla_ue8m0``: power-of-two tile scales) and an
  indexer target of either indexer kind (``indexer_k``: fp32 scales; ``indexer_k_mxfp8``: four
  UE8M0 bytes, ``ue8m0`` must stay True); each kind combination has its own compile-time kernel
  variant (``vmmkv.ops.launch.STORES``). They validate everything
  (types, shapes, devices, alignment, ranges) before launching and raise TypeError/ValueError
  naming the value got and what was expected. Token count = ``slot_mapping.numel()``; inputs may
  be longer. Tokens ``i < num_local_only`` go to the own replica only, the others to every
  replica. Slots < 0 are skipped silently.
- Launches go to torch's current stream: capture-safe after the first launch on a device (which
  compiles/loads; call ``vmmkv.ops.launch.warm_up`` before capture). Not collective. Stores to
  peers become visible to them only after a system-scope barrier (vmmkv.ops.barrier).
- The per-binding fast path is ``vmmkv.ops.prepare`` (vmmkv.ops.prepared): same kernels, same
  checks, parameters packed once.
- Under ``torch.compile`` the functions call the ``torch.ops.vmmkv.*`` custom ops, which declare
  the cache and error counter as mutated. The kernels write through the region addresses, not
  through the tensor handed to the op, so the op refuses to run (RuntimeError) if compilation
  replaced ``cache`` by a copy; keep caches as graph inputs or module buffers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vmmkv._util import require_int
from vmmkv.ops import launch as _launch
from vmmkv.ops.barrier import DeviceBarrier
from vmmkv.ops.formats import FORMATS, INDEXER_ENTRY_BYTES, INDEXER_KINDS, MLA_KINDS
from vmmkv.ops.reference import check_slot_mapping, check_store_input

__all__ = [
    "KINDS",
    "KVTarget",
    "publish_layer",
    "publish_rows",
    "store_ds_mla",
    "store_indexer_k",
    "store_layer",
]

KINDS = tuple(FORMATS)  # every kind of the formats table
_WARPS_PER_CTA = 8
_THREADS = 32 * _WARPS_PER_CTA
_MAX_GRID = 65535
_MAX_SPAN = 2**62  # bound of a view's last byte, so that the kernels' int64 offsets never overflow


def _require_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


@dataclass(frozen=True, eq=False)
class KVTarget:
    """One layer view of a replicated KV cache, as the store kernels see it.

    ``ptr_table``: int64 [num_dest] device tensor of region base addresses, own base at
    ``my_rank`` (peers' regions mapped into this process). Region bases must be 16-byte aligned
    (VMM reservations are). The view starts at ``offset_bytes`` in every region; block ``b``
    starts ``b * block_stride`` later; inside a block token ``o`` is at ``o * entry_stride``
    (the MLA kinds, rows) or split (the indexer kinds: values at ``o*128``, scale at
    ``block_size*128 + 4*o``). ``entry_bytes``: 656 (MLA kinds), 132 (indexer kinds), the row
    size (rows). ``cache``: see the module docstring (the whole own region in the engine).
    """

    kind: str
    ptr_table: torch.Tensor
    my_rank: int
    offset_bytes: int
    num_blocks: int
    block_size: int
    block_stride: int
    entry_stride: int
    entry_bytes: int
    committed_bytes: torch.Tensor
    error_counter: torch.Tensor
    cache: torch.Tensor
    _dest: bytes = dataclasses.field(init=False, repr=False, default=b"")
    _cache_ptr: int = dataclasses.field(init=False, repr=False, default=0)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        pt = _require_tensor("ptr_table", self.ptr_table)
        if pt.dtype != torch.int64 or pt.dim() != 1 or pt.numel() < 1 or not pt.is_contiguous():
            raise ValueError(
                f"ptr_table must be a contiguous 1-D int64 tensor with >= 1 entry, got "
                f"{pt.dtype} shape {list(pt.shape)}"
            )
        require_int("my_rank", self.my_rank, 0, pt.numel() - 1)
        require_int("offset_bytes", self.offset_bytes, 0)
        require_int("num_blocks", self.num_blocks, 0)
        require_int("block_size", self.block_size, 1, 2**31 - 1)
        require_int("block_stride", self.block_stride, 0)
        require_int("entry_stride", self.entry_stride, 0)
        require_int("entry_bytes", self.entry_bytes, 1)
        fmt = FORMATS[self.kind]
        if fmt.entry_bytes is not None and self.entry_bytes != fmt.entry_bytes:
            raise ValueError(
                f"entry_bytes of a {self.kind} view must be {fmt.entry_bytes}, "
                f"got {self.entry_bytes}"
            )
        if not fmt.split_block and self.entry_stride < self.entry_bytes:
            raise ValueError(
                f"entry_stride ({self.entry_stride}) must be >= entry_bytes ({self.entry_bytes})"
            )
        if self.block_stride < self.block_extent:
            raise ValueError(
                f"block_stride ({self.block_stride}) is smaller than the bytes one block spans "
                f"({self.block_extent}): blocks would overlap"
            )
        # the kernels form offset_bytes + block * block_stride + block_extent in int64 for
        # every in-range block (csrc/vmmkv_common.cuh dest_block_offset)
        span_end = self.offset_bytes + max(self.num_blocks - 1, 0) * self.block_stride
        span_end += self.block_extent
        if span_end >= _MAX_SPAN:
            raise ValueError(
                f"the view ends at byte {span_end} of its region (offset_bytes "
                f"{self.offset_bytes} + (num_blocks - 1) * block_stride "
                f"({self.num_blocks} - 1) * {self.block_stride} + block extent "
                f"{self.block_extent}); it must end below 2**62"
            )
        align = fmt.align
        for name in ("offset_bytes", "block_stride") + (
            ("entry_stride",) if self.kind in MLA_KINDS else ()
        ):
            if getattr(self, name) % align:
                raise ValueError(
                    f"{name} of a {self.kind} view must be a multiple of {align}, "
                    f"got {getattr(self, name)}"
                )
        cb = _require_tensor("committed_bytes", self.committed_bytes)
        if cb.dtype != torch.int64 or cb.numel() != 1:
            raise ValueError(
                f"committed_bytes must be an int64 tensor of 1 element, got {cb.dtype} "
                f"shape {list(cb.shape)}"
            )
        ec = _require_tensor("error_counter", self.error_counter)
        if ec.dtype != torch.int32 or ec.numel() != 1:
            raise ValueError(
                f"error_counter must be an int32 tensor of 1 element, got {ec.dtype} "
                f"shape {list(ec.shape)}"
            )
        cache = _require_tensor("cache", self.cache)
        if cache.dtype != torch.uint8:
            raise TypeError(f"cache must be a uint8 tensor, got {cache.dtype}")
        for name, t in (("committed_bytes", cb), ("error_counter", ec), ("cache", cache)):
            if t.device != pt.device:
                raise ValueError(
                    f"{name} is on {t.device} but ptr_table is on {pt.device}; all must match"
                )
        object.__setattr__(self, "_dest", self._pack(ec))
        object.__setattr__(self, "_cache_ptr", cache.data_ptr() if cache.is_cuda else 0)
        if self.kind in MLA_KINDS and self._cache_ptr % 16:
            raise ValueError(
                f"the {self.kind} cache view must be 16-byte aligned, got address "
                f"{self._cache_ptr:#x}"
            )

    @property
    def device(self) -> torch.device:
        return self.ptr_table.device

    @property
    def num_dest(self) -> int:
        return self.ptr_table.numel()

    @property
    def block_extent(self) -> int:
        """Bytes from a block's start that this kind can write."""
        if FORMATS[self.kind].split_block:
            return self.block_size * INDEXER_ENTRY_BYTES
        return (self.block_size - 1) * self.entry_stride + self.entry_bytes

    def _pack(self, error_counter: torch.Tensor) -> bytes:
        if not self.ptr_table.is_cuda:
            return b""  # validation-only target (CPU tensors): never launched
        return _launch.KVDEST.pack(
            self.ptr_table.data_ptr(),
            self.committed_bytes.data_ptr(),
            error_counter.data_ptr(),
            self.offset_bytes,
            self.block_stride,
            self.entry_stride,
            self.block_extent,
            self.num_blocks,
            self.block_size,
            self.num_dest,
            self.my_rank,
            0,
        )

    def _layout(self) -> list[int]:
        """Scalars of the custom ops (KVTarget itself cannot cross torch.library)."""
        return [
            self.my_rank,
            self.offset_bytes,
            self.num_blocks,
            self.block_size,
            self.block_stride,
            self.entry_stride,
            self.entry_bytes,
            self._cache_ptr,
        ]


# ---------------------------------------------------------------------------------------------
# Validation (no data_ptr here: it also runs while torch.compile traces with fake tensors)


def _check_target(name: str, target: object, kinds: tuple[str, ...]) -> KVTarget:
    """``target`` if it is a KVTarget of one of ``kinds``."""
    if not isinstance(target, KVTarget):
        raise TypeError(f"{name} must be a KVTarget, got {type(target).__name__}")
    if target.kind not in kinds:
        alt = f" (or {', '.join(map(repr, kinds[1:]))})" if len(kinds) > 1 else ""
        raise ValueError(f"{name} must be a {kinds[0]!r} target{alt}, got kind {target.kind!r}")
    return target


def _check_ue8m0(ue8m0: object, kinds: tuple[str, ...]) -> None:
    """``ue8m0`` is a bool, and True for kinds whose scales are UE8M0 bytes (they encode only
    powers of two)."""
    if not isinstance(ue8m0, bool):
        raise TypeError(f"ue8m0 must be a bool, got {type(ue8m0).__name__}")
    if not ue8m0:
        for kind in kinds:
            if FORMATS[kind].scale == "ue8m0x4":
                raise ValueError(
                    f"ue8m0=False is not possible for a {kind!r} target: its scales are stored "
                    f"as UE8M0 bytes, which hold only powers of two (vLLM's mxfp8 writer always "
                    f"rounds them); pass ue8m0=True"
                )


def _check_input(
    name: str, t: object, dtype: torch.dtype, width: int, device: torch.device, tokens: int
) -> None:
    if (
        isinstance(t, torch.Tensor)
        and t.dtype == dtype
        and t.dim() == 2
        and t.shape[1] == width
        and t.shape[0] >= tokens
        and t.stride(1) == 1
        and t.device == device
    ):
        return  # the common case, checked in one go; the shared check below explains a failure
    check_store_input(name, t, dtype, width, tokens=tokens, contiguous_rows=True, device=device)
    raise AssertionError(f"{name}: no reason found for a failed check")  # pragma: no cover


def _check_call(
    targets: tuple[KVTarget, ...],
    inputs: tuple[object, ...],
    slot_mapping: object,
    num_local_only: object,
    ue8m0: object = True,
) -> tuple[int, int]:
    """A store call's checks once its targets passed theirs (kinds, one device): the slots, each
    input as ``vmmkv.ops.formats`` lists it for the targets' kinds, ``num_local_only``, ``ue8m0``.
    Returns the token count and ``num_local_only``."""
    device = targets[0].device
    tokens = _check_slots(slot_mapping, device)
    given = iter(inputs)
    for t in targets:
        for name, dtype, width in FORMATS[t.kind].inputs:
            width = t.entry_bytes if width is None else width
            _check_input(name, next(given), dtype, width, device, tokens)
    nlo = require_int("num_local_only", num_local_only, 0, tokens)
    _check_ue8m0(ue8m0, tuple(t.kind for t in targets))
    return tokens, nlo


def _check_layer(mla_target: object, idx_target: object) -> tuple[KVTarget, KVTarget]:
    mla = _check_target("mla_target", mla_target, MLA_KINDS)
    idx = _check_target("idx_target", idx_target, INDEXER_KINDS)
    if idx.device != mla.device:
        raise ValueError(f"idx_target is on {idx.device} but mla_target is on {mla.device}")
    return mla, idx


def _check_slots(slot_mapping: object, device: torch.device) -> int:
    s = check_slot_mapping(slot_mapping)
    n = s.shape[0]
    if n > 1 and s.stride(0) != 1:
        raise ValueError(f"slot_mapping must be contiguous, got stride {s.stride()}")
    if s.device != device:
        raise ValueError(f"slot_mapping is on {s.device}, expected the target's device {device}")
    return n


def _check_cuda(device: torch.device) -> int:
    if device.type != "cuda":
        raise ValueError(f"the target's tensors must be on a CUDA device, got {device}")
    return _launch.device_ordinal(device)


def _check_aligned(name: str, t: torch.Tensor, align: int) -> None:
    row_bytes = t.stride(0) * t.element_size()
    if t.data_ptr() % align or (t.shape[0] > 1 and row_bytes % align):
        raise ValueError(
            f"{name} rows must be {align}-byte aligned, got address {t.data_ptr():#x} and row "
            f"stride {row_bytes} bytes"
        )


def _grid(tokens: int, most: int = _MAX_GRID) -> int:
    """One warp per token, at most ``most`` CTAs (the kernels' token loops are grid-stride; the
    launchers pass ``_launch.resident_grid``), at least one (a publish of zero tokens still runs
    the barrier)."""
    return max(1, min(most, -(-tokens // _WARPS_PER_CTA)))


def _launch_grid(kernel: _launch.Kernel, ordinal: int, tokens: int) -> int:
    return _grid(tokens, _launch.resident_grid((kernel,), ordinal, _THREADS))


def _compiling() -> bool:
    return torch.compiler.is_compiling()


# ---------------------------------------------------------------------------------------------
# Launches (eager path, also the custom ops' implementations)


def _launch_ds_mla(t: KVTarget, kv_c, k_pe, slots, tokens: int, nlo: int) -> None:
    ordinal = _check_cuda(t.device)
    _check_aligned("kv_c", kv_c, 16)
    _check_aligned("k_pe", k_pe, 16)
    if tokens == 0:
        return
    kernel = _launch.STORES[(t.kind,)]
    kernel.launch(
        ordinal, _launch_grid(kernel, ordinal, tokens), _THREADS, t._dest,
        kv_c.data_ptr(), kv_c.stride(0), k_pe.data_ptr(), k_pe.stride(0),
        slots.data_ptr(), int(slots.dtype == torch.int64), tokens, nlo,
    )  # fmt: skip


def _launch_indexer(t: KVTarget, k, slots, tokens: int, nlo: int, ue8m0: bool) -> None:
    ordinal = _check_cuda(t.device)
    _check_aligned("k", k, 8)
    if tokens == 0:
        return
    kernel = _launch.STORES[(t.kind,)]
    kernel.launch(
        ordinal, _launch_grid(kernel, ordinal, tokens), _THREADS, t._dest,
        k.data_ptr(), k.stride(0), slots.data_ptr(), int(slots.dtype == torch.int64),
        tokens, nlo, int(ue8m0),
    )  # fmt: skip


def _layer_params(mla: KVTarget, idx: KVTarget, kv_c, k_pe, k, slots, tokens, nlo, ue8m0):
    """The parameters of vmmkv_store_layer (and of its _barrier twin, before the barrier's)."""
    _check_aligned("kv_c", kv_c, 16)
    _check_aligned("k_pe", k_pe, 16)
    _check_aligned("k", k, 8)
    return (
        mla._dest, idx._dest, kv_c.data_ptr(), kv_c.stride(0), k_pe.data_ptr(), k_pe.stride(0),
        k.data_ptr(), k.stride(0), slots.data_ptr(), int(slots.dtype == torch.int64),
        tokens, nlo, int(ue8m0),
    )  # fmt: skip


def _launch_layer(mla: KVTarget, idx: KVTarget, kv_c, k_pe, k, slots, tokens, nlo, ue8m0):
    ordinal = _check_cuda(mla.device)
    params = _layer_params(mla, idx, kv_c, k_pe, k, slots, tokens, nlo, ue8m0)
    if tokens == 0:
        return
    kernel = _launch.STORES[(mla.kind, idx.kind)]
    kernel.launch(ordinal, _launch_grid(kernel, ordinal, tokens), _THREADS, *params)


def _launch_rows(t: KVTarget, rows: torch.Tensor, slots, tokens: int, nlo: int) -> None:
    ordinal = _check_cuda(t.device)
    if tokens == 0:
        return
    row_stride = rows.stride(0)
    vec16 = all(
        v % 16 == 0
        for v in (
            rows.data_ptr(),
            row_stride if tokens > 1 else 0,
            t.entry_bytes,
            t.offset_bytes,
            t.block_stride,
            t.entry_stride,
            t._cache_ptr,
        )
    )
    _launch.PUBLISH_ROWS.launch(
        ordinal, _launch_grid(_launch.PUBLISH_ROWS, ordinal, tokens), _THREADS, t._dest,
        rows.data_ptr(), row_stride, t.entry_bytes, slots.data_ptr(),
        int(slots.dtype == torch.int64), tokens, nlo, int(vec16),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Public API


def store_ds_mla(
    target: KVTarget,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_local_only: int = 0,
) -> None:
    """Quantize ``kv_c [T, 512]`` / ``k_pe [T, 64]`` (bf16) to the entries of ``target``'s MLA
    kind (``fp8_ds_mla`` or ``fp8_ds_mla_ue8m0``) and store them into every replica."""
    target = _check_target("target", target, MLA_KINDS)
    tokens, nlo = _check_call((target,), (kv_c, k_pe), slot_mapping, num_local_only)
    if _compiling():
        torch.ops.vmmkv.store_ds_mla(
            target.cache, target.error_counter, target.ptr_table, target.committed_bytes,
            kv_c, k_pe, slot_mapping, target._layout(), nlo, target.kind,
        )  # fmt: skip
        return
    _launch_ds_mla(target, kv_c, k_pe, slot_mapping, tokens, nlo)


def store_indexer_k(
    target: KVTarget,
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_local_only: int = 0,
    ue8m0: bool = True,
) -> None:
    """Quantize the indexer keys ``k [T, 128]`` (bf16) and store them into every replica of
    an ``indexer_k`` or ``indexer_k_mxfp8`` target."""
    target = _check_target("target", target, INDEXER_KINDS)
    tokens, nlo = _check_call((target,), (k,), slot_mapping, num_local_only, ue8m0)
    if _compiling():
        torch.ops.vmmkv.store_indexer_k(
            target.cache, target.error_counter, target.ptr_table, target.committed_bytes,
            k, slot_mapping, target._layout(), nlo, ue8m0, target.kind,
        )  # fmt: skip
        return
    _launch_indexer(target, k, slot_mapping, tokens, nlo, ue8m0)


def store_layer(
    mla_target: KVTarget,
    idx_target: KVTarget,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_local_only: int = 0,
    ue8m0: bool = True,
) -> None:
    """``store_ds_mla`` and ``store_indexer_k`` of one layer in a single launch."""
    mla, idx = _check_layer(mla_target, idx_target)
    tokens, nlo = _check_call((mla, idx), (kv_c, k_pe, k), slot_mapping, num_local_only, ue8m0)
    if _compiling():
        torch.ops.vmmkv.store_layer(
            mla.cache, mla.error_counter, idx.cache, idx.error_counter,
            mla.ptr_table, mla.committed_bytes, idx.ptr_table, idx.committed_bytes,
            kv_c, k_pe, k, slot_mapping, mla._layout(), idx._layout(), nlo, ue8m0, idx.kind,
            mla.kind,
        )  # fmt: skip
        return
    _launch_layer(mla, idx, kv_c, k_pe, k, slot_mapping, tokens, nlo, ue8m0)


def publish_layer(
    mla_target: KVTarget,
    idx_target: KVTarget,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    barrier: DeviceBarrier,
    lane: int = 0,
    num_local_only: int = 0,
    ue8m0: bool = True,
) -> None:
    """``store_layer`` then ``barrier.arrive_and_wait(lane)`` in ONE launch: the last CTA to
    finish its stores runs the barrier (same epochs, signal slots, timeout and diagnostic as the
    stand-alone barrier, so the two mix on one lane). Collective in effect like the barrier:
    every rank calls it (zero tokens still run the barrier). Eager and CUDA-graph capture; under
    torch.compile use a prepared store (``vmmkv.ops.prepare((mla, idx)).publish``), which is
    also the cheaper call per step."""
    mla, idx = _check_layer(mla_target, idx_target)
    tokens, nlo = _check_call((mla, idx), (kv_c, k_pe, k), slot_mapping, num_local_only, ue8m0)
    if not isinstance(barrier, DeviceBarrier):
        raise TypeError(f"barrier must be a vmmkv.ops.DeviceBarrier, got {type(barrier).__name__}")
    if _compiling():
        raise RuntimeError(
            "vmmkv.ops.publish_layer cannot be traced by torch.compile; call a PreparedStore "
            "made outside the compiled function: vmmkv.ops.prepare((mla, idx)).publish(...)"
        )
    bar_args = barrier.barrier_args(lane)
    ordinal = _check_cuda(mla.device)
    if barrier.ordinal != ordinal:
        raise ValueError(f"barrier is on {barrier.device}, the targets on {mla.device}")
    params = _layer_params(mla, idx, kv_c, k_pe, k, slot_mapping, tokens, nlo, ue8m0)
    kernel = _launch.PUBLISHES[(mla.kind, idx.kind)]
    kernel.launch(ordinal, _launch_grid(kernel, ordinal, tokens), _THREADS, *params, bar_args)


def publish_rows(
    target: KVTarget,
    rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_local_only: int = 0,
) -> None:
    """Copy already formatted rows ``[T, entry_bytes]`` (uint8) into every replica."""
    target = _check_target("target", target, ("rows",))
    tokens, nlo = _check_call((target,), (rows,), slot_mapping, num_local_only)
    if _compiling():
        torch.ops.vmmkv.publish_rows(
            target.cache, target.error_counter, target.ptr_table, target.committed_bytes,
            rows, slot_mapping, target._layout(), nlo,
        )  # fmt: skip
        return
    _launch_rows(target, rows, slot_mapping, tokens, nlo)


# ---------------------------------------------------------------------------------------------
# torch.library custom ops (torch.compile path; also callable directly, eager or under capture)


def _target_from_op(kind, cache, error_counter, ptr_table, committed_bytes, layout) -> KVTarget:
    if len(layout) != 8:
        raise ValueError(f"layout must have 8 entries, got {len(layout)}")
    my_rank, offset, num_blocks, block_size, block_stride, entry_stride, entry_bytes, ptr = layout
    if cache.data_ptr() != ptr:
        raise RuntimeError(
            f"vmmkv::{kind} got a cache tensor at {cache.data_ptr():#x} instead of the target's "
            f"{ptr:#x}: torch.compile replaced the mutated cache by a copy, which the kernels "
            f"(writing through region addresses) would not update. Pass caches as graph inputs "
            f"or module buffers."
        )
    return KVTarget(
        kind, ptr_table, my_rank, offset, num_blocks, block_size, block_stride, entry_stride,
        entry_bytes, committed_bytes, error_counter, cache,
    )  # fmt: skip


def _op_kind(kind: str, kinds: tuple[str, ...]) -> str:
    if kind not in kinds:
        raise ValueError(f"kind must be one of {kinds}, got {kind!r}")
    return kind


@torch.library.custom_op("vmmkv::store_ds_mla", mutates_args=("cache", "error_counter"))
def _op_store_ds_mla(
    cache: torch.Tensor,
    error_counter: torch.Tensor,
    ptr_table: torch.Tensor,
    committed_bytes: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: list[int],
    num_local_only: int,
    kind: str = "fp8_ds_mla",
) -> None:
    t = _target_from_op(
        _op_kind(kind, MLA_KINDS), cache, error_counter, ptr_table, committed_bytes, layout
    )
    store_ds_mla(t, kv_c, k_pe, slot_mapping, num_local_only=num_local_only)


@_op_store_ds_mla.register_fake
def _(cache, error_counter, ptr_table, committed_bytes, kv_c, k_pe, slot_mapping, layout, nlo,
      kind="fp8_ds_mla"):  # fmt: skip
    return None


@torch.library.custom_op("vmmkv::store_indexer_k", mutates_args=("cache", "error_counter"))
def _op_store_indexer_k(
    cache: torch.Tensor,
    error_counter: torch.Tensor,
    ptr_table: torch.Tensor,
    committed_bytes: torch.Tensor,
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: list[int],
    num_local_only: int,
    ue8m0: bool,
    kind: str,
) -> None:
    t = _target_from_op(
        _op_kind(kind, INDEXER_KINDS), cache, error_counter, ptr_table, committed_bytes, layout
    )
    store_indexer_k(t, k, slot_mapping, num_local_only=num_local_only, ue8m0=ue8m0)


@_op_store_indexer_k.register_fake
def _(cache, error_counter, ptr_table, committed_bytes, k, slot_mapping, layout, nlo, ue8m0, kind):
    return None


@torch.library.custom_op(
    "vmmkv::store_layer",
    mutates_args=("mla_cache", "mla_error_counter", "idx_cache", "idx_error_counter"),
)
def _op_store_layer(
    mla_cache: torch.Tensor,
    mla_error_counter: torch.Tensor,
    idx_cache: torch.Tensor,
    idx_error_counter: torch.Tensor,
    mla_ptr_table: torch.Tensor,
    mla_committed_bytes: torch.Tensor,
    idx_ptr_table: torch.Tensor,
    idx_committed_bytes: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    mla_layout: list[int],
    idx_layout: list[int],
    num_local_only: int,
    ue8m0: bool,
    idx_kind: str,
    mla_kind: str = "fp8_ds_mla",
) -> None:
    mla = _target_from_op(
        _op_kind(mla_kind, MLA_KINDS), mla_cache, mla_error_counter, mla_ptr_table,
        mla_committed_bytes, mla_layout,
    )  # fmt: skip
    idx = _target_from_op(
        _op_kind(idx_kind, INDEXER_KINDS), idx_cache, idx_error_counter, idx_ptr_table,
        idx_committed_bytes, idx_layout,
    )  # fmt: skip
    store_layer(mla, idx, kv_c, k_pe, k, slot_mapping, num_local_only=num_local_only, ue8m0=ue8m0)


@_op_store_layer.register_fake
def _(*args):
    return None


@torch.library.custom_op("vmmkv::publish_rows", mutates_args=("cache", "error_counter"))
def _op_publish_rows(
    cache: torch.Tensor,
    error_counter: torch.Tensor,
    ptr_table: torch.Tensor,
    committed_bytes: torch.Tensor,
    rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: list[int],
    num_local_only: int,
) -> None:
    t = _target_from_op("rows", cache, error_counter, ptr_table, committed_bytes, layout)
    publish_rows(t, rows, slot_mapping, num_local_only=num_local_only)


@_op_publish_rows.register_fake
def _(cache, error_counter, ptr_table, committed_bytes, rows, slot_mapping, layout, nlo):
    return None
