"""Pure-torch reference of the KV byte formats (docs/design.md, "KV byte formats").

This is the oracle of the GPU tests and the store path of the host backend, so it reproduces the
CUDA kernels bit for bit, on any device (CPU or CUDA tensors):

- fp32 arithmetic is IEEE: every division is tensor / tensor (torch turns ``cuda_tensor / 448.0``
  into a multiplication by the rounded reciprocal, which is not the kernel's ``/``).
- fp32 -> e4m3 is round-to-nearest-even with SATFINITE: values are clamped to +-448 first
  (torch's own cast turns overflow into NaN; the clamp does not change any in-range rounding,
  since (448, 464] rounds to 448 anyway), and NaN becomes 0x7f, the canonical NaN that
  ``__nv_cvt_float_to_fp8`` returns whatever the NaN's sign.
- amax ignores NaN like the kernels' ``fmaxf`` reduction; an inf input gives an inf scale, so
  its tile holds 0x7f (inf/inf) for the inf and signed zeros elsewhere, as on the GPU.
- fp16 inputs are rejected (TypeError): only bf16 is specified.
- ``indexer_k_mxfp8`` stores the indexer's power-of-two scale ``2^e`` as four equal UE8M0
  bytes ``e + 127`` (:func:`ue8m0_x4`): an all-zero row gives ``0x69`` (the 1e-4 floor, scale
  2^-22), an inf input ``0xff`` (inf scale), the largest finite bf16 ``0xf7`` (2^120).
- ``fp8_ds_mla_ue8m0`` rounds each tile scale up to a power of two, ``ue8m0(max(amax / 448,
  1e-4))`` (:func:`ds_mla_scale`), as vLLM 0.33.0 writes it: an all-zero tile gives 2^-13, a
  tile amax of exactly ``448 * 2^k`` the scale ``2^k``, anything above it ``2^(k+1)``.

The format facts (entry bytes, widths, tile) come from ``vmmkv.ops.formats``; the old names
(``MLA_ENTRY_BYTES``...) are re-exported here. ``check_store_input`` and ``check_slot_mapping``
are the input checks every store path shares (reference, host stores, kernel wrappers, cache).

Inserters write into a cache view exactly as the kernels do and return how many tokens were
skipped for being out of range (slot >= num_blocks * block_size); slot < 0 is padding, skipped
silently. Token count = ``slot_mapping.numel()``; longer inputs are cut. Duplicate slots: the last
token wins here, the kernels leave it unspecified. Nothing here allocates beyond temporaries;
the caller owns every tensor. Capture-safe only on CUDA tensors without host syncs: the returned
count needs ``.item()``, so do not call the inserters inside CUDA-graph capture.
"""

from __future__ import annotations

import struct
import sys

import torch

from .formats import (
    INDEXER_DIM,
    INDEXER_ENTRY_BYTES,
    INDEXER_KINDS,
    MLA_ENTRY_BYTES,
    MLA_KINDS,
    MLA_KV_DIM,
    MLA_ROPE_DIM,
    MLA_TILE,
    get_format,
)

# The format constants imported above stay importable from here under their old names.
__all__ = [
    "FP8_MAX",
    "INDEXER_AMAX_FLOOR",
    "MLA_UE8M0_SCALE_FLOOR",
    "check_slot_mapping",
    "check_store_input",
    "ds_mla_scale",
    "e4m3_satfinite",
    "indexer_scale",
    "insert_ds_mla",
    "insert_ds_mla_ue8m0",
    "indexer_scale_bytes",
    "insert_indexer_k",
    "insert_indexer_k_mxfp8",
    "insert_rows",
    "quantize_ds_mla",
    "quantize_ds_mla_ue8m0",
    "quantize_indexer_k",
    "quantize_indexer_k_mxfp8",
    "ue8m0",
    "ue8m0_x4",
]

if sys.byteorder != "little":  # pragma: no cover - the formats are little-endian on every GPU host
    raise ImportError("vmmkv.ops.reference assumes a little-endian host")

FP8_MAX = 448.0
FLT_MIN = 2.0**-126
# The float nearest to 1e-4 (0x38d1b717): vLLM writes fmaxf(amax, 1e-4), the double literal
# converted to float, which is this same float.
INDEXER_AMAX_FLOOR = struct.unpack("<f", struct.pack("<I", 0x38D1B717))[0]
# fp8_ds_mla_ue8m0's floor of amax / 448: the same float (vLLM's fmaxf(amax / 448.f, 1e-4f)).
MLA_UE8M0_SCALE_FLOOR = INDEXER_AMAX_FLOOR


def check_store_input(
    name: str,
    t: object,
    dtype: torch.dtype,
    width: int,
    *,
    tokens: int = 0,
    contiguous_rows: bool = False,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The one check of a store's input tensor: a ``torch.Tensor`` ``[T, width]`` of ``dtype``
    with ``T >= tokens``, rows contiguous where ``contiguous_rows`` (the kernels read rows as
    vectors), on ``device`` (the target's) when given. Returns ``t``. TypeError for the type or
    dtype (float16 named: only bfloat16 is specified), ValueError for shape, count, strides or
    device, each with the value got and the one expected. Reads no data (safe on fake tensors).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        want = str(dtype).removeprefix("torch.")
        if dtype == torch.bfloat16 and t.dtype == torch.float16:
            raise TypeError(f"{name} is float16; only bfloat16 inputs are supported")
        raise TypeError(f"{name} must be {want}, got {t.dtype}")
    if t.dim() != 2 or t.shape[1] != width:
        raise ValueError(f"{name} must have shape [T, {width}], got {list(t.shape)}")
    if t.shape[0] < tokens:
        raise ValueError(f"{name} has {t.shape[0]} tokens, fewer than slot_mapping's {tokens}")
    if contiguous_rows and t.stride(1) != 1:
        raise ValueError(f"{name} rows must be contiguous (stride(1) == 1), got {t.stride()}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected the target's device {device}")
    return t


def check_slot_mapping(slot_mapping: object) -> torch.Tensor:
    """``slot_mapping`` if it is a 1-D int32 or int64 tensor (TypeError / ValueError otherwise);
    reads no data."""
    if not isinstance(slot_mapping, torch.Tensor):
        raise TypeError(f"slot_mapping must be a torch.Tensor, got {type(slot_mapping).__name__}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D, got shape {list(slot_mapping.shape)}")
    return slot_mapping


def _full(like: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full_like(like, value, dtype=torch.float32)


def _abs_ignoring_nan(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def e4m3_satfinite(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 bytes (uint8), RNE, saturating to +-448, NaN -> 0x7f. Same shape."""
    if x.dtype != torch.float32:
        raise TypeError(f"e4m3_satfinite expects float32, got {x.dtype}")
    q = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(x), torch.full_like(q, 0x7F), q)


def ds_mla_scale(amax: torch.Tensor, kind: str = "fp8_ds_mla") -> torch.Tensor:
    """The tile scales of float32 tile maxima ``amax`` (NaN already ignored) for the MLA
    ``kind``: ``fmaxf(amax / 448, FLT_MIN)`` (``fp8_ds_mla``), or
    ``exp2f(ceilf(log2f(fmaxf(amax / 448, 1e-4f))))`` (``fp8_ds_mla_ue8m0``)."""
    if kind not in MLA_KINDS:
        raise ValueError(f"kind must be one of {MLA_KINDS}, got {kind!r}")
    if amax.dtype != torch.float32:
        raise TypeError(f"amax must be float32, got {amax.dtype}")
    s = amax / _full(amax, FP8_MAX)
    # amax / 448 of a bf16 amax (m * 2^e, 8-bit mantissa m) is m / 7 * 2^(e - 6): a power of two
    # exactly when m = 224, otherwise at least 0.44% away from one: ue8m0's precondition holds
    if get_format(kind).pow2:
        return _ue8m0(torch.maximum(s, _full(amax, MLA_UE8M0_SCALE_FLOOR)))
    return torch.maximum(s, _full(amax, FLT_MIN))


def quantize_ds_mla(
    kv_c: torch.Tensor, k_pe: torch.Tensor, *, kind: str = "fp8_ds_mla"
) -> torch.Tensor:
    """bf16 ``kv_c [T, 512]`` and ``k_pe [T, 64]`` -> uint8 ``[T, 656]`` entries of the MLA
    ``kind`` (``fp8_ds_mla`` or ``fp8_ds_mla_ue8m0``: they differ only in the tile scale)."""
    if kind not in MLA_KINDS:
        raise ValueError(f"kind must be one of {MLA_KINDS}, got {kind!r}")
    check_store_input("kv_c", kv_c, torch.bfloat16, MLA_KV_DIM)
    check_store_input("k_pe", k_pe, torch.bfloat16, MLA_ROPE_DIM)
    if kv_c.shape[0] != k_pe.shape[0] or kv_c.device != k_pe.device:
        raise ValueError(
            f"kv_c and k_pe must have the same token count and device, got "
            f"{list(kv_c.shape)} on {kv_c.device} and {list(k_pe.shape)} on {k_pe.device}"
        )
    t = kv_c.shape[0]
    x = kv_c.float().reshape(t, MLA_KV_DIM // MLA_TILE, MLA_TILE)
    scale = ds_mla_scale(_abs_ignoring_nan(x).amax(dim=-1), kind)  # [T, 4]
    values = e4m3_satfinite(x / scale.unsqueeze(-1)).reshape(t, MLA_KV_DIM)
    # one little-endian fp32 scale per tile
    scale_bytes = scale.contiguous().view(torch.uint8).reshape(t, 4 * (MLA_KV_DIM // MLA_TILE))
    rope_bytes = k_pe.contiguous().view(torch.uint8).reshape(t, 2 * MLA_ROPE_DIM)
    return torch.cat([values, scale_bytes, rope_bytes], dim=1)


def quantize_ds_mla_ue8m0(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """``quantize_ds_mla`` of the ``fp8_ds_mla_ue8m0`` kind (power-of-two tile scales)."""
    return quantize_ds_mla(kv_c, k_pe, kind="fp8_ds_mla_ue8m0")


def ue8m0(s: torch.Tensor) -> torch.Tensor:
    """``exp2f(ceilf(log2f(s)))`` of positive float32 scales: the power of two at or above."""
    if s.dtype != torch.float32:
        raise TypeError(f"s must be float32, got {s.dtype}")
    # log2f's result is rounded to a float before ceilf, and that rounding decides the power of
    # two just above 2^k: the exact log2 of nextafter(2^k) is k + 1.7e-7, which rounds to k for
    # |k| >= 4 (ceil keeps k) but stays above k in float64. So take log2 in float64 and round it
    # to float32 (the correctly rounded log2f), then ceil. CUDA's log2f is within 1 ulp; for
    # bf16 inputs s is either an exact power of two (log2f is exact there) or at least 0.4% away
    # from one, where every faithful log2f gives the same ceiling.
    e = torch.ceil(torch.log2(s.double()).float())
    # 2^e from its bits (exact): scales here are >= 2^-23, and e >= 128 (inf scale) gives inf
    biased = (e.clamp(-126.0, 128.0).to(torch.int32) + 127) << 23
    return biased.view(torch.float32)


def indexer_scale(amax: torch.Tensor, ue8m0: bool = True) -> torch.Tensor:
    """The indexer scale of a float32 ``amax``: ``fmaxf(amax, 1e-4f) / 448``, then with ue8m0
    ``exp2f(ceilf(log2f(s)))``."""
    if amax.dtype != torch.float32:
        raise TypeError(f"amax must be float32, got {amax.dtype}")
    s = torch.maximum(amax, _full(amax, INDEXER_AMAX_FLOOR)) / _full(amax, FP8_MAX)
    return _ue8m0(s) if ue8m0 else s


def quantize_indexer_k(k: torch.Tensor, ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``k [T, 128]`` -> (uint8 values ``[T, 128]``, float32 scales ``[T]``)."""
    check_store_input("k", k, torch.bfloat16, INDEXER_DIM)
    x = k.float()
    scale = indexer_scale(_abs_ignoring_nan(x).amax(dim=-1), ue8m0)
    return e4m3_satfinite(x / scale.unsqueeze(-1)), scale


def ue8m0_x4(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales ``[...]`` -> uint8 ``[..., 4]``: each scale's UE8M0 byte
    (its biased exponent, bits 30..23: ``2^e`` -> ``e + 127``) four times, the word vLLM's
    ``pack_ue8m0_x4`` stores for an MXFP8 row of 128 values (one byte per 32). ValueError for a
    scale that is not a positive power of two (normal) or +inf, which the byte cannot hold."""
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"scale must be a float32 tensor, got {got}")
    bits = scale.contiguous().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    exact = (bits & 0x807FFFFF) == 0  # positive, no mantissa: 2^e or +inf
    if not bool((exact & (biased > 0)).all()):
        bad = scale[~(exact & (biased > 0))][:4].tolist()
        raise ValueError(f"UE8M0 bytes hold positive powers of two (or inf), got scales {bad}")
    return biased.to(torch.uint8).unsqueeze(-1).expand(*scale.shape, 4).contiguous()


def indexer_scale_bytes(scale: torch.Tensor, kind: str = "indexer_k") -> torch.Tensor:
    """float32 scales ``[T]`` -> the 4 bytes per token the indexer ``kind`` stores ``[T, 4]``:
    a little-endian fp32 (``indexer_k``) or four UE8M0 bytes (``indexer_k_mxfp8``)."""
    fmt = get_format(kind)
    if fmt.kind not in INDEXER_KINDS:
        raise ValueError(f"kind must be one of {INDEXER_KINDS}, got {kind!r}")
    if fmt.scale == "ue8m0x4":
        return ue8m0_x4(scale)
    return scale.contiguous().view(torch.uint8).reshape(*scale.shape, 4)


def quantize_indexer_k_mxfp8(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``k [T, 128]`` -> (uint8 values ``[T, 128]``, uint8 scale bytes ``[T, 4]``) of the
    ``indexer_k_mxfp8`` kind: the ue8m0 values of :func:`quantize_indexer_k` (the scale is
    always rounded up to a power of two), each scale as four equal UE8M0 bytes."""
    values, scale = quantize_indexer_k(k, ue8m0=True)
    return values, ue8m0_x4(scale)


# ---------------------------------------------------------------------------------------------
# Inserters


def _check_cache(cache: torch.Tensor, row_bytes: int | None) -> None:
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8:
        got = cache.dtype if isinstance(cache, torch.Tensor) else type(cache).__name__
        raise TypeError(f"cache must be a uint8 tensor, got {got}")
    if cache.dim() != 3 or (row_bytes is not None and cache.shape[2] != row_bytes):
        want = f"[num_blocks, block_size, {row_bytes if row_bytes is not None else 'row_bytes'}]"
        raise ValueError(f"cache must have shape {want}, got {list(cache.shape)}")


def _scatter(
    cache_rows: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, block_size: int
) -> int:
    """cache_rows: [num_blocks, block_size, W] view; rows: [T, W]. Returns the out-of-range count."""
    num_slots = cache_rows.shape[0] * block_size
    valid = slots >= 0
    in_range = slots < num_slots
    skipped = int((valid & ~in_range).sum().item())
    keep = valid & in_range
    s = slots[keep]
    cache_rows[s // block_size, s % block_size] = rows[keep].to(cache_rows.device)
    return skipped


def insert_rows(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> int:
    """Copy formatted ``rows [T', row_bytes]`` (uint8) to ``cache[block, offset]``."""
    slots = check_slot_mapping(slot_mapping).long()
    _check_cache(cache, None)
    n = slots.numel()
    check_store_input("rows", rows, torch.uint8, cache.shape[2], tokens=n)
    return _scatter(cache, rows[:n], slots.to(cache.device), cache.shape[1])


def insert_ds_mla(
    cache: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kind: str = "fp8_ds_mla",
) -> int:
    """Quantize and insert into an MLA view ``[num_blocks, block_size, 656]`` (any strides, e.g.
    one layer of a layer-interleaved buffer) of ``kind`` (``fp8_ds_mla``, ``fp8_ds_mla_ue8m0``)."""
    if kind not in MLA_KINDS:
        raise ValueError(f"kind must be one of {MLA_KINDS}, got {kind!r}")
    slots = check_slot_mapping(slot_mapping).long()
    _check_cache(cache, MLA_ENTRY_BYTES)
    n = slots.numel()
    check_store_input("kv_c", kv_c, torch.bfloat16, MLA_KV_DIM, tokens=n)
    check_store_input("k_pe", k_pe, torch.bfloat16, MLA_ROPE_DIM, tokens=n)
    rows = quantize_ds_mla(kv_c[:n], k_pe[:n], kind=kind)
    return _scatter(cache, rows, slots.to(cache.device), cache.shape[1])


def insert_ds_mla_ue8m0(
    cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor
) -> int:
    """``insert_ds_mla`` of the ``fp8_ds_mla_ue8m0`` kind (power-of-two tile scales)."""
    return insert_ds_mla(cache, kv_c, k_pe, slot_mapping, kind="fp8_ds_mla_ue8m0")


def _indexer_block_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8:
        raise TypeError("cache must be a uint8 tensor")
    if cache.dim() == 3:
        if cache.shape[2] != INDEXER_ENTRY_BYTES:
            raise ValueError(
                f"indexer cache must be [num_blocks, block_size, {INDEXER_ENTRY_BYTES}], "
                f"got {list(cache.shape)}"
            )
        block_size = cache.shape[1]
        if cache.stride(2) != 1 or cache.stride(1) != INDEXER_ENTRY_BYTES:
            raise ValueError(
                f"each indexer block must be contiguous, got strides {list(cache.stride())}"
            )
        blocks = cache.as_strided(
            (cache.shape[0], block_size * INDEXER_ENTRY_BYTES), (cache.stride(0), 1)
        )
    elif cache.dim() == 2:
        if cache.shape[1] % INDEXER_ENTRY_BYTES or cache.stride(1) != 1:
            raise ValueError(
                f"indexer cache must be [num_blocks, block_size*{INDEXER_ENTRY_BYTES}] with "
                f"contiguous blocks, "
                f"got shape {list(cache.shape)} strides {list(cache.stride())}"
            )
        block_size = cache.shape[1] // INDEXER_ENTRY_BYTES
        blocks = cache
    else:
        raise ValueError(f"indexer cache must be 2-D or 3-D, got shape {list(cache.shape)}")
    nb = blocks.shape[0]
    values = blocks[:, : block_size * INDEXER_DIM].unflatten(1, (block_size, INDEXER_DIM))
    scales = blocks[:, block_size * INDEXER_DIM :].unflatten(1, (block_size, 4))
    assert values.shape[0] == scales.shape[0] == nb
    return values, scales, block_size


def insert_indexer_k(
    cache: torch.Tensor,
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    ue8m0: bool = True,
    *,
    kind: str = "indexer_k",
) -> int:
    """Quantize and insert into an Indexer-K view: ``[num_blocks, block_size*132]`` or
    ``[num_blocks, block_size, 132]`` whose blocks hold ``block_size*128`` fp8 values (token o at
    ``o*128``) followed by ``block_size`` 4-byte scales (token o at ``block_size*128 + 4*o``):
    fp32 (``kind="indexer_k"``) or four UE8M0 bytes (``"indexer_k_mxfp8"``, ``ue8m0`` True)."""
    if kind not in INDEXER_KINDS:
        raise ValueError(f"kind must be one of {INDEXER_KINDS}, got {kind!r}")
    if not ue8m0 and get_format(kind).scale == "ue8m0x4":
        raise ValueError(f"ue8m0=False is not possible for {kind!r}: UE8M0 holds powers of two")
    slots = check_slot_mapping(slot_mapping).long()
    values_view, scales_view, block_size = _indexer_block_views(cache)
    n = slots.numel()
    check_store_input("k", k, torch.bfloat16, INDEXER_DIM, tokens=n)
    values, scale = quantize_indexer_k(k[:n], ue8m0)
    slots = slots.to(cache.device)
    skipped = _scatter(values_view, values, slots, block_size)
    _scatter(scales_view, indexer_scale_bytes(scale, kind), slots, block_size)
    return skipped


def insert_indexer_k_mxfp8(cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor) -> int:
    """``insert_indexer_k`` of the ``indexer_k_mxfp8`` kind (UE8M0 x4 scales)."""
    return insert_indexer_k(cache, k, slot_mapping, True, kind="indexer_k_mxfp8")


_ue8m0 = ue8m0  # indexer_scale's parameter of the same name shadows the function
