"""Elastic KV, the worker side: grow and release latency of DeepSeek-V3.2-sized caches by layout.

Per rank a 61-layer DeepSeek-V3.2 cache (MLA 41,984 B + indexer 8,448 B per block and layer) of
``--max-blocks`` blocks on a :class:`vmmkv.ReplicatedKVCache` with a block layout, in one of two
layouts: ``BL`` (BLNHC: one segment of packed blocks, 3,076,352 B each) or ``LB`` (LBNHC: 122
segments, the 61 indexer segments of 8,448 B per block then the 61 MLA segments of 41,984 B per
block, each ``max_blocks`` blocks long). Every resize goes through the plugin's worker side,
``ElasticWorker.apply(cache, (seq, target))`` of ``vmmkv.integrations.vllm._elastic_worker``, over
an adapter that makes the cache calls ``VllmKVCache`` makes (``grow_blocks``, ``shrink_blocks``,
``set_committed_blocks``; no zeroing or barrier of its own).

Steps per configuration (layout, chunk size, ranks): 0 -> ``--floor`` (1000), then ``--reps``
times a watermark grow ``+--step`` (256) and its release back to the floor, then a hole: the
``--step`` blocks in the middle of the floor released (``(seq, block set)``, the chunks wholly
inside them decommitted) and recommitted (``(seq, floor)``), then a full grow to
``--max-blocks`` (4000, like a wake) and a release to 0. Each step starts after a
``dist.barrier()`` and ends when the device is synchronized; per step and rank: ms, chunks
committed or released on this rank, committed blocks, and ``committed_bytes / (blocks x
block_bytes)``. Outside the timing, every step is checked (``zero_ok``): before it, every
committed block of the own replica is dirtied; after it, each rank at once stamps the first byte
of every block that joined the set in the next rank's replica, and after a barrier every joined
block reads zero in the own replica but for those stamps (a rank that zeroed late would erase a
stamp, one that did not zero would show the dirt). Rows: the slowest rank per repetition, then
the median over repetitions. The criterion (BL at 1000 blocks, 2 processes): ratio <= 1.01 and
a +256 grow <= 30 ms.

Ranks share the GPU(s) (rank r on GPU r % count) or run on the host backend (``--backend
host``); each group size is one spawn running every configuration in turn. ``--configs``:
``LAYOUT:SIZE`` pairs, SIZE in MiB or with a ``K`` suffix in KiB (``BL:64K``): the region's
chunk, each chunk an allocation of its own; with ``--runs``, SIZE is the run grid instead
(elastic mode's geometry in the plugin: chunks of the allocation granularity, runs cut at
SIZE), and ``*_chunks`` count the allocations a step created or released either way. Prints a table and
writes JSON (``--out``) with the machine, date, commit and command line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from common import (
    arguments,
    device_name,
    median,
    rank_device,
    ranks_per_config,
    resolve_backend,
    table,
    write_json,
)  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
MLA_BLOCK, IDX_BLOCK = 41984, 8448  # bytes per block and layer (64 tokens x 656 B, x 132 B)
LAYOUTS = ("BL", "LB")
CRITERION = {"ratio": 1.01, "grow_ms": 30.0}  # the issue's, for BL at 1000 blocks, 2 processes


def geometry(layout: str, layers: int, max_blocks: int) -> tuple[list[tuple[int, int]], int]:
    """``(segments, bytes)`` of a ``max_blocks``-block cache of ``layers`` layers in ``layout``,
    offsets from the backing's start: ``BL`` one segment of packed blocks (every layer's MLA
    and indexer block), ``LB`` the indexer segments of every layer, then the MLA segments."""
    if layout == "BL":
        packed = layers * (MLA_BLOCK + IDX_BLOCK)
        return [(0, packed)], max_blocks * packed
    if layout == "LB":
        segs, off = [], 0
        for bb in (IDX_BLOCK,) * layers + (MLA_BLOCK,) * layers:
            segs.append((off, bb))
            off += max_blocks * bb
        return segs, off
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def parse_configs(text: str) -> list[tuple[str, int]]:
    """``"BL:32,LB:2,BL:64K"`` -> ``[("BL", 32 MiB), ("LB", 2 MiB), ("BL", 64 KiB)]``."""
    out = []
    for item in text.split(","):
        layout, sep, size = item.strip().partition(":")
        if not sep or layout not in LAYOUTS or not size:
            raise ValueError(f"config {item!r}: want LAYOUT:SIZE with LAYOUT in {LAYOUTS}")
        unit = KiB if size[-1] in "kK" else MiB
        out.append((layout, int(float(size.rstrip("kK")) * unit)))
    return out


def git_commit() -> str | None:
    """``$GIT_COMMIT`` when set (the device machines run a copy whose ``.git`` may not be the
    code's), else ``git rev-parse --short HEAD`` of this checkout (``+dirty`` with local
    changes), else None."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True).stdout  # fmt: skip
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout  # fmt: skip
        return head.strip() + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


class ElasticCache:
    """What ``ElasticWorker.apply`` resizes: a ``ReplicatedKVCache`` with a block layout over
    ``buffer`` (``segments`` in buffer offsets), resized with the calls ``VllmKVCache`` makes
    (``grow_blocks``, ``shrink_blocks``, ``set_committed_blocks``) and nothing else: blocks that
    join the set read zero in every replica because vmmkv's resize zeroes them before the
    agreement that lets a peer map them (:func:`check_step` checks it every step)."""

    def __init__(self, cache: Any, buffer: Any, segments: list[tuple[int, int]]) -> None:
        self.cache, self.buffer, self.segments = cache, buffer, segments

    rank = property(lambda self: self.cache.rank)
    num_blocks = property(lambda self: self.cache.region.max_blocks)
    committed_block_set = property(lambda self: self.cache.committed_block_set or ())

    @property
    def committed_blocks(self) -> int:
        return int(self.cache.committed_blocks or 0)

    def set_committed_blocks(self, intervals: Any) -> Any:
        return self.cache.set_committed_blocks(intervals)

    def grow(self, n: int) -> int:
        return self.cache.grow_blocks(n)

    def shrink(self, n: int) -> int:
        return self.cache.shrink_blocks(n)


DIRT, STAMP = 0xA5, 0x5A
PIECE = 256 << 20  # bytes of a replica the zero check reads at once


def dirty(adapter: ElasticCache) -> None:
    """Every committed block of every segment of the own replica set to ``DIRT``: a chunk that a
    release keeps (a hole's edges, a neighbouring segment's) holds these bytes afterwards."""
    for off, bb in adapter.segments:
        for a, b in adapter.committed_block_set:
            adapter.buffer[off + a * bb : off + b * bb].fill_(DIRT)


def check_step(adapter: ElasticCache, old: Any, replicas: list[Any], base: int) -> str:
    """Collective, after a step returned on this rank: at once (no barrier) stamp ``STAMP`` into
    the first byte of every block that joined the set, in the next rank's replica, as a peer's
    store would; then, after a host barrier, every block that joined reads zero in the own
    replica but for the previous rank's stamps. A rank that zeroed its replica after the step
    returned elsewhere would erase a stamp; one that did not zero would show ``DIRT``. Reads
    in pieces of at most ``PIECE`` bytes (a whole cache at once would need temporaries of its
    size, which the next grow's ``cuMemCreate`` could then not have) and returns the caching
    allocator's memory to the driver. Returns "" or what was wrong; an exception is reported
    the same way, so every rank reaches both barriers."""
    import torch
    import torch.distributed as dist

    from vmmkv import _blockset as blockset

    rank, world = adapter.rank, dist.get_world_size()
    added = blockset.difference(adapter.committed_block_set, old)
    dev, wrong = adapter.buffer.device, []
    stamped = world > 1
    try:
        if stamped:
            nxt = replicas[(rank + 1) % world]
            for off, bb in adapter.segments:
                for a, b in added:
                    idx = torch.arange(base + off + a * bb, base + off + b * bb, bb, device=dev)
                    nxt.index_fill_(0, idx, STAMP)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as exc:  # reported, not raised: the peers wait at the barrier
        wrong.append(f"stamping: {type(exc).__name__}: {exc}"[:300])
    dist.barrier()
    try:
        own = replicas[rank]
        for off, bb in adapter.segments:
            for a, b in added:
                step = max(1, PIECE // bb)
                for lo in range(a, b, step):
                    hi = min(b, lo + step)
                    piece = own[base + off + lo * bb : base + off + hi * bb]
                    firsts = piece[::bb]
                    nonzero = int(torch.count_nonzero(piece))
                    good = (firsts == STAMP).all() if stamped else (firsts == 0).all()
                    if nonzero != (hi - lo if stamped else 0) or not bool(good):
                        wrong.append(f"segment at {off} blocks [{lo}, {hi})")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    except Exception as exc:
        wrong.append(f"checking: {type(exc).__name__}: {exc}"[:300])
    dist.barrier()  # every rank checked before the next step dirties its replica
    return f"rank {rank}: joined blocks not zero or a stamp lost: {wrong[:3]}" if wrong else ""


def hole(floor: int, step: int) -> tuple[tuple[int, int], ...]:
    """The floor with ``step`` blocks released in its middle: the hole step's block set."""
    lo = max(0, floor // 2 - step // 2)
    hi = min(floor, lo + step)
    return tuple(iv for iv in ((0, lo), (hi, floor)) if iv[0] < iv[1])


def plan(floor: int, step: int, max_blocks: int, reps: int) -> list[tuple[str, Any]]:
    """The ``(step name, target)`` sequence of one configuration: a target is a block count
    (the prefix) or a block set (the hole)."""
    out: list[tuple[str, Any]] = [("floor", floor)]
    for _ in range(reps):
        out += [("grow", floor + step), ("release", floor)]
    out += [("hole", hole(floor, step)), ("recommit", floor)]
    return out + [("full", max_blocks), ("zero", 0)]


def run_config(dev: Any, cfg: dict[str, Any], layout: str, chunk: int) -> dict[str, Any]:
    """One configuration on this rank (collective): every step's ms, committed blocks and bytes,
    and allocations (chunks, or runs with ``cfg["runs"]``) created or released on this rank."""
    import torch
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache
    from vmmkv._util import round_up
    from vmmkv.alloc.region import make_backend
    from vmmkv.integrations.vllm._elastic_worker import ElasticWorker

    segs, size = geometry(layout, cfg["layers"], cfg["max_blocks"])
    gran = make_backend(dev, cfg["backend"]).granularity
    cap = round_up(size, gran)
    pieces = dict(chunk_bytes=min(chunk, cap))
    if cfg.get("runs"):  # granule chunks in runs cut at `chunk` (the plugin's elastic mode)
        pieces = dict(chunk_bytes=gran, run_bytes=round_up(chunk, gran))
    cache = ReplicatedKVCache(
        dist.group.WORLD, cap, dev, initial_bytes=0, lanes=1, timeout=cfg["timeout"],
        backend=cfg["backend"], **pieces,
    )  # fmt: skip
    out: dict[str, Any] = {"rank": cache.rank, "capacity": cap, "chunk_bytes": cache.chunk_bytes,
                           "run_bytes": cache.region.run_bytes, "path": cache.path,
                           "steps": []}  # fmt: skip
    try:
        buffer = cache.allocate(size, reserve=True).view(torch.uint8)
        base = buffer.data_ptr() - cache.region.base_ptr
        out["base"] = base
        cache.set_block_layout([(base + off, bb) for off, bb in segs], cfg["max_blocks"])
        adapter, worker = ElasticCache(cache, buffer, segs), ElasticWorker()
        replicas = [cache.region.view(q, reserve=True) for q in range(dist.get_world_size())]
        block_bytes = sum(bb for _, bb in segs)
        for seq, (name, target) in enumerate(
            plan(cfg["floor"], cfg["step"], cfg["max_blocks"], cfg["reps"]), start=1
        ):
            before, old = set(cache.region.region.chunks()), adapter.committed_block_set
            dirty(adapter)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            dist.barrier()
            t0 = time.perf_counter()
            error = ""
            try:
                worker.apply(adapter, (seq, target))
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
            except Exception as exc:  # a rank whose size changed: apply re-raises
                error = f"{type(exc).__name__}: {exc}"
            ms = (time.perf_counter() - t0) * 1e3
            blocks, committed = adapter.committed_blocks, cache.committed_bytes
            held = [list(iv) for iv in adapter.committed_block_set]
            count = sum(b - a for a, b in held)
            error = error or worker.error or ""
            zero = "" if error else check_step(adapter, old, replicas, base)
            out["steps"].append({
                "step": name, "target": target, "ms": ms, "blocks": blocks, "held": held,
                "committed_bytes": committed,
                "chunks": len(before ^ set(cache.region.region.chunks())),
                "ratio": committed / (count * block_bytes) if count else None, "error": error,
                "zero": zero,
            })  # fmt: skip
            if error:
                break
    finally:
        cache.close()
        dist.barrier()  # rank 0 holds the group's store: it leaves after every rank closed
    return out


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Every configuration in turn on this rank (spawned, in a gloo group); one that raised
    gives ``{"error": ...}`` and the next one starts."""
    dev = rank_device(rank, cfg["backend"])
    results = []
    for layout, chunk in cfg["configs"]:
        try:
            results.append(run_config(dev, cfg, layout, chunk))
        except Exception as exc:
            results.append({"rank": rank, "error": f"{type(exc).__name__}: {exc}"[-600:]})
    return results


def _held(target: Any) -> list[list[int]]:
    """A step's target as the committed set its ranks report (JSON lists)."""
    if isinstance(target, int):
        return [[0, target]] if target else []
    return [list(iv) for iv in target]


def summarize(world: int, layout: str, chunk: int, ranks: list[dict[str, Any]],
              cfg: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """One row: per step name the slowest rank's ms (median over repetitions and the worst),
    rank 0's chunks and ratio; whether every rank reports every target's blocks; the raw
    per-rank steps under ``ranks``."""
    segs, _ = geometry(layout, cfg["layers"], cfg["max_blocks"])
    row: dict[str, Any] = {"pcp": world, "layout": layout, "chunk_MiB": chunk / MiB,
                           "segments": len(segs), "block_bytes": sum(bb for _, bb in segs),
                           "ranks": ranks}  # fmt: skip
    errors = [r["error"] for r in ranks if r.get("error")]
    errors += [s["error"] for r in ranks for s in r.get("steps", ()) if s["error"]]
    if errors:
        row["error"] = errors[0][-200:]
    done = [r["steps"] for r in ranks if "steps" in r]
    if len(done) < len(ranks) or not done:
        return row
    row["chunk_MiB"] = ranks[0]["chunk_bytes"] / MiB
    if cfg.get("runs"):
        row["run_MiB"] = ranks[0]["run_bytes"] / MiB
    row["path"] = ranks[0]["path"]
    n = min(len(s) for s in done)
    want = plan(cfg["floor"], cfg["step"], cfg["max_blocks"], cfg["reps"])
    row["zero_ok"] = n == len(want) and not any(s[i]["zero"] for s in done for i in range(n))
    row["blocks_ok"] = n == len(want) and all(  # every rank at every step's target
        all(s[i]["held"] == _held(target) for s in done) for i, (_, target) in enumerate(want)
    )
    for name in ("floor", "grow", "release", "hole", "recommit", "full", "zero"):
        idx = [i for i in range(n) if done[0][i]["step"] == name]
        if not idx:
            continue
        worst = [max(s[i]["ms"] for s in done) for i in idx]  # slowest rank per repetition
        row[f"{name}_ms"] = round(median(worst), 2)
        if len(idx) > 1:
            row[f"{name}_max_ms"] = round(max(worst), 2)
        row[f"{name}_chunks"] = done[0][idx[0]]["chunks"]
        ratio = done[0][idx[0]]["ratio"]
        if ratio is not None:
            row[f"{name}_ratio"] = round(ratio, 4)
    if "floor_ratio" in row and "grow_ms" in row:
        row["criterion"] = (row["floor_ratio"] <= CRITERION["ratio"]
                            and row["grow_ms"] <= CRITERION["grow_ms"])  # fmt: skip
    return row


def main() -> None:
    ap = arguments(__doc__, "bench_elastic_gpu")
    ap.add_argument("--ranks", default="2,4", help="PCP group sizes (ranks share the GPUs)")
    ap.add_argument("--configs", default="BL:32,BL:64,LB:2",
                    help="LAYOUT:SIZE pairs (BL or LB; chunk in MiB, or KiB with a K suffix)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--max-blocks", type=int, default=4000, help="blocks of a full cache")
    ap.add_argument("--floor", type=int, default=1000, help="blocks after the first grow")
    ap.add_argument("--step", type=int, default=256, help="blocks of a watermark grow")
    ap.add_argument("--reps", type=int, default=10, help="watermark grow + release pairs")
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"))
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per collective")
    ap.add_argument("--runs", action="store_true",
                    help="SIZE is the run grid over granule chunks (elastic mode in the plugin)")  # fmt: skip
    a = ap.parse_args()
    if not (0 < a.floor and 0 < a.step and a.floor + a.step <= a.max_blocks and a.reps > 0):
        ap.error("want 0 < --floor, 0 < --step, --floor + --step <= --max-blocks, --reps > 0")
    try:
        configs = parse_configs(a.configs)
    except ValueError as exc:
        ap.error(str(exc))
    backend = resolve_backend(a.backend)
    cfg = dict(configs=configs, layers=a.layers, max_blocks=a.max_blocks, floor=a.floor,
               step=a.step, reps=a.reps, backend=backend, timeout=a.timeout)  # fmt: skip
    if a.runs:
        cfg["runs"] = True
    rows = []
    for world in (int(w) for w in a.ranks.split(",")):
        t0 = time.perf_counter()
        per_rank = ranks_per_config(rank_main, world, cfg, len(configs),
                                    a.timeout * 4 * len(configs))  # fmt: skip
        for i, (layout, chunk) in enumerate(configs):
            row = summarize(world, layout, chunk, [ranks[i] for ranks in per_rank], cfg)
            print({k: v for k, v in row.items() if k != "ranks"}, file=sys.stderr, flush=True)
            rows.append(row)
        print(f"pcp {world}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    cols = ["pcp", "layout", "chunk_MiB", "run_MiB", "segments", "path", "floor_ms", "floor_chunks",
            "floor_ratio", "grow_ms", "grow_max_ms", "grow_chunks", "grow_ratio", "release_ms",
            "release_chunks", "hole_ms", "hole_chunks", "recommit_ms", "recommit_chunks", "full_ms", "full_chunks", "zero_ms", "zero_chunks", "blocks_ok", "zero_ok",
            "criterion", "error"]  # fmt: skip
    print(f"{backend}: {a.layers} layers, floor {a.floor}, +{a.step} x {a.reps}, full "
          f"{a.max_blocks}; ms: slowest rank, median over repetitions (max: the worst); chunks "
          f"and ratio (committed / blocks' bytes) after the step, rank 0")  # fmt: skip
    print(table(rows, [c for c in cols if any(c in r for r in rows)]), flush=True)
    print(f"criterion: floor_ratio <= {CRITERION['ratio']} and grow_ms <= "
          f"{CRITERION['grow_ms']:g} (the issue's, for BL at 1000 blocks with 2 processes)")  # fmt: skip
    write_json(a.out, "bench_elastic_gpu", rows, device=device_name(backend), commit=git_commit(),
               command=[sys.executable, *sys.argv], settings={**cfg, "configs": a.configs})  # fmt: skip


if __name__ == "__main__":
    main()
