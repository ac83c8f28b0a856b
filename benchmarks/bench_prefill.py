"""Engine-shaped PCP prefill: the KV-cache update paths inside a synthetic DeepSeek-V3.2 forward.

The question: what does direct publication (vmmkv) do to a whole prefill forward pass under
prefill context parallelism (PCP), compared with vLLM 0.33.0's gather-then-insert and with torch
symmetric memory? ``--world`` ranks (default 2), one process per GPU. Each rank holds its share of
every prompt (DualChunkSwap, as vLLM splits prompts: a prompt of ``world * t`` tokens is cut into
``2 * world`` chunks, rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r``) and a full replica
of the KV cache in the formats vLLM 0.33.0 writes: Main-KV ``fp8_ds_mla_ue8m0`` (tile scales
rounded up to a power of two, docs/design.md) where this vmmkv has that kind, else
``fp8_ds_mla`` (the raw scale: other values, the same bytes per token and the same work); the
indexer kind of the GPU (``vmmkv.ops.formats.indexer_kind_for``: indexer_k on Hopper,
indexer_k_mxfp8 on sm_10x); layer-interleaved blocks of 64 tokens (``vmmkv.testing.kv``); one
random block table per prompt, the same on every rank.

Forward of one rank, ``T`` tokens, ``L`` layers (``--layers``, default 61 as the model). Shapes
from DeepSeek-V3.2's config: hidden 7168, q_lora_rank 1536, kv_lora_rank 512, qk_rope_head_dim
64, qk_nope_head_dim = v_head_dim = 128, 128 heads, indexer 64 heads x 128, MoE of 256 routed
experts (8 per token) + 1 shared expert with moe_intermediate_size 2048, KV blocks of 64 tokens.
Per layer, in the order an engine runs it (bf16 GEMMs; ``@ W`` = one GEMM):

    x = rmsnorm(h)
    [q_c | kv_c | k_pe] = x @ W_qkv_a          7168 -> 1536 + 512 + 64 (fused q_a/kv_a proj)
    q_c, kv_c = rmsnorm(q_c), rmsnorm(kv_c);   k_pe copied contiguous (rope: omitted, elementwise)
    k = layernorm(x @ W_k)                     7168 -> 128 (indexer key)
    KV UPDATE (the path under test): kv_c, k_pe -> Main-KV, k -> Indexer-K, every replica
    q_nope, q_pe = q_c @ W_qb_nope, q_c @ W_qb_pe        1536 -> 128 x 128, 1536 -> 128 x 64
    q = [q_nope @ W_uk | q_pe[:, :64]]         16384 -> 512 (W_UK of every head, absorbed)
    q_idx = sum over 64 heads of (q_c @ W_qi) * (x @ W_w)    1536 -> 64 x 128, 7168 -> 64
    o = attention stand-in (reads the replicated cache, below)                 [T, 512]
    h += (o @ W_uv) @ W_o                      512 -> 16384 -> 7168
    h += swiglu(rmsnorm(h) @ W_gu) @ W_down    7168 -> 2 x 18432, 18432 -> 7168

GEMM FLOPs per token and layer = 2 x weight elements = 1.195 GFLOP (``Shapes.linear_flops``).
The FFN is dense with intermediate 9 x 2048 = 18432: exactly the active FLOPs of the MoE layer (8
routed + 1 shared expert of 2048 each), and DeepSeek's own dense-layer width (its first 3
layers). Routing and the gate are not modelled (TP1, one GPU per rank: no expert parallelism).
One weight set serves every layer (1.2 GB, 24x the 50 MB L2 of an H200: no layer finds another
layer's weights in cache).

Attention stand-in, per prompt: gather the layer's Main-KV and Indexer-K entries of all ``S =
world * t`` tokens of the prompt from the local replica (by slot, in position order), dequantize
them (fp8 x tile scale, bf16 rope; fp8 x scale), then ``softmax(q kv^T / sqrt(576) + q_idx k^T /
sqrt(128)) kv[:, :512]``: one absorbed head over all S keys, not causal, ``2 t S (576 + 128 +
512)`` FLOPs. The output's float32 sum is the layer's checksum: a rank that read its replica
before a peer's rows arrived, or a missing update, gives another checksum. Not modelled: the 128
heads of sparse MLA over the 2048 keys the indexer selects (about 0.57 GFLOP per token once S >=
2048), the indexer's 64-head scoring (2 x 64 x 128 x S per token), the checkpoint's fp8 GEMMs
(about 2x faster than these bf16 ones). They change the denominator of every percentage, in
opposite directions: at 256 tokens per rank a real forward is shorter than this one (fp8 GEMMs,
little attention), so the percentages here understate the real ones; at 16384 the real attention
adds roughly what the fp8 GEMMs save.

KV-update paths, measured in one run on the same inputs and the same cache layout:

- ``direct``: ``ReplicatedKVCache.publish_layer``: one launch stores this rank's rows into every
  replica through the peer mappings, then the device barrier.
- ``vllm_gather``: vLLM 0.33.0's PCP path (``vllm/v1/attention/ops/pcp.py`` and its callers),
  written here from its description, not copied. Per layer the indexer first: an NCCL all-gather
  of ``k`` (``all_gather_into_tensor`` -- ``all_gather_single`` in newer torch -- on the device
  group into a fresh ``[world * T, 128]`` tensor, rank-major: the padded layout, every rank passes
  the same ``T``), then the insert of all ``world * T`` rows; then the MLA cache: all-gathers of
  ``kv_c`` and ``k_pe``, the insert of all rows. The slot mapping is the engine's gathered one
  (vLLM does not gather slots). Pure prefill has no replicated decode rows, so vLLM's
  concatenation (decode rows ahead of the gathered rows) does not occur. vLLM's insert ops cannot
  run here (no vLLM on the GPU machine): the inserts are vmmkv's local-only store kernels
  (``vmmkv.ops.prepare`` over the own buffer), which write the bytes of the C++ writers vLLM's
  PCP path calls after its gather (``concat_and_cache_mla``, ``indexer_k_quant_and_cache``) as
  docs/design.md specifies them (with ``fp8_ds_mla`` instead of ``fp8_ds_mla_ue8m0``: the same
  bytes per token and work, other scale values). vLLM drives NCCL through its pynccl wrapper on the
  current stream; torch's ProcessGroupNCCL used here runs the same NCCL kernel plus a stream
  hand-off. The cache is a plain ``torch.zeros`` buffer, as vLLM's.
- ``vmmkv_gather``: vmmkv's own fallback on the vmmkv cache: ``publish_layer(mode="gather")``
  with the gathered slot mapping (one pack, one NCCL all-gather, one insert).
- ``symm_mem``: torch symmetric memory: ``torch.distributed._symmetric_memory.empty`` of the same
  bytes, ``rendezvous`` over the gloo group, a vmmkv ``KVTarget`` over its peer pointer table
  (``buffer_ptrs``), the same fused store kernel (one launch, both caches), then the handle's
  ``barrier()``.

Modes: ``eager``; ``graph``: one CUDA graph per layer (GEMMs, KV update, attention stand-in,
FFN) replayed in order, for workloads of at most ``--graph-max-tokens`` tokens per rank (default
1024: vLLM captures batch sizes up to 512 on Hopper and 1024 on data-center Blackwell by default;
larger prefill batches run eagerly there).

Each (workload, mode) step:
1. Verification (the first warm-up forward): each path runs one forward on a replica poisoned
   with 0xA5. Its bytes (every block the workload uses) must equal the first path's byte for
   byte, its per-layer checksums must be identical, every token must be written (layers 0 and
   L-1), no slot counted out of range, and each replica's fingerprint must be equal on every
   rank. A mismatch raises on every rank: the run aborts with the message before any timing is
   reported.
2. ``--warmup - 1`` more untimed forwards per path, then ``--iters`` timed forwards per path,
   the order of the paths rotated every iteration. Before each forward a device synchronize and a
   gloo barrier align the ranks; CUDA events around the forward; an iteration counts the slowest
   rank. p50, and p99 = the sample at rank round(0.99 (n - 1)) of the sorted ones (with 20
   samples: the slowest).
3. KV update alone: the same L updates (layer l into layer l's caches, this step's token count,
   random inputs) without the rest of the forward, CUDA events around the sequence (graph mode:
   one graph holding the L updates). Share = its p50 / the forward's p50. It excludes the rank
   skew that a forward adds to a barrier or an all-gather; the forward difference includes it.
4. Difference vs ``vllm_gather``: (forward p50 - the baseline's p50) / the baseline's p50.

Setup cost (once, every buffer sized for the largest workload; each measured twice, ``first``
and ``second``, in this order): the kernels' load (NVRTC compile or disk cache); vmmkv's
``ReplicatedKVCache`` construction with direct publication (reservation of twice the bytes,
commit, fd exchange, peer mapping, barrier) and with ``direct=False`` (no peer mapping);
``torch.zeros`` of the same bytes (vLLM's cache; the NCCL group is not counted, an engine makes it
anyway); ``symm_mem.empty`` + ``rendezvous``.

Growth (smallest workload; graphs on CUDA, eager on the host backend): vmmkv: capture the L layer
graphs, ``grow`` every replica to twice its committed bytes plus a block, in chunks
(collective), move the workload's
blocks past the old committed end (slots and read indices rewritten in place: the graphs read
them), replay: the replica at the new blocks and the checksums must equal those before. Torch
symmetric memory needs a new buffer for the same growth: ``empty`` + ``rendezvous``, a copy of the
old bytes, new ``KVTarget`` s, a recapture of the L graphs (an engine recaptures once per
captured batch size: about 50 with vLLM's default list on Hopper), then the same replay check.

Budget (``--budget-s``, default 345 s from the start, 0 = none): the steps run in order of cost.
Before a step (projected from the throughput measured so far) and after its verification
(projected from its measured forwards), a step that would end after the budget (less 15 s for the
teardown) is skipped on every rank with a printed reason and a JSON entry; rerun it on its own.
The default run on 2 H200 (5 workloads, 7 steps, 4 paths, 61 layers, 1 + 20 forwards) holds
about 305 s of forwards at 650 TFLOPS bf16 (printed at the start) plus about 30 s of startup,
setup, growth and KV-only timings: over budget by a few percent, so the 16384-token step (about
165 s alone) runs only when the measured rate leaves room (about 690 TFLOPS); otherwise run it
alone: ``--tokens 16384 --batch none --modes eager``.

Outputs under ``--out``: ``bench_prefill.json`` (every slowest-rank sample, setup, growth,
verification), ``bench_prefill.png`` (when matplotlib is installed; otherwise one line says so),
``bench_prefill.partial.jsonl`` (each finished step, for a run cut short), and a markdown table
on stdout ready for BENCHMARKS.md.

``--cpu``: host backend, gloo, tiny model shapes (the KV formats unchanged), paths ``direct``,
``vllm_gather`` (its all-gathers over gloo) and ``vmmkv_gather``; ``symm_mem`` and graphs are
skipped with a printed reason. It runs the script's logic without a GPU
(tests/test_bench_prefill.py).

Contract: a script (``if __name__ == "__main__"``); its ranks start through
``vmmkv.testing.spawn`` (multicast off in every rank); each rank closes everything it created
before it returns. Exit status 0 done, 1 a rank failed (verification included), 2 bad arguments
or too few GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import percentile, write_json  # noqa: E402

from vmmkv._util import ceil_div, round_up  # noqa: E402
from vmmkv.ops.formats import (  # noqa: E402
    INDEXER_DIM,
    MLA_ENTRY_BYTES,
    MLA_KV_DIM,
    MLA_ROPE_DIM,
    MLA_TILE,
)
from vmmkv.testing.kv import BLOCK_SIZE  # noqa: E402

NAME = "bench_prefill"
PATHS = ("direct", "vllm_gather", "vmmkv_gather", "symm_mem")
BASELINE = "vllm_gather"
MODES = ("eager", "graph")
GPU_TOKENS = (256, 1024, 4096, 16384)
GPU_BATCH = "16x1024"
CPU_TOKENS = (64,)
CPU_BATCH = "4x48"  # prompt length divisible by 2 x world for 2, 3 and 4 ranks
MODEL_LAYERS = 61
POISON = 0xA5
ASSUMED_TFLOPS = 650.0  # bf16 GEMM rate of an H200 assumed by the printed plan (not the guard)
TEARDOWN_S = 15.0  # kept free at the end of --budget-s
SCALE_AT = MLA_KV_DIM  # fp8_ds_mla entry: 512 fp8 values, 4 fp32 tile scales, 64 bf16 rope
ROPE_AT = MLA_KV_DIM + 4 * (MLA_KV_DIM // MLA_TILE)
QK_DIM = MLA_KV_DIM + MLA_ROPE_DIM  # 576: an absorbed MLA head's query/key width
assert ROPE_AT + 2 * MLA_ROPE_DIM == MLA_ENTRY_BYTES


# ---------------------------------------------------------------------------------------------
# shapes, workloads, plan (pure logic, no torch)


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


def plan_seconds(args: argparse.Namespace, tflops: float = ASSUMED_TFLOPS) -> float:
    """The forwards' seconds of a run at ``tflops`` (every step, every path): the printed
    plan. Startup, setup, growth and the KV-only timings come on top (tens of seconds)."""
    shapes = TINY if args.cpu else DEEPSEEK_V32
    total = 0.0
    for spec, _ in steps(args.specs, tuple(args.modes), args.graph_max_tokens):
        forwards = len(args.paths) * (args.warmup + args.iters)
        total += forwards * spec.flops(shapes, args.layers) / (tflops * 1e12)
    return total


# ---------------------------------------------------------------------------------------------
# arguments


def _int_at_least(lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            want = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"must be {want}, got {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _tokens(text: str) -> list[int]:
    if text.lower() == "none":
        return []
    values = []
    for part in text.split(","):
        try:
            t = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"takes comma-separated integers (tokens per rank), got {part!r}"
            ) from None
        if t < 2 or t % 2:
            raise argparse.ArgumentTypeError(
                f"each value must be an even number >= 2 (each rank holds two chunks of every "
                f"prompt), got {t}"
            )
        values.append(t)
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"lists a value twice: {text!r}")
    return values


def _batch(text: str) -> tuple[int, ...]:
    """``(prompts, length)``; ``()`` for none."""
    if text.lower() == "none":
        return ()
    parts = text.lower().split("x")
    try:
        prompts, length = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"takes PROMPTSxLENGTH (e.g. 16x1024) or none, got {text!r}"
        ) from None
    if prompts < 1 or length < 2:
        raise argparse.ArgumentTypeError(
            f"needs >= 1 prompt of >= 2 tokens, got {prompts} x {length}"
        )
    return prompts, length


def _names(known: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {bad or [text]}; choose from {', '.join(known)}"
            )
        return tuple(n for n in known if n in names)  # canonical order, no duplicates

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Validated options; ``argparse`` exits with status 2 and a message naming the flag, the
    value got and what is expected. Adds ``specs`` (the workloads) and ``notes`` (paths or modes
    left out, with why)."""
    ap = argparse.ArgumentParser(prog="bench_prefill.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=f"bench-out/{NAME}", help="output directory")
    ap.add_argument("--layers", type=_int_at_least(1, MODEL_LAYERS),
                    default=MODEL_LAYERS, help=f"layers (default {MODEL_LAYERS})")  # fmt: skip
    ap.add_argument("--tokens", type=_tokens, default=None,
                    help="tokens per rank of the single-prompt workloads, comma-separated, or "
                         "none "
                         f"(default {','.join(map(str, GPU_TOKENS))}; --cpu: "
                         f"{','.join(map(str, CPU_TOKENS))})")  # fmt: skip
    ap.add_argument("--batch", type=_batch, default=None,
                    help=f"PROMPTSxLENGTH of the batch of short prompts, or none (default "
                         f"{GPU_BATCH}; --cpu: {CPU_BATCH})")  # fmt: skip
    ap.add_argument("--iters", type=_int_at_least(1), default=20,
                    help="timed forwards per path and step (default 20)")  # fmt: skip
    ap.add_argument("--warmup", type=_int_at_least(1), default=1,
                    help="untimed forwards per path and step, the first being the verification "
                         "(default 1)")  # fmt: skip
    ap.add_argument("--modes", type=_names(MODES), default=MODES,
                    help="eager,graph (default both)")  # fmt: skip
    ap.add_argument("--paths", type=_names(PATHS), default=PATHS,
                    help=f"{','.join(PATHS)} (default all)")  # fmt: skip
    ap.add_argument("--graph-max-tokens", type=_int_at_least(0),
                    default=1024, help="largest tokens per rank run as CUDA graphs (default 1024)")  # fmt: skip
    ap.add_argument("--budget-s", type=_seconds, default=345.0,
                    help="skip steps that would end later than this many seconds after the "
                         "start (default 345; 0: no guard)")  # fmt: skip
    ap.add_argument("--world", type=_int_at_least(2), default=2,
                    help="ranks, one GPU each (default 2)")  # fmt: skip
    ap.add_argument("--seed", type=_int_at_least(0), default=0)
    ap.add_argument("--timeout", type=_seconds, default=None,
                    help="seconds for the whole run (default budget + 240; 3600 without budget)")  # fmt: skip
    ap.add_argument("--cpu", action="store_true",
                    help="host backend, gloo, tiny shapes: the script's logic without a GPU")  # fmt: skip
    ap.add_argument("--drop-update", default=None, choices=PATHS,
                    help="testing: this path skips layer 0's KV update in every step, which the "
                         "verification must catch")  # fmt: skip
    args = ap.parse_args(argv)
    if args.tokens is None:
        args.tokens = list(CPU_TOKENS if args.cpu else GPU_TOKENS)
    if args.batch is None:
        args.batch = _batch(CPU_BATCH if args.cpu else GPU_BATCH)
    args.batch = args.batch or None  # () was "none"
    if args.batch is not None and args.batch[1] % (2 * args.world):
        ap.error(
            f"--batch: the prompt length must be a multiple of 2 x --world = {2 * args.world} "
            f"(each rank holds two equal chunks of every prompt), got {args.batch[1]}"
        )
    if not args.tokens and args.batch is None:
        ap.error("--tokens none and --batch none: nothing to run")
    if args.timeout is not None and args.timeout <= 0:
        ap.error(f"--timeout must be > 0, got {args.timeout}")
    args.notes = {}
    if args.cpu:
        if "symm_mem" in args.paths:
            args.notes["symm_mem"] = "skipped with --cpu: torch symmetric memory needs CUDA"
        if "graph" in args.modes:
            args.notes["graph"] = "skipped with --cpu: CUDA graphs need CUDA"
        args.paths = tuple(p for p in args.paths if p != "symm_mem")
        args.modes = tuple(m for m in args.modes if m != "graph")
        if not args.paths or not args.modes:
            ap.error("--cpu leaves nothing to run (symm_mem and graph need CUDA)")
    if args.drop_update is not None and args.drop_update not in args.paths:
        ap.error(f"--drop-update {args.drop_update}: that path is not among --paths {args.paths}")
    args.specs = workloads(args.tokens, args.batch, args.world)
    if args.timeout is None:
        args.timeout = args.budget_s + 240.0 if args.budget_s else 3600.0
    return args


# ---------------------------------------------------------------------------------------------
# summary (pure logic)


def _pct(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return (a - b) / b * 100.0


def summarize(step_records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat rows, one per (workload, mode, path) of every timed step: forward p50/p99/mean (ms),
    KV update alone p50/p99 (ms), its share of the forward (%), and the forward's difference vs
    the baseline path of the same step (%, None without the baseline)."""
    rows = []
    for st in step_records:
        if st.get("skipped"):
            continue
        base = st["paths"].get(BASELINE)
        base_p50 = percentile(base["forward_ms"], 50) if base else None
        for name in PATHS:
            got = st["paths"].get(name)
            if got is None:
                continue
            fwd, kv = got["forward_ms"], got["kv_ms"]
            p50, kv50 = percentile(fwd, 50), percentile(kv, 50)
            rows.append(
                {
                    "workload": st["workload"],
                    "tokens_per_rank": st["tokens_per_rank"],
                    "mode": st["mode"],
                    "path": name,
                    "forward_p50_ms": p50,
                    "forward_p99_ms": percentile(fwd, 99),
                    "forward_mean_ms": sum(fwd) / len(fwd),
                    "kv_p50_ms": kv50,
                    "kv_p99_ms": percentile(kv, 99),
                    "kv_share_pct": kv50 / p50 * 100.0 if p50 > 0 else None,
                    "vs_baseline_pct": _pct(p50, base_p50),
                    "tflops": st["flop_per_forward"] / (p50 * 1e-3) / 1e12 if p50 > 0 else None,
                    "iters": len(fwd),
                }
            )
    return rows


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _md(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(result: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The tables for BENCHMARKS.md: forwards, setup, growth, skipped steps."""
    out = []
    fwd = []
    for r in rows:
        vs = r["vs_baseline_pct"]
        pct = "baseline" if r["path"] == BASELINE else (None if vs is None else f"{vs:+.2f}%")
        share = None if r["kv_share_pct"] is None else f"{r['kv_share_pct']:.2f}%"
        fwd.append([r["workload"], r["tokens_per_rank"], r["mode"], r["path"],
                    r["forward_p50_ms"], r["forward_p99_ms"], r["kv_p50_ms"], share, pct])  # fmt: skip
    out.append(_md(["workload", "tokens/rank", "mode", "path", "forward p50 ms", "p99 ms",
                    "KV update alone p50 ms", "KV share", "vs vllm_gather p50"], fwd))  # fmt: skip
    setup = result.get("setup") or {}
    if setup:
        out.append("")
        out.append(_md(["setup (slowest rank)", "first ms", "second ms", "what"],
                       [[k, v.get("first_s", 0) * 1e3, v.get("second_s", 0) * 1e3, v["what"]]
                        for k, v in setup.items()]))  # fmt: skip
    growth = (result.get("growth") or {}).get("paths", {})
    grow_rows = []
    for k, v in growth.items():
        if isinstance(v, dict) and "total_s" in v:
            parts = ", ".join(f"{p} {_fmt(s * 1e3)}" for p, s in v.get("parts_s", {}).items())
            grow_rows.append([k, v["total_s"] * 1e3, parts or "-", v.get("check", "-")])
        elif isinstance(v, str):
            grow_rows.append([k, None, v, "-"])
    if grow_rows:
        out.append("")
        out.append(_md(["growth to 2x (slowest rank)", "total ms", "parts ms", "replay check"],
                       grow_rows))  # fmt: skip
    skipped = [s for s in result.get("steps", []) if s.get("skipped")]
    if skipped:
        out.append("")
    for s in skipped:
        if s["sequences"] == 1:
            alone = f"--tokens {s['tokens_per_rank']} --batch none"
        else:
            alone = f"--tokens none --batch {s['sequences']}x{s['seq_len']}"
        out.append(f"- skipped: {s['workload']} {s['mode']}: {s['skipped']} (alone: {alone} "
                   f"--modes {s['mode']})")  # fmt: skip
    return "\n".join(out)


def plot(path: str, rows: list[dict[str, Any]]) -> bool:
    """Forward difference vs the baseline and KV share per workload, one line per path and
    mode; False (and a printed line, no file) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print(f"{NAME}: matplotlib is not installed: no {path} (the JSON holds every number)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["workload"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in MODES:
        for name in PATHS:
            pts = [r for r in rows if r["mode"] == mode and r["path"] == name]
            if not pts:
                continue
            xs = [labels.index(r["workload"]) for r in pts]
            style = "-o" if mode == "eager" else "--s"
            if name != BASELINE and any(r["vs_baseline_pct"] is not None for r in pts):
                left.plot(xs, [r["vs_baseline_pct"] for r in pts], style, label=f"{name} {mode}")
            right.plot(xs, [r["kv_share_pct"] for r in pts], style, label=f"{name} {mode}")
    for ax, title in ((left, f"forward p50 vs {BASELINE} (%)"),
                      (right, "KV update alone / forward p50 (%)")):  # fmt: skip
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(title)
        ax.axhline(0, color="grey", linewidth=0.5)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def merge_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One step record from every rank's: each timed iteration counts its slowest rank (ranks
    ran the same iterations in the same order); verification seconds likewise."""
    first = per_rank[0]
    merged = {k: v for k, v in first.items() if k not in ("paths", "verify")}
    if first.get("skipped"):
        return merged
    merged["verify"] = dict(first["verify"])
    merged["verify"]["forward_s"] = {
        p: max(r["verify"]["forward_s"][p] for r in per_rank) for p in first["verify"]["forward_s"]
    }
    merged["paths"] = {}
    for name in first["paths"]:
        merged["paths"][name] = {
            key: [max(vals) for vals in zip(*(r["paths"][name][key] for r in per_rank),
                                            strict=True)]
            for key in ("forward_ms", "kv_ms")
        }  # fmt: skip
    return merged


# ---------------------------------------------------------------------------------------------
# one rank: the model, a workload's tensors, the KV-update paths


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


def mla_kind(indexer_kind: str) -> str:
    """The Main-KV kind to bind: ``fp8_ds_mla_ue8m0`` (vLLM 0.33.0's bytes) where the formats
    table has it with the store combinations used here, else ``fp8_ds_mla``."""
    from vmmkv.ops.formats import FORMATS, STORE_KINDS

    want = "fp8_ds_mla_ue8m0"
    if want in FORMATS and {(want,), (want, indexer_kind)} <= set(STORE_KINDS):
        return want
    return "fp8_ds_mla"


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


class _Update:
    """One KV-update path: ``update(layer, kv_c, k_pe, k, wl)`` writes the layer's rows of every
    rank into this rank's replica (and, for the direct paths, into the peers'); ``buf`` is the
    replica's bytes (the layout starts at its first byte), ``read`` the attention's views of it,
    ``errors`` the out-of-range counter of its targets."""

    name = ""

    def __init__(self, buf, read, errors) -> None:
        self.buf, self.read, self.errors = buf, read, errors
        self.drop_first = False  # testing (--drop-update): skip layer 0's update

    def update(self, layer: int, kv_c, k_pe, k, wl: _Workload) -> None:
        if self.drop_first and layer == 0:
            return
        self._update(layer, kv_c, k_pe, k, wl)

    def _update(self, layer, kv_c, k_pe, k, wl) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Direct(_Update):
    name = "direct"

    def __init__(self, cache, buf, bindings, read) -> None:
        super().__init__(buf, read, cache.error_counter)
        self.cache, self.bindings = cache, bindings

    def _update(self, layer, kv_c, k_pe, k, wl) -> None:
        mla, idx = self.bindings[layer]
        self.cache.publish_layer(mla, idx, kv_c, k_pe, k, wl.own)


class _VmmkvGather(_Direct):
    name = "vmmkv_gather"

    def _update(self, layer, kv_c, k_pe, k, wl) -> None:
        mla, idx = self.bindings[layer]
        self.cache.publish_layer(mla, idx, kv_c, k_pe, k, None,
                                 gathered_slot_mapping=wl.gslots, mode="gather")  # fmt: skip


class _VllmGather(_Update):
    """vLLM 0.33.0's order per layer: gather k, insert the indexer cache; gather kv_c and k_pe,
    insert the MLA cache (see the module docstring)."""

    name = "vllm_gather"

    def __init__(self, buf, read, targets, errors, group, world) -> None:
        import torch.distributed as dist

        from vmmkv import ops

        super().__init__(buf, read, errors)
        self.mla = [ops.prepare((m,)) for m, _ in targets]
        self.idx = [ops.prepare((i,)) for _, i in targets]
        self.group, self.world = group, world
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def _all(self, x):
        import torch

        out = torch.empty((self.world * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        self._gather(out, x, group=self.group)
        return out

    def _update(self, layer, kv_c, k_pe, k, wl) -> None:
        self.idx[layer].store((self._all(k),), wl.gslots)
        self.mla[layer].store((self._all(kv_c), self._all(k_pe)), wl.gslots)


class _SymmMem(_Update):
    name = "symm_mem"

    def __init__(self, tensor, handle, read, targets, errors) -> None:
        from vmmkv import ops

        super().__init__(tensor, read, errors)
        self.handle = handle
        self.stores = [ops.prepare((m, i)) for m, i in targets]

    def _update(self, layer, kv_c, k_pe, k, wl) -> None:
        self.stores[layer].store((kv_c, k_pe, k), wl.own)
        self.handle.barrier()

    def close(self) -> None:
        self.stores = []
        self.handle = None


def _targets(buf, ptr_table, my_rank: int, views, kinds: tuple[str, str]):
    """``(fp8_ds_mla, indexer_k)`` KVTargets per layer over the views of ``buf`` (offsets from
    its first byte, the same in every buffer of ``ptr_table``) and their error counter."""
    import torch

    from vmmkv._store import target_geometry
    from vmmkv.ops.kv import KVTarget

    dev = buf.device
    shared = dict(ptr_table=ptr_table, my_rank=my_rank, cache=buf,
                  committed_bytes=torch.tensor([buf.numel()], dtype=torch.int64, device=dev),
                  error_counter=torch.zeros(1, dtype=torch.int32, device=dev))  # fmt: skip
    base, size = buf.data_ptr(), buf.numel()
    out = [
        tuple(KVTarget(**target_geometry(v, kind, base, size), **shared)
              for v, kind in zip((mla, idx), kinds, strict=True))
        for mla, idx in views
    ]  # fmt: skip
    return out, shared["error_counter"]


# ---------------------------------------------------------------------------------------------
# one rank: the run


class _VerificationError(RuntimeError):
    pass


class _Rank:
    """Everything one rank does (see the module docstring); ``run`` returns rank 0's merged
    result (other ranks: a short status). ``close`` releases every cache and buffer."""

    def __init__(self, rank: int, world: int, opts: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.world, self.opts = rank, world, opts
        self.cpu = opts["cpu"]
        if self.cpu:
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", rank)
            torch.cuda.set_device(self.device)
        self.group = dist.group.WORLD
        self.dgroup = None if self.cpu else dist.new_group(backend="nccl")
        self.shapes = TINY if self.cpu else DEEPSEEK_V32
        # the indexer bytes vLLM writes on this GPU (Hopper: indexer_k, sm_10x: indexer_k_mxfp8)
        self.indexer_kind = "indexer_k"
        if not self.cpu:
            from vmmkv.ops.formats import indexer_kind_for

            self.indexer_kind = indexer_kind_for(torch.cuda.get_device_capability(self.device))
        self.kinds = (mla_kind(self.indexer_kind), self.indexer_kind)
        self.layers = opts["layers"]
        self.specs = [WorkloadSpec(**s) for s in opts["specs"]]
        self.paths: dict[str, _Update] = {}
        self.notes: dict[str, str] = dict(opts["notes"])
        self.cache = None
        self.kept: list[Any] = []  # buffers the paths write (kept alive until close)
        self.rate: float | None = None  # measured FLOP/s of a forward, for the budget guard
        self.partial = opts.get("partial")

    # -- small collective helpers (gloo) ---------------------------------------------------
    def sync(self) -> None:
        import torch

        if not self.cpu:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def all_true(self, flag: bool) -> bool:
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def timed(self, fn):
        """``(fn(), seconds)`` with every rank starting together and the device synchronized."""
        self.sync()
        self.barrier()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0

    def clock_ms(self, fn) -> float:
        """Milliseconds of ``fn``: CUDA events on the current stream, host clock on the CPU."""
        import torch

        if self.cpu:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[{NAME} +{time.time() - self.opts['t0']:.1f}s] {msg}", file=sys.stderr,
                  flush=True)  # fmt: skip

    # -- setup -----------------------------------------------------------------------------
    def sizes(self) -> None:
        from vmmkv.testing.kv import block_stride

        self.stride = block_stride(self.layers)
        need = max(s.blocks for s in self.specs) * self.stride
        gran = 1 << 16 if self.cpu else 2 << 20
        self.chunk = round_up(ceil_div(need, 32), gran)
        self.cap = 32 * self.chunk  # every path's buffer at the start
        # vmmkv's reservation and the growth target: twice, plus a block, so that the growth
        # check can move the smallest workload wholly past the old committed end
        self.capacity = round_up(2 * self.cap + self.stride, self.chunk)
        self.nb_cap, self.nb_capacity = self.cap // self.stride, self.capacity // self.stride

    def setup(self) -> dict[str, Any]:
        """Build every path's cache, timing each construction twice (see the docstring)."""
        import torch

        from vmmkv import ReplicatedKVCache, ops
        from vmmkv.testing.kv import interleaved_views

        out: dict[str, Any] = {}
        if not self.cpu:
            _, out["kernel_load_s"] = self.timed(lambda: ops.warm_up(self.device))
            x = torch.ones(4, device=self.device)
            self._gather_warm(x)
        setup = self.setup_times = {}

        def twice(key: str, what: str, make, drop) -> Any:
            setup[key] = {"what": what}
            obj = None
            for attempt in ("first_s", "second_s"):
                if obj is not None:
                    drop(obj)
                    obj = None
                    if not self.cpu:
                        torch.cuda.empty_cache()
                obj, setup[key][attempt] = self.timed(make)
            return obj

        kw = dict(device_group=self.dgroup, chunk_bytes=self.chunk, initial_bytes=self.cap,
                  barrier_timeout=60.0)  # fmt: skip

        def cache(direct: bool):
            return lambda: ReplicatedKVCache(self.group, self.capacity, self.device,
                                             direct=direct, **kw)  # fmt: skip

        if {"direct", "vmmkv_gather"} & set(self.opts["paths"]):
            self.cache = twice(
                "vmmkv direct", "ReplicatedKVCache: reserve 2x, commit, fd exchange, map peers",
                cache(True), lambda c: c.close(),
            )  # fmt: skip
            buf = self.cache.allocate(self.capacity).view(torch.uint8)
            views = interleaved_views(buf, self.layers, self.nb_capacity)
            binds = [(self.cache.bind(f"l{i}.mla", m, self.kinds[0]),
                      self.cache.bind(f"l{i}.idx", x, self.indexer_kind))
                     for i, (m, x) in enumerate(views)]  # fmt: skip
            read = _read_views(views, self.indexer_kind)
            if "direct" in self.opts["paths"]:
                if self.cache.direct:
                    self.paths["direct"] = _Direct(self.cache, buf, binds, read)
                else:
                    self.notes["direct"] = f"not available: {self.cache.why_not_direct}"
            if "vmmkv_gather" in self.opts["paths"]:
                self.paths["vmmkv_gather"] = _VmmkvGather(self.cache, buf, binds, read)
            gather_only = twice(
                "vmmkv direct=False", "ReplicatedKVCache without peer mapping (gather only)",
                cache(False), lambda c: c.close(),
            )  # fmt: skip
            gather_only.close()
        if "vllm_gather" in self.opts["paths"]:
            buf = twice("vllm plain", "torch.zeros of the same bytes (vLLM's cache)",
                        lambda: torch.zeros(self.cap, dtype=torch.uint8, device=self.device),
                        lambda b: None)  # fmt: skip
            self.kept.append(buf)
            views = interleaved_views(buf, self.layers, self.nb_cap)
            table = torch.tensor([buf.data_ptr()], dtype=torch.int64, device=self.device)
            targets, errors = _targets(buf, table, 0, views, self.kinds)
            group = self.group if self.cpu else self.dgroup
            self.paths["vllm_gather"] = _VllmGather(buf, _read_views(views, self.indexer_kind),
                                                    targets, errors, group, self.world)  # fmt: skip
        if "symm_mem" in self.opts["paths"]:
            self._setup_symm(twice)
        # the baseline first: the verification's reference (its replica needs no barrier)
        order = [BASELINE] + [p for p in PATHS if p != BASELINE]
        self.paths = {p: self.paths[p] for p in order if p in self.paths}
        out["setup"] = setup
        return out

    def _gather_warm(self, x) -> None:
        """One NCCL all-gather, so the communicator exists before any timing or capture."""
        import torch
        import torch.distributed as dist

        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        out = torch.empty(self.world * x.numel(), dtype=x.dtype, device=x.device)
        gather(out, x, group=self.dgroup)
        self.sync()

    def _setup_symm(self, twice) -> None:
        import torch

        error = None
        made = None
        try:
            import torch.distributed._symmetric_memory as symm

            def make():
                t = symm.empty(self.cap, dtype=torch.uint8, device=self.device)
                return t, symm.rendezvous(t, self.group.group_name)

            made = twice("torch symm_mem", "symm_mem.empty + rendezvous of the same bytes", make,
                         lambda th: None)  # fmt: skip
        except Exception as exc:  # reported, and the path left out on every rank
            error = f"{type(exc).__name__}: {exc}"[:300]
        errors = self.gather(error)
        if any(errors):
            self.setup_times.pop("torch symm_mem", None)
            self.notes["symm_mem"] = "not available: " + "; ".join(
                f"rank {r}: {e}" for r, e in enumerate(errors) if e
            )
            return
        self.paths["symm_mem"] = self._symm_path(*made)

    def _symm_path(self, tensor, handle) -> _SymmMem:
        """The symm_mem path over ``tensor`` (its handle's peer pointer table, this layout)."""
        import torch

        from vmmkv.testing.kv import interleaved_views

        views = interleaved_views(tensor, self.layers, tensor.numel() // self.stride)
        table = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=self.device)
        targets, errors = _targets(tensor, table, self.rank, views, self.kinds)
        return _SymmMem(tensor, handle, _read_views(views, self.indexer_kind), targets, errors)

    # -- forwards, graphs --------------------------------------------------------------------
    def layer(self, path: _Update, wl: _Workload, layer: int) -> None:
        x, q_c, kv_c, k_pe, k = self.model.pre(wl.h)
        path.update(layer, kv_c, k_pe, k, wl)
        self.model.post(layer, wl, x, q_c, path.read[layer])

    def forward(self, path: _Update, wl: _Workload) -> None:
        for layer in range(self.layers):
            self.layer(path, wl, layer)

    def kv_only(self, path: _Update, wl: _Workload) -> None:
        kv_c, k_pe, k = wl.kv_in
        for layer in range(self.layers):
            path.update(layer, kv_c, k_pe, k, wl)

    def on_side(self, fn) -> None:
        """Run ``fn`` eagerly on the capture stream (cuBLAS workspaces, NCCL, kernels), ranks
        together."""
        import torch

        self.sync()
        self.barrier()
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(self.side)
        self.sync()
        self.barrier()

    def capture(self, fns, pool) -> list[Any]:
        """One CUDA graph per function, captured on the capture stream into ``pool``."""
        import torch

        graphs = []
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            for fn in fns:
                g = torch.cuda.CUDAGraph()
                g.capture_begin(pool=pool)
                try:
                    fn()
                finally:
                    g.capture_end()
                graphs.append(g)
        torch.cuda.current_stream(self.device).wait_stream(self.side)
        self.sync()
        return graphs

    def graph_forward(self, path: _Update, wl: _Workload, pool):
        """Warm ``path`` once eagerly, capture its L layer graphs; the replaying forward."""
        wl.reset()
        self.on_side(lambda: self.forward(path, wl))
        graphs = self.capture(
            [lambda p=path, i=i: self.layer(p, wl, i) for i in range(self.layers)], pool
        )

        def replay(graphs=graphs) -> None:
            for g in graphs:
                g.replay()

        return replay

    def forwards(self, names: list[str], wl: _Workload, mode: str) -> dict[str, Any]:
        if mode == "eager":
            return {n: (lambda p=self.paths[n]: self.forward(p, wl)) for n in names}
        import torch

        pool = torch.cuda.graph_pool_handle()  # one pool: the forwards replay one at a time
        return {n: self.graph_forward(self.paths[n], wl, pool) for n in names}

    # -- verification ------------------------------------------------------------------------
    def _unwritten(self, path: _Update, wl: _Workload) -> int:
        """Entries (MLA and indexer, every token of the group) of layers 0 and L-1 whose scale
        still holds the poison (a scale is a positive float: never 0xA5A5A5A5)."""
        blk, off = wl.gslots // BLOCK_SIZE, wl.gslots % BLOCK_SIZE
        count = 0
        for layer in sorted({0, self.layers - 1}):
            mla, _, scales, _ = path.read[layer]
            for s in (mla[blk, off, SCALE_AT : SCALE_AT + 4], scales[blk, off]):
                count += int((s == POISON).all(dim=1).sum())
        return count

    def verify(self, fwd: dict[str, Any], wl: _Workload, label: str) -> dict[str, Any]:
        """Poison, run each path's forward once, compare (see the module docstring); raises
        ``_VerificationError`` on every rank when anything differs."""
        import torch

        lo, hi = wl.byte_range(self.stride)
        problems: list[str] = []
        fingerprints: dict[str, tuple[int, int]] = {}
        seconds: dict[str, float] = {}
        ref = None
        me = f"rank {self.rank}"
        for name, fn in fwd.items():
            path = self.paths[name]
            path.buf[lo:hi].fill_(POISON)
            errors_before = int(path.errors.item())
            wl.reset()
            _, seconds[name] = self.timed(fn)
            self.barrier()  # every rank's forward is done: the replicas are final
            mine = path.buf[lo:hi]
            checksum = wl.checksum.clone()
            unwritten = self._unwritten(path, wl)
            if unwritten:
                problems.append(f"{me}: {name}: {unwritten} entries (MLA and indexer) of layers "
                                f"0/{self.layers - 1} still hold the poison (update missing or "
                                "late)")  # fmt: skip
            skipped = int(path.errors.item()) - errors_before
            if skipped:
                problems.append(f"{me}: {name}: {skipped} slots counted out of range")
            if not bool(torch.isfinite(checksum).all()):
                problems.append(f"{me}: {name}: non-finite checksums {checksum.tolist()[:4]}")
            fingerprints[name] = _fingerprint(mine)
            if ref is None:
                ref = (name, mine.clone(), checksum)
            else:
                if not torch.equal(mine, ref[1]):
                    bad = (mine != ref[1]).nonzero().flatten()
                    first = lo + int(bad[0])
                    problems.append(
                        f"{me}: {name}'s replica differs from {ref[0]}'s in {bad.numel()} of "
                        f"{hi - lo} bytes (first at byte {first}: block {first // self.stride})"
                    )
                if not torch.equal(checksum, ref[2]):
                    layers = (checksum != ref[2]).nonzero().flatten().tolist()
                    i = layers[0]
                    problems.append(
                        f"{me}: {name}'s attention checksums differ from {ref[0]}'s in layers "
                        f"{layers[:8]} (layer {i}: {float(checksum[i])!r} vs "
                        f"{float(ref[2][i])!r})"
                    )
            self.barrier()  # before the next path poisons a buffer it may share
        everyone = self.gather((problems, fingerprints))
        messages = [m for probs, _ in everyone for m in probs]
        for name in fingerprints:
            values = [fp[name] for _, fp in everyone]
            if any(v != values[0] for v in values):
                messages.append(f"{name}: the replicas differ across ranks (fingerprints {values})")
        if messages:
            raise _VerificationError(f"verification failed ({label}): " + "; ".join(messages))
        return {
            "passed": True,
            "reference": ref[0],
            "checksum_sum": float(ref[2].sum()),
            "fingerprint": list(fingerprints[ref[0]]),
            "bytes_compared": hi - lo,
            "forward_s": seconds,
        }

    # -- a step ------------------------------------------------------------------------------
    def fits(self, seconds: float) -> bool:
        """Every rank agrees that ``seconds`` more end before the budget's deadline."""
        deadline = self.opts["deadline"]
        return self.all_true(deadline is None or time.time() + seconds <= deadline)

    def step(self, spec: WorkloadSpec, mode: str) -> dict[str, Any]:
        import torch

        label = f"{spec.name} {mode}"
        flops = spec.flops(self.shapes, self.layers)
        rec: dict[str, Any] = {"workload": spec.name, "tokens_per_rank": spec.tokens,
                               "sequences": spec.sequences, "seq_len": spec.seq_len,
                               "mode": mode, "flop_per_forward": flops}  # fmt: skip
        names = list(self.paths)
        iters, warmup = self.opts["iters"], self.opts["warmup"]
        captures = 0.01 * self.layers * len(names) if mode == "graph" else 0.0
        if self.rate:
            need = 1.08 * len(names) * (warmup + iters) * flops / self.rate + captures
            if not self.fits(need):
                rec["skipped"] = f"budget: needs about {need:.0f} s (projected), not left"
                return rec
        wl = _Workload(spec, self.rank, self.shapes, self.layers, self.device, self.opts["seed"])
        for name, path in self.paths.items():
            path.drop_first = name == self.opts["drop_update"]
        try:
            fwd = self.forwards(names, wl, mode)
            rec["verify"] = self.verify(fwd, wl, label)
            seconds = rec["verify"]["forward_s"]
            self.rate = flops * len(seconds) / sum(seconds.values())
            need = 1.08 * sum(seconds.values()) * (warmup - 1 + iters)
            if not self.fits(need):
                rec["skipped"] = f"budget: needs about {need:.0f} s (measured), not left"
                return rec
            for _ in range(warmup - 1):
                for name in names:
                    self.sync()
                    self.barrier()
                    wl.reset()
                    fwd[name]()
            samples: dict[str, list[float]] = {n: [] for n in names}
            for i in range(iters):
                k = i % len(names)
                for name in names[k:] + names[:k]:  # rotated: drift hits every path alike
                    self.sync()
                    self.barrier()
                    wl.reset()
                    samples[name].append(self.clock_ms(fwd[name]))
            kv = self.kv_alone(names, wl, mode)
            rec["paths"] = {n: {"forward_ms": samples[n], "kv_ms": kv[n]} for n in names}
            p50 = sorted(sum(samples[n]) / len(samples[n]) for n in names)[len(names) // 2]
            self.rate = flops / (p50 / 1e3)
            return rec
        finally:
            for path in self.paths.values():
                path.drop_first = False
            fwd = None
            self.sync()
            if not self.cpu:
                torch.cuda.empty_cache()

    def kv_alone(self, names: list[str], wl: _Workload, mode: str) -> dict[str, list[float]]:
        """The L updates of each path alone (see the module docstring)."""
        out = {}
        for name in names:
            path = self.paths[name]

            def updates(path=path) -> None:
                self.kv_only(path, wl)

            if mode == "graph":
                self.on_side(updates)
                (graph,) = self.capture([updates], None)
                run = graph.replay
            else:
                run = updates
                self.sync()
                self.barrier()
                run()
            samples = []
            for _ in range(self.opts["iters"]):
                self.sync()
                self.barrier()
                samples.append(self.clock_ms(run))
            out[name] = samples
            run = graph = None
        return out

    # -- growth ------------------------------------------------------------------------------
    def growth(self) -> dict[str, Any]:
        """vmmkv ``grow`` after capture vs torch symmetric memory's regrow (module docstring);
        raises ``_VerificationError`` on every rank when a replay check fails."""
        import torch

        spec = min(self.specs, key=lambda s: (s.tokens, s.sequences))
        wl = _Workload(spec, self.rank, self.shapes, self.layers, self.device, self.opts["seed"])
        move = ceil_div(self.cap, self.stride)  # the first block wholly past the old end
        if move + spec.blocks > self.nb_capacity:  # sizes() rules it out
            raise AssertionError(f"growth check: {move} + {spec.blocks} > {self.nb_capacity}")
        res: dict[str, Any] = {"workload": spec.name, "from_bytes": self.cap,
                               "to_bytes": self.capacity, "graphs": not self.cpu}  # fmt: skip
        done = res["paths"] = {}
        problems: list[str] = []

        def runner(path):
            if self.cpu:
                return lambda: self.forward(path, wl)
            # A fresh pool each time: the previous path's graphs are gone by the next capture,
            # and capturing into a pool whose graphs were all freed trips torch's allocator.
            return self.graph_forward(path, wl, torch.cuda.graph_pool_handle())

        def run_checked(fn, path, expect_bytes, expect_sum, what) -> None:
            wl.reset()
            errors_before = int(path.errors.item())
            self.timed(fn)
            self.barrier()
            lo, hi = wl.byte_range(self.stride)
            if not torch.equal(wl.checksum, expect_sum):
                problems.append(f"rank {self.rank}: {what}: checksums changed")
            if not torch.equal(path.buf[lo:hi], expect_bytes):
                problems.append(f"rank {self.rank}: {what}: the moved blocks differ")
            if int(path.errors.item()) != errors_before:
                problems.append(f"rank {self.rank}: {what}: slots counted out of range")
            self.barrier()

        vm = self.paths.get("direct") or self.paths.get("vmmkv_gather")
        reference = None
        if vm is not None:
            fwd = runner(vm)
            wl.reset()
            self.timed(fwd)
            self.barrier()
            lo, hi = wl.byte_range(self.stride)
            reference = (vm.buf[lo:hi].clone(), wl.checksum.clone())
            self.barrier()
            _, seconds = self.timed(lambda: self.cache.grow(self.capacity))
            wl.relocate(move)
            run_checked(fwd, vm, *reference, f"{vm.name} replay after grow")
            wl.relocate(-move)
            done[f"vmmkv grow ({vm.name})"] = {"total_s": seconds, "parts_s": {"grow": seconds}}
            fwd = None
        sy = self.paths.get("symm_mem")
        if sy is not None:
            fwd = runner(sy)
            wl.reset()
            self.timed(fwd)
            self.barrier()
            lo, hi = wl.byte_range(self.stride)
            if reference is None:
                reference = (sy.buf[lo:hi].clone(), wl.checksum.clone())
            self.barrier()
            parts: dict[str, float] = {}
            import torch.distributed._symmetric_memory as symm

            def alloc():
                t = symm.empty(self.capacity, dtype=torch.uint8, device=self.device)
                return t, symm.rendezvous(t, self.group.group_name)

            (tensor, handle), parts["empty+rendezvous"] = self.timed(alloc)
            _, parts["copy"] = self.timed(lambda: tensor[: self.cap].copy_(sy.buf))
            new, parts["new targets"] = self.timed(lambda: self._symm_path(tensor, handle))
            fwd, parts["warm-up + recapture"] = self.timed(lambda: runner(new))
            wl.relocate(move)
            run_checked(fwd, new, *reference, "symm_mem replay after regrow")
            wl.relocate(-move)
            if not torch.equal(new.buf[lo:hi], reference[0]):
                problems.append(f"rank {self.rank}: symm_mem: the copied bytes differ")
            self.paths["symm_mem"] = new
            sy.close()
            sy = fwd = None
            done["torch symm_mem regrow"] = {"total_s": sum(parts.values()), "parts_s": parts}
        elif "symm_mem" in self.notes:
            done["torch symm_mem regrow"] = self.notes["symm_mem"]
        everyone = self.gather(problems)
        messages = [m for probs in everyone for m in probs]
        if messages:
            raise _VerificationError("growth check failed: " + "; ".join(messages))
        for v in done.values():
            if isinstance(v, dict):
                v["check"] = "moved blocks byte-exact, same checksums"
        self.sync()
        if not self.cpu:
            torch.cuda.empty_cache()
        return res

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        import torch

        self.sizes()
        self.model = _Model(self.shapes, self.device, self.opts["seed"])
        if not self.cpu:
            self.side = torch.cuda.Stream(self.device)
        devices = self.gather(str(self.device) if self.cpu else
                              f"{self.device} {torch.cuda.get_device_name(self.device)}")  # fmt: skip
        self.log(f"ranks on {devices}; setup of {len(self.opts['paths'])} paths")
        made = self.setup()
        setups = self.gather(made)
        chosen = self.gather(list(self.paths))
        if any(c != chosen[0] for c in chosen):
            raise RuntimeError(
                f"rank {self.rank}: the ranks ended up with different paths {chosen}"
            )
        result: dict[str, Any] = {"devices": devices, "paths": list(self.paths),
                                  "kv_kinds": list(self.kinds)}  # fmt: skip
        if not self.cpu:
            result["kernel_load_s"] = max(s["kernel_load_s"] for s in setups)
        result["setup"] = {
            key: {**entry, **{a: max(s["setup"][key][a] for s in setups)
                              for a in ("first_s", "second_s")}}
            for key, entry in made["setup"].items()
        }  # fmt: skip
        self.log("growth: vmmkv grow after capture vs torch symmetric memory regrow")
        growths = self.gather(self.growth())
        growth = growths[0]
        for key, v in growth["paths"].items():
            if isinstance(v, dict):
                v["total_s"] = max(g["paths"][key]["total_s"] for g in growths)
                v["parts_s"] = {p: max(g["paths"][key]["parts_s"][p] for g in growths)
                                for p in v["parts_s"]}  # fmt: skip
        result["growth"] = growth
        result["steps"] = []
        for spec, mode in steps(self.specs, tuple(self.opts["modes"]),
                                self.opts["graph_max_tokens"]):  # fmt: skip
            self.log(f"{spec.name} ({spec.tokens} tokens/rank) {mode}: {len(self.paths)} paths")
            rec = self.step(spec, mode)
            merged = merge_ranks(self.gather(rec))
            if merged.get("skipped"):
                self.log(f"  skipped: {merged['skipped']}")
            result["steps"].append(merged)
            if self.rank == 0 and self.partial:
                with open(self.partial, "a") as f:
                    f.write(json.dumps(merged) + "\n")
        result["notes"] = self.notes
        return result if self.rank == 0 else {"rank": self.rank}

    def close(self) -> None:
        """Release every path, the vmmkv cache and the buffers (local; runs after errors too)."""
        import torch

        try:
            self.sync()
        except Exception:  # a failed device must not keep the cache open
            pass
        for path in self.paths.values():
            path.close()
        self.paths.clear()
        self.kept.clear()
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        if not self.cpu:
            torch.cuda.empty_cache()


def _fingerprint(data) -> tuple[int, int]:
    """Two wrapping int64 sums of ``data``'s 32-bit words (plain and position-weighted), in
    fixed chunks: equal bytes give equal fingerprints on every rank."""
    import torch

    words = data.view(torch.int32)
    plain = weighted = 0
    step = 1 << 24
    for at in range(0, words.numel(), step):
        chunk = words[at : at + step].to(torch.int64)
        weight = torch.arange(at, at + chunk.numel(), device=chunk.device) % 1000003 + 1
        plain = chunk.sum() + plain
        weighted = (chunk * weight).sum() + weighted
    return int(plain), int(weighted)


def _rank_main(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank (run by ``vmmkv.testing.spawn`` inside its gloo group)."""
    state = _Rank(rank, world, opts)
    try:
        return state.run()
    finally:
        state.close()


# ---------------------------------------------------------------------------------------------


def _reason(error: str) -> str:
    lines = [x for x in error.strip().splitlines() if x.strip()]
    return lines[-1] if lines else error


def main(argv: list[str] | None = None) -> int:
    t0 = time.time()
    args = parse_args(argv)
    if not args.cpu:
        import torch

        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < args.world:
            print(f"{NAME}: needs {args.world} GPUs (one process per GPU: NCCL refuses two ranks "
                  f"on one GPU), found {found}; --cpu runs the logic on the host backend",
                  file=sys.stderr)  # fmt: skip
            return 2
    for what, why in args.notes.items():
        print(f"{NAME}: {what} {why}")
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, f"{NAME}.json")
    partial = os.path.join(args.out, f"{NAME}.partial.jsonl")
    if os.path.exists(partial):
        os.remove(partial)
    shapes = TINY if args.cpu else DEEPSEEK_V32
    plan = steps(args.specs, tuple(args.modes), args.graph_max_tokens)
    print(f"{NAME}: {len(plan)} steps ({', '.join(f'{s.name} {m}' for s, m in plan)}) x "
          f"{len(args.paths)} paths x {args.warmup}+{args.iters} forwards of {args.layers} layers")  # fmt: skip
    if not args.cpu:
        print(f"{NAME}: the forwards alone take about {plan_seconds(args):.0f} s at "
              f"{ASSUMED_TFLOPS:.0f} TFLOPS bf16; add about 40 s (startup, setup, growth, "
              f"KV-only timings); budget guard: "
              f"{f'{args.budget_s:.0f} s' if args.budget_s else 'off'}", flush=True)  # fmt: skip
    options = {k: v for k, v in vars(args).items() if k not in ("specs", "notes")}
    opts = dict(
        cpu=args.cpu, layers=args.layers, specs=[asdict(s) for s in args.specs],
        paths=list(args.paths), modes=list(args.modes), graph_max_tokens=args.graph_max_tokens,
        iters=args.iters, warmup=args.warmup, seed=args.seed, notes=dict(args.notes),
        drop_update=args.drop_update, t0=t0, partial=partial,
        deadline=t0 + args.budget_s - TEARDOWN_S if args.budget_s else None,
    )  # fmt: skip
    from vmmkv.testing.spawn import run_world_raw

    results = run_world_raw(_rank_main, args.world, args=(opts,), timeout=args.timeout)
    extra = dict(options=options, shapes=asdict(shapes),
                 flops_per_token_per_layer={"linear": shapes.linear_flops()})  # fmt: skip
    failed = [r for r in results if not r.ok]
    if failed:
        done = []
        if os.path.exists(partial):
            with open(partial) as f:
                done = [json.loads(line) for line in f if line.strip()]
        errors = {r.rank: r.error[-4000:] for r in failed}
        write_json(json_path, NAME, summarize(done), steps=done, errors=errors, **extra)
        for reason in dict.fromkeys(_reason(e) for e in errors.values()):
            print(f"{NAME}: aborted: {reason}")
        print(f"{NAME}: ranks {sorted(errors)} failed; what finished is in {json_path}")
        return 1
    result = results[0].value
    rows = summarize(result["steps"])
    write_json(json_path, NAME, rows, **extra, **result, elapsed_s=time.time() - t0)
    print(markdown(result, rows))
    plot(os.path.join(args.out, f"{NAME}.png"), rows)
    print(f"{NAME}: {time.time() - t0:.0f} s; JSON in {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
