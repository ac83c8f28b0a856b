"""DeepSeek-V3.2 KV cache at full size: start, sleep, wake and stores of a PCP group, with fds.

Per rank a 61-layer DeepSeek-V3.2 cache (MLA ``fp8_ds_mla``, 656 B per token, and indexer K,
132 B per token; 64 tokens per block) of ``--gib`` GiB in one of the block layouts vLLM 0.33
allows for it: ``LBNHC`` (layer-major: one segment per layer and cache, 122 segments) or
``BLNHC`` (block-major: one segment of packed blocks). On a ``ReplicatedKVCache`` with a block
layout, the calls the vLLM plugin makes: start (grow 0 -> every block), sleep (shrink to 0),
wake (grow back); then the first and last layers' stores from every rank, checked byte for byte
on every replica against the pure-torch oracle (``vmmkv.ops.reference``), outputs poisoned
first. A sampler thread records each rank's peak of open fds per step.

``--chunk``: ``default`` (the region's own, at most 64 chunks of at most 1 GiB: what the plugin
takes, since it commits everything or nothing), ``budget`` (``block_layout_chunk_bytes``: at
most ``MAX_CHUNKS``), or a size in MiB. ``--nofile N``: RLIMIT_NOFILE soft = hard = N in every
rank first (0: the machine's own). Ranks share the GPU(s) (rank r on GPU r % count), or run on
the host backend (``--backend host``). Prints a table and writes JSON (``--out``), with a model of
a 100 GiB wake at PCP 8 fitted to the wakes measured (``model``); ``--model FILES`` fits it to the
rows of earlier runs instead.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from common import arguments, table, write_json  # noqa: E402

from vmmkv.testing.spawn import run_world_raw  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
LAYERS = 61
BLOCK = 64  # tokens per block
MLA_BLOCK = BLOCK * 656
IDX_BLOCK = BLOCK * 132
STEPS = ("start", "sleep", "wake")


def geometry(layout: str, blocks: int) -> tuple[list[tuple[int, int]], int]:
    """``(segments, bytes)`` of a ``blocks``-block cache in ``layout`` (offsets from the
    backing's start): per layer its MLA run then its indexer run (LBNHC), or one run of packed
    blocks, each holding every layer's MLA block then indexer block (BLNHC)."""
    if layout == "LBNHC":
        segs = []
        for layer in range(LAYERS):
            base = layer * blocks * (MLA_BLOCK + IDX_BLOCK)
            segs += [(base, MLA_BLOCK), (base + blocks * MLA_BLOCK, IDX_BLOCK)]
        return segs, LAYERS * blocks * (MLA_BLOCK + IDX_BLOCK)
    if layout == "BLNHC":
        stride = LAYERS * (MLA_BLOCK + IDX_BLOCK)
        return [(0, stride)], blocks * stride
    raise ValueError(f"layout must be LBNHC or BLNHC, got {layout!r}")


def layer_views(buf: Any, layout: str, blocks: int, layer: int) -> tuple[Any, Any]:
    """Layer ``layer``'s ``(mla [blocks, 64, 656], indexer [blocks, 64, 132])`` uint8 views."""
    from vmmkv.testing.kv import interleaved_views

    if layout == "BLNHC":
        return interleaved_views(buf, LAYERS, blocks)[layer]
    u8 = buf.view(-1)
    base = layer * blocks * (MLA_BLOCK + IDX_BLOCK)
    mla = u8[base : base + blocks * MLA_BLOCK].view(blocks, BLOCK, 656)
    idx = u8[base + blocks * MLA_BLOCK : base + blocks * (MLA_BLOCK + IDX_BLOCK)]
    return mla, idx.view(blocks, BLOCK, 132)


def chunk_bytes(choice: str, segs: list[tuple[int, int]], cap: int, gran: int) -> int | None:
    from vmmkv.alloc.region import block_layout_chunk_bytes

    if choice == "default":
        return None
    if choice == "budget":
        return block_layout_chunk_bytes(segs, cap, gran)
    return int(float(choice) * MiB)


class _FdPeak:
    """The most fds this process held since the last ``reset`` (sampled every 2 ms)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, len(os.listdir("/proc/self/fd")))
            except OSError:  # at the limit itself: nothing to list with
                pass
            time.sleep(0.002)

    def reset(self) -> None:
        time.sleep(0.01)
        self.peak = 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _batch(rank: int, layer: int, slots_all: Any, tokens: int) -> tuple[Any, ...]:
    from vmmkv.testing.kv import layer_inputs

    slots = slots_all[rank * tokens : (rank + 1) * tokens]
    return (*layer_inputs(1000 * layer + 100 * (rank + 1), tokens), slots)


def _verify_stores(cache, buf, layout, blocks, rank, world, tokens, sync) -> int:
    """Every rank publishes ``tokens`` rows into two layers (first and last); returns the bytes
    of this replica that differ from the oracle (0 when byte-exact)."""
    import torch

    from vmmkv.ops import reference as ref

    dev = cache.device
    g = torch.Generator().manual_seed(7)
    slots_all = torch.randperm(blocks * BLOCK, generator=g)[: world * tokens]
    layers = (0, LAYERS - 1)
    bound, before = [], []
    for layer in layers:
        mla, idx = layer_views(buf, layout, blocks, layer)
        bound.append((cache.bind(f"mla.{layer}", mla, "fp8_ds_mla"),
                      cache.bind(f"idx.{layer}", idx, "indexer_k"), mla, idx))  # fmt: skip
        gen = torch.Generator(device=dev).manual_seed(31 * rank + layer)
        for v in (mla, idx):
            v.copy_(torch.randint(1, 256, v.shape, generator=gen, device=dev, dtype=torch.uint8))
        before.append((mla.cpu(), idx.cpu()))
    sync()
    for layer, (bm, bi, _, _) in zip(layers, bound, strict=True):
        kv_c, k_pe, k, slots = (t.to(dev) for t in _batch(rank, layer, slots_all, tokens))
        cache.publish_layer(bm, bi, kv_c, k_pe, k, slots)
    sync()
    bad = 0
    for layer, (_, _, mla, idx), (want_mla, want_idx) in zip(layers, bound, before, strict=True):
        for r in range(world):
            kv_c, k_pe, k, slots = _batch(r, layer, slots_all, tokens)
            ref.insert_ds_mla(want_mla, kv_c, k_pe, slots)
            ref.insert_indexer_k(want_idx, k, slots)
        bad += int((mla.cpu() != want_mla).sum()) + int((idx.cpu() != want_idx).sum())
    return bad


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of one configuration (spawned, in a gloo group): the seconds and fd peak of
    each step, the chunk geometry, and the stores' mismatching bytes."""
    import resource

    import torch
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache
    from vmmkv._util import round_up
    from vmmkv.alloc.region import make_backend

    if cfg["nofile"]:
        resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["nofile"], cfg["nofile"]))
    if cfg["backend"] == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier()

    blocks = cfg["blocks"] or int(cfg["gib"] * GiB) // (LAYERS * (MLA_BLOCK + IDX_BLOCK))
    segs, size = geometry(cfg["layout"], blocks)
    gran = make_backend(dev, cfg["backend"]).granularity
    cap = round_up(size, gran)
    out: dict[str, Any] = {"rank": rank, "blocks": blocks, "size_GiB": size / GiB,
                           "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[1]}  # fmt: skip
    cache = ReplicatedKVCache(
        dist.group.WORLD, cap, dev, initial_bytes=0, lanes=1, timeout=cfg["timeout"],
        chunk_bytes=chunk_bytes(cfg["chunk"], segs, cap, gran), backend=cfg["backend"],
    )  # fmt: skip
    peak = _FdPeak()
    try:
        out.update(chunk_MiB=cache.chunk_bytes / MiB, chunks=-(-cap // cache.chunk_bytes),
                   path=cache.path)  # fmt: skip
        buf = cache.allocate(size, reserve=True).view(torch.uint8)
        base = buf.data_ptr() - cache.region.base_ptr
        cache.set_block_layout([(base + off, bb) for off, bb in segs], blocks)
        steps = {"start": blocks, "sleep": 0, "wake": blocks}
        for step, n in steps.items():
            sync()
            peak.reset()
            t0 = time.perf_counter()
            try:
                (cache.grow_blocks if n else cache.shrink_blocks)(n)
                error = ""
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            out[step] = {"s": time.perf_counter() - t0, "peak_fds": peak.peak, "error": error,
                         "committed_GiB": cache.committed_bytes / GiB}  # fmt: skip
            if error:
                return out
        out["bad_bytes"] = _verify_stores(
            cache, buf, cfg["layout"], blocks, rank, world, cfg["tokens"], sync
        )
        cache.close()
        dist.barrier()  # rank 0 holds the group's store: it leaves after every rank closed
        return out
    finally:
        peak.stop()
        cache.close()


def run(world: int, **cfg: Any) -> list[dict[str, Any]]:
    """``rank_main`` on ``world`` spawned ranks; a rank that failed gives ``{"error": ...}``."""
    results = run_world_raw(rank_main, world, args=(cfg,), timeout=cfg["timeout"] * 6)
    return [r.value if r.ok else {"rank": r.rank, "error": r.error[-600:]} for r in results]


def summarize(world: int, cfg: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row: the slowest rank's seconds and the highest fd peak per step."""
    row: dict[str, Any] = {"pcp": world, "layout": cfg["layout"], "nofile": ranks[0].get("nofile"),
                           "GiB": round(ranks[0].get("size_GiB", 0), 1)}  # fmt: skip
    if any("error" in r and r.get("start") is None for r in ranks):
        row["error"] = next(r["error"] for r in ranks if "error" in r)[-200:]
        return row
    row.update(chunk_MiB=ranks[0]["chunk_MiB"], chunks=ranks[0]["chunks"], path=ranks[0]["path"])
    for step in STEPS:
        done = [r[step] for r in ranks if step in r]
        if len(done) < len(ranks):
            break
        row[f"{step}_s"] = round(max(d["s"] for d in done), 3)
        row[f"{step}_fds"] = max(d["peak_fds"] for d in done)
        errors = {d["error"] for d in done if d["error"]}
        if errors:
            row["error"] = sorted(errors)[0][:200]
            return row
    row["bad_bytes"] = sum(r.get("bad_bytes", -1) for r in ranks)
    return row


def model(rows: list[dict[str, Any]], gib: float = 100.0, pcp: int = 8) -> dict[str, Any]:
    """A wake of ``gib`` GiB per rank at PCP ``pcp``, fitted to the wakes measured: seconds =
    ``a + b (W - 1) + N (c + d (W - 1))`` for ``W`` ranks and ``N`` chunks (least squares over
    every run, whatever its layout and chunk rule; a step's fixed cost and its per-chunk cost
    apart). Ranks sharing one GPU contend for it and for the host's cores, so on separate GPUs
    this is an upper bound. Returns the coefficients and, per chunk rule, the chunk count at
    ``gib`` GiB (LBNHC geometry, 2 MiB granularity) and the modelled seconds."""
    import torch

    from vmmkv._util import round_up
    from vmmkv.alloc.region import block_layout_chunk_bytes

    done = [r for r in rows if "wake_s" in r]
    if len({(r["pcp"], r["chunks"]) for r in done}) < 4:
        return {}
    a = torch.tensor([[1.0, r["pcp"] - 1, r["chunks"], r["chunks"] * (r["pcp"] - 1)]
                      for r in done], dtype=torch.float64)  # fmt: skip
    y = torch.tensor([[r["wake_s"]] for r in done], dtype=torch.float64)
    coef = torch.linalg.lstsq(a, y).solution.flatten().tolist()
    segs, size = geometry("LBNHC", int(gib * GiB) // (LAYERS * (MLA_BLOCK + IDX_BLOCK)))
    cap = round_up(size, 2 * MiB)
    rules = {"default": min(round_up(-(-cap // 64), 2 * MiB), GiB),
             "budget": block_layout_chunk_bytes(segs, cap, 2 * MiB)}  # fmt: skip
    out: dict[str, Any] = {
        "fit_ms": dict(
            zip(
                ("step", "step_per_peer", "chunk", "chunk_per_peer"),
                (round(c * 1e3, 4) for c in coef),
                strict=True,
            )
        ),  # fmt: skip
        "runs": len(done),
        "GiB": gib,
        "pcp": pcp,
    }
    for rule, chunk in rules.items():
        n = -(-cap // chunk)
        secs = coef[0] + (pcp - 1) * coef[1] + n * (coef[2] + (pcp - 1) * coef[3])
        out[rule] = {"chunk_MiB": chunk // MiB, "chunks": n, "wake_s": round(secs, 3)}
    return out


def main() -> None:
    ap = arguments(__doc__, "bench_scale")
    ap.add_argument("--ranks", default="2,4,8", help="PCP group sizes")
    ap.add_argument("--gib", default="50,25,12", help="GiB per rank, one per group size")
    ap.add_argument("--blocks", type=int, default=0, help="blocks per rank (overrides --gib)")
    ap.add_argument("--layouts", default="LBNHC,BLNHC")
    ap.add_argument("--chunks", default="default", help="default, budget or MiB; comma list")
    ap.add_argument("--nofile", default="0,4096", help="RLIMIT_NOFILE per run (0: as is)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank and stored layer")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "host"))
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument(
        "--model",
        nargs="*",
        metavar="JSON",
        help="only fit the model to the rows of these bench_scale JSON files",
    )
    a = ap.parse_args()
    if a.model:
        rows = [r for path in a.model for r in json.load(open(path))["rows"]]
        fit = model(rows)
        print(json.dumps(fit, indent=1))
        write_json(a.out, "bench_scale_model", [], model=fit, inputs=a.model)
        return
    worlds = [int(w) for w in a.ranks.split(",")]
    gibs = [float(g) for g in a.gib.split(",")]
    if len(gibs) == 1:
        gibs *= len(worlds)
    if len(gibs) != len(worlds):
        ap.error(f"--gib has {len(gibs)} values for {len(worlds)} group sizes")
    rows = []
    for world, gib in zip(worlds, gibs, strict=True):
        for layout in a.layouts.split(","):
            for rule in a.chunks.split(","):
                for nofile in (int(n) for n in a.nofile.split(",")):
                    cfg = dict(gib=gib, blocks=a.blocks, layout=layout, chunk=rule,
                               nofile=nofile, tokens=a.tokens, backend=a.backend,
                               timeout=a.timeout)  # fmt: skip
                    row = {**summarize(world, cfg, run(world, **cfg)), "rule": rule}
                    print(row, file=sys.stderr, flush=True)
                    rows.append(row)
    cols = ["pcp", "layout", "rule", "GiB", "nofile", "chunk_MiB", "chunks", "start_s",
            "start_fds", "sleep_s", "wake_s", "wake_fds", "bad_bytes", "error"]  # fmt: skip
    print(table(rows, [c for c in cols if any(c in r for r in rows)]))
    fit = model(rows)
    if fit:
        print("model of a 100 GiB wake at PCP 8 (an upper bound on separate GPUs):")
        print(json.dumps(fit))
    write_json(a.out, "bench_scale", rows, model=fit)


if __name__ == "__main__":
    main()
