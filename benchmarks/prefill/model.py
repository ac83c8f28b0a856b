"""bench_prefill's model stand-in: shapes (DeepSeek-V3.2, or tiny for ``--cpu``), workloads and
their order, a forward's two halves around its KV update, a workload's tensors on one rank, and
the attention's dequantizing reads of the replicated cache.

Local, never collective. Pure logic down to ``steps`` (no torch); ``_Model``, ``_Workload`` and
the readers import torch when called. They create tensors only (garbage-collected; nothing to
close).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vmmkv._util import ceil_div
from vmmkv.ops.formats import (
    INDEXER_DIM,
    MLA_ENTRY_BYTES,
    MLA_KV_DIM,
    MLA_ROPE_DIM,
    MLA_TILE,
)
from vmmkv.testing.kv import BLOCK_SIZE

MODES = ("eager", "graph")
SCALE_AT = MLA_KV_DIM  # fp8_ds_mla entry: 512 fp8 values, 4 fp32 tile scales, 64 bf16 rope
ROPE_AT = MLA_KV_DIM + 4 * (MLA_KV_DIM // MLA_TILE)
QK_DIM = MLA_KV_DIM + MLA_ROPE_DIM  # 576: an absorbed MLA head's query/key width
assert ROPE_AT + 2 * MLA_ROPE_DIM == MLA_ENTRY_BYTES


@dataclass(frozen=True)
class Shapes:
    """Model dimensions (DeepSeek-V3.2 by default). The KV widths come from the formats table."""

    hidden: int = 7168
    q_lora_rank: int = 1536
    heads: int = 128
    qk_nope: int = 128
    v_head: int = 128
    index_heads: int = 64
    moe_inter: int = 2048
    active_experts: int = 9  # 8 routed of 256 + 1 shared

    @property
    def ffn_inter(self) -> int:
        return self.active_experts * self.moe_inter

    def weights(self) -> dict[str, tuple[int, int]]:
        """Every GEMM weight as ``(in, out)``."""
        return {
            "qkv_a": (self.hidden, self.q_lora_rank + MLA_KV_DIM + MLA_ROPE_DIM),
            "k_idx": (self.hidden, INDEXER_DIM),
            "w_idx": (self.hidden, self.index_heads),
            "qb_nope": (self.q_lora_rank, self.heads * self.qk_nope),
            "qb_pe": (self.q_lora_rank, self.heads * MLA_ROPE_DIM),
            "q_idx": (self.q_lora_rank, self.index_heads * INDEXER_DIM),
            "uk": (self.heads * self.qk_nope, MLA_KV_DIM),
            "uv": (MLA_KV_DIM, self.heads * self.v_head),
            "o": (self.heads * self.v_head, self.hidden),
            "gu": (self.hidden, 2 * self.ffn_inter),
            "down": (self.ffn_inter, self.hidden),
        }

    def linear_flops(self) -> int:
        """GEMM FLOPs per token and layer."""
        return sum(2 * a * b for a, b in self.weights().values())

    @staticmethod
    def attention_flops(seq_len: int) -> int:
        """Attention stand-in FLOPs per query token over ``seq_len`` keys."""
        return 2 * seq_len * (QK_DIM + INDEXER_DIM + MLA_KV_DIM)


DEEPSEEK_V32 = Shapes()
TINY = Shapes(hidden=256, q_lora_rank=64, heads=4, qk_nope=32, v_head=32, index_heads=4,
              moe_inter=64, active_experts=2)  # fmt: skip


@dataclass(frozen=True)
class WorkloadSpec:
    """``sequences`` prompts of ``world * per_rank`` tokens; each rank holds ``per_rank`` tokens
    of each (``tokens`` in all)."""

    name: str
    sequences: int
    per_rank: int
    world: int

    @property
    def tokens(self) -> int:
        return self.sequences * self.per_rank

    @property
    def seq_len(self) -> int:
        return self.world * self.per_rank

    @property
    def blocks(self) -> int:
        return self.sequences * ceil_div(self.seq_len, BLOCK_SIZE)

    def flops(self, shapes: Shapes, layers: int) -> int:
        """FLOPs of one rank's forward."""
        per_token = shapes.linear_flops() + shapes.attention_flops(self.seq_len)
        return layers * self.tokens * per_token


def workloads(tokens: list[int], batch: tuple[int, int] | None, world: int) -> list[WorkloadSpec]:
    """One single-prompt workload per token count (tokens per rank), plus the batch of
    ``prompts x length`` short prompts (each split across the ranks)."""
    specs = [WorkloadSpec(f"{t}/rank", 1, t, world) for t in tokens]
    if batch is not None:
        prompts, length = batch
        specs.append(WorkloadSpec(f"{prompts}x{length}", prompts, length // world, world))
    return specs


def steps(specs: list[WorkloadSpec], modes: tuple[str, ...], graph_max: int) -> list[tuple]:
    """(spec, mode) pairs in order of cost: fewer tokens first, eager before graph."""
    out = [(s, m) for s in specs for m in modes if m == "eager" or s.tokens <= graph_max]
    return sorted(out, key=lambda sm: (sm[0].tokens, sm[0].sequences, MODES.index(sm[1])))


class _Model:
    """The weights (one set for every layer) and the two halves of a layer around its KV
    update. Local; every output is a new tensor except the in-place updates of ``h`` and the
    checksum (capture-safe: no host synchronization)."""

    def __init__(self, shapes: Shapes, device, seed: int) -> None:
        import torch

        self.shapes = shapes
        gen = torch.Generator(device=device).manual_seed(seed)
        self.w = {}
        for name, (k, n) in shapes.weights().items():
            w = torch.randn(k, n, generator=gen, device=device).div_(math.sqrt(k))
            self.w[name] = w.to(torch.bfloat16)
        ones = {n: torch.ones(n, dtype=torch.bfloat16, device=device)
                for n in (shapes.hidden, shapes.q_lora_rank, MLA_KV_DIM)}  # fmt: skip
        self.norm = ones

    def pre(self, h):
        """``(x, q_c, kv_c, k_pe, k)`` of a layer: everything the KV update needs."""
        import torch.nn.functional as F

        s, w = self.shapes, self.w
        x = F.rms_norm(h, (s.hidden,), self.norm[s.hidden], 1e-6)
        qkv = x @ w["qkv_a"]
        ql = s.q_lora_rank
        q_c = F.rms_norm(qkv[:, :ql], (ql,), self.norm[ql], 1e-6)
        kv_c = F.rms_norm(qkv[:, ql : ql + MLA_KV_DIM], (MLA_KV_DIM,), self.norm[MLA_KV_DIM],
                          1e-6).contiguous()  # fmt: skip
        k_pe = qkv[:, ql + MLA_KV_DIM :].contiguous()
        k = F.layer_norm(x @ w["k_idx"], (INDEXER_DIM,))
        return x, q_c, kv_c, k_pe, k

    def post(self, layer: int, wl: _Workload, x, q_c, views) -> None:
        """Attention stand-in over the replica (``views``: this layer's read views), then the
        output projection and the FFN; updates ``wl.h`` and ``wl.checksum[layer]``."""
        import torch
        import torch.nn.functional as F

        s, w = self.shapes, self.w
        n, t, tokens = wl.spec.sequences, wl.spec.per_rank, wl.spec.tokens
        q_pe = q_c @ w["qb_pe"]
        q = torch.cat((q_c @ w["qb_nope"] @ w["uk"], q_pe[:, :MLA_ROPE_DIM]), dim=1)
        qi = (q_c @ w["q_idx"]).view(tokens, s.index_heads, INDEXER_DIM)
        qi = (qi * (x @ w["w_idx"]).unsqueeze(-1)).sum(1)
        kv, kidx = _read_cache(views, wl)
        scores = torch.bmm(q.view(n, t, QK_DIM), kv.transpose(1, 2)).mul_(QK_DIM**-0.5)
        scores.baddbmm_(qi.view(n, t, INDEXER_DIM), kidx.transpose(1, 2), alpha=INDEXER_DIM**-0.5)
        o = torch.bmm(torch.softmax(scores, dim=-1), kv[:, :, :MLA_KV_DIM]).view(tokens, -1)
        wl.checksum[layer].copy_(o.sum(dtype=torch.float32))
        wl.h.add_(o @ w["uv"] @ w["o"])
        gu = F.rms_norm(wl.h, (s.hidden,), self.norm[s.hidden], 1e-6) @ w["gu"]
        inter = s.ffn_inter
        wl.h.add_((F.silu(gu[:, :inter]) * gu[:, inter:]) @ w["down"])


def _read_cache(views, wl: _Workload):
    """The prompt's cache entries of one layer, dequantized: ``kv [n, S, 576]`` (bf16) and the
    indexer keys ``[n, S, 128]`` (bf16), in position order."""
    import torch

    mla, idx_vals, idx_scales, mxfp8 = views
    n, seq = wl.read_blk.shape
    rows = mla[wl.read_blk, wl.read_off]  # [n, S, 656] uint8
    values = rows[..., :SCALE_AT].view(torch.float8_e4m3fn).float()
    scales = rows[..., SCALE_AT:ROPE_AT].view(torch.float32)  # [n, S, 4]
    nope = values.view(n, seq, -1, MLA_TILE) * scales.unsqueeze(-1)
    rope = rows[..., ROPE_AT:].view(torch.bfloat16)
    kv = torch.cat((nope.view(n, seq, MLA_KV_DIM).to(torch.bfloat16), rope), dim=-1)
    k8 = idx_vals[wl.read_blk, wl.read_off].view(torch.float8_e4m3fn).float()
    raw = idx_scales[wl.read_blk, wl.read_off]  # [n, S, 4] uint8
    if mxfp8:  # four equal UE8M0 bytes: 2^(byte - 127), rebuilt as the fp32 exponent field
        kscale = (raw[..., :1].to(torch.int32) << 23).view(torch.float32)
    else:
        kscale = raw.view(torch.float32)  # [n, S, 1]
    return kv, (k8 * kscale).to(torch.bfloat16)


def _read_views(views, indexer_kind: str):
    """Per layer: (fp8_ds_mla view, indexer values ``[nb, 64, 128]``, indexer scale bytes ``[nb,
    64, 4]``, whether those are UE8M0) over the split indexer blocks of
    ``vmmkv.testing.kv.interleaved_views``."""
    out = []
    for mla, idx in views:
        nb, bs, _ = idx.shape
        at = idx.storage_offset()
        vals = idx.as_strided((nb, bs, INDEXER_DIM), (idx.stride(0), INDEXER_DIM, 1), at)
        scales = idx.as_strided((nb, bs, 4), (idx.stride(0), 4, 1), at + bs * INDEXER_DIM)
        out.append((mla, vals, scales, indexer_kind == "indexer_k_mxfp8"))
    return out


def _rank_positions(rank: int, world: int, per_rank: int):
    """Positions of ``rank``'s tokens in a prompt of ``world * per_rank`` (DualChunkSwap)."""
    import torch

    c = per_rank // 2
    lo, hi = rank * c, (2 * world - 1 - rank) * c
    return torch.cat((torch.arange(lo, lo + c), torch.arange(hi, hi + c)))


class _Workload:
    """A workload's static tensors on one rank (the graphs read them in place): the gathered slot
    mapping (rank-major) and this rank's view of it, the block/offset of every key the attention
    reads, the hidden states, the checksums and the KV-only inputs."""

    def __init__(self, spec: WorkloadSpec, rank: int, shapes: Shapes, layers: int, device,
                 seed: int) -> None:  # fmt: skip
        import torch

        self.spec = spec
        world, n, seq = spec.world, spec.sequences, spec.seq_len
        per_seq = ceil_div(seq, BLOCK_SIZE)
        table = torch.randperm(spec.blocks, generator=torch.Generator().manual_seed(seed))
        pos = torch.arange(seq)
        blk = table.view(n, per_seq)[:, pos // BLOCK_SIZE]  # [n, S]
        off = (pos % BLOCK_SIZE).expand(n, seq)
        slot = blk * BLOCK_SIZE + off
        per_rank = [slot[:, _rank_positions(r, world, spec.per_rank)].reshape(-1)
                    for r in range(world)]  # fmt: skip
        self.gslots = torch.cat(per_rank).to(device)
        self.own = self.gslots[rank * spec.tokens : (rank + 1) * spec.tokens]
        self.read_blk = blk.contiguous().to(device)
        self.read_off = off.contiguous().to(device)
        gen = torch.Generator(device=device).manual_seed(1000 * (seed + 1) + rank)
        self.h0 = torch.randn(spec.tokens, shapes.hidden, generator=gen, device=device).bfloat16()
        self.h = self.h0.clone()
        self.checksum = torch.zeros(layers, dtype=torch.float32, device=device)
        self.kv_in = tuple(
            torch.randn(spec.tokens, width, generator=gen, device=device).bfloat16()
            for width in (MLA_KV_DIM, MLA_ROPE_DIM, INDEXER_DIM)
        )
        self.block_offset = 0

    def reset(self) -> None:
        self.h.copy_(self.h0)
        self.checksum.zero_()

    def relocate(self, blocks: int) -> None:
        """Move every block by ``blocks`` (in place: captured graphs see the new slots)."""
        self.gslots.add_(blocks * BLOCK_SIZE)
        self.read_blk.add_(blocks)
        self.block_offset += blocks

    def byte_range(self, stride: int) -> tuple[int, int]:
        return self.block_offset * stride, (self.block_offset + self.spec.blocks) * stride
