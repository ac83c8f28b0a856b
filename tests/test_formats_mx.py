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
from vmmkv.ops.kv import KVTarget, store_indexer_k, store_layer
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


def _cpu_targets(replicas: list[torch.Tensor], nb: int, my_rank: int, idx_kind: str = MX):
    table = torch.tensor([r.data_ptr() for r in replicas], dtype=torch.int64)
    common = dict(ptr_table=table, my_rank=my_rank, num_blocks=nb, block_size=BS,
                  committed_bytes=torch.tensor([replicas[0].numel()]),
                  error_counter=torch.zeros(1, dtype=torch.int32), cache=replicas[my_rank])  # fmt: skip
    mla = KVTarget(kind="fp8_ds_mla", offset_bytes=0, block_stride=BS * MLA, entry_stride=MLA,
                   entry_bytes=MLA, **common)  # fmt: skip
    idx = KVTarget(kind=idx_kind, offset_bytes=nb * BS * MLA, block_stride=BS * IDX,
                   entry_stride=IDX, entry_bytes=IDX, **common)  # fmt: skip
    return mla, idx


def test_kernel_wrappers_accept_mxfp8_targets_and_refuse_ue8m0_false_before_launching():
    replicas = [torch.zeros(2 * BS * (MLA + IDX), dtype=torch.uint8)]
    mla, idx = _cpu_targets(replicas, 2, 0)
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
    replicas = [
        torch.randint(1, 256, (nb * BS * (MLA + IDX),), generator=g, dtype=torch.uint8)
        for _ in range(3)
    ]
    expected = [r.clone() for r in replicas]
    mla, idx = _cpu_targets(replicas, nb, my_rank=2)
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

LAYERS = 2
NB = 4
GUARD = 4096
OWN = [13, 5]
DECODE = 3
STORES = 5  # out-of-range tokens are counted by: store_layer (2), store_indexer_k, publish (2)


def _batches(world: int, seed: int):
    """[(kv_c, k_pe, k, slots)] on the CPU: the shared decode batch, then each rank's own batch
    (rank 0's with a padding and an out-of-range slot); slots unique across batches."""
    from vmmkv.testing.kv import layer_inputs

    perm = torch.randperm(NB * BS, generator=torch.Generator().manual_seed(seed))
    out, at = [], 0
    for who in range(-1, world):
        n = DECODE if who < 0 else OWN[who % len(OWN)]
        slots = perm[at : at + n].clone()
        at += n
        if who == 0:
            slots[1], slots[4] = -1, NB * BS + 7
        kv_c, k_pe, k = layer_inputs(seed * 10 + who + 1, n)
        k[0, :] *= 1e4  # one row far from the others: its own exponent byte
        out.append((kv_c, k_pe, k, slots))
    return out


def _oracle(poison: torch.Tensor, world: int, kind: str) -> torch.Tensor:
    from vmmkv.testing.kv import interleaved_views

    want = poison.clone()
    (mla0, idx0), (mla1, idx1) = interleaved_views(want, LAYERS, NB, offset=GUARD)
    for seed, views in ((1, ((mla0, idx0), (None, idx1))), (2, ((mla1, idx1),))):
        for kv_c, k_pe, k, slots in _batches(world, seed):
            for mla, idx in views:
                if mla is not None:
                    R.insert_ds_mla(mla, kv_c, k_pe, slots)
                R.insert_indexer_k(idx, k, slots, kind=kind)
    return want


def _cache_worker(rank: int, world: int, backend: str):
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache
    from vmmkv.gather import pad_tokens
    from vmmkv.testing.kv import block_stride, interleaved_views

    device = "cpu" if backend == "host" else "cuda:0"
    chunk = 1 << 21 if backend == "cuda" else 1 << 16
    total = 2 * GUARD + NB * block_stride(LAYERS)
    cap = -(-total // chunk) * chunk
    out = {}
    with ReplicatedKVCache(
        dist.group.WORLD, cap, device, chunk_bytes=chunk, backend=backend, initial_bytes=cap
    ) as cache:
        buf = cache.allocate(total).view(torch.uint8)
        (mla0, idx0), (mla1, idx1) = interleaved_views(buf, LAYERS, NB, offset=GUARD)
        b_mla0 = cache.bind("mla0", mla0, "fp8_ds_mla")
        b_mla1 = cache.bind("mla1", mla1, "fp8_ds_mla")
        b_idx0, b_idx1 = cache.bind("idx0", idx0, MX), cache.bind("idx1", idx1, MX)
        pad_to = max(OWN[r % len(OWN)] for r in range(world))

        def inputs(seed):
            """Decode rows first (replicated), then this rank's rows padded to pad_to."""
            dec, *own = _batches(world, seed)
            padded, slots = pad_tokens(own[rank][:3], own[rank][3], pad_to)
            cat = [torch.cat([d, o]).to(device) for d, o in zip(dec, (*padded, slots), strict=True)]
            return cat[:3], cat[3].to(torch.int32)

        for mode in ("direct", "gather"):
            g = torch.Generator().manual_seed(100 + rank)
            poison = torch.randint(1, 256, (total,), generator=g, dtype=torch.uint8)
            buf.copy_(poison.to(device))
            cache.error_counter.zero_()
            dist.barrier()
            (kv_c, k_pe, k), slots = inputs(1)
            cache.store_layer(b_mla0, b_idx0, kv_c, k_pe, k, slots, num_local_only=DECODE,
                              mode=mode)  # fmt: skip
            cache.store_indexer_k(b_idx1, k, slots, num_local_only=DECODE, mode=mode)
            cache.barrier()
            (kv_c, k_pe, k), slots = inputs(2)
            cache.publish_layer(b_mla1, b_idx1, kv_c, k_pe, k, slots, num_local_only=DECODE,
                                mode=mode)  # fmt: skip
            if backend == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            got = buf.cpu()
            want = _oracle(poison, world, MX)
            assert not torch.equal(want, _oracle(poison, world, "indexer_k"))  # a real difference
            assert torch.equal(got, want), (
                f"rank {rank} mode {mode}: {(got != want).sum().item()} bytes differ, first at "
                f"{(got != want).nonzero()[:4].flatten().tolist()}"
            )
            out[mode] = (int(cache.error_counter.item()), cache.direct)
            dist.barrier()
    return out


def _check_cache_results(out, world):
    for rank, res in enumerate(out):
        assert res["direct"] == (STORES * (rank == 0), True)  # own tokens: rank 0's bad slot
        assert res["gather"] == (STORES, True)  # every rank inserts every rank's tokens


@pytest.mark.timeout(120)
def test_the_cache_stores_mxfp8_layers_byte_equal_to_the_reference_in_direct_and_gather_modes():
    _check_cache_results(run_world(_cache_worker, 2, args=("host",), timeout=100), 2)


@requires_gpu
@pytest.mark.timeout(300)
def test_two_gpu_ranks_store_mxfp8_layers_byte_equal_to_the_reference_in_both_modes():
    _check_cache_results(run_world(_cache_worker, 2, args=("cuda",), timeout=280), 2)
