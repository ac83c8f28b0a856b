"""The floor of a wake: what N processes sharing the GPU(s) cannot avoid to map a KV cache in
runs and every peer's replica, in plain cuda-python (no vmmkv allocator, no vmmkv exchange).

The same geometry as ``bench_extensible_gpu.py``: DeepSeek-V3.2, 61 layers, MLA 41,984 B +
indexer 8,448 B per block and layer; ``LB`` (LBNHC: 122 segments, each padded onto the 2 MiB
granule as vLLM pads them) or ``BL`` (BLNHC: one segment). One run per segment: the segment's
first ``--budget`` blocks rounded up to the granule, one ``cuMemCreate`` each.

Per rank and repetition, every step after a barrier (gloo), timed on the host:

- ``own``: ``cuMemCreate`` every run, ``cuMemMap`` it at its offset of a reservation made
  beforehand, ``cuMemSetAccess`` per run, ``cuMemsetD8`` every run, one ``cuCtxSynchronize``;
- ``export``: ``cuMemExportToShareableHandle`` (POSIX fd) of every run;
- ``pass``: the fds to every peer over abstract Unix sockets (SCM_RIGHTS, 250 a message) and
  theirs received; own fds closed;
- ``import``: every peer's fds imported (``cuMemImportFromShareableHandle``), mapped at the same
  offsets of a reservation of the peer's size (made beforehand, as vmmkv reserves at its
  rendezvous, not at a wake), ``cuMemSetAccess`` per run, fds closed;
- ``wake``: the four together, from the barrier to the last mapping (the figure a wake is read
  against); ``sleep``: every mapping unmapped and every handle released (peers' then own).

Reported per (ranks, layout): the slowest rank's median over ``--reps`` of each step, the runs
per rank, the GiB per rank, and the peak of open fds. JSON (``--out``) with machine and date.
Nothing here runs on the host backend: it needs CUDA and ``cuda.bindings``.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from bench_extensible_gpu import LAYOUTS, padded_geometry  # noqa: E402
from common import arguments, device_name, ranks_per_config, table, write_json  # noqa: E402

STEPS = ("own", "export", "pass", "import", "wake", "sleep")
FDS_PER_MESSAGE = 250  # below the kernel's SCM_MAX_FD (253)


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def runs_of(layout: str, layers: int, capacity: int, budget: int, granule: int) -> list:
    """``(offset, size)`` of every run: each segment's first ``budget`` blocks, granule-rounded,
    at its offset in the padded layout of ``capacity`` blocks (``bench_extensible_gpu``'s)."""
    segs, _ = padded_geometry(layout, layers, capacity, granule)
    return [(off, _up(budget * stride, granule)) for off, stride in segs]


def _check(res: tuple, what: str) -> Any:
    from cuda.bindings import driver as cu

    err = res[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return res[1] if len(res) == 2 else res[1:] if len(res) > 2 else None


def _socket_name(nonce: str, rank: int) -> str:
    return f"\0vmmkv-floor-{nonce}-{rank}"


def _send_all(peer_name: str, rank: int, fds: list[int]) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(peer_name)
        s.sendall(rank.to_bytes(4, "little") + len(fds).to_bytes(4, "little"))
        for i in range(0, len(fds), FDS_PER_MESSAGE):
            socket.send_fds(s, [b"f"], fds[i : i + FDS_PER_MESSAGE])
        s.recv(1)  # the receiver's acknowledgement: it holds every fd
    finally:
        s.close()


def _receive_all(listener: socket.socket, count: int, got: dict[int, list[int]]) -> None:
    for _ in range(count):
        conn, _ = listener.accept()
        try:
            head = b""
            while len(head) < 8:
                more = conn.recv(8 - len(head))
                if not more:
                    raise RuntimeError("a peer closed before its header")
                head += more
            peer, n = int.from_bytes(head[:4], "little"), int.from_bytes(head[4:], "little")
            fds: list[int] = []
            while len(fds) < n:
                _, more, _, _ = socket.recv_fds(conn, 1, FDS_PER_MESSAGE)
                if not more:
                    raise RuntimeError(f"rank {peer} closed after {len(fds)} of {n} fds")
                fds += more
            got[peer] = fds
            conn.sendall(b"k")
        finally:
            conn.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run_config(rank: int, world: int, cfg: dict[str, Any], layout: str) -> dict[str, Any]:
    """Every repetition of one layout on this rank: per step, the seconds it took."""
    import torch
    import torch.distributed as dist
    from cuda.bindings import driver as cu

    ordinal = rank % torch.cuda.device_count()
    _check(cu.cuInit(0), "cuInit")
    dev = _check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
    ctx = _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    fd_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = fd_type
    granule = int(_check(cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity"))  # fmt: skip
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = ordinal
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    runs = runs_of(layout, cfg["layers"], cfg["capacity"], cfg["budget"], granule)
    span = max(o + s for o, s in runs)
    own_va = int(_check(cu.cuMemAddressReserve(span, granule, 0, 0), "cuMemAddressReserve"))
    peers = [p for p in range(world) if p != rank]
    peer_va = {
        p: int(_check(cu.cuMemAddressReserve(span, granule, 0, 0), "reserve")) for p in peers
    }
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(_socket_name(cfg["nonce"] + layout, rank))
    listener.listen(world)
    peak = [0]
    times: dict[str, list[float]] = {s: [] for s in STEPS}
    try:
        for _ in range(cfg["reps"]):
            dist.barrier()
            t0 = time.perf_counter()
            handles = []
            for off, size in runs:
                h = _check(cu.cuMemCreate(size, prop, 0), f"cuMemCreate({size})")
                handles.append(h)
                _check(cu.cuMemMap(own_va + off, size, 0, h, 0), "cuMemMap")
                _check(cu.cuMemSetAccess(own_va + off, size, [access], 1), "cuMemSetAccess")
            for off, size in runs:
                _check(cu.cuMemsetD8(own_va + off, 0, size), "cuMemsetD8")
            _check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
            t1 = time.perf_counter()
            fds = [int(_check(cu.cuMemExportToShareableHandle(h, fd_type, 0), "export"))
                   for h in handles]  # fmt: skip
            t2 = time.perf_counter()
            got: dict[int, list[int]] = {}
            receiver = threading.Thread(target=_receive_all, args=(listener, len(peers), got))
            receiver.start()
            for p in peers:
                _send_all(_socket_name(cfg["nonce"] + layout, p), rank, fds)
            receiver.join()
            if len(got) != len(peers):
                raise RuntimeError(f"rank {rank}: fds from {sorted(got)}, expected {peers}")
            peak[0] = max(peak[0], _open_fds())
            for fd in fds:
                os.close(fd)
            t3 = time.perf_counter()
            imported = []
            for p in peers:
                for (off, size), fd in zip(runs, got[p], strict=True):
                    h = _check(cu.cuMemImportFromShareableHandle(fd, fd_type), "import")
                    imported.append(h)
                    _check(cu.cuMemMap(peer_va[p] + off, size, 0, h, 0), "cuMemMap(peer)")
                    _check(cu.cuMemSetAccess(peer_va[p] + off, size, [access], 1), "access(peer)")
                    os.close(fd)
            t4 = time.perf_counter()
            dist.barrier()  # every rank mapped every peer before anything goes
            t5 = time.perf_counter()
            _check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
            for p in peers:
                for off, size in runs:
                    _check(cu.cuMemUnmap(peer_va[p] + off, size), "cuMemUnmap(peer)")
            for off, size in runs:
                _check(cu.cuMemUnmap(own_va + off, size), "cuMemUnmap")
            for h in imported + handles:
                _check(cu.cuMemRelease(h), "cuMemRelease")
            t6 = time.perf_counter()
            for step, sec in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, t6 - t5),
                                 strict=True):  # fmt: skip
                times[step].append(sec)
    finally:
        listener.close()
        for p in peers:
            cu.cuMemAddressFree(peer_va[p], span)
        cu.cuMemAddressFree(own_va, span)
        dist.barrier()
    return {"rank": rank, "layout": layout, "runs": len(runs), "bytes": sum(s for _, s in runs),
            "granule": granule, "times": times, "peak_fds": peak[0]}  # fmt: skip


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for layout in cfg["layouts"]:
        try:
            out.append(run_config(rank, world, cfg, layout))
        except Exception as exc:
            import traceback

            traceback.print_exc()
            out.append({"rank": rank, "layout": layout, "error": f"{type(exc).__name__}: {exc}"})
    return out


def summarize(world: int, layout: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The slowest rank's median of each step, in ms."""
    errors = [r["error"] for r in ranks if r.get("error")]
    if errors:
        return {"pcp": world, "layout": layout, "error": errors[0][:200]}
    row: dict[str, Any] = {"pcp": world, "layout": layout, "runs": ranks[0]["runs"],
                           "GiB": round(ranks[0]["bytes"] / (1 << 30), 2)}  # fmt: skip
    for step in STEPS:
        row[f"{step}_ms"] = round(max(statistics.median(r["times"][step]) for r in ranks) * 1e3, 2)
    row["peak_fds"] = max(r["peak_fds"] for r in ranks)
    return row


def main() -> None:
    ap = arguments(__doc__, "floor_extensible_gpu")
    ap.add_argument("--ranks", default="2,4", help="process counts (they share the GPUs)")
    ap.add_argument("--layouts", default="LB,BL", help="LB and/or BL")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--capacity", type=int, default=9000, help="blocks reserved per segment")
    ap.add_argument("--budget", type=int, default=8500, help="blocks mapped per segment")
    ap.add_argument("--reps", type=int, default=3, help="wake/sleep cycles per configuration")
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args()
    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    if not layouts or any(x not in LAYOUTS for x in layouts):
        ap.error(f"--layouts: a comma-separated subset of {LAYOUTS}, got {a.layouts!r}")
    if not (0 < a.budget <= a.capacity and a.layers > 0 and a.reps > 0):
        ap.error("want 0 < --budget <= --capacity, --layers > 0, --reps > 0")
    cfg = dict(layouts=layouts, layers=a.layers, capacity=a.capacity, budget=a.budget,
               reps=a.reps, nonce=os.urandom(8).hex())  # fmt: skip
    rows = []
    for world in (int(w) for w in a.ranks.split(",")):
        per_rank = ranks_per_config(rank_main, world, cfg, len(layouts), a.timeout)
        for i, layout in enumerate(layouts):
            rows.append(summarize(world, layout, [r[i] for r in per_rank]))
    cols = ["pcp", "layout", "runs", "GiB", *(f"{s}_ms" for s in STEPS), "peak_fds", "error"]
    print(f"floor: {a.layers} layers, capacity {a.capacity}, budget {a.budget} blocks, "
          f"{a.reps} reps; ms: the slowest rank's median")  # fmt: skip
    print(table(rows, [c for c in cols if any(c in r for r in rows)]), flush=True)
    write_json(a.out, "floor_extensible_gpu", rows, device=device_name("cuda"),
               command=[sys.executable, *sys.argv], settings=cfg)  # fmt: skip


if __name__ == "__main__":
    main()
