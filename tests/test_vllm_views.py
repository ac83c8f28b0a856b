"""Binding vLLM's 4-D single-head layer views ``[B, 1, N, C]`` (no vLLM needed): the geometry is
the 3-D view's, in every stride pattern vLLM 0.34.0 makes (LB*: block stride = page; BL*: block
stride = the packed block of every layer; HNC vs NHC: the head stride differs, irrelevant for one
head); more than one head is refused naming it."""

from __future__ import annotations

import pytest
import torch

from vmmkv._store import target_geometry
from vmmkv.ops.formats import INDEXER_ENTRY_BYTES, MLA_ENTRY_BYTES

BS, NB = 64, 5


def _as4d(buf, offset, block_stride, entry, head_stride):
    return buf.as_strided((NB, 1, BS, entry), (block_stride, head_stride, entry, 1), offset)


@pytest.mark.parametrize("kind,entry", [("fp8_ds_mla", MLA_ENTRY_BYTES),
                                        ("indexer_k", INDEXER_ENTRY_BYTES)])  # fmt: skip
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("head_stride_of", ["page", "entry"])
def test_a_single_head_4d_view_binds_with_the_geometry_of_its_3d_squeeze(
    kind, entry, packed, head_stride_of
):
    page = BS * entry
    block_stride = 3 * page if packed else page  # BL*: other layers' pages between blocks
    buf = torch.zeros(4096 + NB * block_stride, dtype=torch.int8)
    head_stride = page if head_stride_of == "page" else entry  # HNC / NHC
    view = _as4d(buf, 4096, block_stride, entry, head_stride)
    got = target_geometry(view, kind, buf.data_ptr(), buf.numel(), name="l0")
    want = target_geometry(view.squeeze(1), kind, buf.data_ptr(), buf.numel(), name="l0")
    assert got == want
    assert got["offset_bytes"] == 4096 and got["num_blocks"] == NB and got["block_size"] == BS
    assert got["block_stride"] == block_stride and got["entry_stride"] == entry


def test_a_4d_view_with_more_than_one_head_is_refused_naming_the_heads():
    buf = torch.zeros(2 * NB * BS * MLA_ENTRY_BYTES, dtype=torch.uint8)
    view = buf.view(NB, 2, BS, MLA_ENTRY_BYTES)
    with pytest.raises(ValueError, match=r"'l0'.*one head.*H = 2.*\[5, 2, 64, 656\]"):
        target_geometry(view, "fp8_ds_mla", buf.data_ptr(), buf.numel(), name="l0")


def test_a_5d_view_is_refused_naming_both_accepted_shapes():
    buf = torch.zeros(NB * BS * MLA_ENTRY_BYTES, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\[num_blocks, 1, block_size, entry\], got shape \[3"):
        target_geometry(buf.view(-1)[:3 * 4 * 5].view(3, 4, 5, 1, 1), "rows",
                        buf.data_ptr(), buf.numel())  # fmt: skip
