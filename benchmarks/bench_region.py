"""VirtualRegion overhead: commit / decommit / close next to bare cuda.bindings calls.

For ``--total`` bytes (default 8 GiB) committed in chunks of 2 MiB, 64 MiB, 256 MiB and 1 GiB,
times (median of ``--reps``, the two paths alternating in one run):
- commit: VirtualRegion.commit (create + map + access + release handle + zero + sync) against the
  same driver calls written out by hand;
- decommit: VirtualRegion.decommit(0) (sync + unmap) against bare sync + cuMemUnmap per chunk;
- close: VirtualRegion.close() on a fully committed region against bare unmap + cuMemAddressFree.
Prints a table, writes JSON (``--out``). Needs a CUDA GPU.
"""

from __future__ import annotations

import sys

sys.path.insert(0, __import__("os").path.dirname(__file__))

from common import arguments, median, table, timed, write_json  # noqa: E402

from vmmkv.alloc import VirtualRegion  # noqa: E402
from vmmkv.alloc.cuda import CudaBackend  # noqa: E402
from vmmkv.alloc.driver import call, cu, primary_context  # noqa: E402

MiB = 1 << 20


class Bare:
    """The same work as the region, written as plain driver calls."""

    def __init__(self, ordinal: int, total: int, chunk: int):
        self.ordinal, self.total, self.chunk = ordinal, total, chunk
        b = CudaBackend(ordinal)
        self.prop, self.gran = b._prop, b.granularity
        self.access = b._access
        with primary_context(ordinal):
            self.base = int(call(cu.cuMemAddressReserve, total, self.gran, 0, 0))

    def commit(self):
        with primary_context(self.ordinal):
            for off in range(0, self.total, self.chunk):
                h = call(cu.cuMemCreate, self.chunk, self.prop, 0)
                call(cu.cuMemMap, self.base + off, self.chunk, 0, h, 0)
                call(cu.cuMemSetAccess, self.base + off, self.chunk, [self.access], 1)
                call(cu.cuMemRelease, h)
            call(cu.cuMemsetD8, self.base, 0, self.total)
            call(cu.cuCtxSynchronize)

    def unmap(self):
        with primary_context(self.ordinal):
            call(cu.cuCtxSynchronize)
            for off in range(0, self.total, self.chunk):
                call(cu.cuMemUnmap, self.base + off, self.chunk)

    def free(self):
        with primary_context(self.ordinal):
            call(cu.cuMemAddressFree, self.base, self.total)


def run(total: int, chunks: list[int], reps: int) -> list[dict]:
    rows = []
    for chunk in chunks:
        t = {
            k: []
            for k in ("commit", "bare_commit", "decommit", "bare_unmap", "close", "bare_close")
        }
        n_reps = max(2, reps // 2) if chunk < 64 * MiB else reps
        for _ in range(n_reps):
            r = VirtualRegion(total, 0, chunk_bytes=chunk, backend="cuda")
            t["commit"].append(timed(lambda r=r: r.commit(total)))
            t["decommit"].append(timed(lambda r=r: r.decommit(0)))
            r.commit(total)
            t["close"].append(timed(r.close))
            b = Bare(0, total, chunk)
            t["bare_commit"].append(timed(b.commit))
            t["bare_unmap"].append(timed(b.unmap))
            b.commit()
            t["bare_close"].append(timed(lambda b=b: (b.unmap(), b.free())))
        m = {k: median(v) * 1e3 for k, v in t.items()}
        rows.append(
            {
                "chunk_MiB": chunk // MiB,
                "chunks": total // chunk,
                "commit_ms": m["commit"],
                "bare_commit_ms": m["bare_commit"],
                "commit_ratio": m["commit"] / m["bare_commit"],
                "decommit_ms": m["decommit"],
                "bare_unmap_ms": m["bare_unmap"],
                "decommit_ratio": m["decommit"] / m["bare_unmap"],
                "close_ms": m["close"],
                "bare_close_ms": m["bare_close"],
                "close_ratio": m["close"] / m["bare_close"],
                "reps": n_reps,
            }
        )
        print(f"chunk {chunk // MiB} MiB done", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = arguments(__doc__, "bench_region")
    ap.add_argument("--total-gib", type=float, default=8.0)
    ap.add_argument("--chunks-mib", default="2,64,256,1024")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    total = int(a.total_gib * (1 << 30))
    rows = run(total, [int(c) * MiB for c in a.chunks_mib.split(",")], a.reps)
    cols = list(rows[0])
    print(f"VirtualRegion vs bare driver, {total >> 20} MiB committed (median ms)")
    print(table(rows, cols))
    write_json(a.out, "bench_region", rows, total_bytes=total)


if __name__ == "__main__":
    main()
