"""vLLM 0.34's extensible KV cache on vmmkv, in the worker's call order, without vLLM.

vLLM cannot be installed on the GPU machines, so this replays what vLLM 0.34's worker does to
its ``ExtensibleKVCache`` buffer against the plugin's own buffer
(``vmmkv.integrations.vllm._buffer.PeerKVBuffer``) on the CUDA backend, at DeepSeek-V3.2's
size: 61 layers, MLA 41,984 B + indexer 8,448 B per block and layer. Layouts: ``LB`` (LBNHC:
122 segments, the indexer regions then the MLA regions, each padded onto the 2 MiB granule as
vLLM's ``pad_kv_cache_segments`` does) and ``BL`` (BLNHC: one segment of packed blocks). The
buffer sits on a ``ReplicatedKVCache`` with that block layout, grown as ``VllmKVCache.grow``
does (``bench_elastic_gpu.ElasticCache``), in the plugin's own geometry under the extensible
cache (``_buffer._chunk_and_runs``: chunks of the allocation granularity, one run per
stretch of each segment a commit adds), or with ``--chunk-mib`` in chunks of that size, each an
allocation of its own (``VMMKV_CHUNK_MIB``'s geometry).

Steps, each after a ``dist.barrier()`` and ending with the device synchronized (vLLM's commit
rule replayed by :func:`commit`: a shrink releases everything and recommits the prefix):

1. ``allocate``: the null block (1 block under LB, 2 under BL), the allocate hook's commit;
2. ``warmup``: ``--warmup`` blocks, as warmup commits them;
3. ``remap 1``, ``sizing warmup``, ``remap 2``: ``commit(min, shrink=True)``, the sizing
   warmup's commits, ``commit(min, shrink=True)`` again before capture;
4. ``capture``: a CUDA graph (host backend: a plain function) writing a 64-byte stamp into the
   first and the last budget block of the first, a middle and the last segment of this rank's
   own replica, through views of the buffer; not replayed yet (the blocks are not committed);
5. ``extend``: ``commit(--budget, shrink=True)``, then the graph replayed and the stamps read;
6. ``sleep``: ``release_physical``; ``wake``: vLLM's ``recommit``, graph replayed, stamps read,
   the rest of a stamped block read zero;
7. ``discard`` and ``rewake``: the same as sleep and wake (``release_kv_cache_memory``, lending);
8. ``free``.

Per step and rank: ms, committed blocks, own allocations (``chunks``: runs, or chunks with
``--chunk-mib``), the handles this rank exported (``handles``: one per new allocation), each
peer's mapped allocations equal to that peer's own (checked on rank 0 from every rank's
report), the peak of open fds, and ``physical_bytes`` against vLLM's estimate
(``physical_bytes_for``: each segment's committed bytes rounded up to the buffer's
``granularity``). Ranks share the GPU(s) (rank r on GPU r % count) or run on
the host backend. Prints a table and writes JSON (``--out``) with machine, date and commit.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from bench_elastic_gpu import IDX_BLOCK, MLA_BLOCK, ElasticCache, git_commit  # noqa: E402
from common import (
    arguments,
    device_name,
    rank_device,
    ranks_per_config,
    resolve_backend,
    table,
    write_json,
)  # noqa: E402

MiB, GRANULE = 1 << 20, 2 << 20
LAYOUTS = ("LB", "BL")
STAMP = 64  # bytes written per stamped block


def padded_geometry(
    layout: str, layers: int, capacity: int, granule: int = GRANULE
) -> tuple[list[tuple[int, int]], int]:
    """``(segments, bytes)`` as vLLM 0.34 lays out a ``capacity``-block cache under its
    extensible cache: ``(offset, block stride)`` per segment, every LB region starting on the
    granule (BL is not padded)."""
    if layout == "BL":
        packed = layers * (MLA_BLOCK + IDX_BLOCK)
        return [(0, packed)], capacity * packed
    if layout != "LB":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    segs, off = [], 0
    for stride in (IDX_BLOCK,) * layers + (MLA_BLOCK,) * layers:
        segs.append((off, stride))
        off += -(-capacity * stride // granule) * granule
    return segs, off


def estimate(segs: list[tuple[int, int]], blocks: int, unit: int) -> int:
    """vLLM's ``physical_bytes_for(blocks)``: each segment's bytes rounded up to the buffer's
    ``granularity`` (``unit``: the plugin's buffer reports its chunk)."""
    return sum(-(-blocks * stride // unit) * unit for _, stride in segs)


class Replay:
    """vLLM 0.34's ``ExtensibleKVCache.commit``/``recommit`` rule over a ``PeerKVBuffer``."""

    def __init__(self, buffer: Any, segs: list[tuple[int, int]]) -> None:
        self.buffer, self.strides, self.committed = buffer, [s for _, s in segs], 0

    def commit(self, n: int, shrink: bool = False) -> None:
        if shrink and n < self.committed:
            self.buffer.release_physical()
            self.committed = 0
        if n <= self.committed:
            return
        self.buffer.resize_segments_([n * s for s in self.strides], zero_new=True)
        self.committed = n

    def recommit(self) -> None:
        n, self.committed = self.committed, 0
        self.commit(n)


def stamp_sites(segs: list[tuple[int, int]], budget: int) -> list[int]:
    """Byte offsets of the stamps: blocks 0 and ``budget - 1`` of three segments."""
    picked = {0, len(segs) // 2, len(segs) - 1}
    return [off + b * stride for i, (off, stride) in enumerate(segs) if i in picked
            for b in (0, budget - 1)]  # fmt: skip


def run_config(dev: Any, cfg: dict[str, Any], layout: str) -> dict[str, Any]:
    """One layout on this rank (collective): every step's record."""
    import torch
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache
    from vmmkv._util import round_up
    from vmmkv.alloc.region import make_backend
    from vmmkv.integrations.vllm._buffer import PeerKVBuffer, _chunk_and_runs
    from vmmkv.ipc import transports

    segs, size = padded_geometry(layout, cfg["layers"], cfg["capacity"])
    gran = make_backend(dev, cfg["backend"]).granularity
    cap = round_up(size, gran)
    chunk, runs = _chunk_and_runs(gran, size, None, min(cfg["chunk"], cap) or None)
    cache = ReplicatedKVCache(
        dist.group.WORLD, cap, dev, initial_bytes=0, lanes=1, timeout=cfg["timeout"],
        chunk_bytes=chunk, run_bytes=runs, backend=cfg["backend"],
    )  # fmt: skip
    exported: list[Any] = []  # the handles this rank exports (one per new allocation)
    real_export = transports._FdTransport.export
    transports._FdTransport.export = lambda t, owner, c: (
        exported.append(c) or real_export(t, owner, c)
    )
    rank = cache.rank
    out: dict[str, Any] = {"rank": rank, "capacity": cap, "chunk_bytes": cache.chunk_bytes,
                           "run_bytes": cache.region.run_bytes, "path": cache.path,
                           "steps": []}  # fmt: skip
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], len(os.listdir("/proc/self/fd")))
            except OSError:
                pass
            time.sleep(0.002)

    threading.Thread(target=sample, daemon=True).start()
    try:
        raw = cache.allocate(size, reserve=True).view(torch.uint8)
        base = raw.data_ptr() - cache.region.base_ptr
        cache.set_block_layout([(base + off, s) for off, s in segs], cfg["capacity"])
        adapter = ElasticCache(cache, raw, segs)
        adapter.close = cache.close  # its num_blocks is the layout's max_blocks (capacity)
        capacities = [b - a for (a, _), (b, _) in zip(segs, [*segs[1:], (size, 0)], strict=True)]
        buf = PeerKVBuffer(adapter, [o for o, _ in segs], capacities, [s for _, s in segs])
        vllm = Replay(buf, segs)
        minimum = 2 if layout == "BL" else 1
        sites = stamp_sites(segs, cfg["budget"])
        full = buf.full_view()
        src = torch.arange(STAMP, dtype=torch.uint8, device=dev) + 1 + rank
        views = [full[o : o + STAMP] for o in sites]

        def stamp() -> None:
            # A kernel, as vLLM's captured attention writes are: a captured memcpy node into
            # reserved but not yet mapped memory fails at capture (cudaErrorInvalidValue on an
            # H200), where a kernel's write is only resolved at replay.
            for v in views:
                torch.add(src, 0, out=v)

        graph = None

        def capture() -> None:
            nonlocal graph
            if dev.type == "cuda":
                graph = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream(dev)
                with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
                    stamp()

        def replay() -> None:
            graph.replay() if graph is not None else stamp()

        def read() -> dict[str, Any]:
            replay()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            ok = all(torch.equal(v, src) for v in views)
            rest = full[sites[0] + STAMP : sites[0] + segs[0][1]]
            return {"stamps_ok": ok, "rest_zero": int(rest.count_nonzero()) == 0}

        steps = [
            ("allocate", lambda: vllm.commit(minimum), None),
            ("warmup", lambda: vllm.commit(cfg["warmup"]), None),
            ("remap 1", lambda: vllm.commit(minimum, shrink=True), None),
            ("sizing warmup", lambda: vllm.commit(cfg["warmup"]), None),
            ("remap 2", lambda: vllm.commit(minimum, shrink=True), None),
            ("capture", capture, None),
            ("extend", lambda: vllm.commit(cfg["budget"], shrink=True), read),
            ("sleep", buf.release_physical, None),
            ("wake", vllm.recommit, read),
            ("discard", buf.release_physical, None),
            ("rewake", vllm.recommit, read),
        ]
        for name, call, check in steps:
            dist.barrier()
            peak[0] = len(os.listdir("/proc/self/fd"))
            exported.clear()
            t0 = time.perf_counter()
            try:
                call()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
            except Exception as exc:
                raise RuntimeError(f"rank {rank}, step {name!r}: {exc}") from exc
            ms = (time.perf_counter() - t0) * 1e3
            sr = cache.region
            blocks = adapter.committed_blocks
            rec = {"step": name, "ms": ms, "blocks": blocks, "peak_fds": peak[0],
                   "handles": len(exported),
                   "physical": buf.physical_bytes, "estimate": estimate(segs, blocks, buf.granularity),
                   "own": [c.offset for c in sr.region.chunks()],
                   "peers": {str(r): [c.offset for c in sr.peers.mapped_chunks(r)]
                             for r in range(sr.world_size) if r != rank}}  # fmt: skip
            if check is not None:
                dist.barrier()  # every rank committed before anyone reads
                rec.update(check())
            out["steps"].append(rec)
        views.clear()  # the graph and the views go before the buffer
        graph = None
        buf.free()
    finally:
        stop.set()
        transports._FdTransport.export = real_export
        cache.close()
        dist.barrier()  # rank 0 holds the group's store: it leaves after every rank closed
    return out


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    dev = rank_device(rank, cfg["backend"])
    results = []
    for layout in cfg["layouts"]:
        try:
            results.append(run_config(dev, cfg, layout))
        except Exception as exc:
            # The head of the message names the failure (a CUDA error's tail is boilerplate);
            # the whole traceback goes to stderr.
            traceback.print_exc()
            results.append({"rank": rank, "layout": layout,
                            "error": f"{type(exc).__name__}: {exc}"[:600]})  # fmt: skip
    return results


def summarize(world: int, layout: str, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step: the slowest rank's ms, rank 0's blocks, chunks, fd peak and physical
    bytes against vLLM's estimate; whether every rank agrees on the blocks, every peer maps
    exactly its owner's chunks and every read found its stamps."""
    errors = [r["error"] for r in ranks if r.get("error")]
    if errors:
        return [{"pcp": world, "layout": layout, "error": errors[0][:200]}]
    rows = []
    for i, first in enumerate(ranks[0]["steps"]):
        recs = [r["steps"][i] for r in ranks]
        own = {r["rank"]: r["steps"][i]["own"] for r in ranks}
        mapped = all(rec["peers"][str(p)] == own[p] for rec in recs for p in map(int, rec["peers"]))
        row = {"pcp": world, "layout": layout, "step": first["step"],
               "ms": round(max(rec["ms"] for rec in recs), 2), "blocks": first["blocks"],
               "same_blocks": len({rec["blocks"] for rec in recs}) == 1,
               "chunks": len(first["own"]), "handles": first["handles"], "peers_mapped": mapped,
               "peak_fds": max(rec["peak_fds"] for rec in recs),
               "physical_MiB": round(first["physical"] / MiB, 1),
               "estimate_MiB": round(first["estimate"] / MiB, 1)}  # fmt: skip
        if "stamps_ok" in first:
            row["read_ok"] = all(rec["stamps_ok"] and rec["rest_zero"] for rec in recs)
        rows.append(row)
    rows[0]["chunk_MiB"] = ranks[0]["chunk_bytes"] / MiB
    rows[0]["run_MiB"] = ranks[0]["run_bytes"] / MiB
    rows[0]["path"] = ranks[0]["path"]
    return rows


def main() -> None:
    ap = arguments(__doc__, "bench_extensible_gpu")
    ap.add_argument("--ranks", default="2,4", help="PCP group sizes (ranks share the GPUs)")
    ap.add_argument("--layouts", default="LB,BL", help="LB and/or BL")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--capacity", type=int, default=9000, help="blocks reserved (LB: ~27 GiB)")
    ap.add_argument("--budget", type=int, default=8500, help="blocks of the extend")
    ap.add_argument("--warmup", type=int, default=512, help="blocks warmup commits")
    ap.add_argument(
        "--chunk-mib",
        type=float,
        default=0.0,
        help="chunks of this many MiB, one allocation each (0: the plugin's runs)",
    )
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per collective")
    a = ap.parse_args()
    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    if not layouts or any(x not in LAYOUTS for x in layouts):
        ap.error(f"--layouts: a comma-separated subset of {LAYOUTS}, got {a.layouts!r}")
    if not (2 < a.warmup < a.budget <= a.capacity and a.layers > 0 and a.chunk_mib >= 0):
        ap.error("want 2 < --warmup < --budget <= --capacity, --layers > 0, --chunk-mib >= 0")
    chunk = int(a.chunk_mib * MiB)
    backend = resolve_backend(a.backend)
    cfg = dict(layouts=layouts, layers=a.layers, capacity=a.capacity, budget=a.budget,
               warmup=a.warmup, chunk=chunk, backend=backend, timeout=a.timeout)  # fmt: skip
    rows = []
    for world in (int(w) for w in a.ranks.split(",")):
        per_rank = ranks_per_config(rank_main, world, cfg, len(layouts),
                                    a.timeout * 4 * len(layouts))  # fmt: skip
        for i, layout in enumerate(layouts):
            rows += summarize(world, layout, [ranks[i] for ranks in per_rank])
    cols = ["pcp", "layout", "chunk_MiB", "run_MiB", "path", "step", "ms", "blocks", "same_blocks",
            "chunks", "handles", "peers_mapped", "peak_fds", "physical_MiB", "estimate_MiB", "read_ok",
            "error"]  # fmt: skip
    print(f"{backend}: {a.layers} layers, capacity {a.capacity}, warmup {a.warmup}, budget "
          f"{a.budget} blocks; ms: slowest rank; chunks, physical: rank 0's replica")  # fmt: skip
    print(table(rows, [c for c in cols if any(c in r for r in rows)]), flush=True)
    write_json(a.out, "bench_extensible_gpu", rows, device=device_name(backend), commit=git_commit(),
               command=[sys.executable, *sys.argv], settings={**cfg, "layouts": a.layouts})  # fmt: skip


if __name__ == "__main__":
    main()
