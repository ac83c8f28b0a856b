"""The CUDA stores and the barrier, byte for byte against vmmkv.ops.reference.

GPU tests (marker ``gpu``) run in one process on one device: "replicas" are separate torch
allocations, each a packed region between two 4096-byte guards of 0xA5, so that one process
plays every rank's memory. Regions are poisoned with random non-zero bytes before every run; the
expected buffers are the poisoned bytes with the reference inserters applied on the CPU.
The first tests (no marker) check argument validation on CPU tensors: it happens before any
launch, so it needs no GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vmmkv.ops import reference as R
from vmmkv.ops.barrier import DeviceBarrier
from vmmkv.ops.kv import KVTarget, publish_rows, store_ds_mla, store_indexer_k, store_layer
from vmmkv.ops.launch import warm_up
from vmmkv.testing.markers import requires_gpu

GUARD = 4096
GUARD_BYTE = 0xA5
BS = 64
MLA = 656
IDX = 132
REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# Validation (CPU tensors: everything is rejected before a launch is attempted)


def _cpu_target(kind: str = "fp8_ds_mla", **over) -> KVTarget:
    nb = 4
    geometry = {
        "indexer_k": (BS * IDX, IDX, IDX, (nb, BS * IDX)),
        "rows": (BS * 112, 112, 100, (nb, BS, 112)),
    }.get(kind, (BS * MLA, MLA, MLA, (nb, BS, MLA)))
    fields = dict(
        kind=kind,
        ptr_table=torch.zeros(2, dtype=torch.int64),
        my_rank=0,
        offset_bytes=0,
        num_blocks=nb,
        block_size=BS,
        block_stride=geometry[0],
        entry_stride=geometry[1],
        entry_bytes=geometry[2],
        committed_bytes=torch.zeros(1, dtype=torch.int64),
        error_counter=torch.zeros(1, dtype=torch.int32),
        cache=torch.zeros(geometry[3], dtype=torch.uint8),
    )
    fields.update(over)
    return KVTarget(**fields)


def _bf16(*shape) -> torch.Tensor:
    return torch.ones(*shape, dtype=torch.bfloat16)


SLOTS = torch.arange(4, dtype=torch.int64)


def test_stores_reject_fp16_inputs_with_a_type_error():
    with pytest.raises(TypeError, match="float16"):
        store_ds_mla(_cpu_target(), torch.ones(4, 512, dtype=torch.float16), _bf16(4, 64), SLOTS)
    with pytest.raises(TypeError, match="float16"):
        store_indexer_k(_cpu_target("indexer_k"), torch.ones(4, 128, dtype=torch.float16), SLOTS)


def test_stores_reject_wrong_widths_naming_the_expected_shape():
    with pytest.raises(ValueError, match=r"kv_c must have shape \[T, 512\], got \[4, 576\]"):
        store_ds_mla(_cpu_target(), _bf16(4, 576), _bf16(4, 64), SLOTS)
    with pytest.raises(ValueError, match=r"k must have shape \[T, 128\]"):
        store_indexer_k(_cpu_target("indexer_k"), _bf16(4, 64), SLOTS)
    with pytest.raises(ValueError, match=r"rows must have shape \[T, 100\]"):
        publish_rows(_cpu_target("rows"), torch.zeros(4, 99, dtype=torch.uint8), SLOTS)


def test_stores_reject_a_target_of_another_kind():
    with pytest.raises(ValueError, match="'fp8_ds_mla' target.*, got kind 'indexer_k'"):
        store_ds_mla(_cpu_target("indexer_k"), _bf16(4, 512), _bf16(4, 64), SLOTS)
    with pytest.raises(TypeError, match="KVTarget"):
        store_indexer_k(object(), _bf16(4, 128), SLOTS)


def test_stores_reject_float_and_2d_slot_mappings():
    with pytest.raises(TypeError, match="int32 or int64, got torch.float32"):
        store_ds_mla(_cpu_target(), _bf16(4, 512), _bf16(4, 64), torch.zeros(4))
    with pytest.raises(ValueError, match="1-D"):
        store_ds_mla(
            _cpu_target(), _bf16(4, 512), _bf16(4, 64), torch.zeros(2, 2, dtype=torch.int64)
        )


def test_stores_reject_inputs_shorter_than_the_slot_mapping():
    with pytest.raises(ValueError, match="k_pe has 3 tokens, fewer than slot_mapping's 4"):
        store_ds_mla(_cpu_target(), _bf16(4, 512), _bf16(3, 64), SLOTS)


@pytest.mark.parametrize("nlo", [-1, 5])
def test_stores_reject_num_local_only_outside_0_to_t(nlo):
    with pytest.raises(ValueError, match=rf"num_local_only must be in \[0, 4\], got {nlo}"):
        store_ds_mla(_cpu_target(), _bf16(4, 512), _bf16(4, 64), SLOTS, num_local_only=nlo)


def test_stores_on_cpu_tensors_are_rejected_before_launching():
    with pytest.raises(ValueError, match="CUDA device"):
        store_ds_mla(_cpu_target(), _bf16(4, 512), _bf16(4, 64), SLOTS)


def test_store_layer_needs_an_mla_and_an_indexer_target():
    with pytest.raises(ValueError, match="idx_target must be a 'indexer_k' target"):
        store_layer(_cpu_target(), _cpu_target(), _bf16(4, 512), _bf16(4, 64), _bf16(4, 128), SLOTS)


@pytest.mark.parametrize(
    ("over", "error", "match"),
    [
        ({"kind": "fp8"}, ValueError, "kind must be one of"),
        ({"my_rank": 2}, ValueError, r"my_rank must be in \[0, 1\], got 2"),
        ({"block_stride": BS * MLA - 16}, ValueError, "blocks would overlap"),
        ({"offset_bytes": 8}, ValueError, "offset_bytes of a fp8_ds_mla view must be a multiple of 16"),
        ({"entry_stride": 664, "block_stride": BS * 664}, ValueError, "entry_stride of a fp8_ds_mla"),
        ({"entry_bytes": 576}, ValueError, "must be 656, got 576"),
        ({"committed_bytes": torch.zeros(1, dtype=torch.int32)}, ValueError, "committed_bytes must be an int64"),
        ({"error_counter": torch.zeros(2, dtype=torch.int32)}, ValueError, "error_counter must be an int32 tensor of 1"),
        ({"cache": torch.zeros(4, dtype=torch.int8)}, TypeError, "cache must be a uint8 tensor"),
        ({"ptr_table": torch.zeros(2, dtype=torch.int32)}, ValueError, "ptr_table must be"),
        ({"num_blocks": 1.5}, TypeError, "num_blocks must be an int"),
    ],
)  # fmt: skip
def test_targets_are_validated_when_built(over, error, match):
    with pytest.raises(error, match=match):
        _cpu_target(**over)


def test_the_custom_ops_declare_what_they_mutate():
    import vmmkv.ops  # noqa: F401  (registers the ops)

    schema = str(torch.ops.vmmkv.store_ds_mla.default._schema)
    assert "Tensor(a0!) cache" in schema and "Tensor(a1!) error_counter" in schema
    schema = str(torch.ops.vmmkv.barrier.default._schema)
    assert "Tensor(a0!) epochs" in schema and "Tensor(a1!)[] fence" in schema
    assert "Int handle" in schema and "Int lane" in schema  # the barrier by handle
    for op in ("store_indexer_k", "store_layer", "publish_rows"):
        assert "!" in str(getattr(torch.ops.vmmkv, op).default._schema)


def test_barrier_arguments_are_validated():
    table = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="CUDA device"):
        DeviceBarrier(table, None, rank=0, world=2, lanes=1, device="cpu")
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\), got 2"):
        DeviceBarrier(table, None, rank=2, world=2, lanes=1, device="cuda:0")
    with pytest.raises(ValueError, match="timeout_s"):
        DeviceBarrier(table, None, rank=0, world=2, lanes=1, device="cuda:0", timeout_s=0)


# ---------------------------------------------------------------------------------------------
# GPU helpers


@dataclass(frozen=True)
class Layout:
    """Where one layer's MLA and Indexer views sit inside a region."""

    num_blocks: int
    mla_offset: int
    mla_stride: int
    idx_offset: int
    idx_stride: int
    region_bytes: int


def packed(num_blocks: int) -> Layout:
    mla = num_blocks * BS * MLA
    return Layout(num_blocks, 0, BS * MLA, mla, BS * IDX, mla + num_blocks * BS * IDX)


def interleaved(num_blocks: int, layers: int = 3, layer: int = 1) -> Layout:
    per_layer = BS * (MLA + IDX)
    stride = layers * per_layer
    return Layout(
        num_blocks, layer * per_layer, stride, layer * per_layer + BS * MLA, stride,
        num_blocks * stride,
    )  # fmt: skip


def mla_view(region: torch.Tensor, lay: Layout) -> torch.Tensor:
    return region.as_strided(
        (lay.num_blocks, BS, MLA),
        (lay.mla_stride, MLA, 1),
        region.storage_offset() + lay.mla_offset,
    )


def idx_view(region: torch.Tensor, lay: Layout) -> torch.Tensor:
    return region.as_strided(
        (lay.num_blocks, BS * IDX), (lay.idx_stride, 1), region.storage_offset() + lay.idx_offset
    )


class Replicas:
    """``n`` simulated replicas: separate allocations, each [guard | region | guard]."""

    def __init__(self, n: int, region_bytes: int, device: torch.device):
        self.region_bytes = region_bytes
        self.bufs = [
            torch.empty(region_bytes + 2 * GUARD, dtype=torch.uint8, device=device)
            for _ in range(n)
        ]
        self.regions = [b[GUARD : GUARD + region_bytes] for b in self.bufs]
        self.ptr_table = torch.tensor(
            [r.data_ptr() for r in self.regions], dtype=torch.int64, device=device
        )
        self.committed = torch.tensor([region_bytes], dtype=torch.int64, device=device)

    def poison(self, seed: int) -> list[torch.Tensor]:
        """Fill guards with 0xA5 and regions with random non-zero bytes; return CPU copies."""
        g = torch.Generator().manual_seed(seed)
        for b in self.bufs:
            host = torch.full((b.numel(),), GUARD_BYTE, dtype=torch.uint8)
            host[GUARD : GUARD + self.region_bytes] = torch.randint(
                1, 256, (self.region_bytes,), generator=g, dtype=torch.uint8
            )
            b.copy_(host)
        torch.cuda.synchronize()
        return [b.cpu() for b in self.bufs]

    def assert_equal(self, expected: list[torch.Tensor]) -> None:
        torch.cuda.synchronize()
        for r, (got, want) in enumerate(zip(self.bufs, expected, strict=True)):
            got = got.cpu()
            assert (got[:GUARD] == GUARD_BYTE).all() and (got[-GUARD:] == GUARD_BYTE).all(), r
            if not torch.equal(got, want):
                diff = (got != want).nonzero().flatten()
                first = int(diff[0]) - GUARD
                raise AssertionError(
                    f"replica {r}: {diff.numel()} bytes differ, first at region offset {first}: "
                    f"got {got[diff[:8]].tolist()} want {want[diff[:8]].tolist()}"
                )


def targets(
    rep: Replicas,
    lay: Layout,
    my_rank: int,
    idx_kind: str = "indexer_k",
    mla_kind: str = "fp8_ds_mla",
) -> tuple[KVTarget, KVTarget]:
    dev = rep.ptr_table.device
    region = rep.regions[my_rank]
    mla = KVTarget(
        mla_kind, rep.ptr_table, my_rank, lay.mla_offset, lay.num_blocks, BS, lay.mla_stride,
        MLA, MLA, rep.committed, torch.zeros(1, dtype=torch.int32, device=dev),
        mla_view(region, lay),
    )  # fmt: skip
    idx = KVTarget(
        idx_kind, rep.ptr_table, my_rank, lay.idx_offset, lay.num_blocks, BS, lay.idx_stride,
        IDX, IDX, rep.committed, torch.zeros(1, dtype=torch.int32, device=dev),
        idx_view(region, lay),
    )  # fmt: skip
    return mla, idx


def _bf16_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor([b - 0x10000 if b >= 0x8000 else b for b in bits], dtype=torch.int16).view(
        torch.bfloat16
    )


def make_inputs(tokens: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kv_c [T,512] and k_pe [T,64] as views of one [T,576] tensor (as engines pass them), and
    k [T,128]: random non-zero bf16 at per-tile magnitudes 1e-3..1e3, plus extreme rows."""
    g = torch.Generator().manual_seed(seed)
    mag = 10 ** (torch.rand(tokens, 5, 1, generator=g) * 6 - 3)
    x = (torch.randn(tokens, 5, 128, generator=g) * mag).reshape(tokens, 640)
    x[0, 0:128] = 0.0  # a zero tile: scale FLT_MIN
    x[0, 130] = -0.0
    x[1, 128:256] = _bf16_bits(list(range(1, 129))).float()  # bf16 subnormals only
    x[2, 256], x[2, 257] = 3.0e38, -2.5e38  # near the bf16 maximum
    x[3, :] *= 1e-36  # normal and subnormal values, fp8 subnormal outputs
    x[4, 384:512] = torch.tensor([56.0, -28.0, 7.0, 3.5] * 32)  # tile amax 448 * 2^-3 exactly
    x[5, 512:640] = torch.tensor([56.0, -0.5] * 64)  # indexer: ue8m0 scale exactly 2^-3
    x[6, 512:640] = 0.0  # indexer: amax floor 1e-4
    x[7, 512:640] = torch.tensor([56.25, 1.0] * 64)  # indexer: the bf16 above 56 -> 2^-2
    x[8, 512:640] *= 1e-38  # indexer: subnormal inputs
    x[9, 512] = 3.0e38
    x = x.bfloat16()
    both = torch.empty(tokens, 576, dtype=torch.bfloat16)
    both[:, :512] = x[:, :512]
    both[:, 512:] = (torch.randn(tokens, 64, generator=g) * 3).bfloat16()
    both = both.to(device)
    return both[:, :512], both[:, 512:], x[:, 512:].contiguous().to(device)


def make_slots(tokens: int, num_blocks: int, seed: int, dtype, padded=(3, 17), oob=(5, 40)):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * BS, generator=g)[:tokens].to(torch.int64)
    for i in padded:
        slots[i] = -1
    for j, i in enumerate(oob):
        slots[i] = num_blocks * BS + j * 1000  # the first slot past the end, and far past it
    return slots.to(dtype)


def expect_mla(exp, lay, my_rank, kv_c, k_pe, slots, nlo=0, first_uncommitted_block=None,
               kind="fp8_ds_mla"):  # fmt: skip
    """Apply the reference insert (of the MLA ``kind``) to the CPU copies ``exp`` as the kernel
    should."""
    s = slots.cpu().long().clone()
    if first_uncommitted_block is not None:
        s[s >= first_uncommitted_block * BS] = -1
    for r, buf in enumerate(exp):
        start = 0 if r == my_rank else nlo
        region = buf[GUARD:-GUARD]
        R.insert_ds_mla(
            mla_view(region, lay), kv_c.cpu()[start:], k_pe.cpu()[start:], s[start:], kind=kind
        )


def expect_idx(exp, lay, my_rank, k, slots, nlo=0, ue8m0=True, first_uncommitted_block=None,
               kind="indexer_k"):  # fmt: skip
    s = slots.cpu().long().clone()
    if first_uncommitted_block is not None:
        s[s >= first_uncommitted_block * BS] = -1
    for r, buf in enumerate(exp):
        start = 0 if r == my_rank else nlo
        R.insert_indexer_k(
            idx_view(buf[GUARD:-GUARD], lay), k.cpu()[start:], s[start:], ue8m0, kind=kind
        )


def expect_layer(exp, lay, my_rank, kv_c, k_pe, k, slots, kind="indexer_k",
                 mla_kind="fp8_ds_mla", **kw):  # fmt: skip
    """``expect_mla`` (of ``mla_kind``) and ``expect_idx`` (of the indexer ``kind``) of one
    layer's tokens, with the same options."""
    expect_mla(exp, lay, my_rank, kv_c, k_pe, slots, kind=mla_kind, **kw)
    expect_idx(exp, lay, my_rank, k, slots, kind=kind, **kw)


def n_out_of_range(slots: torch.Tensor, num_blocks: int) -> int:
    return int((slots.cpu() >= num_blocks * BS).sum())


@pytest.fixture
def dev():
    d = torch.device("cuda", torch.cuda.current_device())
    warm_up(d)
    return d


LAYOUTS = {"packed": packed(6), "interleaved": interleaved(6)}

# ---------------------------------------------------------------------------------------------
# Stores


@requires_gpu
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_store_ds_mla_writes_reference_bytes_into_every_replica(dev, layout, slot_dtype):
    lay = LAYOUTS[layout]
    rep = Replicas(3, lay.region_bytes, dev)
    mla, _ = targets(rep, lay, my_rank=1)
    kv_c, k_pe, _ = make_inputs(200, seed=1, device=dev)
    slots = make_slots(190, lay.num_blocks, seed=2, dtype=slot_dtype).to(dev)  # inputs longer
    exp = rep.poison(3)
    store_ds_mla(mla, kv_c, k_pe, slots)
    expect_mla(exp, lay, 1, kv_c, k_pe, slots)
    rep.assert_equal(exp)
    assert mla.error_counter.item() == n_out_of_range(slots, lay.num_blocks) == 2


@requires_gpu
@pytest.mark.parametrize("ue8m0", [True, False])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_store_indexer_k_writes_the_split_block_layout_into_every_replica(dev, layout, ue8m0):
    lay = LAYOUTS[layout]
    rep = Replicas(3, lay.region_bytes, dev)
    _, idx = targets(rep, lay, my_rank=2)
    _, _, k = make_inputs(200, seed=4, device=dev)
    slots = make_slots(195, lay.num_blocks, seed=5, dtype=torch.int64).to(dev)
    exp = rep.poison(6)
    store_indexer_k(idx, k, slots, ue8m0=ue8m0)
    expect_idx(exp, lay, 2, k, slots, ue8m0=ue8m0)
    rep.assert_equal(exp)
    assert idx.error_counter.item() == 2


@requires_gpu
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_layer_writes_both_views_in_one_launch(dev, slot_dtype):
    lay = interleaved(5)
    rep = Replicas(2, lay.region_bytes, dev)
    mla, idx = targets(rep, lay, my_rank=0)
    kv_c, k_pe, k = make_inputs(150, seed=7, device=dev)
    slots = make_slots(150, lay.num_blocks, seed=8, dtype=slot_dtype).to(dev)
    exp = rep.poison(9)
    store_layer(mla, idx, kv_c, k_pe, k, slots)
    expect_layer(exp, lay, 0, kv_c, k_pe, k, slots)
    rep.assert_equal(exp)
    assert mla.error_counter.item() == idx.error_counter.item() == 2


MX = "indexer_k_mxfp8"


def _scale_words(region: torch.Tensor, lay: Layout, slots: torch.Tensor) -> torch.Tensor:
    """The 4 scale bytes ``[n, 4]`` of every in-range slot's token in one replica's indexer view."""
    s = slots.cpu().long()
    s = s[(s >= 0) & (s < lay.num_blocks * BS)]
    scales = idx_view(region.cpu(), lay)[:, BS * 128 :].reshape(lay.num_blocks, BS, 4)
    return scales[s // BS, s % BS]


@requires_gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_store_indexer_k_mxfp8_writes_four_ue8m0_bytes_per_scale_into_every_replica(dev, layout):
    lay = LAYOUTS[layout]
    rep = Replicas(3, lay.region_bytes, dev)
    _, idx = targets(rep, lay, my_rank=1, idx_kind=MX)
    _, _, k = make_inputs(200, seed=50, device=dev)
    k[10, 3] = float("nan")  # ignored by amax
    k[11, 5] = -float("inf")  # inf scale: 0xff bytes
    slots = make_slots(195, lay.num_blocks, seed=51, dtype=torch.int64).to(dev)
    exp = rep.poison(52)
    store_indexer_k(idx, k, slots)
    expect_idx(exp, lay, 1, k, slots, kind=MX)
    rep.assert_equal(exp)
    assert idx.error_counter.item() == 2
    for region in rep.regions:  # the bytes themselves: one exponent byte, four times
        words = _scale_words(region, lay, slots[:195])
        assert words.shape[0] == 195 - 4 and (words == words[:, :1]).all()
        assert (words[:, 0] >= 0x69).all()  # no scale below the 1e-4 floor's 2^-22
    assert _scale_words(rep.regions[0], lay, slots[11:12]).tolist() == [[0xFF] * 4]


@requires_gpu
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_layer_mxfp8_writes_both_views_in_one_launch(dev, slot_dtype):
    lay = interleaved(5)
    rep = Replicas(2, lay.region_bytes, dev)
    mla, idx = targets(rep, lay, my_rank=0, idx_kind=MX)
    kv_c, k_pe, k = make_inputs(150, seed=53, device=dev)
    slots = make_slots(150, lay.num_blocks, seed=54, dtype=slot_dtype).to(dev)
    exp = rep.poison(55)
    store_layer(mla, idx, kv_c, k_pe, k, slots, num_local_only=9)
    expect_layer(exp, lay, 0, kv_c, k_pe, k, slots, kind=MX, nlo=9)
    rep.assert_equal(exp)
    assert mla.error_counter.item() == idx.error_counter.item() == 2
    with pytest.raises(ValueError, match="ue8m0=False is not possible"):
        store_layer(mla, idx, kv_c, k_pe, k, slots, ue8m0=False)


def _check_publish_layer_equals_store_layer_then_barrier(dev, inputs, seed, idx_kind, mla_kind):
    """``publish_layer`` into one set of replicas and ``store_layer`` + the barrier into
    another, from the same ``inputs(150, seed, dev)`` (slots from ``seed + 1``, poison from
    ``seed + 2``): byte-equal, equal to the reference, one epoch each, 2 bad slots counted."""
    from vmmkv.ops import publish_layer

    lay = packed(5)
    reps = [Replicas(2, lay.region_bytes, dev) for _ in range(2)]
    bars = [_one_rank_barrier(dev, lanes=1) for _ in range(2)]
    kv_c, k_pe, k = inputs(150, seed=seed, device=dev)
    slots = make_slots(150, lay.num_blocks, seed=seed + 1, dtype=torch.int64).to(dev)
    exps = [rep.poison(seed + 2) for rep in reps]
    mla, idx = targets(reps[0], lay, my_rank=1, idx_kind=idx_kind, mla_kind=mla_kind)
    store_layer(mla, idx, kv_c, k_pe, k, slots, num_local_only=4)
    bars[0].arrive_and_wait(0)
    mla1, idx1 = targets(reps[1], lay, my_rank=1, idx_kind=idx_kind, mla_kind=mla_kind)
    publish_layer(mla1, idx1, kv_c, k_pe, k, slots, barrier=bars[1], lane=0, num_local_only=4)
    torch.cuda.synchronize()
    for a, b in zip(reps[0].bufs, reps[1].bufs, strict=True):
        assert torch.equal(a, b)
    expect_layer(exps[1], lay, 1, kv_c, k_pe, k, slots, kind=idx_kind, mla_kind=mla_kind, nlo=4)
    reps[1].assert_equal(exps[1])
    assert bars[0].epochs.tolist() == bars[1].epochs.tolist() == [1]
    assert mla1.error_counter.item() == idx1.error_counter.item() == 2
    for b in bars:
        b.close()


@requires_gpu
def test_publish_layer_mxfp8_is_byte_equal_to_store_layer_mxfp8_then_barrier(dev):
    _check_publish_layer_equals_store_layer_then_barrier(dev, make_inputs, 56, MX, "fp8_ds_mla")


@requires_gpu
def test_the_indexer_custom_ops_run_the_mxfp8_variant_eagerly(dev):
    lay = packed(3)
    rep = Replicas(2, lay.region_bytes, dev)
    mla, idx = targets(rep, lay, my_rank=1, idx_kind=MX)
    kv_c, k_pe, k = make_inputs(60, seed=59, device=dev)
    slots = make_slots(60, lay.num_blocks, seed=60, dtype=torch.int64).to(dev)
    exp = rep.poison(61)
    torch.ops.vmmkv.store_indexer_k(
        idx.cache, idx.error_counter, idx.ptr_table, idx.committed_bytes, k, slots, idx._layout(),
        5, True, MX,
    )  # fmt: skip
    expect_idx(exp, lay, 1, k, slots, nlo=5, kind=MX)
    rep.assert_equal(exp)
    exp = rep.poison(62)
    torch.ops.vmmkv.store_layer(
        mla.cache, mla.error_counter, idx.cache, idx.error_counter, mla.ptr_table,
        mla.committed_bytes, idx.ptr_table, idx.committed_bytes, kv_c, k_pe, k, slots,
        mla._layout(), idx._layout(), 0, True, MX,
    )  # fmt: skip
    expect_layer(exp, lay, 1, kv_c, k_pe, k, slots, kind=MX)
    rep.assert_equal(exp)


UE = "fp8_ds_mla_ue8m0"


def _mla_scales(region: torch.Tensor, lay: Layout, slots: torch.Tensor) -> torch.Tensor:
    """The 4 fp32 tile scales ``[n, 4]`` of every in-range slot's token in one replica."""
    s = slots.cpu().long()
    s = s[(s >= 0) & (s < lay.num_blocks * BS)]
    entries = mla_view(region.cpu(), lay)[s // BS, s % BS]
    return entries[:, 512:528].contiguous().view(torch.float32)


def _ue8m0_mla_inputs(tokens: int, seed: int, device):
    """``make_inputs`` plus the fp8_ds_mla_ue8m0 boundary tiles in tokens 10..14: amax 336
    (0.75 * 448: scale 1), 450 (the bf16 above 448: scale 2), 2^-5 (under the 1e-4 floor:
    2^-13), a NaN among values, an all-NaN tile (the floor), and +-inf (an inf scale)."""
    kv_c, k_pe, k = make_inputs(tokens, seed, device)
    kv_c[10, 0:128] = 1.0
    kv_c[10, 5] = 336.0
    kv_c[10, 128:256] = -3.0
    kv_c[10, 130] = 450.0
    kv_c[11, 0:128] = 2.0**-9
    kv_c[11, 7] = -(2.0**-5)
    kv_c[12, 300] = float("nan")
    kv_c[13, 384:512] = float("nan")
    kv_c[14, 40] = float("inf")
    kv_c[14, 200] = -float("inf")
    return kv_c, k_pe, k


@requires_gpu
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_store_ds_mla_ue8m0_writes_power_of_two_tile_scales_into_every_replica(
    dev, layout, slot_dtype
):
    lay = LAYOUTS[layout]
    rep = Replicas(3, lay.region_bytes, dev)
    mla, _ = targets(rep, lay, my_rank=1, mla_kind=UE)
    kv_c, k_pe, _ = _ue8m0_mla_inputs(200, seed=70, device=dev)
    slots = make_slots(190, lay.num_blocks, seed=71, dtype=slot_dtype).to(dev)  # inputs longer
    exp = rep.poison(72)
    raw = [b.clone() for b in exp]
    store_ds_mla(mla, kv_c, k_pe, slots)
    expect_mla(exp, lay, 1, kv_c, k_pe, slots, kind=UE)
    rep.assert_equal(exp)
    assert mla.error_counter.item() == n_out_of_range(slots, lay.num_blocks) == 2
    expect_mla(raw, lay, 1, kv_c, k_pe, slots)  # the raw rule's bytes: a real difference
    assert not torch.equal(raw[0], exp[0])
    for region in rep.regions:  # the scales themselves: powers of two (or inf), >= 2^-13
        scales = _mla_scales(region, lay, slots[:190])
        bits = scales.view(torch.int32)
        assert scales.shape[0] == 190 - 4 and ((bits & 0x807FFFFF) == 0).all()
        assert (scales >= 2.0**-13).all()
    ten = _mla_scales(rep.regions[0], lay, slots[10:15]).tolist()  # slots 10..14 are in range
    assert ten[0][:2] == [1.0, 2.0] and ten[1][0] == 2.0**-13 and ten[3][3] == 2.0**-13
    assert ten[4][0] == ten[4][1] == float("inf")


@requires_gpu
@pytest.mark.parametrize("idx_kind", ["indexer_k", MX])
def test_store_layer_ue8m0_writes_both_views_in_one_launch(dev, idx_kind):
    lay = interleaved(5)
    rep = Replicas(2, lay.region_bytes, dev)
    mla, idx = targets(rep, lay, my_rank=0, idx_kind=idx_kind, mla_kind=UE)
    kv_c, k_pe, k = _ue8m0_mla_inputs(150, seed=73, device=dev)
    slots = make_slots(150, lay.num_blocks, seed=74, dtype=torch.int32).to(dev)
    exp = rep.poison(75)
    store_layer(mla, idx, kv_c, k_pe, k, slots, num_local_only=9)
    expect_layer(exp, lay, 0, kv_c, k_pe, k, slots, kind=idx_kind, mla_kind=UE, nlo=9)
    rep.assert_equal(exp)
    assert mla.error_counter.item() == idx.error_counter.item() == 2


@requires_gpu
@pytest.mark.parametrize("idx_kind", ["indexer_k", MX])
def test_publish_layer_ue8m0_is_byte_equal_to_store_layer_ue8m0_then_barrier(dev, idx_kind):
    _check_publish_layer_equals_store_layer_then_barrier(dev, _ue8m0_mla_inputs, 76, idx_kind, UE)


@requires_gpu
def test_the_mla_custom_ops_run_the_ue8m0_variant_eagerly(dev):
    lay = packed(3)
    rep = Replicas(2, lay.region_bytes, dev)
    mla, idx = targets(rep, lay, my_rank=1, idx_kind=MX, mla_kind=UE)
    kv_c, k_pe, k = _ue8m0_mla_inputs(60, seed=79, device=dev)
    slots = make_slots(60, lay.num_blocks, seed=80, dtype=torch.int64).to(dev)
    exp = rep.poison(81)
    torch.ops.vmmkv.store_ds_mla(
        mla.cache, mla.error_counter, mla.ptr_table, mla.committed_bytes, kv_c, k_pe, slots,
        mla._layout(), 5, UE,
    )  # fmt: skip
    expect_mla(exp, lay, 1, kv_c, k_pe, slots, nlo=5, kind=UE)
    rep.assert_equal(exp)
    exp = rep.poison(82)
    torch.ops.vmmkv.store_layer(
        mla.cache, mla.error_counter, idx.cache, idx.error_counter, mla.ptr_table,
        mla.committed_bytes, idx.ptr_table, idx.committed_bytes, kv_c, k_pe, k, slots,
        mla._layout(), idx._layout(), 0, True, MX, UE,
    )  # fmt: skip
    expect_layer(exp, lay, 1, kv_c, k_pe, k, slots, kind=MX, mla_kind=UE)
    rep.assert_equal(exp)


@requires_gpu
def test_num_local_only_leading_tokens_reach_only_the_own_replica(dev):
    lay = packed(6)
    rep = Replicas(3, lay.region_bytes, dev)
    mla, idx = targets(rep, lay, my_rank=1)
    kv_c, k_pe, k = make_inputs(180, seed=10, device=dev)
    slots = make_slots(180, lay.num_blocks, seed=11, dtype=torch.int64).to(dev)
    exp = rep.poison(12)
    store_layer(mla, idx, kv_c, k_pe, k, slots, num_local_only=37)
    expect_layer(exp, lay, 1, kv_c, k_pe, k, slots, nlo=37)
    rep.assert_equal(exp)
    exp = rep.poison(13)
    store_ds_mla(mla, kv_c, k_pe, slots, num_local_only=180)  # all local
    expect_mla(exp, lay, 1, kv_c, k_pe, slots, nlo=180)
    rep.assert_equal(exp)


@requires_gpu
@pytest.mark.parametrize("vec16", [True, False])
def test_publish_rows_copies_rows_on_the_vector_and_the_byte_path(dev, vec16):
    width, entry_stride, offset = (656, 672, 4096) if vec16 else (100, 103, 4101)
    nb = 5
    region_bytes = offset + nb * BS * entry_stride + 64
    rep = Replicas(3, region_bytes, dev)
    views = [
        r.as_strided(
            (nb, BS, width), (BS * entry_stride, entry_stride, 1), r.storage_offset() + offset
        )
        for r in rep.regions
    ]
    target = KVTarget(
        "rows", rep.ptr_table, 0, offset, nb, BS, BS * entry_stride, entry_stride, width,
        rep.committed, torch.zeros(1, dtype=torch.int32, device=dev), views[0],
    )  # fmt: skip
    g = torch.Generator().manual_seed(14)
    rows = torch.randint(0, 256, (150, width), generator=g, dtype=torch.uint8).to(dev)
    slots = make_slots(140, nb, seed=15, dtype=torch.int32).to(dev)
    exp = rep.poison(16)
    publish_rows(target, rows, slots, num_local_only=9)
    for r, buf in enumerate(exp):
        start = 0 if r == 0 else 9
        region = buf[GUARD:-GUARD]
        view = region.as_strided(
            (nb, BS, width), (BS * entry_stride, entry_stride, 1), GUARD + offset
        )
        R.insert_rows(view, rows.cpu()[start:], slots.cpu()[start:])
    rep.assert_equal(exp)
    assert target.error_counter.item() == 2


@requires_gpu
def test_negative_and_out_of_range_slots_write_nothing_and_are_counted_exactly(dev):
    lay = packed(4)
    rep = Replicas(2, lay.region_bytes, dev)
    mla, idx = targets(rep, lay, my_rank=0)
    kv_c, k_pe, k = make_inputs(16, seed=17, device=dev)
    end = lay.num_blocks * BS
    for dtype, huge in ((torch.int32, 2**31 - 1), (torch.int64, 2**62)):
        slots = torch.tensor([-1, end, -5, end + 1, huge, -(2**30), end * 7, -1], dtype=dtype)
        exp = rep.poison(18)
        mla.error_counter.zero_()
        idx.error_counter.zero_()
        store_layer(mla, idx, kv_c, k_pe, k, slots.to(dev))
        rep.assert_equal(exp)
        assert mla.error_counter.item() == idx.error_counter.item() == 4


@requires_gpu
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_size", [1, 13, 48, 64, 528])
def test_store_layer_maps_slots_to_blocks_for_any_block_size(dev, block_size, slot_dtype):
    """The kernels shift a slot by log2 of a power-of-two block size and divide by any other
    (csrc dest_block_offset): both against the reference, every other test here using 64.
    Packed views of 7 blocks in 2 replicas (own rank 1, 5 leading tokens local only); up to 300
    random slots, padding, and out-of-range slots just past the end, a block further and, for
    int64, beyond 32 bits (the division's 64-bit path)."""
    bs, nb = block_size, 7
    mla_bytes = nb * bs * MLA
    rep = Replicas(2, mla_bytes + nb * bs * IDX, dev)

    def views(region):
        base = region.storage_offset()
        return (region.as_strided((nb, bs, MLA), (bs * MLA, MLA, 1), base),
                region.as_strided((nb, bs, IDX), (bs * IDX, IDX, 1), base + mla_bytes))  # fmt: skip

    own_mla, own_idx = views(rep.regions[1])
    counters = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(2)]
    mla = KVTarget("fp8_ds_mla", rep.ptr_table, 1, 0, nb, bs, bs * MLA, MLA, MLA, rep.committed,
                   counters[0], own_mla)  # fmt: skip
    idx = KVTarget("indexer_k", rep.ptr_table, 1, mla_bytes, nb, bs, bs * IDX, IDX, IDX,
                   rep.committed, counters[1], own_idx)  # fmt: skip
    g = torch.Generator().manual_seed(80 + bs)
    end = nb * bs
    slots = torch.randperm(end, generator=g)[:300].to(torch.int64)
    far = [end, end + bs, 2**31 - 1] + ([2**40 + 3] if slot_dtype == torch.int64 else [])
    slots = torch.cat([slots, torch.tensor([-1, -9] + far)])
    slots = slots[torch.randperm(slots.numel(), generator=g)]
    kv_c, k_pe, k = make_inputs(slots.numel(), seed=81, device=dev)
    exp = rep.poison(82)
    store_layer(mla, idx, kv_c, k_pe, k, slots.to(slot_dtype).to(dev), num_local_only=5)
    for r, buf in enumerate(exp):
        start = 0 if r == 1 else 5
        ev = views(buf[GUARD:-GUARD])
        R.insert_ds_mla(ev[0], kv_c.cpu()[start:], k_pe.cpu()[start:], slots[start:])
        R.insert_indexer_k(ev[1], k.cpu()[start:], slots[start:], True)
    rep.assert_equal(exp)
    assert [int(c.item()) for c in counters] == [len(far)] * 2


# ---------------------------------------------------------------------------------------------
# Prefill-shaped slot mappings: requests of consecutive slots (what an engine's prefill writes),
# where every test above draws random slots. A store kernel that treats runs of consecutive
# slots apart (branch exp/run-staging stages a CTA's 8 tokens and writes whole lines; main
# writes every token alone) must give the same bytes and counts on them.


def shifted(num_blocks: int, shift: int) -> Layout:
    """``packed`` moved ``shift`` bytes into the region: block bases off the 128-byte lines."""
    mla = num_blocks * BS * MLA
    return Layout(
        num_blocks, shift, BS * MLA, shift + mla, BS * IDX, shift + mla + num_blocks * BS * IDX
    )


RUN_LAYOUTS = {"packed": packed(120), "interleaved": interleaved(120), "shifted": shifted(120, 80)}


def run_slots(num_blocks: int, seed: int) -> tuple[torch.Tensor, int]:
    """A prefill-shaped slot mapping of 6003 tokens (int64, CPU) and its ``num_local_only``.

    Requests of consecutive slots, as vLLM's block tables give them: one from slot 0 (every
    group a run, aligned to 8 slots), one starting 3 slots into a block (runs off the 8-slot
    grid, groups that cross a block end), one whose tokens start mid-group; isolated random
    slots between and after them; a padding slot, an out-of-range slot and a slot out of
    sequence inside runs; ``num_local_only`` = 13 splits the second group of 8 tokens. Every slot is
    used at most once. More tokens than one wave of resident CTAs covers (the loop strides)."""
    g = torch.Generator().manual_seed(seed)
    parts = [
        torch.arange(0, 1000),  # tokens [0, 1000): slots [0, 1000)
        torch.arange(20 * BS + 3, 20 * BS + 3 + 700),  # [1000, 1700)
        torch.tensor([-7] * 5),  # [1700, 1705): random, filled below
        torch.arange(40 * BS, 40 * BS + 2000),  # [1705, 3705)
        torch.tensor([-7] * 300),  # [3705, 4005): random
        torch.arange(80 * BS, 80 * BS + 1998),  # [4005, 6003)
    ]
    slots = torch.cat(parts).to(torch.int64)
    used = set(slots[slots >= 0].tolist())
    pool = torch.tensor(
        [s for s in torch.randperm(num_blocks * BS, generator=g).tolist() if s not in used]
    )
    holes = (slots == -7).nonzero().flatten()
    slots[holes] = pool[: holes.numel()]
    slots[2003] = -1  # padding inside a run group
    slots[2501] = num_blocks * BS + 5  # out of range inside a run group
    slots[3001] = int(pool[holes.numel()])  # an unused slot breaking a group's run
    assert slots.numel() == 6003 and slots[slots >= 0].unique().numel() == int((slots >= 0).sum())
    return slots, 13


def _run_case(dev, layout, slot_dtype, seed, first_uncommitted_block=None):
    lay = RUN_LAYOUTS[layout]
    rep = Replicas(3, lay.region_bytes, dev)
    slots, nlo = run_slots(lay.num_blocks, seed)
    kv_c, k_pe, k = make_inputs(slots.numel(), seed=seed + 1, device=dev)
    if first_uncommitted_block is not None:  # interleaved: one stride for both views
        # block b of the MLA view ends at idx_offset + b * stride, of the indexer view 8448
        # bytes later: one byte short of block `first`'s MLA end leaves both views' block
        # `first` uncommitted and block `first - 1` committed
        rep.committed.fill_(lay.idx_offset + first_uncommitted_block * lay.idx_stride - 1)
    return lay, rep, slots.to(slot_dtype).to(dev), nlo, (kv_c, k_pe, k)


@requires_gpu
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", sorted(RUN_LAYOUTS))
def test_store_ds_mla_runs_of_consecutive_slots_write_reference_bytes(dev, layout, slot_dtype):
    lay, rep, slots, nlo, (kv_c, k_pe, _) = _run_case(dev, layout, slot_dtype, seed=60)
    mla, _ = targets(rep, lay, my_rank=2)
    exp = rep.poison(62)
    store_ds_mla(mla, kv_c, k_pe, slots, num_local_only=nlo)
    expect_mla(exp, lay, 2, kv_c, k_pe, slots, nlo=nlo)
    rep.assert_equal(exp)
    assert mla.error_counter.item() == n_out_of_range(slots, lay.num_blocks) == 1


@requires_gpu
@pytest.mark.parametrize(
    "mla_kind,idx_kind,ue8m0",
    [("fp8_ds_mla", "indexer_k", False), ("fp8_ds_mla", "indexer_k", True),
     ("fp8_ds_mla_ue8m0", MX, True)],
)  # fmt: skip
@pytest.mark.parametrize("layout", sorted(RUN_LAYOUTS))
def test_store_layer_runs_of_consecutive_slots_write_reference_bytes(
    dev, layout, mla_kind, idx_kind, ue8m0
):
    lay, rep, slots, nlo, (kv_c, k_pe, k) = _run_case(dev, layout, torch.int64, seed=63)
    mla, idx = targets(rep, lay, my_rank=0, idx_kind=idx_kind, mla_kind=mla_kind)
    exp = rep.poison(65)
    store_layer(mla, idx, kv_c, k_pe, k, slots, num_local_only=nlo, ue8m0=ue8m0)
    expect_mla(exp, lay, 0, kv_c, k_pe, slots, nlo=nlo, kind=mla_kind)
    expect_idx(exp, lay, 0, k, slots, nlo=nlo, ue8m0=ue8m0, kind=idx_kind)
    rep.assert_equal(exp)
    assert mla.error_counter.item() == idx.error_counter.item() == 1


@requires_gpu
def test_runs_in_uncommitted_blocks_are_skipped_and_counted_per_token(dev):
    """Interleaved views: blocks >= 100 of both views lie beyond the committed bytes, and the
    last request's run crosses that limit (its slots reach block 111): each token past it is
    skipped and counted, once per view; the tokens below it are written."""
    lay, rep, slots, nlo, (kv_c, k_pe, k) = _run_case(dev, "interleaved", torch.int64, seed=66,
                                                      first_uncommitted_block=100)  # fmt: skip
    mla, idx = targets(rep, lay, my_rank=1)
    exp = rep.poison(68)
    store_layer(mla, idx, kv_c, k_pe, k, slots, num_local_only=nlo)
    expect_layer(exp, lay, 1, kv_c, k_pe, k, slots, nlo=nlo, first_uncommitted_block=100)
    rep.assert_equal(exp)
    bad = n_out_of_range(slots, 100)  # slots in blocks >= 100, out of range or uncommitted
    assert bad > 300
    assert mla.error_counter.item() == idx.error_counter.item() == bad


@requires_gpu
def test_publish_layer_runs_are_byte_equal_to_store_layer_then_barrier(dev):
    from vmmkv.ops import publish_layer

    lay, rep, slots, nlo, (kv_c, k_pe, k) = _run_case(dev, "packed", torch.int64, seed=69)
    reps = [rep, Replicas(3, lay.region_bytes, dev)]
    targets_ = [targets(r, lay, my_rank=1, mla_kind="fp8_ds_mla_ue8m0", idx_kind=MX) for r in reps]
    bars = [_one_rank_barrier(dev, lanes=1) for _ in reps]
    exps = [rep.poison(71) for rep in reps]
    store_layer(*targets_[0], kv_c, k_pe, k, slots, num_local_only=nlo)
    bars[0].arrive_and_wait(0)
    publish_layer(*targets_[1], kv_c, k_pe, k, slots, barrier=bars[1], lane=0, num_local_only=nlo)
    torch.cuda.synchronize()
    for a, b in zip(reps[0].bufs, reps[1].bufs, strict=True):
        assert torch.equal(a, b)
    expect_layer(exps[1], lay, 1, kv_c, k_pe, k, slots, kind=MX, mla_kind="fp8_ds_mla_ue8m0",
                 nlo=nlo)  # fmt: skip
    reps[1].assert_equal(exps[1])
    assert bars[1].epochs.tolist() == [1]
    for b in bars:
        b.close()


@requires_gpu
def test_blocks_beyond_committed_bytes_are_skipped_counted_and_written_after_growth(dev):
    lay = packed(6)
    rep = Replicas(2, lay.region_bytes, dev)
    mla, idx = targets(rep, lay, my_rank=0)
    kv_c, k_pe, k = make_inputs(200, seed=19, device=dev)
    slots = make_slots(200, lay.num_blocks, seed=20, dtype=torch.int64).to(dev)
    # MLA blocks 0..2 fit (block 2 ends exactly at the limit), 3.. do not; the indexer view
    # lies entirely beyond the limit
    rep.committed.fill_(lay.mla_offset + 3 * lay.mla_stride)
    exp = rep.poison(21)
    store_layer(mla, idx, kv_c, k_pe, k, slots)
    expect_mla(exp, lay, 0, kv_c, k_pe, slots, first_uncommitted_block=3)
    rep.assert_equal(exp)
    s = slots.cpu()
    valid = s >= 0
    assert mla.error_counter.item() == int((valid & (s >= 3 * BS)).sum())
    assert idx.error_counter.item() == int(valid.sum())

    rep.committed.fill_(lay.region_bytes)  # the cache grew: same targets, same launch arguments
    mla.error_counter.zero_()
    idx.error_counter.zero_()
    exp = rep.poison(22)
    store_layer(mla, idx, kv_c, k_pe, k, slots)
    expect_layer(exp, lay, 0, kv_c, k_pe, k, slots)
    rep.assert_equal(exp)
    assert mla.error_counter.item() == idx.error_counter.item() == 2


@requires_gpu
def test_misaligned_inputs_are_rejected_before_launch(dev):
    lay = packed(2)
    rep = Replicas(1, lay.region_bytes, dev)
    mla, idx = targets(rep, lay, my_rank=0)
    raw = torch.zeros(4, 584, dtype=torch.bfloat16, device=dev)
    kv_c, k_pe = raw[:, 4:516], raw[:, 516:580]  # 8-byte offset
    slots = torch.zeros(4, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="kv_c rows must be 16-byte aligned"):
        store_ds_mla(mla, kv_c, k_pe, slots)
    with pytest.raises(ValueError, match="k rows must be 8-byte aligned"):
        store_indexer_k(idx, raw[:, 2:130], slots)


@requires_gpu
def test_reference_gives_the_same_bytes_on_cuda_and_cpu(dev):
    kv_c, k_pe, k = make_inputs(64, seed=23, device=dev)
    for kind in ("fp8_ds_mla", "fp8_ds_mla_ue8m0"):
        assert torch.equal(
            R.quantize_ds_mla(kv_c, k_pe, kind=kind).cpu(),
            R.quantize_ds_mla(kv_c.cpu(), k_pe.cpu(), kind=kind),
        )
    for ue8m0 in (True, False):
        v_gpu, s_gpu = R.quantize_indexer_k(k, ue8m0)
        v_cpu, s_cpu = R.quantize_indexer_k(k.cpu(), ue8m0)
        assert torch.equal(v_gpu.cpu(), v_cpu) and torch.equal(s_gpu.cpu(), s_cpu)


@requires_gpu
def test_nonfinite_inputs_give_the_reference_bytes(dev):
    lay = packed(2)
    rep = Replicas(1, lay.region_bytes, dev)
    mla, idx = targets(rep, lay, my_rank=0)
    kv_c, k_pe, k = make_inputs(16, seed=24, device=dev)
    kv_c[0, 3] = float("nan")
    kv_c[1, 200] = float("inf")
    kv_c[2, 300] = -float("inf")
    k[3, 7] = float("nan")
    k[4, 9] = -float("inf")
    slots = torch.arange(16, dtype=torch.int64, device=dev)
    exp = rep.poison(25)
    store_layer(mla, idx, kv_c, k_pe, k, slots)
    expect_layer(exp, lay, 0, kv_c, k_pe, k, slots)
    rep.assert_equal(exp)


@requires_gpu
def test_custom_ops_run_eagerly_and_refuse_a_copied_cache(dev):
    lay = packed(3)
    rep = Replicas(2, lay.region_bytes, dev)
    mla, _ = targets(rep, lay, my_rank=1)
    kv_c, k_pe, _ = make_inputs(60, seed=26, device=dev)
    slots = make_slots(60, lay.num_blocks, seed=27, dtype=torch.int64).to(dev)
    exp = rep.poison(28)
    args = (mla.error_counter, mla.ptr_table, mla.committed_bytes, kv_c, k_pe, slots, mla._layout())
    torch.ops.vmmkv.store_ds_mla(mla.cache, *args, 5)
    expect_mla(exp, lay, 1, kv_c, k_pe, slots, nlo=5)
    rep.assert_equal(exp)
    with pytest.raises(RuntimeError, match="replaced the mutated cache by a copy"):
        torch.ops.vmmkv.store_ds_mla(mla.cache.clone(), *args, 5)


@requires_gpu
def test_the_build_without_cuda_headers_gives_the_same_bytes(dev, tmp_path):
    script = textwrap.dedent(
        """
        import torch
        from vmmkv.ops import build
        from tests.test_kernels_gpu import (
            Replicas, expect_idx, expect_mla, make_inputs, make_slots, packed, targets,
        )
        from vmmkv.ops.kv import store_layer

        assert build.cuda_include_dir() is None
        dev = torch.device("cuda", 0)
        lay = packed(4)
        rep = Replicas(2, lay.region_bytes, dev)
        mla, idx = targets(rep, lay, my_rank=0)
        kv_c, k_pe, k = make_inputs(200, seed=29, device=dev)
        slots = make_slots(200, lay.num_blocks, seed=30, dtype=torch.int64).to(dev)
        exp = rep.poison(31)
        store_layer(mla, idx, kv_c, k_pe, k, slots)
        expect_mla(exp, lay, 0, kv_c, k_pe, slots)
        expect_idx(exp, lay, 0, k, slots)
        rep.assert_equal(exp)
        rep2 = Replicas(2, lay.region_bytes, dev)
        mla2, idx2 = targets(rep2, lay, my_rank=1, idx_kind="indexer_k_mxfp8")
        exp2 = rep2.poison(32)
        store_layer(mla2, idx2, kv_c, k_pe, k, slots)
        expect_mla(exp2, lay, 1, kv_c, k_pe, slots)
        expect_idx(exp2, lay, 1, k, slots, kind="indexer_k_mxfp8")
        rep2.assert_equal(exp2)
        rep3 = Replicas(2, lay.region_bytes, dev)
        mla3, idx3 = targets(rep3, lay, my_rank=0, mla_kind="fp8_ds_mla_ue8m0")
        exp3 = rep3.poison(33)
        store_layer(mla3, idx3, kv_c, k_pe, k, slots)
        expect_mla(exp3, lay, 0, kv_c, k_pe, slots, kind="fp8_ds_mla_ue8m0")
        expect_idx(exp3, lay, 0, k, slots)
        rep3.assert_equal(exp3)
        print("BUILTIN-CONVERSION-OK")
        """
    )
    run = _run_python(dev, script, VMMKV_CUDA_INCLUDE="none")
    assert run.returncode == 0 and "BUILTIN-CONVERSION-OK" in run.stdout, run.stdout + run.stderr


def _pythonpath() -> str:
    return os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


def _run_python(dev, script: str, **env) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter from the repository root, on ``dev``'s GPU unless
    CUDA_VISIBLE_DEVICES is already set, with ``env`` added; output captured, 300 s at most."""
    env = dict(os.environ, PYTHONPATH=_pythonpath(), **env)
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", str(dev.index))
    return subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


# the end of a barrier-timeout script: two ranks' signals, then (after the script's own barrier
# and launch) synchronize, report how that went and the barrier's diagnostic, and exit
_TWO_RANK_SIGNALS = """
sigs = [torch.zeros(2 * 2 * 2, dtype=torch.int32, device=dev) for _ in range(2)]
table = torch.tensor([s.data_ptr() for s in sigs], dtype=torch.int64, device=dev)
"""
_SYNCHRONIZE_AND_REPORT = """
try:
    torch.cuda.synchronize()
    print("SYNCHRONIZE-RETURNED", flush=True)
except Exception as exc:
    print("SYNCHRONIZE-FAILED", type(exc).__name__, flush=True)
print("DIAG", bar.read_diagnostic(), flush=True)
os._exit(3)
"""


def _barrier_timeout_output(dev, setup: str, launch: str) -> str:
    """Run ``setup`` + the two ranks' signals + ``launch`` (which makes ``bar`` wait for a rank
    that never comes) in a fresh process: synchronize must fail and the process must die.
    Returns its output (with the barrier's diagnostic line)."""
    script = textwrap.dedent(setup) + _TWO_RANK_SIGNALS + textwrap.dedent(launch)
    run = _run_python(dev, script + _SYNCHRONIZE_AND_REPORT)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "SYNCHRONIZE-FAILED" in out, out
    return out


# ---------------------------------------------------------------------------------------------
# CUDA graphs


@requires_gpu
def test_captured_stores_and_barrier_replay_byte_exact_and_follow_committed_growth(dev):
    lay = interleaved(5)
    rep = Replicas(1, lay.region_bytes, dev)
    mla, idx = targets(rep, lay, my_rank=0)
    sig = torch.zeros(2 * 2 * 1, dtype=torch.int32, device=dev)
    sig_table = torch.tensor([sig.data_ptr()], dtype=torch.int64, device=dev)
    bar = DeviceBarrier(sig_table, None, rank=0, world=1, lanes=2, device=dev)
    kv_c, k_pe, k = (t.clone() for t in make_inputs(120, seed=32, device=dev))
    slots = make_slots(120, lay.num_blocks, seed=33, dtype=torch.int64).to(dev)
    kv_c2, k_pe2, _ = (t.clone() for t in make_inputs(30, seed=34, device=dev))
    slots2 = torch.zeros(30, dtype=torch.int32, device=dev)

    bar.arrive_and_wait(0)  # loads the kernels; epochs now [1, 0]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_layer(mla, idx, kv_c, k_pe, k, slots)
        bar.arrive_and_wait(0)
        torch.ops.vmmkv.store_ds_mla(
            mla.cache, mla.error_counter, mla.ptr_table, mla.committed_bytes, kv_c2, k_pe2,
            slots2, mla._layout(), 0,
        )  # fmt: skip
        bar.arrive_and_wait(1)

    for round_, limit in enumerate([None, 2, None]):
        fresh = make_inputs(120, seed=40 + round_, device=dev)
        for static, new in zip((kv_c, k_pe, k), fresh, strict=True):
            static.copy_(new)
        slots.copy_(make_slots(120, lay.num_blocks, seed=50 + round_, dtype=torch.int64))
        extra = make_inputs(30, seed=60 + round_, device=dev)
        kv_c2.copy_(extra[0])
        k_pe2.copy_(extra[1])
        # second store: its own slots, disjoint from the first (blocks 4.. of the view)
        slots2.copy_(torch.randperm(BS)[:30].to(torch.int32) + 4 * BS)
        slots[slots >= 4 * BS] = -1
        rep.committed.fill_(
            lay.region_bytes if limit is None else lay.mla_offset + limit * lay.mla_stride
        )
        mla.error_counter.zero_()
        exp = rep.poison(70 + round_)
        graph.replay()
        expect_layer(exp, lay, 0, kv_c, k_pe, k, slots, first_uncommitted_block=limit)
        expect_mla(exp, lay, 0, kv_c2, k_pe2, slots2, first_uncommitted_block=limit)
        rep.assert_equal(exp)
        assert bar.epochs.tolist() == [2 + round_, 1 + round_]
    bar.close()


# ---------------------------------------------------------------------------------------------
# Barrier


def _two_ranks(dev, lanes: int, timeout_s: float = 5.0):
    world = 2
    sigs = [torch.zeros(lanes * 2 * world, dtype=torch.int32, device=dev) for _ in range(world)]
    table = torch.tensor([s.data_ptr() for s in sigs], dtype=torch.int64, device=dev)
    bars = [
        DeviceBarrier(
            table, None, rank=r, world=world, lanes=lanes, device=dev, timeout_s=timeout_s
        )
        for r in range(world)
    ]
    streams = [torch.cuda.Stream(dev) for _ in range(world)]
    return sigs, bars, streams


@requires_gpu
def test_two_ranks_on_two_streams_pass_barriers_and_lanes_count_independently(dev):
    sigs, bars, streams = _two_ranks(dev, lanes=3)
    plan = [0, 0, 2, 0, 2, 0]  # lane 1 never used
    for lane in plan:
        for r in (0, 1):
            with torch.cuda.stream(streams[r]):
                bars[r].arrive_and_wait(lane)
    torch.cuda.synchronize()
    want = [plan.count(lane) for lane in range(3)]
    for r in (0, 1):
        assert bars[r].epochs.tolist() == want
        assert bars[r].read_diagnostic() is None
        s = sigs[r].view(3, 2, 2).cpu()
        assert s[0, want[0] & 1].tolist() == [want[0]] * 2  # last epoch, from both ranks
        assert s[0, (want[0] - 1) & 1].tolist() == [want[0] - 1] * 2
        assert s[1].eq(0).all()
    for b in bars:
        b.close()
        b.close()  # idempotent


@requires_gpu
def test_stores_before_the_barrier_are_visible_to_the_peer_after_it(dev):
    lay = packed(4)
    rep = Replicas(2, lay.region_bytes, dev)
    mla0, _ = targets(rep, lay, my_rank=0)  # rank 0 writes both replicas
    sigs, bars, streams = _two_ranks(dev, lanes=1)
    kv_c, k_pe, _ = make_inputs(256, seed=80, device=dev)
    slots = torch.randperm(lay.num_blocks * BS)[:256].to(dev)
    exp = rep.poison(81)
    expect_mla(exp, lay, 0, kv_c, k_pe, slots)
    seen = torch.empty_like(rep.bufs[1])
    # load torch's sleep kernel now: lazy module loading while a barrier spins would wait for it
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    with torch.cuda.stream(streams[1]):  # rank 1 waits at the barrier, then reads its replica
        bars[1].arrive_and_wait(0)
        seen.copy_(rep.bufs[1])
    with torch.cuda.stream(streams[0]):
        torch.cuda._sleep(50_000_000)  # make rank 1 wait for real
        store_ds_mla(mla0, kv_c, k_pe, slots)
        bars[0].arrive_and_wait(0)
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), exp[1])


@requires_gpu
def test_a_barrier_collected_during_a_graph_capture_leaves_the_capture_valid(dev):
    """A barrier dropped without close() (here: in a reference cycle, so only the cyclic
    collector frees it) and collected while a stream captures: its page is queued, not freed
    under the capture (cuMemFreeHost there invalidates it), and the next barrier frees it."""
    import gc

    from vmmkv.ops import barrier_control

    gc.collect()  # earlier tests' garbage goes outside the capture
    sigs, bars, streams = _two_ranks(dev, lanes=1)  # (construction frees what it queued)
    pages = {b._host_ptr for b in bars}
    gc.disable()  # the collection below is the one inside the capture
    try:
        bars[0].cycle = bars[0]
        bars.clear()
        x = torch.zeros(4, device=dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            x.add_(1)
            gc.collect()  # the barrier in the cycle goes here
    finally:
        gc.enable()
    g.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [1.0] * 4
    assert pages <= {p for p, _ in barrier_control._dropped}
    kept = _two_ranks(dev, lanes=1)  # construction frees the queued pages
    assert not pages & {p for p, _ in barrier_control._dropped}
    del kept


@requires_gpu
def test_barrier_lanes_interleave_eagerly_and_in_captured_graphs(dev):
    sigs, bars, streams = _two_ranks(dev, lanes=2)
    for r in (0, 1):  # load the kernels before capture
        with torch.cuda.stream(streams[r]):
            bars[r].arrive_and_wait(1)
    torch.cuda.synchronize()
    graphs = []
    for r in (0, 1):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            bars[r].arrive_and_wait(0)
            bars[r].arrive_and_wait(1)
            bars[r].arrive_and_wait(0)
        graphs.append(g)
    torch.cuda.synchronize()
    assert [b.epochs.tolist() for b in bars] == [[0, 1], [0, 1]]  # capture ran nothing
    for step in range(3):
        for r in (0, 1):
            with torch.cuda.stream(streams[r]):
                graphs[r].replay()
                bars[r].arrive_and_wait(step % 2)
    torch.cuda.synchronize()
    want = [
        6 + 2,
        1 + 3 + 1,
    ]  # lane 0: 2 per replay + steps 0, 2; lane 1: 1 + 1 per replay + step 1
    assert [b.epochs.tolist() for b in bars] == [want, want]
    assert all(b.read_diagnostic() is None for b in bars)


@requires_gpu
def test_with_the_opt_in_trap_a_missing_peer_times_out_with_a_diagnostic_and_kills_the_process(
    dev,
):
    setup = """
        import os, torch
        from vmmkv.ops.barrier import DeviceBarrier
        dev = torch.device("cuda", 0)
        """
    launch = """
        bar = DeviceBarrier(table, None, rank=0, world=2, lanes=2, device=dev, timeout_s=0.2,
                            trap=True)  # the opt-in trap
        bar.arrive_and_wait(lane=1)  # rank 1 never arrives
        """
    out = _barrier_timeout_output(dev, setup, launch)
    assert "DIAG vmmkv barrier timeout: lane=1 rank=0 missing peer=1 epoch=1 observed=0" in out, out


# ---------------------------------------------------------------------------------------------
# torch.compile


@requires_gpu
def test_torch_compile_keeps_store_then_barrier_then_read_in_order(dev):
    lay = packed(3)
    rep = Replicas(1, lay.region_bytes, dev)
    mla, _ = targets(rep, lay, my_rank=0)
    sig = torch.zeros(2, dtype=torch.int32, device=dev)
    table = torch.tensor([sig.data_ptr()], dtype=torch.int64, device=dev)
    bar = DeviceBarrier(table, None, rank=0, world=1, lanes=1, device=dev, fence=[mla.cache])
    kv_c, k_pe, _ = make_inputs(100, seed=90, device=dev)
    slots = make_slots(100, lay.num_blocks, seed=91, dtype=torch.int64).to(dev)

    def step(kv_c, k_pe, slots):
        store_ds_mla(mla, kv_c, k_pe, slots)
        bar.arrive_and_wait(0)
        return mla.cache.sum(dtype=torch.int64)

    compiled = torch.compile(step, fullgraph=True)
    for seed in (92, 93):
        exp = rep.poison(seed)
        got = compiled(kv_c, k_pe, slots)
        expect_mla(exp, lay, 0, kv_c, k_pe, slots)
        rep.assert_equal(exp)
        want = mla_view(exp[0][GUARD:-GUARD], lay).sum(dtype=torch.int64)
        assert got.item() == want.item()
    assert bar.epochs.tolist() == [2]


# ---------------------------------------------------------------------------------------------
# Prepared stores (vmmkv.ops.prepare) and one launch per layer (stores + barrier)


def _one_rank_barrier(dev, lanes: int = 2, **kw) -> DeviceBarrier:
    sig = torch.zeros(lanes * 2 * 1, dtype=torch.int32, device=dev)
    table = torch.tensor([sig.data_ptr()], dtype=torch.int64, device=dev)
    bar = DeviceBarrier(table, None, rank=0, world=1, lanes=lanes, device=dev, **kw)
    bar._test_signals = sig  # keep the signal memory alive with the barrier
    return bar


ROW_WIDTH, ROW_STRIDE, ROW_OFFSET = 656, 672, 4096


def _rows_setup(rep: Replicas, nb: int, my_rank: int) -> KVTarget:
    view = rep.regions[my_rank].as_strided(
        (nb, BS, ROW_WIDTH), (BS * ROW_STRIDE, ROW_STRIDE, 1),
        rep.regions[my_rank].storage_offset() + ROW_OFFSET,
    )  # fmt: skip
    return KVTarget(
        "rows", rep.ptr_table, my_rank, ROW_OFFSET, nb, BS, BS * ROW_STRIDE, ROW_STRIDE,
        ROW_WIDTH, rep.committed, torch.zeros(1, dtype=torch.int32, device=dev_of(rep)), view,
    )  # fmt: skip


def dev_of(rep: Replicas) -> torch.device:
    return rep.ptr_table.device


def _expect_rows(exp, nb, my_rank, rows, slots, nlo=0):
    for r, buf in enumerate(exp):
        start = 0 if r == my_rank else nlo
        region = buf[GUARD:-GUARD]
        view = region.as_strided(
            (nb, BS, ROW_WIDTH), (BS * ROW_STRIDE, ROW_STRIDE, 1),
            region.storage_offset() + ROW_OFFSET,
        )  # fmt: skip
        R.insert_rows(view, rows.cpu()[start:], slots.cpu()[start:])


class _Case:
    """One store call of a kind: its targets, inputs and expected bytes."""

    def __init__(self, kind: str, dev, tokens: int, seed: int, slot_dtype=torch.int64, nlo=0,
                 my_rank=1, dests=3):  # fmt: skip
        self.kind, self.nlo, self.my_rank = kind, nlo, my_rank
        if kind == "rows":
            self.nb = 5
            self.rep = Replicas(dests, ROW_OFFSET + self.nb * BS * ROW_STRIDE + 64, dev)
            self.targets = (_rows_setup(self.rep, self.nb, my_rank),)
            g = torch.Generator().manual_seed(seed)
            self.inputs = (torch.randint(0, 256, (tokens + 3, ROW_WIDTH), generator=g,
                                         dtype=torch.uint8).to(dev),)  # fmt: skip
        else:
            self.lay = interleaved(5)
            self.nb = self.lay.num_blocks
            self.rep = Replicas(dests, self.lay.region_bytes, dev)
            self.idx_kind = "indexer_k_mxfp8" if kind.endswith("mxfp8") else "indexer_k"
            self.mla_kind = "fp8_ds_mla_ue8m0" if "ue8m0" in kind else "fp8_ds_mla"
            mla, idx = targets(self.rep, self.lay, my_rank=my_rank, idx_kind=self.idx_kind,
                               mla_kind=self.mla_kind)  # fmt: skip
            kv_c, k_pe, k = make_inputs(tokens + 3, seed=seed, device=dev)
            self.targets, self.inputs = {
                "fp8_ds_mla": ((mla,), (kv_c, k_pe)),
                "indexer_k": ((idx,), (k,)),
                "layer": ((mla, idx), (kv_c, k_pe, k)),
                "indexer_k_mxfp8": ((idx,), (k,)),
                "layer_mxfp8": ((mla, idx), (kv_c, k_pe, k)),
                "fp8_ds_mla_ue8m0": ((mla,), (kv_c, k_pe)),
                "layer_ue8m0": ((mla, idx), (kv_c, k_pe, k)),
                "layer_ue8m0_mxfp8": ((mla, idx), (kv_c, k_pe, k)),
            }[kind]
        self.slots = make_slots(tokens, self.nb, seed=seed + 1, dtype=slot_dtype).to(dev)

    def expect(self, exp) -> None:
        ins, s, r, nlo = self.inputs, self.slots, self.my_rank, self.nlo
        if self.kind == "rows":
            _expect_rows(exp, self.nb, r, ins[0], s, nlo)
        if self.kind.startswith(("fp8_ds_mla", "layer")):
            expect_mla(exp, self.lay, r, ins[0], ins[1], s, nlo=nlo, kind=self.mla_kind)
        if self.kind.startswith(("indexer_k", "layer")):
            expect_idx(exp, self.lay, r, ins[-1], s, nlo=nlo, kind=self.idx_kind)

    def counters_ok(self) -> bool:
        return all(t.error_counter.item() == 2 for t in self.targets)


KINDS_UNDER_TEST = ["fp8_ds_mla", "indexer_k", "layer", "rows", "indexer_k_mxfp8", "layer_mxfp8",
                    "fp8_ds_mla_ue8m0", "layer_ue8m0", "layer_ue8m0_mxfp8"]  # fmt: skip


@requires_gpu
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("kind", KINDS_UNDER_TEST)
def test_prepared_store_writes_the_reference_bytes_for_every_kind(dev, kind, slot_dtype):
    from vmmkv.ops import prepare

    case = _Case(kind, dev, tokens=150, seed=100, slot_dtype=slot_dtype, nlo=7)
    p = prepare(case.targets)
    exp = case.rep.poison(101)
    p.store(case.inputs, case.slots, 7)
    case.expect(exp)
    case.rep.assert_equal(exp)
    assert case.counters_ok()


@requires_gpu
@pytest.mark.parametrize("kind", KINDS_UNDER_TEST)
def test_prepared_publish_stores_the_same_bytes_and_passes_the_lane_once(dev, kind):
    from vmmkv.ops import prepare

    case = _Case(kind, dev, tokens=150, seed=110, nlo=4)
    bar = _one_rank_barrier(dev, lanes=2)
    p = prepare(case.targets)
    exp = case.rep.poison(111)
    p.publish(case.inputs, case.slots, 4, bar, 1)
    case.expect(exp)
    case.rep.assert_equal(exp)
    assert case.counters_ok()
    assert bar.epochs.tolist() == [0, 1] and bar.arrivals.tolist() == [0, 0]
    assert bar._test_signals.view(2, 2).tolist() == [[0, 0], [0, 1]]  # lane 1, parity 1
    bar.close()


@requires_gpu
def test_publish_layer_is_byte_equal_to_store_layer_then_barrier(dev):
    from vmmkv.ops import publish_layer

    lay = interleaved(5)
    reps = [Replicas(2, lay.region_bytes, dev) for _ in range(2)]
    bars = [_one_rank_barrier(dev, lanes=1) for _ in range(2)]
    kv_c, k_pe, k = make_inputs(150, seed=120, device=dev)
    slots = make_slots(150, lay.num_blocks, seed=121, dtype=torch.int64).to(dev)
    exps = [rep.poison(122) for rep in reps]
    assert all(torch.equal(a, b) for a, b in zip(exps[0], exps[1], strict=True))
    mla, idx = targets(reps[0], lay, my_rank=0)
    store_layer(mla, idx, kv_c, k_pe, k, slots, num_local_only=3)
    bars[0].arrive_and_wait(0)
    mla1, idx1 = targets(reps[1], lay, my_rank=0)
    publish_layer(mla1, idx1, kv_c, k_pe, k, slots, barrier=bars[1], lane=0, num_local_only=3)
    torch.cuda.synchronize()
    for a, b in zip(reps[0].bufs, reps[1].bufs, strict=True):
        assert torch.equal(a, b)
    expect_mla(exps[0], lay, 0, kv_c, k_pe, slots, nlo=3)
    expect_idx(exps[0], lay, 0, k, slots, nlo=3)
    reps[0].assert_equal(exps[0])
    assert bars[0].epochs.tolist() == bars[1].epochs.tolist() == [1]
    assert mla1.error_counter.item() == idx1.error_counter.item() == 2
    for b in bars:
        b.close()


@requires_gpu
def test_publish_of_more_tokens_than_resident_warps_loops_and_resets_the_arrival_counter(dev):
    from vmmkv.ops import prepare

    lay = packed(400)  # 25600 slots
    rep = Replicas(2, lay.region_bytes, dev)
    mla, idx = targets(rep, lay, my_rank=0)
    bar = _one_rank_barrier(dev, lanes=1)
    p = prepare((mla, idx))
    # the grid is capped at the resident CTAs (at least one per SM), so at 20000 tokens every
    # warp stores several tokens and every resident CTA arrives
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    assert sms <= p._max_grid < 20000 // 8, (sms, p._max_grid)
    for round_, tokens in enumerate((20000, 12, 20000)):  # capped grid, 2 CTAs, capped grid
        kv_c, k_pe, k = make_inputs(tokens, seed=130 + round_, device=dev)
        slots = make_slots(tokens, lay.num_blocks, seed=140 + round_, dtype=torch.int64,
                           padded=(3,), oob=(5,)).to(dev)  # fmt: skip
        exp = rep.poison(150 + round_)
        p.publish((kv_c, k_pe, k), slots, 0, bar, 0)
        expect_layer(exp, lay, 0, kv_c, k_pe, k, slots)
        rep.assert_equal(exp)
        assert bar.epochs.tolist() == [round_ + 1] and bar.arrivals.tolist() == [0]
    bar.close()


@requires_gpu
def test_publish_of_zero_tokens_writes_nothing_but_runs_the_barrier(dev):
    from vmmkv.ops import prepare

    case = _Case("layer", dev, tokens=64, seed=160)
    bar = _one_rank_barrier(dev, lanes=1)
    p = prepare(case.targets)
    exp = case.rep.poison(161)
    p.store(case.inputs, case.slots[:0])
    p.publish(case.inputs, case.slots[:0], 0, bar, 0)
    p.publish(case.inputs, case.slots[:0], 0, bar, 0)
    case.rep.assert_equal(exp)
    assert bar.epochs.tolist() == [2] and bar.arrivals.tolist() == [0]
    bar.close()


@requires_gpu
def test_prepared_calls_validate_before_launching(dev):
    from vmmkv.ops import prepare

    case = _Case("layer", dev, tokens=48, seed=170)
    bar = _one_rank_barrier(dev, lanes=1)
    p = prepare(case.targets)
    kv_c, k_pe, k = case.inputs
    s = case.slots
    with pytest.raises(TypeError, match=r"3 tensors \('kv_c', 'k_pe', 'k'\)"):
        p.store((kv_c, k_pe), s)
    with pytest.raises(TypeError, match="only bfloat16"):
        p.store((kv_c.half(), k_pe, k), s)
    with pytest.raises(ValueError, match=r"k must have shape \[T, 128\]"):
        p.store((kv_c, k_pe, k[:, :64]), s)
    with pytest.raises(ValueError, match="fewer than slot_mapping's 48"):
        p.store((kv_c[:5], k_pe, k), s)
    with pytest.raises(ValueError, match="is on cpu"):
        p.store((kv_c, k_pe.cpu(), k), s)
    raw = torch.zeros(48, 584, dtype=torch.bfloat16, device=dev)
    with pytest.raises(ValueError, match="kv_c rows must be 16-byte aligned"):
        p.store((raw[:, 4:516], k_pe, k), s)
    with pytest.raises(TypeError, match="int32 or int64"):
        p.store(case.inputs, s.float())
    with pytest.raises(ValueError, match="slot_mapping is on cpu"):
        p.store(case.inputs, s.cpu())
    with pytest.raises(ValueError, match=r"num_local_only must be in \[0, 48\], got 49"):
        p.store(case.inputs, s, 49)
    with pytest.raises(TypeError, match="DeviceBarrier"):
        p.publish(case.inputs, s, 0, object(), 0)
    with pytest.raises(ValueError, match=r"lane must be an int in \[0, 1\), got 1"):
        p.publish(case.inputs, s, 0, bar, 1)
    bar.close()
    with pytest.raises(RuntimeError, match="closed"):
        p.publish(case.inputs, s, 0, bar, 0)
    torch.cuda.synchronize()
    assert case.targets[0].error_counter.item() == 0  # nothing was launched


@requires_gpu
def test_captured_publish_replays_byte_exact_and_advances_the_epoch_per_replay(dev):
    from vmmkv.ops import prepare, publish_layer

    lay = interleaved(5)
    rep = Replicas(2, lay.region_bytes, dev)
    mla, idx = targets(rep, lay, my_rank=0)
    bar = _one_rank_barrier(dev, lanes=2)
    p = prepare((mla, idx))
    kv_c, k_pe, k = (t.clone() for t in make_inputs(100, seed=180, device=dev))
    slots = make_slots(100, lay.num_blocks, seed=181, dtype=torch.int64).to(dev)
    slots2 = torch.zeros(20, dtype=torch.int64, device=dev)
    p.publish((kv_c, k_pe, k), slots, 0, bar, 1)  # eager first: epochs [0, 1]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p.publish((kv_c, k_pe, k), slots, 0, bar, 0)
        publish_layer(mla, idx, kv_c, k_pe, k, slots2, barrier=bar, lane=1)
        bar.arrive_and_wait(0)
    torch.cuda.synchronize()
    assert bar.epochs.tolist() == [0, 1]  # capture ran nothing
    for round_ in range(3):
        fresh = make_inputs(100, seed=190 + round_, device=dev)
        for static, new in zip((kv_c, k_pe, k), fresh, strict=True):
            static.copy_(new)
        new_slots = make_slots(100, lay.num_blocks, seed=200 + round_, dtype=torch.int64)
        new_slots[new_slots >= 4 * BS] = -1  # blocks 4.. belong to the second publish
        slots.copy_(new_slots)
        slots2.copy_(torch.randperm(BS)[:20] + 4 * BS)
        mla.error_counter.zero_()
        exp = rep.poison(210 + round_)
        graph.replay()
        if round_ == 1:
            bar.arrive_and_wait(1)  # a stand-alone barrier between replays, same lane
        expect_layer(exp, lay, 0, kv_c, k_pe, k, slots)
        expect_mla(exp, lay, 0, kv_c, k_pe, slots2)
        expect_idx(exp, lay, 0, k, slots2)
        rep.assert_equal(exp)
        assert bar.epochs.tolist() == [2 * (round_ + 1), 1 + (round_ + 1) + (round_ >= 1)]
        assert bar.arrivals.tolist() == [0, 0]
    assert bar.read_diagnostic() is None
    bar.close()


def _snapshot_has(snapshot: torch.Tensor, lay: Layout, kv_c, k_pe, k, slots) -> bool:
    """True when the replica snapshot already holds the reference rows of these tokens
    (inserting them again changes nothing)."""
    region = snapshot[GUARD:-GUARD].clone()
    R.insert_ds_mla(mla_view(region, lay), kv_c.cpu(), k_pe.cpu(), slots.cpu())
    R.insert_indexer_k(idx_view(region, lay), k.cpu(), slots.cpu(), True)
    return torch.equal(region, snapshot[GUARD:-GUARD])


@requires_gpu
def test_two_ranks_see_each_others_rows_after_publish_mixing_fused_and_standalone_barriers(dev):
    """Two ranks in one process, one stream each. Per round each rank stores its own tokens
    into both replicas, either fused (``publish``) or as ``store_layer`` + ``arrive_and_wait``,
    on lane ``round % 2``; rank 0 is delayed so rank 1's barrier must really wait. After its
    barrier each rank snapshots its replica (a copy, no kernel to load while a peer spins):
    every snapshot must hold the peer's rows of that round."""
    from vmmkv.ops import prepare

    lay = packed(8)  # rank r, round parity q -> blocks 4q + 2r, 4q + 2r + 1
    rep = Replicas(2, lay.region_bytes, dev)
    sigs, bars, streams = _two_ranks(dev, lanes=2)
    tg = [targets(rep, lay, my_rank=r) for r in (0, 1)]
    prepared = [prepare(t) for t in tg]
    rounds = 6
    inputs, slots = {}, {}
    for j in range(rounds):
        for r in (0, 1):
            inputs[j, r] = make_inputs(100, seed=300 + 2 * j + r, device=dev)
            base = (4 * (j % 2) + 2 * r) * BS
            slots[j, r] = (torch.randperm(2 * BS)[:100] + base).to(dev)
    snaps = {(j, r): torch.empty_like(rep.bufs[r]) for j in range(rounds) for r in (0, 1)}
    exp = rep.poison(320)
    torch.cuda._sleep(1)  # load torch's sleep kernel before any barrier spins
    torch.cuda.synchronize()
    for j in range(rounds):
        lane = j % 2
        for r in (1, 0):
            with torch.cuda.stream(streams[r]):
                if j == 0 and r == 0:
                    torch.cuda._sleep(50_000_000)
                kv_c, k_pe, k = inputs[j, r]
                if (j + r) % 2 == 0:
                    prepared[r].publish((kv_c, k_pe, k), slots[j, r], 0, bars[r], lane)
                else:
                    store_layer(*tg[r], kv_c, k_pe, k, slots[j, r])
                    bars[r].arrive_and_wait(lane)
                snaps[j, r].copy_(rep.bufs[r])
    torch.cuda.synchronize()
    for j in range(rounds):
        for r in (0, 1):
            peer = 1 - r
            assert _snapshot_has(snaps[j, r].cpu(), lay, *inputs[j, peer], slots[j, peer]), (j, r)
    for j in range(rounds):
        for r in (0, 1):
            expect_mla(exp, lay, r, inputs[j, r][0], inputs[j, r][1], slots[j, r])
            expect_idx(exp, lay, r, inputs[j, r][2], slots[j, r])
    rep.assert_equal(exp)
    for b in bars:
        assert b.epochs.tolist() == [rounds // 2, rounds // 2]
        assert b.arrivals.tolist() == [0, 0] and b.read_diagnostic() is None
        b.close()


@requires_gpu
def test_with_the_opt_in_trap_a_missing_peer_times_out_in_the_fused_publish_with_a_diagnostic(
    dev,
):
    setup = """
        import os, torch
        from vmmkv.ops import prepare
        from vmmkv.ops.barrier import DeviceBarrier
        from tests.test_kernels_gpu import _Case
        dev = torch.device("cuda", 0)
        case = _Case("layer", dev, tokens=64, seed=5)
        """
    launch = """
        bar = DeviceBarrier(table, None, rank=1, world=2, lanes=2, device=dev, timeout_s=0.2,
                            trap=True)  # the opt-in trap
        prepare(case.targets).publish(case.inputs, case.slots, 0, bar, 1)  # rank 0 never comes
        """
    out = _barrier_timeout_output(dev, setup, launch)
    assert "DIAG vmmkv barrier timeout: lane=1 rank=1 missing peer=0 epoch=1 observed=0" in out, out
