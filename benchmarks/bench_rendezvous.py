"""Rendezvous / grow / shrink / close of SymmetricRegion against bare driver costs.

PCP groups of 2 and 4 processes sharing the GPU(s) (rank r uses GPU r % count), per-rank
capacity 8 and 32 GiB, chunks 256 MiB and 1 GiB. Each rank rendezvous with nothing committed,
then grows by ``--grow-gib`` (default 8 GiB), shrinks to zero and closes; the slowest rank's time
(after a barrier) is reported. Next to it, in the same run: bare cuda.bindings create + export +
import + map of the same chunks in one process (target: grow <= 2x that), and torch symmetric
memory ``empty`` + ``rendezvous`` of the grow size in a 1-rank group (it refuses two ranks on
one device). Prints a table and writes JSON (``--out``). Needs CUDA.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import arguments, median, table, timed, write_json  # noqa: E402

from vmmkv.testing.spawn import run_world, run_world_raw  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20


def _rank_main(rank, world, configs, grow):
    """One rank of the PCP group (spawned, in a gloo group): per config, the seconds of
    rendezvous (construction), grow, shrink and close, each started after a barrier."""
    import torch
    import torch.distributed as dist

    from vmmkv.ipc import SymmetricRegion

    dev = f"cuda:{rank % torch.cuda.device_count()}"
    torch.cuda.set_device(dev)
    out = []
    for cap, chunk in configs:
        if grow > cap:
            raise ValueError(f"--grow-gib ({grow}) exceeds a capacity of {cap} bytes")
        t = {}
        dist.barrier()
        t0 = time.perf_counter()
        sr = SymmetricRegion(cap, dev, chunk_bytes=chunk, backend="cuda")
        t["rendezvous"] = time.perf_counter() - t0
        for name, fn in (
            ("grow", lambda sr=sr: sr.resize(grow)),
            ("shrink", lambda sr=sr: sr.resize(0)),
            ("close", sr.close),
        ):
            dist.barrier()
            t[name] = timed(fn)
        out.append(t)
    return out


def _spawn(world, configs, grow):
    """The slowest rank's seconds per operation and config (raises if any rank failed)."""
    results = run_world(_rank_main, world, args=(configs, grow), timeout=900)
    return [
        {k: max(results[r][i][k] for r in range(world)) for k in results[0][i]}
        for i in range(len(configs))
    ]


def bare_cost(size, chunk, reps=3):
    """create + export + import + map (+ access) of size/chunk chunks in one process."""
    import torch

    from vmmkv.alloc.cuda import CudaBackend
    from vmmkv.alloc.driver import call, cu, primary_context

    torch.cuda.init()
    b = CudaBackend(0)
    fd_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    times = []
    for _ in range(reps):
        with primary_context(0):
            own = int(call(cu.cuMemAddressReserve, size, b.granularity, 0, 0))
            peer = int(call(cu.cuMemAddressReserve, size, b.granularity, 0, 0))
            t0 = time.perf_counter()
            for off in range(0, size, chunk):
                h = call(cu.cuMemCreate, chunk, b._prop, 0)
                call(cu.cuMemMap, own + off, chunk, 0, h, 0)
                call(cu.cuMemSetAccess, own + off, chunk, [b._access], 1)
                fd = call(cu.cuMemExportToShareableHandle, h, fd_type, 0)
                call(cu.cuMemRelease, h)
                h2 = call(cu.cuMemImportFromShareableHandle, int(fd), fd_type)
                os.close(int(fd))
                call(cu.cuMemMap, peer + off, chunk, 0, h2, 0)
                call(cu.cuMemSetAccess, peer + off, chunk, [b._access], 1)
                call(cu.cuMemRelease, h2)
            call(cu.cuCtxSynchronize)
            times.append(time.perf_counter() - t0)
            for base in (peer, own):
                for off in range(0, size, chunk):
                    call(cu.cuMemUnmap, base + off, chunk)
                call(cu.cuMemAddressFree, base, size)
    return median(times)


def _symm_mem_rank(rank, world, size):
    """torch symmetric memory empty + rendezvous in a 1-rank group (first call, then again)."""
    import torch
    import torch.distributed as dist

    try:
        import torch.distributed._symmetric_memory as symm_mem
    except Exception as exc:  # pragma: no cover
        return {"error": f"unavailable: {exc}"}
    out = {}
    try:
        for label in ("first", "second"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            t = symm_mem.empty(size, dtype=torch.uint8, device="cuda:0")
            symm_mem.rendezvous(t, dist.group.WORLD.group_name)
            torch.cuda.synchronize()
            out[label] = time.perf_counter() - t0
            del t
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def symm_mem_anchor(size):
    """``_symm_mem_rank`` in one spawned process (its own gloo group, multicast off)."""
    (result,) = run_world_raw(_symm_mem_rank, 1, args=(size,), timeout=300)
    return result.value if result.ok else {"error": result.error.strip().splitlines()[-1]}


def main() -> None:
    ap = arguments(__doc__, "bench_rendezvous")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--caps-gib", default="8,32")
    ap.add_argument("--chunks-mib", default="256,1024")
    ap.add_argument("--grow-gib", type=float, default=8.0)
    a = ap.parse_args()
    grow = int(a.grow_gib * GiB)
    chunks = [int(c) * MiB for c in a.chunks_mib.split(",")]
    configs = [(int(c) * GiB, ch) for c in a.caps_gib.split(",") for ch in chunks]
    bare = {ch: bare_cost(grow, ch) for ch in chunks}
    rows = []
    for world in (int(w) for w in a.worlds.split(",")):
        res = _spawn(world, configs, grow)
        for (cap, ch), t in zip(configs, res, strict=True):
            rows.append(
                {
                    "pcp": world,
                    "cap_GiB": cap // GiB,
                    "chunk_MiB": ch // MiB,
                    "rendezvous_ms": t["rendezvous"] * 1e3,
                    "grow_ms": t["grow"] * 1e3,
                    "bare_ms": bare[ch] * 1e3,
                    "grow/bare": t["grow"] / bare[ch],
                    "shrink_ms": t["shrink"] * 1e3,
                    "close_ms": t["close"] * 1e3,
                }
            )
        print(f"PCP{world} done", file=sys.stderr, flush=True)
    anchor = symm_mem_anchor(grow)
    print(f"SymmetricRegion, grow by {grow >> 20} MiB per rank (slowest rank, ms)")
    print(table(rows, list(rows[0])))
    print(f"torch symmetric memory 1-rank empty+rendezvous of {grow >> 20} MiB: {anchor}")
    write_json(a.out, "bench_rendezvous", rows, grow_bytes=grow, symm_mem_anchor=anchor)


if __name__ == "__main__":
    main()
