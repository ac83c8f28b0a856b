"""The pure-torch reference of the KV byte formats, checked against bytes built by hand.

The expected bytes come from scalar Python (``struct``, ``math``, an exhaustive nearest-value
fp8 encoder), never from the functions under test. Every fp32 operation is done in double and
rounded to fp32 once, which equals the fp32 IEEE result for one division (53 >= 2*24 + 2 bits).
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vmmkv.ops import reference as R
from vmmkv.ops.formats import INDEXER_ENTRY_BYTES as IDX
from vmmkv.ops.formats import MLA_ENTRY_BYTES as MLA
from vmmkv.testing.kv import (
    BLOCK_SIZE,
    block_stride,
    expected_replica,
    interleaved_views,
    layer_inputs,
    random_bf16,
)

FLT_MIN = 2.0**-126
BS = BLOCK_SIZE

# ---------------------------------------------------------------------------------------------
# Independent scalar oracle


def f32(v: float) -> float:
    """Round a Python float (double) to the nearest fp32."""
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def f32_next_up(x: float) -> float:
    """The fp32 right above the positive fp32 ``x``."""
    return struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", x))[0] + 1))[
        0
    ]


def e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exp, mant = (code >> 3) & 0xF, code & 7
    if exp == 0:
        return sign * mant * 2.0**-9
    return sign * (1 + mant / 8) * 2.0 ** (exp - 7)


_POSITIVE = [(e4m3_value(c), c) for c in range(0x7F)]  # 0x00..0x7e: every finite non-negative


def py_e4m3(x: float) -> int:
    """Nearest e4m3 code by exhaustive search, ties to the even code, saturating, NaN -> 0x7f."""
    if math.isnan(x):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if a >= 448.0:
        return sign | 0x7E
    best_code, best_err = 0, math.inf
    for value, code in _POSITIVE:
        err = abs(value - a)
        if err < best_err or (err == best_err and code % 2 == 0):
            best_code, best_err = code, err
    return sign | best_code


def bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def bf16_bits_of(x: float) -> int:
    """bf16 bits of a float that is exactly representable in bf16."""
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    assert b & 0xFFFF == 0, f"{x!r} is not a bf16 value"
    return b >> 16


def bf16_tensor(bits: list[list[int]]) -> torch.Tensor:
    signed = [[b - 0x10000 if b >= 0x8000 else b for b in row] for row in bits]
    return torch.tensor(signed, dtype=torch.int16).view(torch.bfloat16)


def rand_bf16_bits(rng: random.Random, n: int, lo_exp: int = 110, hi_exp: int = 140) -> list[int]:
    """Random non-zero, finite, normal bf16 patterns with biased exponents in [lo_exp, hi_exp]."""
    return [
        (rng.getrandbits(1) << 15) | (rng.randint(lo_exp, hi_exp) << 7) | rng.getrandbits(7)
        for _ in range(n)
    ]


def hand_raw_scale(amax: float) -> float:
    """fp8_ds_mla's tile scale by hand: ``fmaxf(amax / 448.f, FLT_MIN)``."""
    return max(f32(amax / 448.0), FLT_MIN)


def hand_mla_entry(
    kv_bits: list[int], pe_bits: list[int], tile_scale: Callable[[float], float] = hand_raw_scale
) -> bytes:
    """The 656 bytes of one MLA token whose tile scales ``tile_scale(amax)`` gives (default:
    fp8_ds_mla's raw rule), built by hand."""
    vals = [bf16_value(b) for b in kv_bits]
    out, scales = bytearray(), []
    for t in range(4):
        tile = vals[128 * t : 128 * (t + 1)]
        amax = max((abs(v) for v in tile if not math.isnan(v)), default=0.0)
        s = tile_scale(amax)
        scales.append(s)
        out += bytes(py_e4m3(f32(v / s)) for v in tile)
    out += struct.pack("<4f", *scales)
    out += b"".join(struct.pack("<H", b) for b in pe_bits)
    assert len(out) == MLA
    return bytes(out)


def hand_indexer(k_bits: list[int], ue8m0: bool) -> tuple[bytes, float]:
    vals = [bf16_value(b) for b in k_bits]
    amax = max((abs(v) for v in vals if not math.isnan(v)), default=0.0)
    s = f32(max(amax, f32(1e-4)) / 448.0)
    if ue8m0:
        s = 2.0 ** math.ceil(f32(math.log2(s)))
    return bytes(py_e4m3(f32(v / s)) for v in vals), s


def rand_tokens(rng: random.Random, n: int, dim: int) -> list[list[int]]:
    rows = []
    for _ in range(n):
        lo = rng.randint(100, 135)
        rows.append(rand_bf16_bits(rng, dim, lo, lo + rng.randint(0, 10)))
    return rows


# ---------------------------------------------------------------------------------------------
# fp8 conversion


def test_oracle_knows_the_e4m3_extremes():
    assert e4m3_value(0x7E) == 448.0 and e4m3_value(0x08) == 2.0**-6 and e4m3_value(1) == 2.0**-9


EDGE_FLOATS = [
    0.0, -0.0, 448.0, -448.0, 449.0, 463.99, 464.0, 464.01, 465.0, 480.0, 1e30, -1e30,
    math.inf, -math.inf, math.nan, 2.0**-10, 2.0**-10 * 1.0000001, -(2.0**-10), 2.0**-11,
    7.5 * 2.0**-9, 6.5 * 2.0**-9, 2.0**-6, 2.0**-6 * (1 - 2.0**-20), 2.0**-149, -(2.0**-140),
    1.0625, 1.1875, 0.3, 17.0, 18.0, 19.0,
]  # fmt: skip


def test_e4m3_matches_the_oracle_on_every_code_midpoint_and_edge():
    xs = list(EDGE_FLOATS)
    codes = [v for v, _ in _POSITIVE]
    for a, b in zip(codes, codes[1:], strict=False):
        mid = (a + b) / 2  # exact tie: rounds to the even code
        xs += [a, mid, math.nextafter(mid, 0), math.nextafter(mid, 1e9), -mid]
    xs = [f32(x) for x in xs]
    got = R.e4m3_satfinite(torch.tensor(xs, dtype=torch.float32)).tolist()
    assert got == [py_e4m3(x) for x in xs]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64))
def test_e4m3_matches_the_oracle_on_any_float32(xs):
    got = R.e4m3_satfinite(torch.tensor(xs, dtype=torch.float32)).tolist()
    assert got == [py_e4m3(x) for x in xs]


def test_negative_zero_and_tiny_negatives_encode_0x80():
    got = R.e4m3_satfinite(torch.tensor([-0.0, -(2.0**-12), -(2.0**-10)])).tolist()
    assert got == [0x80, 0x80, 0x80]


def test_nan_encodes_0x7f_whatever_its_sign():
    nan = torch.tensor([math.nan, -math.nan], dtype=torch.float32)
    assert R.e4m3_satfinite(nan).tolist() == [0x7F, 0x7F]


# ---------------------------------------------------------------------------------------------
# fp8_ds_mla


def _mla_inputs(kv_rows: list[list[int]], pe_rows: list[list[int]]):
    return bf16_tensor(kv_rows), bf16_tensor(pe_rows)


def test_ds_mla_entries_of_random_tokens_match_hand_built_bytes():
    rng = random.Random(1)
    kv = rand_tokens(rng, 5, 512)
    pe = [[rng.getrandbits(16) for _ in range(64)] for _ in range(5)]  # any bits, NaN patterns too
    got = R.quantize_ds_mla(*_mla_inputs(kv, pe))
    assert got.dtype == torch.uint8 and got.shape == (5, MLA)
    for i in range(5):
        assert bytes(got[i].tolist()) == hand_mla_entry(kv[i], pe[i])


def test_ds_mla_zero_tile_scale_is_flt_min_and_values_are_zero():
    rng = random.Random(2)
    kv = rand_bf16_bits(rng, 512)
    kv[128:256] = [0] * 128
    kv[130] = 0x8000  # -0.0 -> 0x80
    pe = rand_bf16_bits(rng, 64)
    row = bytes(R.quantize_ds_mla(*_mla_inputs([kv], [pe]))[0].tolist())
    assert row[512 + 4 : 512 + 8] == struct.pack("<f", FLT_MIN) == b"\x00\x00\x80\x00"
    assert row[128:256] == bytes(2) + b"\x80" + bytes(125)
    assert row == hand_mla_entry(kv, pe)


def test_ds_mla_tile_maximum_saturates_to_448_and_scale_is_amax_over_448():
    rng = random.Random(3)
    kv = rand_bf16_bits(rng, 512, 120, 126)  # |x| < 1
    kv[5] = bf16_bits_of(-3.0)  # tile 0 amax 3 -> byte for -3.0 is -448
    kv[300] = 0x7F70  # 3.19e38, near the bf16 maximum
    pe = rand_bf16_bits(rng, 64)
    row = bytes(R.quantize_ds_mla(*_mla_inputs([kv], [pe]))[0].tolist())
    s0, _, s2, _ = struct.unpack("<4f", row[512:528])
    assert s0 == f32(3.0 / 448.0) and s2 == f32(bf16_value(kv[300]) / 448.0)
    assert row[5] == 0xFE and row[300] == 0x7E
    assert row == hand_mla_entry(kv, pe)


def test_ds_mla_subnormal_inputs_and_e4m3_subnormal_outputs():
    rng = random.Random(4)
    kv = rand_bf16_bits(rng, 512)
    # tile 0: bf16 subnormals only -> amax/448 underflows below FLT_MIN -> scale FLT_MIN
    kv[0:128] = [(rng.getrandbits(1) << 15) | rng.randint(1, 127) for _ in range(128)]
    # tile 1: amax 448 (scale 1) with values that land on e4m3 subnormals (< 2^-6)
    kv[128:256] = [bf16_bits_of(v) for v in (448.0, 2.0**-7, -(2.0**-8), 2.0**-9, 2.0**-10)] + [
        bf16_bits_of(3 * 2.0**-10)
    ] * 123
    pe = rand_bf16_bits(rng, 64)
    row = bytes(R.quantize_ds_mla(*_mla_inputs([kv], [pe]))[0].tolist())
    assert struct.unpack("<f", row[512:516])[0] == FLT_MIN
    assert struct.unpack("<f", row[516:520])[0] == 1.0
    assert list(row[128:134]) == [0x7E, 0x04, 0x82, 0x01, 0x00, 0x02]  # 3*2^-10 ties to 2*2^-9
    assert row == hand_mla_entry(kv, pe)


def test_ds_mla_scale_bytes_are_little_endian_fp32_per_tile():
    kv = [bf16_bits_of(v) for v in (448.0, 896.0, 1.75, 7.0) for _ in range(128)]
    row = bytes(R.quantize_ds_mla(*_mla_inputs([kv], [[1] * 64]))[0].tolist())
    assert row[512:528] == struct.pack("<4f", 1.0, 2.0, 2.0**-8, 2.0**-6)
    assert row[512:520] == b"\x00\x00\x80\x3f\x00\x00\x00\x40"  # 1.0f, 2.0f: low byte first
    assert row[:512] == b"\x7e" * 512


def test_ds_mla_k_pe_is_copied_verbatim_whatever_its_bits():
    rng = random.Random(5)
    pe = [0xFFC1, 0x7F80, 0xFF80, 0x8000, 0x0001] + [rng.getrandbits(16) for _ in range(59)]
    row = bytes(R.quantize_ds_mla(*_mla_inputs([rand_bf16_bits(rng, 512)], [pe]))[0].tolist())
    assert row[528:] == struct.pack("<64H", *pe)


def test_ds_mla_nan_is_ignored_by_amax_and_inf_gives_an_inf_scale():
    rng = random.Random(6)
    kv = rand_bf16_bits(rng, 512)
    kv[10] = 0x7FC0  # NaN in tile 0
    kv[200] = 0xFF80  # -inf in tile 1
    pe = rand_bf16_bits(rng, 64)
    row = bytes(R.quantize_ds_mla(*_mla_inputs([kv], [pe]))[0].tolist())
    tile0 = [bf16_value(b) for i, b in enumerate(kv[:128]) if i != 10]
    assert struct.unpack("<f", row[512:516])[0] == f32(max(map(abs, tile0)) / 448.0)
    assert row[10] == 0x7F
    assert struct.unpack("<f", row[516:520])[0] == math.inf
    assert row[200] == 0x7F  # -inf / inf = NaN
    assert row == hand_mla_entry(kv, pe)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_ds_mla_rejects_inputs_that_are_not_bf16(dtype):
    with pytest.raises(TypeError, match="bfloat16"):
        R.quantize_ds_mla(
            torch.zeros(2, 512, dtype=dtype), torch.zeros(2, 64, dtype=torch.bfloat16)
        )


def test_ds_mla_and_indexer_of_zero_tokens_are_empty_with_the_entry_width():
    none = torch.zeros(0, 512, dtype=torch.bfloat16)
    assert R.quantize_ds_mla(none, torch.zeros(0, 64, dtype=torch.bfloat16)).shape == (0, MLA)
    values, scales = R.quantize_indexer_k(torch.zeros(0, 128, dtype=torch.bfloat16))
    assert values.shape == (0, 128) and scales.shape == (0,)


def test_ds_mla_rejects_wrong_widths():
    with pytest.raises(ValueError, match=r"\[T, 512\]"):
        R.quantize_ds_mla(torch.zeros(2, 576, dtype=torch.bfloat16), torch.zeros(2, 64).bfloat16())


# ---------------------------------------------------------------------------------------------
# Indexer-K


@pytest.mark.parametrize("ue8m0", [True, False])
def test_indexer_values_and_scales_of_random_tokens_match_hand_built(ue8m0):
    rng = random.Random(7)
    rows = rand_tokens(rng, 6, 128)
    values, scales = R.quantize_indexer_k(bf16_tensor(rows), ue8m0=ue8m0)
    assert values.dtype == torch.uint8 and scales.dtype == torch.float32
    for i, row in enumerate(rows):
        want_bytes, want_scale = hand_indexer(row, ue8m0)
        assert bytes(values[i].tolist()) == want_bytes
        assert scales[i].item() == want_scale


def test_indexer_amax_floor_is_1e_4_for_an_all_zero_row():
    k = torch.zeros(1, 128, dtype=torch.bfloat16)
    _, s_plain = R.quantize_indexer_k(k, ue8m0=False)
    _, s_ue8m0 = R.quantize_indexer_k(k, ue8m0=True)
    assert struct.pack("<f", 1e-4) == struct.pack("<I", 0x38D1B717)
    assert s_plain.item() == f32(f32(1e-4) / 448.0)
    assert s_ue8m0.item() == 2.0**-22  # log2(2.23e-7) = -22.09


def test_indexer_ue8m0_keeps_an_exact_power_of_two():
    k = [bf16_bits_of(56.0), bf16_bits_of(-7.0)] + [bf16_bits_of(0.5)] * 126  # 56/448 = 2^-3
    values, s = R.quantize_indexer_k(bf16_tensor([k]))
    assert s.item() == 0.125
    assert values[0, :3].tolist() == [0x7E, 0xE6, 0x48]  # 448, -56, 4


def test_indexer_ue8m0_rounds_the_next_bf16_above_a_power_of_two_up():
    k = [bf16_bits_of(56.25)] + [bf16_bits_of(1.0)] * 127  # the bf16 after 56 = 448 * 2^-3
    _, s = R.quantize_indexer_k(bf16_tensor([k]))
    assert s.item() == 0.25


def test_ue8m0_log2_is_rounded_to_float_before_ceil():
    # one ulp above 2^k, log2 = k + 1.7e-7 exactly; rounded to a float that is above k for k = -3
    # (ulp 2.4e-7: rounds up to k + ulp, ceil gives k + 1) but exactly k for k = -10 (ulp 9.5e-7)
    above = [f32_next_up(2.0**-3), f32_next_up(2.0**-10)]
    assert R.ue8m0(torch.tensor(above, dtype=torch.float32)).tolist() == [0.25, 2.0**-10]
    exact = torch.tensor([2.0**-3, 2.0**-10, 2.0**-22, 2.0**100], dtype=torch.float32)
    assert R.ue8m0(exact).tolist() == exact.tolist()
    below = torch.tensor([f32_next_up(2.0**-4)], dtype=torch.float32)
    assert R.ue8m0(below).tolist() == [0.125]
    assert R.ue8m0(torch.tensor([math.inf])).tolist() == [math.inf]


def test_indexer_saturates_and_handles_subnormals():
    k = [bf16_bits_of(448.0), 0x0001, 0x8001] + [bf16_bits_of(2.0**-8)] * 125
    values, s = R.quantize_indexer_k(bf16_tensor([k]), ue8m0=False)
    assert s.item() == 1.0 and values[0, :4].tolist() == [0x7E, 0x00, 0x80, 0x02]


def test_indexer_rejects_fp16():
    with pytest.raises(TypeError, match="float16"):
        R.quantize_indexer_k(torch.zeros(1, 128, dtype=torch.float16))


# ---------------------------------------------------------------------------------------------
# Inserters


POISON = 0x5C


def _layer_interleaved(num_blocks: int, layers: int, pad: int = 16, extra: int = 32):
    """A poisoned buffer of the layer-interleaved layout (``vmmkv.testing.kv``) with ``pad``
    bytes between blocks and ``extra`` trailing bytes, and its per-layer (mla, indexer) views.
    Returns (buf, block stride, views); the stride is spelled out here, not taken from there."""
    stride = layers * BS * (MLA + IDX) + pad
    buf = torch.full((num_blocks * stride + extra,), POISON, dtype=torch.uint8)
    return buf, stride, interleaved_views(buf, layers, num_blocks, block_pad=pad)


def _slots(rng: random.Random, n: int, num_slots: int, dtype) -> list[int]:
    slots = rng.sample(range(num_slots), n)
    slots[1] = -1  # padding
    slots[3] = num_slots  # out of range
    slots[4] = num_slots + 1000
    slots[6] = -7
    return slots


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_insert_ds_mla_into_a_layer_interleaved_view(slot_dtype):
    rng = random.Random(8)
    nb, layers, layer = 4, 3, 1
    buf, stride, views = _layer_interleaved(nb, layers)
    offset = layer * BS * (MLA + IDX)  # layer 1's MLA block, after layer 0's MLA + indexer
    view = views[layer][0]
    assert view.storage_offset() == offset and view.stride() == (stride, MLA, 1)
    n = 40
    kv, pe = rand_tokens(rng, n + 3, 512), rand_tokens(rng, n + 3, 64)  # longer than slots
    slots = _slots(rng, n, nb * BS, slot_dtype)
    skipped = R.insert_ds_mla(view, *_mla_inputs(kv, pe), torch.tensor(slots, dtype=slot_dtype))
    assert skipped == 2
    want = bytearray([POISON]) * buf.numel()
    for i, s in enumerate(slots):
        if 0 <= s < nb * BS:
            at = offset + (s // BS) * stride + (s % BS) * MLA
            want[at : at + MLA] = hand_mla_entry(kv[i], pe[i])
    assert bytes(buf.tolist()) == bytes(want)


@pytest.mark.parametrize("shape", ["2d", "3d"])
@pytest.mark.parametrize("ue8m0", [True, False])
def test_insert_indexer_k_uses_the_split_block_layout(shape, ue8m0):
    rng = random.Random(9)
    nb, layers, layer = 3, 2, 1
    buf, stride, views = _layer_interleaved(nb, layers)
    offset = layer * BS * (MLA + IDX) + BS * MLA  # layer 1's indexer block, after its MLA block
    view = views[layer][1] if shape == "3d" else views[layer][1].flatten(1)
    assert view.storage_offset() == offset and view.stride()[0] == stride
    assert view.shape == ((nb, BS, IDX) if shape == "3d" else (nb, BS * IDX))
    n = 30
    k = rand_tokens(rng, n + 2, 128)
    slots = _slots(rng, n, nb * BS, torch.int64)
    skipped = R.insert_indexer_k(view, bf16_tensor(k), torch.tensor(slots), ue8m0=ue8m0)
    assert skipped == 2
    want = bytearray([POISON]) * buf.numel()
    for i, s in enumerate(slots):
        if 0 <= s < nb * BS:
            block, o = divmod(s, BS)
            base = offset + block * stride
            values, scale = hand_indexer(k[i], ue8m0)
            want[base + o * 128 : base + o * 128 + 128] = values
            want[base + BS * 128 + 4 * o : base + BS * 128 + 4 * o + 4] = struct.pack("<f", scale)
    assert bytes(buf.tolist()) == bytes(want)


def test_insert_rows_copies_rows_to_their_slots():
    rng = random.Random(10)
    nb, width, entry_stride = 3, 40, 48
    buf = torch.full((nb * BS * entry_stride,), POISON, dtype=torch.uint8)
    view = buf.as_strided((nb, BS, width), (BS * entry_stride, entry_stride, 1))
    n = 20
    rows = [[rng.randint(0, 255) for _ in range(width)] for _ in range(n + 4)]
    slots = _slots(rng, n, nb * BS, torch.int32)
    skipped = R.insert_rows(view, torch.tensor(rows, dtype=torch.uint8), torch.tensor(slots))
    assert skipped == 2
    want = bytearray([POISON]) * buf.numel()
    for i, s in enumerate(slots):
        if 0 <= s < nb * BS:
            at = (s // BS) * BS * entry_stride + (s % BS) * entry_stride
            want[at : at + width] = bytes(rows[i])
    assert bytes(buf.tolist()) == bytes(want)


def test_inserters_reject_a_2d_slot_mapping_and_float_slots():
    cache = torch.zeros(2, BS, MLA, dtype=torch.uint8)
    kv, pe = torch.zeros(4, 512, dtype=torch.bfloat16), torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="1-D"):
        R.insert_ds_mla(cache, kv, pe, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="int32 or int64"):
        R.insert_ds_mla(cache, kv, pe, torch.zeros(4))


def test_inserters_reject_inputs_shorter_than_the_slot_mapping():
    cache = torch.zeros(2, BS, MLA, dtype=torch.uint8)
    kv, pe = torch.zeros(2, 512, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fewer than"):
        R.insert_ds_mla(cache, kv, pe, torch.zeros(3, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# The shared input check, and the fixtures of vmmkv.testing.kv (layout, inputs, oracle) that the
# demo, the cache tests and the example build on


def _bits(t: torch.Tensor) -> list[list[int]]:
    """bf16 bit patterns of a 2-D bf16 tensor, row by row."""
    return [[v & 0xFFFF for v in row] for row in t.view(torch.int16).tolist()]


def test_the_format_table_agrees_with_the_hand_built_entry_sizes():
    rng = random.Random(11)
    assert len(hand_mla_entry(rand_bf16_bits(rng, 512), rand_bf16_bits(rng, 64))) == MLA
    values, _ = hand_indexer(rand_bf16_bits(rng, 128), ue8m0=True)
    assert len(values) + 4 == IDX  # 128 fp8 values, one fp32 scale
    assert block_stride(3) == 3 * BS * (MLA + IDX)


@pytest.mark.parametrize(
    ("t", "kw", "exc", "msg"),
    [
        ([[0.0] * 512], {}, TypeError, "kv_c must be a torch.Tensor, got list"),
        (torch.zeros(2, 512, dtype=torch.float16), {}, TypeError, "kv_c is float16; only bfloat16"),
        (torch.zeros(2, 512), {}, TypeError, "kv_c must be bfloat16, got torch.float32"),
        (torch.zeros(2, 576).bfloat16(), {}, ValueError, r"shape \[T, 512\], got \[2, 576\]"),
        (torch.zeros(2, 512).bfloat16(), {"tokens": 3}, ValueError, "2 tokens, fewer than .* 3"),
        (
            torch.zeros(512, 2).bfloat16().t(),
            {"contiguous_rows": True},
            ValueError,
            r"kv_c rows must be contiguous \(stride\(1\) == 1\), got \(1, 2\)",
        ),
        (
            torch.zeros(2, 512).bfloat16(),
            {"device": torch.device("meta")},
            ValueError,
            "kv_c is on cpu, expected the target's device meta",
        ),
    ],
)
def test_check_store_input_names_the_tensor_what_it_got_and_what_was_expected(t, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        R.check_store_input("kv_c", t, torch.bfloat16, 512, **kw)


def test_check_store_input_returns_a_valid_tensor_and_checks_other_dtypes_too():
    t = torch.zeros(4, 100, dtype=torch.uint8)
    assert R.check_store_input("rows", t, torch.uint8, 100, tokens=4, contiguous_rows=True) is t
    with pytest.raises(TypeError, match="rows must be uint8, got torch.int8"):
        R.check_store_input("rows", t.view(torch.int8), torch.uint8, 100)


def test_interleaved_views_lay_each_block_out_layer_by_layer_mla_then_indexer():
    nb, layers = 3, 2
    stride = layers * BS * (MLA + IDX)
    buf = torch.zeros(nb * stride, dtype=torch.uint8)
    for layer, (mla, idx) in enumerate(interleaved_views(buf, layers, nb)):
        assert mla.shape == (nb, BS, MLA) and idx.shape == (nb, BS, IDX)
        mla.fill_(2 * layer + 1)
        idx.fill_(2 * layer + 2)
    want = bytearray()
    for _ in range(nb):
        for layer in range(layers):
            want += bytes([2 * layer + 1]) * (BS * MLA) + bytes([2 * layer + 2]) * (BS * IDX)
    assert bytes(buf.tolist()) == bytes(want)  # every byte covered once, in this order


def test_interleaved_views_refuse_a_buffer_too_small_for_the_blocks():
    stride = BS * (MLA + IDX)
    with pytest.raises(ValueError, match=f"need {2 * stride + 8}"):
        interleaved_views(torch.zeros(2 * stride, dtype=torch.uint8), 1, 2, offset=8)


def test_random_inputs_are_deterministic_non_zero_bf16_of_the_format_widths():
    kv_c, k_pe, k = layer_inputs(5, 7)
    assert [tuple(x.shape) for x in (kv_c, k_pe, k)] == [(7, 512), (7, 64), (7, 128)]
    assert all(x.dtype == torch.bfloat16 and bool((x != 0).all()) for x in (kv_c, k_pe, k))
    assert all(map(torch.equal, layer_inputs(5, 7), (kv_c, k_pe, k)))
    assert not torch.equal(layer_inputs(6, 7)[0], kv_c)
    row_amax = random_bf16(1, 16, 128).float().abs().amax(dim=1)
    assert row_amax.unique().numel() == 16  # every row its own scale


def test_the_oracle_writes_every_batch_into_every_layer_and_skips_uncommitted_blocks():
    nb, layers, committed = 3, 2, 2
    stride = layers * BS * (MLA + IDX)
    before = torch.randint(1, 256, (nb * stride,), generator=torch.Generator().manual_seed(3))
    before = before.to(torch.uint8)
    kept = before.clone()
    batch1 = (*layer_inputs(1, 3), torch.tensor([5, 2 * BS + 2, -1]))  # block 2 is uncommitted
    batch2 = (*layer_inputs(2, 1), torch.tensor([BS + 6], dtype=torch.int32))
    got = expected_replica(
        before, [batch1, batch2], layers=layers, num_blocks=nb, committed_blocks=committed
    )
    assert torch.equal(before, kept)  # the input is not modified
    want = bytearray(bytes(before.tolist()))
    for kv_c, k_pe, k, slots in (batch1, batch2):
        for i, s in enumerate(slots.tolist()):
            if not 0 <= s < committed * BS:
                continue
            block, o = divmod(s, BS)
            entry = hand_mla_entry(_bits(kv_c)[i], _bits(k_pe)[i])
            values, scale = hand_indexer(_bits(k)[i], ue8m0=True)
            for layer in range(layers):
                base = block * stride + layer * BS * (MLA + IDX)
                want[base + o * MLA : base + (o + 1) * MLA] = entry
                ib = base + BS * MLA
                want[ib + o * 128 : ib + (o + 1) * 128] = values
                want[ib + BS * 128 + 4 * o : ib + BS * 128 + 4 * o + 4] = struct.pack("<f", scale)
    assert bytes(got.tolist()) == bytes(want)
