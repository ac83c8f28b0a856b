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
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import write_json  # noqa: E402
from prefill.model import DEEPSEEK_V32, MODES, TINY, steps, workloads  # noqa: E402
from prefill.paths import PATHS  # noqa: E402
from prefill.rank import _rank_main  # noqa: E402
from prefill.report import NAME, markdown, plot, summarize  # noqa: E402

GPU_TOKENS = (256, 1024, 4096, 16384)
GPU_BATCH = "16x1024"
CPU_TOKENS = (64,)
CPU_BATCH = "4x48"  # prompt length divisible by 2 x world for 2, 3 and 4 ranks
MODEL_LAYERS = 61
ASSUMED_TFLOPS = 650.0  # bf16 GEMM rate of an H200 assumed by the printed plan (not the guard)
TEARDOWN_S = 15.0  # kept free at the end of --budget-s


# ---------------------------------------------------------------------------------------------
# the printed plan


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
