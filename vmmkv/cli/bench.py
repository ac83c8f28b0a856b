"""``python -m vmmkv bench``: direct publication against the gather fallback, over a token sweep.

Spawns the same group as the demo (one process per GPU; two sharing one GPU; host backend
without a GPU). Per step: ``store_layer`` of one Main-KV + Indexer-K layer, then ``barrier``;
direct (peer writes) and gather (all-gather + local insert, NCCL when each rank has its own
GPU) measured side by side in one run: ``--warmup`` untimed steps (20), ``--iters`` timed ones
(100), every step started together on all ranks, p50 and p99 of the slowest rank. With direct
mode and several ranks it also measures a peer copy (each rank copies into the next rank's
region through the mapping) and reports publish bandwidth at the largest T against it. Prints a
table, writes ``<--out>/bench.json`` always (default ``./vmmkv-bench/bench.json``) and
``<--out>/bench.png`` (latency against tokens, one line per path) where matplotlib is
installed (on the host backend its title says the timings are functional checks only); without
it one log line says the plot was skipped; the last line names the files
written (the directory is checked before the sweep, with every argument and environment variable:
a wrong one exits 2). ``--quick`` finishes within a minute. On the host backend the timings are functional
checks, not performance: the output says so and ``bench.json`` has ``"timings": "functional"``
(``"performance"`` on CUDA). The detailed kernel, region and rendezvous benchmarks live in the
repository's ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from . import HOST_TIMINGS, add_group_args, banner, checks, rank_reports, tool_parser

log = logging.getLogger(__name__)

FULL = (1, 8, 32, 128, 512, 2048, 8192)
QUICK = (1, 32, 512, 2048)


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    fill = int(width * done / total)
    sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {label:<24}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _rank(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from .. import ReplicatedKVCache, ops
    from .._util import ceil_div, round_up
    from ..testing.kv import BLOCK_SIZE, block_stride, interleaved_views, layer_inputs
    from ..testing.timing import percentile, time_us

    backend = opts["backend"]
    if backend == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        ngpu = torch.cuda.device_count()
        device_group = dist.new_group(backend="nccl") if ngpu >= world else None
    else:
        device, device_group = torch.device("cpu"), None
    sweep = opts["tokens"]
    nblk = ceil_div(max(sweep) * world, BLOCK_SIZE) + 1
    nbytes = nblk * block_stride(1)
    chunk = opts["chunk"]
    cap = round_up(nbytes, chunk)
    out: dict[str, Any] = {"rank": rank, "rows": []}
    with ReplicatedKVCache(
        dist.group.WORLD, cap, device, device_group=device_group, initial_bytes=cap,
        chunk_bytes=chunk, backend=backend,
    ) as cache:  # fmt: skip
        ((mla_view, idx_view),) = interleaved_views(cache.allocate(nbytes), 1, nblk)
        mla = cache.bind("mla", mla_view, "fp8_ds_mla")
        idx = cache.bind("idx", idx_view, "indexer_k")
        out["direct"] = cache.direct
        if device.type == "cuda":
            ops.warm_up(device)
        for i, t in enumerate(sweep):
            kv_c, k_pe, k = (x.to(device) for x in layer_inputs(1000 * rank + i, t))
            slots = (torch.arange(t) + rank * t).to(device)

            def step(mode, kv_c=kv_c, k_pe=k_pe, k=k, slots=slots):
                cache.store_layer(mla, idx, kv_c, k_pe, k, slots, mode=mode)
                cache.barrier()

            row = {"tokens_per_rank": t}
            for mode in ("direct", "gather") if cache.direct else ("gather",):
                times = time_us(
                    lambda m=mode: step(m),
                    iters=opts["iters"],
                    warmup=opts["warmup"],
                    device=device,
                    before=dist.barrier,  # every rank starts each step together
                )
                row[f"{mode}_p50_us"] = percentile(times, 50)
                row[f"{mode}_p99_us"] = percentile(times, 99)
            out["rows"].append(row)
            if rank == 0:
                _progress(i + 1, len(sweep), f"{t} tokens/rank")
        if cache.direct and world > 1:
            out["peer_copy_GBps"] = _peer_copy_GBps(cache, rank, world, device)
    return out


def _peer_copy_GBps(cache, rank: int, world: int, device) -> float:
    """Unidirectional copy bandwidth into the next rank's region through the peer mapping
    (every rank copies at once, a ring), median of 10 copies of up to 256 MiB."""
    import torch
    import torch.distributed as dist

    from ..testing.timing import percentile, time_us

    n = min(cache.committed_bytes, 256 << 20)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8).to(device)
    dst = cache.region.view((rank + 1) % world)[:n]
    times = time_us(lambda: dst.copy_(src), iters=10, warmup=2, device=device, before=dist.barrier)
    return n / percentile(times, 50) / 1e3


def _plot(path: str, series: dict[str, list[tuple[float, float]]], title: str) -> bool:
    """Latency against tokens, one line per path, through matplotlib, ``title`` above the plot
    and in the PNG's Description; False (one log line, no file) where matplotlib is not
    installed."""
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed: no %s (the JSON holds every number)", path)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in series.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("step latency (us, median, slowest rank)")
    ax.legend()
    ax.set_title(title, fontsize=8, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Title": "vmmkv bench", "Description": title})
    plt.close(fig)
    return True


def parser() -> argparse.ArgumentParser:
    ap = tool_parser("bench", __doc__)
    ap.add_argument("--quick", action="store_true", help="a short sweep (under a minute)")
    add_group_args(ap)
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 20; 3 quick)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (default 100; 10 quick)")
    ap.add_argument(
        "--out",
        default="vmmkv-bench",
        help="directory to write bench.json and bench.png into, created if missing "
        "(default: ./vmmkv-bench, i.e. ./vmmkv-bench/bench.json)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    a, errors, backend, world, chunk = checks.parse_group_args(
        parser(), argv, {"--warmup": 0, "--iters": 1}
    )
    errors += checks.writable("--out", a.out, directory=True)
    if errors:
        return checks.refuse("bench", errors)
    from ..ops.formats import INDEXER_ENTRY_BYTES, MLA_ENTRY_BYTES

    tokens = QUICK if a.quick else FULL
    if backend == "host":
        tokens = tuple(t for t in tokens if t <= 2048)
    opts = {
        "backend": backend,
        "tokens": list(tokens),
        "warmup": a.warmup if a.warmup is not None else (3 if a.quick else 20),
        "iters": a.iters if a.iters is not None else (10 if a.quick else 100),
        "chunk": chunk,
    }
    banner("bench", f"{world} ranks, {backend} backend, tokens/rank {list(tokens)}")
    if backend == "host":
        banner("bench", HOST_TIMINGS)
    reports = rank_reports(_rank, world, opts, timeout=900)
    bad = [r for r in reports if "error" in r]
    if bad:
        for r in bad:
            print(f"rank {r.get('rank')} failed: {r['error']}", file=sys.stderr)
        return 1
    rows = []
    # written to peers per token of one rank
    peer_bytes = (MLA_ENTRY_BYTES + INDEXER_ENTRY_BYTES) * (world - 1)
    for i, t in enumerate(tokens):
        row: dict[str, Any] = {"tokens_per_rank": t}
        for key in reports[0]["rows"][i]:
            if key.endswith("_us"):  # the slowest rank's percentile
                row[key] = max(r["rows"][i][key] for r in reports)
        if "direct_p50_us" in row:
            row["direct/gather"] = row["direct_p50_us"] / row["gather_p50_us"]
            row["publish_GBps"] = t * peer_bytes / row["direct_p50_us"] / 1e3
        rows.append(row)
    summary: dict[str, Any] = {}
    copies = [r["peer_copy_GBps"] for r in reports if "peer_copy_GBps" in r]
    if copies and "publish_GBps" in rows[-1]:
        summary["peer_copy_GBps"] = min(copies)
        summary["publish/peer_copy at the largest T"] = rows[-1]["publish_GBps"] / min(copies)
    cols = list(rows[0])
    print(" | ".join(f"{c:>16}" for c in cols))
    for row in rows:
        print(" | ".join(f"{row[c]:>16.3g}" if isinstance(row[c], float) else f"{row[c]:>16}"
                         for c in cols))  # fmt: skip
    out_dir = os.path.abspath(a.out)
    for k, v in summary.items():
        print(f"{k}: {v:.3g}")
    timings = "functional" if backend == "host" else "performance"
    if backend == "host":
        print(HOST_TIMINGS)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"world": world, "backend": backend, "timings": timings, "opts": opts,
                   "rows": rows, **summary}, f, indent=1)  # fmt: skip
    series = {
        k[: -len("_p50_us")]: [(r["tokens_per_rank"], r[k]) for r in rows]
        for k in cols
        if k.endswith("_p50_us")
    }
    png = os.path.join(out_dir, "bench.png")
    title = HOST_TIMINGS if backend == "host" else f"{world} ranks, {backend} backend"
    wrote = [os.path.join(out_dir, "bench.json")] + ([png] if _plot(png, series, title) else [])
    print(f"wrote {' and '.join(wrote)}")
    return 0
