"""The ``fp8_ds_mla_ue8m0`` format: the DeepSeek-V3.2 MLA cache as vLLM 0.33.0 writes it, whose
tile scales are powers of two, ``exp2f(ceilf(log2f(fmaxf(amax / 448, 1e-4f))))``, where
``fp8_ds_mla`` keeps the raw ``fmaxf(amax / 448, FLT_MIN)``. Same 656-byte entries otherwise.

Expected bytes come from scalar Python (``tests.test_reference``'s hand-built encoder:
``struct``, an exhaustive fp8 search) and from literal bytes worked out by hand in the comments;
the power of two at or above a scale comes from ``math.frexp``, never from the code under test.
The cache tests run two host-backend ranks through ``ReplicatedKVCache`` in both paths (direct,
gather) against the reference; the ``gpu`` twin runs the same ranks on one GPU.
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
from tests.test_reference import (
    bf16_bits_of,
    bf16_tensor,
    bf16_value,
    f32,
    hand_mla_entry,
    py_e4m3,
    rand_tokens,
)
from vmmkv.ops import build, host, launch
from vmmkv.ops import reference as R
from vmmkv.ops.formats import (
    FORMATS,
    INDEXER_KINDS,
    MLA_KINDS,
    STORE_KINDS,
    get_format,
    mla_kind_for,
)
from vmmkv.ops.kv import publish_layer, store_ds_mla, store_layer
from vmmkv.testing.markers import requires_gpu
from vmmkv.testing.spawn import run_world

U = "fp8_ds_mla_ue8m0"
MX = "indexer_k_mxfp8"
BS = 64
IDX = 132
MLA = 656
FLOOR = f32(1e-4)  # 0x38d1b717


def hand_pow2_scale(amax: float) -> float:
    """``exp2f(ceilf(log2f(fmaxf(amax / 448.f, 1e-4f))))`` by hand: the fp32 quotient, the
    floor, then the power of two at or above it (frexp: q = m * 2^e with m in [0.5, 1))."""
    q = max(f32(amax / 448.0), FLOOR)
    if math.isinf(q):
        return math.inf
    mant, exp = math.frexp(q)
    return q if mant == 0.5 else math.ldexp(1.0, exp)


def hand_entry(kv_bits: list[int], pe_bits: list[int]) -> bytes:
    """The 656 bytes of one fp8_ds_mla_ue8m0 token, built by hand."""
    return hand_mla_entry(kv_bits, pe_bits, tile_scale=hand_pow2_scale)


def _tile(first: list[float], fill: float) -> list[int]:
    return [bf16_bits_of(v) for v in first] + [bf16_bits_of(fill)] * (128 - len(first))


def _quantize(rows: list[list[int]], kind: str = U) -> list[bytes]:
    pe = bf16_tensor([[0x3F80 + i for i in range(64)]] * len(rows))
    got = R.quantize_ds_mla(bf16_tensor(rows), pe, kind=kind)
    assert got.dtype == torch.uint8 and got.shape == (len(rows), MLA)
    return [bytes(r.tolist()) for r in got]


# ---------------------------------------------------------------------------------------------
# The formats table, the kernels of each kind and the selection rule


def test_the_ue8m0_mla_kind_differs_from_fp8_ds_mla_only_in_the_rounding_of_its_tile_scales():
    a, b = get_format("fp8_ds_mla"), get_format(U)
    assert (a.entry_bytes, a.inputs, a.align, a.split_block, a.scale) == (
        b.entry_bytes, b.inputs, b.align, b.split_block, b.scale
    ) == (MLA, (("kv_c", torch.bfloat16, 512), ("k_pe", torch.bfloat16, 64)), 16, False, "fp32")  # fmt: skip
    assert (a.pow2, b.pow2) == (False, True)
    assert MLA_KINDS == ("fp8_ds_mla", U) and INDEXER_KINDS == ("indexer_k", MX)
    assert set(FORMATS) == {"fp8_ds_mla", U, "indexer_k", MX, "rows"}


def test_store_kinds_take_the_ue8m0_mla_cache_alone_and_as_a_layer_with_either_indexer_kind():
    assert {(U,), (U, "indexer_k"), (U, MX)} <= set(STORE_KINDS)
    assert ("fp8_ds_mla", "indexer_k") in STORE_KINDS and ("fp8_ds_mla", MX) in STORE_KINDS
    assert len(set(STORE_KINDS)) == len(STORE_KINDS) == 9


def test_every_store_kind_has_its_own_kernel_named_by_its_kinds_suffixes():
    def suffix(kind: str) -> str:
        return kind.removeprefix("fp8_ds_mla").removeprefix("indexer_k").removeprefix("rows")

    base = {"fp8_ds_mla": "vmmkv_store_ds_mla", "indexer_k": "vmmkv_store_indexer_k",
            "rows": "vmmkv_publish_rows"}  # fmt: skip
    entries = set(build.KERNELS["kv_store.cu"])
    assert list(launch.STORES) == list(launch.PUBLISHES) == list(STORE_KINDS)
    for kinds in STORE_KINDS:
        if len(kinds) == 2:
            name = "vmmkv_store_layer" + suffix(kinds[0]) + suffix(kinds[1])
        else:
            name = next(b for k, b in base.items() if kinds[0].startswith(k)) + suffix(kinds[0])
        assert launch.STORES[kinds].name == name, kinds
        assert launch.PUBLISHES[kinds].name == name + "_barrier", kinds
        assert {name, name + "_barrier"} <= entries, kinds
    assert launch.STORES[(U, MX)].name == "vmmkv_store_layer_ue8m0_mxfp8"
    assert launch.STORES[(U,)].layout == launch.STORES[("fp8_ds_mla",)].layout
    assert launch.PUBLISHES[(U, "indexer_k")].layout == launch.STORE_LAYER_BARRIER.layout


@pytest.mark.parametrize(
    "version",
    ["0.33.0", "0.33", "0.33.1", "0.33.0rc1", "0.33.1.dev7+gab12", "0.34.0", "0.34.0+cu130"],
)
def test_mla_kind_for_names_the_ue8m0_kind_for_vllm_0_33_and_0_34(version):
    assert mla_kind_for(version) == U


@pytest.mark.parametrize("version", ["0.32.1", "0.35.0", "1.33.0", "0.330.0", "v0.33.0", ""])
def test_mla_kind_for_refuses_a_release_whose_writer_was_not_established(version):
    with pytest.raises(ValueError, match="not established .*known: 0.33.x, 0.34.x.*pass the"):
        mla_kind_for(version)


def test_mla_kind_for_wants_a_version_string():
    with pytest.raises(TypeError, match="vllm_version must be a str, got tuple"):
        mla_kind_for((0, 33, 0))


# ---------------------------------------------------------------------------------------------
# The reference against hand-computed bytes


def test_a_tile_amax_of_448_times_a_power_of_two_keeps_it_and_anything_above_rounds_up():
    row = (
        _tile([448.0, -1.0], 0.5)  # amax 448 = 448 * 2^0: scale 1, 448 -> 0x7e, -1 -> 0xb8
        + _tile([56.0, -7.0], 0.25)  # 56 = 448 * 2^-3: scale 2^-3, 56 -> 448, -7 -> -56 = 0xe6
        + _tile([450.0], 1.0)  # the bf16 after 448: 450/448 -> scale 2, 450/2 = 225 -> 224 = 0x76
        + _tile([336.0], 1.0)  # 336/448 = 0.75 -> scale 1: 336 ties 320/352, even 320 = 0x7a
    )
    (got,) = _quantize([row])
    assert got[512:528] == struct.pack("<4f", 1.0, 2.0**-3, 2.0, 1.0)
    assert got[512:528].hex() == "0000803f0000003e000000400000803f"
    assert list(got[0:2]) == [0x7E, 0xB8] and list(got[128:130]) == [0x7E, 0xE6]
    assert got[256] == 0x76 and got[384] == 0x7A
    assert got == hand_entry(row, [0x3F80 + i for i in range(64)])
    (raw,) = _quantize([row], "fp8_ds_mla")  # the raw rule agrees on tiles 0, 1 only
    assert raw[512:520] == got[512:520] and raw[520:528] != got[520:528]
    assert raw[:256] == got[:256] and raw[256:512] != got[256:512]


def test_a_zero_tile_and_tiles_under_the_1e_4_floor_get_the_scale_2_to_the_minus_13():
    row = (
        _tile([-0.0], 0.0)  # zero tile: 1e-4 -> 2^-13; -0 -> 0x80, 0 -> 0x00
        + _tile([2.0**-5], 2.0**-9)  # 2^-5/448 = 7e-5 < 1e-4: 2^-13; 2^-5 -> 256 = 0x78
        + _tile([7 * 2.0**-7], 1.0 * 2.0**-10)  # 448 * 2^-13 exactly: 2^-13 itself; -> 448
        + _tile([7 * 2.0**-8], 2.0**-20)  # 448 * 2^-14 = 2^-14 < 1e-4: 2^-13; -> 224 = 0x76
    )
    (got,) = _quantize([row])
    assert got[512:528] == struct.pack("<f", 2.0**-13) * 4 == b"\x00\x00\x00\x39" * 4
    assert got[:128] == b"\x80" + bytes(127)
    assert got[128] == 0x78 and got[256] == 0x7E and got[384] == 0x76
    assert got[385] == py_e4m3(2.0**-20 / 2.0**-13) == 0x04  # 2^-7 = 4 * 2^-9: subnormal
    assert got == hand_entry(row, [0x3F80 + i for i in range(64)])
    (raw,) = _quantize([row], "fp8_ds_mla")
    assert raw[512:516] == struct.pack("<f", 2.0**-126)  # the raw rule's FLT_MIN floor


def test_nan_is_ignored_by_amax_an_all_nan_tile_gets_the_floor_and_inf_an_inf_scale():
    nan, big = 0x7FC0, -(2.0**128 - 2.0**120)  # big: the largest finite bf16, negated
    row = (
        _tile([big], 1.0)  # (2^128 - 2^120)/448 = 7.6e35 -> 2^120; -255 -> -256 = 0xf8
        + [nan] + _tile([56.0], 1.0)[:127]  # NaN ignored: amax 56 -> 2^-3; NaN -> 0x7f
        + [nan] * 128  # all NaN: fmaxf(NaN / 448, 1e-4) = 1e-4 -> 2^-13, every value 0x7f
        + _tile([1.0, -math.inf, -1.0], 2.0)  # inf scale: inf/inf NaN 0x7f, x/inf -> +-0
    )  # fmt: skip
    (got,) = _quantize([row])
    assert struct.unpack("<4f", got[512:528]) == (2.0**120, 2.0**-3, 2.0**-13, math.inf)
    assert got[524:528] == b"\x00\x00\x80\x7f"
    assert got[0] == 0xF8 and list(got[128:130]) == [0x7F, 0x7E]
    assert got[256:384] == b"\x7f" * 128 and list(got[384:388]) == [0x00, 0x7F, 0x80, 0x00]
    assert got == hand_entry(row, [0x3F80 + i for i in range(64)])


def test_the_scale_of_every_bf16_amax_is_the_power_of_two_at_or_above_its_floored_quotient():
    bits = list(range(0x7F80)) + [0x7F80]  # every finite non-negative bf16, then +inf
    amax = torch.tensor([b << 16 for b in bits], dtype=torch.int32).view(torch.float32)
    got = R.ds_mla_scale(amax, U).tolist()
    want = [hand_pow2_scale(bf16_value(b)) for b in bits]
    bad = [(hex(b), g, w) for b, g, w in zip(bits, got, want, strict=True) if g != w]
    assert not bad, bad[:5]
    assert R.ds_mla_scale(amax, "fp8_ds_mla").tolist()[1:4] == [2.0**-126] * 3  # the raw rule


def test_vllms_triton_rule_multiplying_by_1_over_448_gives_the_same_scale_for_every_bf16_amax():
    # vLLM 0.33's fused Triton writer: exp2(ceil(log2(max(amax * (1/448), 1e-4)))), the
    # reciprocal an fp32 constant; the C++ writer (and this kind) divide by 448
    amax = (torch.arange(0x7F80, dtype=torch.int32) << 16).view(torch.float32)
    recip = torch.tensor(1.0 / 448.0, dtype=torch.float32)
    assert recip.view(torch.int32).item() == 0x3B124925  # as in the C++ kernel's SASS, too
    triton = R.ue8m0(torch.maximum(amax * recip, torch.full_like(amax, FLOOR)))
    assert torch.equal(triton, R.ds_mla_scale(amax, U))
    assert not torch.equal(amax * recip, amax / torch.full_like(amax, 448.0))  # not trivially


def test_random_tokens_match_the_hand_encoder_and_the_raw_kind_where_scales_are_powers_of_two():
    rng = random.Random(31)
    kv = rand_tokens(rng, 12, 512)
    pe = [[rng.getrandbits(16) for _ in range(64)] for _ in range(12)]  # any bits, NaNs too
    got = R.quantize_ds_mla_ue8m0(bf16_tensor(kv), bf16_tensor(pe))
    for i in range(12):
        assert bytes(got[i].tolist()) == hand_entry(kv[i], pe[i]), i
    # tiles whose amax is 448 * 2^k (k >= -13): both rules give the same scale, so equal bytes
    for row in kv:
        for t in range(4):
            row[128 * t] = bf16_bits_of(448.0 * 2.0 ** rng.randint(-13, 20))
            row[128 * t + 1 : 128 * t + 128] = [b & 0x807F | (100 << 7) for b in row[1:128]]
    same = R.quantize_ds_mla(bf16_tensor(kv), bf16_tensor(pe), kind=U)
    assert torch.equal(same, R.quantize_ds_mla(bf16_tensor(kv), bf16_tensor(pe)))
    assert [bytes(r.tolist()) for r in same] == [
        hand_mla_entry(k, p) for k, p in zip(kv, pe, strict=True)
    ]


def test_insert_ds_mla_ue8m0_writes_its_entries_and_skips_padding_and_out_of_range_slots():
    rng = random.Random(32)
    nb, layers, poison = 3, 2, 0x5C
    stride = layers * BS * (MLA + IDX)
    buf = torch.full((nb * stride + 64,), poison, dtype=torch.uint8)
    view = buf.as_strided((nb, BS, MLA), (stride, MLA, 1), BS * (MLA + IDX))  # layer 1
    kv = rand_tokens(rng, 33, 512)
    pe = [[rng.getrandbits(16) for _ in range(64)] for _ in range(33)]
    slots = rng.sample(range(nb * BS), 30)
    slots[2], slots[5], slots[9] = -1, nb * BS, nb * BS + 999  # padding, out of range twice
    skipped = R.insert_ds_mla_ue8m0(view, bf16_tensor(kv), bf16_tensor(pe), torch.tensor(slots))
    assert skipped == 2
    want = bytearray([poison]) * buf.numel()
    for i, s in enumerate(slots):
        if 0 <= s < nb * BS:
            at = (s // BS) * stride + BS * (MLA + IDX) + (s % BS) * MLA
            want[at : at + MLA] = hand_entry(kv[i], pe[i])
    assert bytes(buf.tolist()) == bytes(want)


def test_the_reference_refuses_kinds_that_are_not_mla_kinds():
    view = torch.zeros(1, BS, MLA, dtype=torch.uint8)
    kv_c, k_pe = torch.ones(1, 512, dtype=torch.bfloat16), torch.ones(1, 64, dtype=torch.bfloat16)
    for call in (
        lambda: R.insert_ds_mla(view, kv_c, k_pe, torch.zeros(1, dtype=torch.int64), kind=MX),
        lambda: R.quantize_ds_mla(kv_c, k_pe, kind="indexer_k"),
        lambda: R.ds_mla_scale(torch.ones(4), "rows"),
    ):
        with pytest.raises(ValueError, match=r"kind must be one of \('fp8_ds_mla', "):
            call()
    with pytest.raises(TypeError, match="amax must be float32"):
        R.ds_mla_scale(torch.ones(4, dtype=torch.float64), U)
    assert view.eq(0).all()


# ---------------------------------------------------------------------------------------------
# The functional stores, the custom ops and the host backend on CPU targets


def test_kernel_wrappers_accept_ue8m0_mla_targets_with_either_indexer_kind_before_launching():
    replicas = [torch.zeros(2 * BS * (MLA + IDX), dtype=torch.uint8)]
    kv_c, k_pe = torch.ones(4, 512, dtype=torch.bfloat16), torch.ones(4, 64, dtype=torch.bfloat16)
    k, s = torch.ones(4, 128, dtype=torch.bfloat16), torch.arange(4)
    for idx_kind in INDEXER_KINDS:
        mla, idx = cpu_layer_targets(replicas, 2, 0, U, idx_kind)
        with pytest.raises(ValueError, match="CUDA device"):  # every check passed: only the device
            store_ds_mla(mla, kv_c, k_pe, s)
        with pytest.raises(ValueError, match="CUDA device"):
            store_layer(mla, idx, kv_c, k_pe, k, s)
        with pytest.raises(TypeError, match="barrier must be a vmmkv.ops.DeviceBarrier"):
            publish_layer(mla, idx, kv_c, k_pe, k, s, barrier=object())  # checked last
    with pytest.raises(ValueError, match=r"target must be a 'fp8_ds_mla' target \(or "
                       r"'fp8_ds_mla_ue8m0'\), got kind 'indexer_k_mxfp8'"):  # fmt: skip
        store_ds_mla(idx, kv_c, k_pe, s)
    with pytest.raises(ValueError, match=r"mla_target must be a 'fp8_ds_mla' target \(or "
                       r"'fp8_ds_mla_ue8m0'\), got kind 'indexer_k_mxfp8'"):  # fmt: skip
        store_layer(idx, idx, kv_c, k_pe, k, s)
    with pytest.raises(ValueError, match="this store writes fp8_ds_mla or fp8_ds_mla_ue8m0"):
        host.store_ds_mla(idx, kv_c, k_pe, s)
    assert replicas[0].eq(0).all()


def test_the_custom_ops_take_the_mla_kind_and_refuse_one_that_is_not():
    replicas = [torch.zeros(2 * BS * (MLA + IDX), dtype=torch.uint8)]
    mla, idx = cpu_layer_targets(replicas, 2, 0, U, "indexer_k")
    kv_c, k_pe = torch.ones(4, 512, dtype=torch.bfloat16), torch.ones(4, 64, dtype=torch.bfloat16)
    k, s = torch.ones(4, 128, dtype=torch.bfloat16), torch.arange(4)
    # the layouts name the cache's address, as a CUDA target's do (a CPU target records 0)
    mla_layout, idx_layout = mla._layout(), idx._layout()
    mla_layout[-1] = idx_layout[-1] = replicas[0].data_ptr()
    ds = (mla.cache, mla.error_counter, mla.ptr_table, mla.committed_bytes, kv_c, k_pe, s,
          mla_layout, 0)  # fmt: skip
    layer = (mla.cache, mla.error_counter, idx.cache, idx.error_counter, mla.ptr_table,
             mla.committed_bytes, idx.ptr_table, idx.committed_bytes, kv_c, k_pe, k, s,
             mla_layout, idx_layout, 0, True, "indexer_k")  # fmt: skip
    assert 'str kind="fp8_ds_mla"' in str(torch.ops.vmmkv.store_ds_mla.default._schema)
    assert 'str mla_kind="fp8_ds_mla"' in str(torch.ops.vmmkv.store_layer.default._schema)
    with pytest.raises(ValueError, match="CUDA device"):  # a ue8m0 target, checked to the device
        torch.ops.vmmkv.store_ds_mla(*ds, U)
    with pytest.raises(ValueError, match="CUDA device"):
        torch.ops.vmmkv.store_layer(*layer, U)
    with pytest.raises(ValueError, match=r"kind must be one of \('fp8_ds_mla', 'fp8_ds_mla_ue8m0'"):
        torch.ops.vmmkv.store_ds_mla(*ds, "indexer_k")
    with pytest.raises(ValueError, match=r"kind must be one of \('fp8_ds_mla', 'fp8_ds_mla_ue8m0'"):
        torch.ops.vmmkv.store_layer(*layer, MX)
    assert replicas[0].eq(0).all()


@pytest.mark.parametrize("idx_kind", INDEXER_KINDS)
def test_host_stores_and_prepared_host_stores_write_the_ue8m0_reference_into_every_replica(
    idx_kind,
):
    import vmmkv.ops

    nb, tokens, nlo = 3, 50, 6
    g = torch.Generator().manual_seed(33)
    replicas = random_replicas(3, nb * BS * (MLA + IDX), g)
    before = [r.clone() for r in replicas]
    mla, idx = cpu_layer_targets(replicas, nb, 2, U, idx_kind)
    kv_c = torch.randn(tokens, 512, generator=g) * torch.rand(tokens, 1, generator=g) * 9
    kv_c = kv_c.bfloat16()
    k_pe = torch.randn(tokens, 64, generator=g).bfloat16()
    k = (torch.randn(tokens, 128, generator=g) * 5).bfloat16()
    slots = torch.randperm(nb * BS, generator=g)[:tokens]
    slots[4], slots[11], slots[20], slots[40] = -1, nb * BS + 3, nb * BS + 1, nb * BS
    a, b = tokens // 3, 2 * (tokens // 3)
    host.store_layer(mla, idx, kv_c[:a], k_pe[:a], k[:a], slots[:a], num_local_only=nlo)
    host.store_ds_mla(mla, kv_c[a:b], k_pe[a:b], slots[a:b])
    p = vmmkv.ops.prepare((mla, idx))
    assert type(p).__name__ == "HostPreparedStore" and p.kinds == (U, idx_kind)
    p.store((kv_c[b:], k_pe[b:], k[b:]), slots[b:], 0)

    def expect(mla_kind: str) -> list[torch.Tensor]:
        out = [t.clone() for t in before]
        for r, buf in enumerate(out):
            mla_v = buf[: nb * BS * MLA].view(nb, BS, MLA)
            idx_v = buf[nb * BS * MLA :].view(nb, BS, IDX)
            for lo, hi, with_idx in ((0 if r == 2 else nlo, a, True), (a, b, False),
                                     (b, tokens, True)):  # fmt: skip
                R.insert_ds_mla(mla_v, kv_c[lo:hi], k_pe[lo:hi], slots[lo:hi], kind=mla_kind)
                if with_idx:
                    R.insert_indexer_k(idx_v, k[lo:hi], slots[lo:hi], kind=idx_kind)
        return out

    want = expect(U)
    for r in range(3):
        assert torch.equal(replicas[r], want[r]), f"replica {r}"
    assert not torch.equal(want[0], expect("fp8_ds_mla")[0])  # the rules differ on these inputs
    assert mla.error_counter.item() == 5  # slots 11, 20, 40: layer (2), ds_mla (1), prepared (2)


# ---------------------------------------------------------------------------------------------
# ReplicatedKVCache: two ranks, direct and gather, byte-equal to the reference


def _ue8m0_cache(idx_kind: str) -> KindsScenario:
    """Both layers' MLA views ue8m0; the second store is the MLA's own."""
    return KindsScenario(U, idx_kind, "store_ds_mla", ("fp8_ds_mla", idx_kind), 200)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("idx_kind", INDEXER_KINDS)
def test_the_cache_stores_ue8m0_mla_layers_byte_equal_to_the_reference_in_both_modes(idx_kind):
    scenario = _ue8m0_cache(idx_kind)
    check_kinds_results(run_world(kinds_cache_worker, 2, args=("host", scenario), timeout=100))


@requires_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("idx_kind", INDEXER_KINDS)
def test_two_gpu_ranks_store_ue8m0_mla_layers_byte_equal_to_the_reference_in_both_modes(idx_kind):
    scenario = _ue8m0_cache(idx_kind)
    check_kinds_results(run_world(kinds_cache_worker, 2, args=("cuda", scenario), timeout=280))
