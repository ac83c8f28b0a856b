"""The ``indexer_k_mxfp8`` format: vLLM 0.33.0's Blackwell indexer K cache, whose per-token
scale is four equal UE8M0 bytes instead of an fp32 (``scale_fmt="mxfp8"``).

Expected bytes come from scalar Python (``tests.test_reference``'s hand-built encoder: ``struct``,
``math``, an exhaustive fp8 search) and from literal bytes worked out by hand in the comments;
the UE8M0 byte of a power of two ``2^e`` is ``e + 127``, taken here from ``math.frexp``, never
from the bit arithmetic under test. The cache tests run two host-backend ranks through
``ReplicatedKVCache`` in both paths (direct, gather) against the reference; the ``gpu`` twin runs
the same ranks on one GPU.
"""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from tests.helpers import (
    KindsScenario,
    check_kinds_results,
    cpu_layer_targets,
    kinds_cache_worker,
    random_replicas,
)
from tests.test_reference import bf16_bits_of, bf16_tensor, hand_indexer, rand_tokens
from vmmkv.ops import host
from vmmkv.ops import reference as R
from vmmkv.ops.formats import (
    FORMATS,
    INDEXER_KINDS,
    STORE_KINDS,
    get_format,
    indexer_kind_for,
)
from vmmkv.ops.kv import store_indexer_k, store_layer
from vmmkv.testing.markers import requires_gpu
from vmmkv.testing.spawn import run_world

MX = "indexer_k_mxfp8"
BS = 64
IDX = 132
MLA = 656


def ue8m0_byte(scale: float) -> int:
    """The UE8M0 byte of a positive power of two (or 0xff for inf), by frexp: 2^e = 0.5 * 2^(e+1)."""
    if math.isinf(scale):
        return 0xFF
    mant, exp = math.frexp(scale)
    assert mant == 0.5, f"{scale!r} is not a power of two"
    return exp - 1 + 127


def hand_mx(k_bits: list[int]) -> tuple[bytes, bytes]:
    """(128 value bytes, 4 scale bytes) of one indexer_k_mxfp8 row, built by hand."""
    values, scale = hand_indexer(k_bits, ue8m0=True)
    return values, bytes([ue8m0_byte(scale)] * 4)


# ---------------------------------------------------------------------------------------------
# The formats table and the selection rule


def test_the_mxfp8_kind_differs_from_indexer_k_only_in_its_scale_encoding():
    a, b = get_format("indexer_k"), get_format(MX)
    assert (a.entry_bytes, a.inputs, a.align, a.split_block) == (
        b.entry_bytes, b.inputs, b.align, b.split_block
    ) == (IDX, (("k", torch.bfloat16, 128),), 4, True)  # fmt: skip
    assert (a.scale, b.scale) == ("fp32", "ue8m0x4")
    assert INDEXER_KINDS == ("indexer_k", MX)
    assert set(FORMATS) == {"fp8_ds_mla", "fp8_ds_mla_ue8m0", "indexer_k", MX, "rows"}


def test_store_kinds_take_the_mxfp8_cache_alone_and_as_a_layer_with_fp8_ds_mla():
    assert (MX,) in STORE_KINDS and ("fp8_ds_mla", MX) in STORE_KINDS
    assert ("fp8_ds_mla", "indexer_k") in STORE_KINDS  # the Hopper pair stays
    assert len(set(STORE_KINDS)) == len(STORE_KINDS)


@pytest.mark.parametrize(
    ("capability", "kind"),
    [
        ((8, 0), "indexer_k"),
        ((8, 9), "indexer_k"),
        ((9, 0), "indexer_k"),  # H100 / H200
        ((10, 0), MX),  # B200
        ((10, 3), MX),  # B300
        ((11, 0), "indexer_k"),  # vLLM's family test is 10.x only
        ((12, 0), "indexer_k"),
        ((12, 1), "indexer_k"),
    ],
)
def test_indexer_kind_for_picks_mxfp8_on_the_sm10x_family_only_as_vllm_does(capability, kind):
    assert indexer_kind_for(capability) == kind


@pytest.mark.parametrize(
    ("bad", "error"),
    [([10, 0], TypeError), ((10,), TypeError), ((10.0, 0), TypeError), ((10, 10), ValueError),
     ((-1, 0), ValueError), ((True, 0), TypeError)],
)  # fmt: skip
def test_indexer_kind_for_rejects_what_is_not_a_major_minor_pair(bad, error):
    with pytest.raises(error, match="capability"):
        indexer_kind_for(bad)


# ---------------------------------------------------------------------------------------------
# The reference against hand-computed bytes


def _row(first: list[float], fill: float) -> list[int]:
    return [bf16_bits_of(v) for v in first] + [bf16_bits_of(fill)] * (128 - len(first))


def test_hand_rows_give_the_scale_bytes_worked_out_by_hand():
    rows = [
        [0] * 128,  # zero row: amax floor 1e-4, 1e-4/448 = 2.2e-7 -> 2^-22 -> 105 = 0x69
        _row([-(2.0**-14)], 2.0**-20),  # tiny amax 6.1e-5 (under the floor): the same 2^-22
        _row([56.0, -7.0], 0.5),  # 56/448 = 2^-3 exactly -> 124 = 0x7c
        _row([56.25], 1.0),  # the bf16 after 56: 2^-2 -> 125 = 0x7d
        _row([-(2.0**128 - 2.0**120)], 1.0),  # largest bf16: /448 = 7.6e35 -> 2^120 -> 0xf7
        _row([1.0, 448.0 * 2.0**-126], 2.0**-130),  # amax 1 -> 1/448 -> 2^-8 -> 119 = 0x77
    ]
    values, scale_bytes = R.quantize_indexer_k_mxfp8(bf16_tensor(rows))
    assert scale_bytes.dtype == torch.uint8 and scale_bytes.shape == (6, 4)
    assert [bytes(r.tolist()) for r in scale_bytes] == [
        b"\x69" * 4, b"\x69" * 4, b"\x7c" * 4, b"\x7d" * 4, b"\xf7" * 4, b"\x77" * 4,
    ]  # fmt: skip
    assert values[0].tolist() == [0] * 128
    assert values[2, :3].tolist() == [0x7E, 0xE6, 0x48]  # 448, -56, 4 (scale 2^-3)
    assert values[4, 0] == 0xF8  # -(2^128 - 2^120) / 2^120 = -255, nearest e4m3 -256 = 0xf8
    assert values[1, :2].tolist() == [0xF8, 0x48]  # -2^-14 / 2^-22 = -256, 2^-20 / 2^-22 = 4
    for i, row in enumerate(rows):
        want_values, want_scale = hand_mx(row)
        assert bytes(values[i].tolist()) == want_values, i
        assert bytes(scale_bytes[i].tolist()) == want_scale, i


def test_an_inf_input_gives_0xff_scale_bytes_and_a_nan_is_ignored_by_amax():
    inf_row = _row([1.0, -math.inf], 2.0)  # amax inf -> scale inf -> 0xff x4; inf/inf -> 0x7f
    nan_row = [0x7FC0] + _row([], 56.0)[1:]  # NaN ignored: amax 56 -> 2^-3; NaN -> 0x7f
    values, scale_bytes = R.quantize_indexer_k_mxfp8(bf16_tensor([inf_row, nan_row]))
    assert bytes(scale_bytes[0].tolist()) == b"\xff" * 4
    assert values[0, :3].tolist() == [0x00, 0x7F, 0x00]  # 1/inf = +0, -inf/inf = NaN, 2/inf = +0
    assert bytes(scale_bytes[1].tolist()) == b"\x7c" * 4
    assert values[1, :2].tolist() == [0x7F, 0x7E]  # NaN, 56 / 2^-3 = 448


def test_random_rows_match_the_hand_encoder_and_the_ue8m0_values_of_indexer_k():
    rows = rand_tokens(random.Random(11), 24, 128)
    k = bf16_tensor(rows)
    values, scale_bytes = R.quantize_indexer_k_mxfp8(k)
    plain_values, plain_scales = R.quantize_indexer_k(k, ue8m0=True)
    assert torch.equal(values, plain_values)  # only the scale encoding differs
    for i, row in enumerate(rows):
        want_values, want_scale = hand_mx(row)
        assert bytes(values[i].tolist()) == want_values
        assert bytes(scale_bytes[i].tolist()) == want_scale
        fp32 = struct.pack("<f", plain_scales[i].item())
        assert want_scale == bytes([((fp32[3] << 1) & 0xFF) | (fp32[2] >> 7)]) * 4  # its exponent


def test_ue8m0_x4_refuses_scales_that_are_not_powers_of_two():
    assert R.ue8m0_x4(torch.tensor([1.0, 2.0**-126, 2.0**127, math.inf])).tolist() == [
        [127] * 4, [1] * 4, [254] * 4, [255] * 4,
    ]  # fmt: skip
    for bad in (3.0, 0.0, -1.0, 2.0**-127, math.nan):
        with pytest.raises(ValueError, match="powers of two"):
            R.ue8m0_x4(torch.tensor([1.0, bad]))
    with pytest.raises(TypeError, match="float32"):
        R.ue8m0_x4(torch.tensor([1.0], dtype=torch.float64))


def test_insert_indexer_k_mxfp8_writes_the_split_block_and_skips_what_the_fp32_kind_skips():
    rng = random.Random(12)
    nb, poison = 3, 0x5C
    buf = torch.full((nb * BS * IDX + 40,), poison, dtype=torch.uint8)
    view = buf[:-40].view(nb, BS, IDX)
    k = rand_tokens(rng, 33, 128)
    slots = rng.sample(range(nb * BS), 30)
    slots[2], slots[5], slots[9] = -1, nb * BS, nb * BS + 999  # padding, out of range twice
    skipped = R.insert_indexer_k_mxfp8(view, bf16_tensor(k), torch.tensor(slots))
    assert skipped == 2
    want = bytearray([poison]) * buf.numel()
    for i, s in enumerate(slots):
        if 0 <= s < nb * BS:
            block, o = divmod(s, BS)
            base = block * BS * IDX
            values, scale = hand_mx(k[i])
            want[base + o * 128 : base + o * 128 + 128] = values
            want[base + BS * 128 + 4 * o : base + BS * 128 + 4 * o + 4] = scale
    assert bytes(buf.tolist()) == bytes(want)


def test_the_reference_refuses_an_unrounded_mxfp8_scale_and_unknown_indexer_kinds():
    view = torch.zeros(1, BS, IDX, dtype=torch.uint8)
    k = torch.ones(1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="ue8m0=False"):
        R.insert_indexer_k(view, k, torch.zeros(1, dtype=torch.int64), False, kind=MX)
    with pytest.raises(ValueError, match="kind must be one of"):
        R.insert_indexer_k(view, k, torch.zeros(1, dtype=torch.int64), kind="fp8_ds_mla")
    assert view.eq(0).all()


# ---------------------------------------------------------------------------------------------
# The functional stores and the host backend on CPU targets


def test_kernel_wrappers_accept_mxfp8_targets_and_refuse_ue8m0_false_before_launching():
    replicas = [torch.zeros(2 * BS * (MLA + IDX), dtype=torch.uint8)]
    mla, idx = cpu_layer_targets(replicas, 2, 0, "fp8_ds_mla", MX)
    k = torch.ones(4, 128, dtype=torch.bfloat16)
    kv_c, k_pe = torch.ones(4, 512, dtype=torch.bfloat16), torch.ones(4, 64, dtype=torch.bfloat16)
    s = torch.arange(4)
    with pytest.raises(ValueError, match="CUDA device"):  # every check passed: only the device
        store_indexer_k(idx, k, s)
    with pytest.raises(ValueError, match="CUDA device"):
        store_layer(mla, idx, kv_c, k_pe, k, s)
    with pytest.raises(ValueError, match="ue8m0=False is not possible for a 'indexer_k_mxfp8'"):
        store_indexer_k(idx, k, s, ue8m0=False)
    with pytest.raises(ValueError, match="ue8m0=False is not possible"):
        store_layer(mla, idx, kv_c, k_pe, k, s, ue8m0=False)
    with pytest.raises(ValueError, match=r"idx_target must be a 'indexer_k' target \(or "
                       r"'indexer_k_mxfp8'\), got kind 'fp8_ds_mla'"):  # fmt: skip
        store_layer(mla, mla, kv_c, k_pe, k, s)
    with pytest.raises(ValueError, match="ue8m0=False"):
        host.store_indexer_k(idx, k, s, ue8m0=False)
    assert replicas[0].eq(0).all()


def test_host_stores_and_prepared_host_stores_write_the_mxfp8_reference_into_every_replica():
    import vmmkv.ops

    nb, tokens, nlo = 3, 50, 6
    g = torch.Generator().manual_seed(21)
    replicas = random_replicas(3, nb * BS * (MLA + IDX), g)
    expected = [r.clone() for r in replicas]
    mla, idx = cpu_layer_targets(replicas, nb, 2, "fp8_ds_mla", MX)
    kv_c = (torch.randn(tokens, 512, generator=g) * 5).bfloat16()
    k_pe = torch.randn(tokens, 64, generator=g).bfloat16()
    k = (torch.randn(tokens, 128, generator=g) * torch.rand(tokens, 1, generator=g) * 9).bfloat16()
    slots = torch.randperm(nb * BS, generator=g)[:tokens]
    slots[4], slots[11] = -1, nb * BS + 3
    half = tokens // 2
    host.store_layer(mla, idx, kv_c[:half], k_pe[:half], k[:half], slots[:half],
                     num_local_only=nlo)  # fmt: skip
    p = vmmkv.ops.prepare((idx,))
    assert p.kinds == (MX,)
    p.store((k[half:],), slots[half:], 0)
    for r, buf in enumerate(expected):
        first = 0 if r == 2 else nlo
        mla_v = buf[: nb * BS * MLA].view(nb, BS, MLA)
        idx_v = buf[nb * BS * MLA :].view(nb, BS, IDX)
        R.insert_ds_mla(mla_v, kv_c[first:half], k_pe[first:half], slots[first:half])
        R.insert_indexer_k_mxfp8(idx_v, k[first:half], slots[first:half])
        R.insert_indexer_k_mxfp8(idx_v, k[half:], slots[half:])
    for r in range(3):
        assert torch.equal(replicas[r], expected[r]), f"replica {r}"
    assert idx.error_counter.item() == 2  # the out-of-range token: store_layer's and this one
    with pytest.raises(ValueError, match="ue8m0=False is not possible"):
        vmmkv.ops.prepare((mla, idx), ue8m0=False)


# ---------------------------------------------------------------------------------------------
# ReplicatedKVCache: two ranks, direct and gather, byte-equal to the reference

# the MLA layers stay fp8_ds_mla; the second store is the indexer's own
MX_CACHE = KindsScenario("fp8_ds_mla", MX, "store_indexer_k", ("fp8_ds_mla", "indexer_k"), 100)


@pytest.mark.timeout(120)
def test_the_cache_stores_mxfp8_layers_byte_equal_to_the_reference_in_direct_and_gather_modes():
    check_kinds_results(run_world(kinds_cache_worker, 2, args=("host", MX_CACHE), timeout=100))


@requires_gpu
@pytest.mark.timeout(300)
def test_two_gpu_ranks_store_mxfp8_layers_byte_equal_to_the_reference_in_both_modes():
    check_kinds_results(run_world(kinds_cache_worker, 2, args=("cuda", MX_CACHE), timeout=280))
