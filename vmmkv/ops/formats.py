"""The KV byte formats, in one table: entry bytes, the inputs a store takes (dtype, width),
the alignment the kernels need, how a block is laid out and how scales are encoded. Every other
module (kernel wrappers, reference, host stores, the cache, tools, tests) reads these facts from
here.

The byte layouts themselves are described in docs/design.md ("KV byte formats"); the pure-torch
reference (``vmmkv.ops.reference``) is their executable definition. Local, no device work.

The kinds, and the vLLM writer whose bytes each one reproduces:

- ``fp8_ds_mla``: DeepSeek-V3.2 Main-KV, 656 bytes per token (512 e4m3 values in 4 tiles of
  128, 4 little-endian fp32 tile scales, 64 bf16 ``k_pe``). Tile scale
  ``fmaxf(amax / 448, FLT_MIN)``, the raw fp32 quotient (not a power of two): the rule of
  vLLM's C++ ``concat_and_cache_mla`` (kernel ``concat_and_cache_ds_mla_kernel``) before vLLM
  made every fp8_ds_mla writer round the scale (vLLM PR 49435). NOT what vLLM 0.33.0 writes.
- ``fp8_ds_mla_ue8m0``: the same entries, inputs and layout with the tile scale rounded up to a
  power of two, ``exp2f(ceilf(log2f(fmaxf(amax / 448, 1e-4f))))``, still stored as an fp32 (the
  "ue8m0" rounding in vLLM's words: its indexer's ``scale_fmt="ue8m0"``, its Triton
  ``_fp8_ue8m0_quantize``). This is what vLLM 0.33.0 writes: established from the SASS of
  ``concat_and_cache_ds_mla_kernel`` in the 0.33.0 wheel (sm_90 and sm_100: IEEE ``amax / 448``,
  ``fmaxf`` with 1e-4f, accurate ``log2f``, ``FRND.CEIL``, ``exp2f``; each value ``x / s`` by
  IEEE division, then ``cvt.rn.satfinite`` to e4m3) and from its fused Triton writer of the
  non-PCP path (``_fused_norm_rope_kernel``: ``max(amax * (1/448), 1e-4)`` rounded the same way,
  which gives the same power of two for every bf16 amax). :func:`mla_kind_for` names it.
- ``indexer_k``: DeepSeek-V3.2 sparse-indexer K, 132 bytes per token split inside the block
  (``block_size * 128`` e4m3 values, then one 4-byte scale per token). The scale is an fp32:
  ``fmaxf(amax, 1e-4) / 448``, rounded up to a power of two with vLLM's ``scale_fmt="ue8m0"``
  (the Hopper path; ``ue8m0=False`` keeps the raw quotient). Writer: vLLM's
  ``indexer_k_quant_and_cache`` (C++ ``indexer_k_quant_and_cache_kernel``).
- ``indexer_k_mxfp8``: the same cache and values as ``indexer_k`` on Blackwell, where vLLM's
  ``mqa_logits_use_mx_scales()`` holds and the writer is called with ``scale_fmt="mxfp8"``:
  DeepGEMM's MQA-logits kernels there take MXFP8 K, i.e. e4m3 values with one UE8M0 scale
  byte per 32 values. The row's power-of-two scale ``2^e`` is therefore stored as its biased
  exponent byte ``e + 127`` (bits 30..23 of the fp32) repeated four times (vLLM's
  ``pack_ue8m0_x4``), e.g. ``0x7f7f7f7f`` for 1.0. ``mxfp8`` always rounds the scale up to a
  power of two (the writer forces ``ue8m0``). :func:`indexer_kind_for` picks the kind of a GPU.
- ``rows``: already formatted uint8 rows of any width, copied as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .._util import require_int

__all__ = [
    "FORMATS",
    "INDEXER_DIM",
    "INDEXER_ENTRY_BYTES",
    "INDEXER_KINDS",
    "MLA_ENTRY_BYTES",
    "MLA_KINDS",
    "MLA_KV_DIM",
    "MLA_ROPE_DIM",
    "MLA_TILE",
    "KVFormat",
    "STORE_KINDS",
    "get_format",
    "indexer_kind_for",
    "mla_kind_for",
]

MLA_KV_DIM = 512
MLA_ROPE_DIM = 64
MLA_TILE = 128
MLA_ENTRY_BYTES = MLA_KV_DIM + 4 * (MLA_KV_DIM // MLA_TILE) + 2 * MLA_ROPE_DIM  # 656
INDEXER_DIM = 128
INDEXER_ENTRY_BYTES = INDEXER_DIM + 4  # 132, split inside the block (values, then scales)


@dataclass(frozen=True)
class KVFormat:
    """One cache kind.

    ``entry_bytes``: bytes per token (None: any, the row width of a "rows" cache).
    ``inputs``: (name, dtype, width) of each input tensor ``[T, width]`` a store of this kind
    takes (width None: the entry size). ``align``: the byte alignment the kernels need of the
    view offset, the block stride and (``fp8_ds_mla``) the entry stride. ``split_block``: the
    block holds every token's values first, then every token's scales (the indexer kinds), so a
    block must be contiguous. ``scale``: how each 4-byte scale is stored: ``"fp32"`` (a
    little-endian float), ``"ue8m0x4"`` (four equal UE8M0 bytes, the biased exponent of a
    power-of-two scale), None (no scale: rows). ``pow2``: every scale is rounded up to a power
    of two whatever a store's ``ue8m0`` flag (``fp8_ds_mla_ue8m0``, ``indexer_k_mxfp8``);
    ``indexer_k`` rounds when ``ue8m0`` is True, ``fp8_ds_mla`` never.
    """

    kind: str
    entry_bytes: int | None
    inputs: tuple[tuple[str, torch.dtype, int | None], ...]
    align: int
    split_block: bool = False
    scale: str | None = "fp32"
    pow2: bool = False


_MLA_INPUTS = (("kv_c", torch.bfloat16, MLA_KV_DIM), ("k_pe", torch.bfloat16, MLA_ROPE_DIM))
_INDEXER_INPUTS = (("k", torch.bfloat16, INDEXER_DIM),)

FORMATS: dict[str, KVFormat] = {
    f.kind: f
    for f in (
        KVFormat("fp8_ds_mla", MLA_ENTRY_BYTES, _MLA_INPUTS, align=16),
        KVFormat("indexer_k", INDEXER_ENTRY_BYTES, _INDEXER_INPUTS, align=4, split_block=True),
        KVFormat(
            "indexer_k_mxfp8",
            INDEXER_ENTRY_BYTES,
            _INDEXER_INPUTS,
            align=4,
            split_block=True,
            scale="ue8m0x4",
            pow2=True,
        ),
        KVFormat("rows", None, (("rows", torch.uint8, None),), align=1, scale=None),
        KVFormat("fp8_ds_mla_ue8m0", MLA_ENTRY_BYTES, _MLA_INPUTS, align=16, pow2=True),
    )
}

# The indexer kinds: the same inputs, entry bytes and split block, differing only in the scale.
INDEXER_KINDS = tuple(kind for kind, f in FORMATS.items() if f.split_block)
# The MLA kinds: the same inputs, entries and layout, differing only in the tile scale's rounding.
MLA_KINDS = tuple(kind for kind, f in FORMATS.items() if f.entry_bytes == MLA_ENTRY_BYTES)

# The combinations of bound caches one store call takes (store_layer: both caches of a layer).
STORE_KINDS = (
    ("fp8_ds_mla",),
    ("indexer_k",),
    ("rows",),
    ("fp8_ds_mla", "indexer_k"),
    ("indexer_k_mxfp8",),
    ("fp8_ds_mla", "indexer_k_mxfp8"),
    ("fp8_ds_mla_ue8m0",),
    ("fp8_ds_mla_ue8m0", "indexer_k"),
    ("fp8_ds_mla_ue8m0", "indexer_k_mxfp8"),
)


def get_format(kind: object) -> KVFormat:
    """The format of ``kind``; ValueError naming the known kinds otherwise."""
    fmt = FORMATS.get(kind) if isinstance(kind, str) else None
    if fmt is None:
        raise ValueError(f"kind must be one of {list(FORMATS)}, got {kind!r}")
    return fmt


def indexer_kind_for(capability: tuple[int, int]) -> str:
    """The indexer kind whose bytes vLLM 0.33.0 writes on a GPU of compute ``capability``
    ``(major, minor)`` (e.g. ``torch.cuda.get_device_capability()``).

    vLLM's rule (``vllm.utils.deep_gemm.mqa_logits_use_mx_scales``): MX scales are used when the
    platform is CUDA and ``current_platform.is_device_capability_family(100)``, which compares
    ``(10 * major + minor) // 10`` with 10: the sm_10x family only (sm_100, sm_103), not sm_90,
    sm_110 or sm_120. Then the sparse indexer calls ``indexer_k_quant_and_cache`` with
    ``scale_fmt="mxfp8"`` (``"indexer_k_mxfp8"``), else with the model's ``"ue8m0"``
    (``"indexer_k"``). Local, no device query; ROCm is not a CUDA platform for vLLM, so pass a
    CUDA capability only."""
    if not isinstance(capability, tuple) or len(capability) != 2:
        raise TypeError(f"capability must be a (major, minor) tuple, got {capability!r}")
    major = require_int("capability major", capability[0], 0)
    minor = require_int("capability minor", capability[1], 0, 9)
    return "indexer_k_mxfp8" if (10 * major + minor) // 10 == 10 else "indexer_k"


# The vLLM releases whose fp8_ds_mla writers were read (SASS and Triton source) and the kind each
# one's bytes are: see mla_kind_for.
_MLA_KIND_OF_VLLM = {(0, 33): "fp8_ds_mla_ue8m0", (0, 34): "fp8_ds_mla_ue8m0"}


def mla_kind_for(vllm_version: str) -> str:
    """The MLA kind whose bytes vLLM ``vllm_version`` (e.g. ``vllm.__version__``) writes into
    its ``kv_cache_dtype="fp8_ds_mla"`` cache.

    0.33.x: ``"fp8_ds_mla_ue8m0"`` (power-of-two tile scales). Established for 0.33.0 from the
    wheel itself, not from a source tree: the SASS (sm_90, sm_100) of its C++
    ``concat_and_cache_ds_mla_kernel``, which vLLM's PCP path calls after its gather, computes
    ``exp2f(ceilf(log2f(fmaxf(amax / 448.0f, 1e-4f))))``, and its fused Triton writer of the
    non-PCP path rounds the same way (vLLM PR 49435 made this the contract of every
    fp8_ds_mla writer). ``"fp8_ds_mla"`` (raw ``amax / 448``, FLT_MIN floor) is the rule of the
    older C++ source, from before that change; which release first shipped the rounding was
    not established, so any version other than 0.33.x and 0.34.x raises ValueError rather
    than guess: bind the kind you checked explicitly.

    0.34.x: the same kind. Established from the 0.34.0 wheel the same way: the kernel's
    quantization (sm_90 and sm_100 SASS) is 0.33's instruction for instruction; its one new
    ``bool`` parameter gates the warp that writes the RoPE bytes, and the host launcher sets
    it to ``row bytes == 656`` (x86 disassembly of ``concat_and_cache_mla``: no Python
    argument reaches it; a 528-byte row without RoPE is new in 0.34). DeepSeek-V3.2's rows are
    656 bytes, so its PCP inserts write every byte 0.33 wrote. Not yet compared with vLLM's
    kernel on a GPU. Local, reads nothing."""
    if not isinstance(vllm_version, str):
        raise TypeError(f"vllm_version must be a str, got {type(vllm_version).__name__}")
    m = re.match(r"(\d+)\.(\d+)(?:\.|$|[a-z+])", vllm_version)
    kind = _MLA_KIND_OF_VLLM.get((int(m.group(1)), int(m.group(2)))) if m else None
    if kind is None:
        known = ", ".join(f"{a}.{b}.x" for a, b in _MLA_KIND_OF_VLLM)
        raise ValueError(
            f"vllm_version {vllm_version!r}: the fp8_ds_mla scale rule of this vLLM release was "
            f"not established (known: {known}); pass the kind explicitly ('fp8_ds_mla': raw "
            f"amax/448 scales, 'fp8_ds_mla_ue8m0': power-of-two scales)"
        )
    return kind
