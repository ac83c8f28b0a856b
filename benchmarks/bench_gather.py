"""The gather fallback (vmmkv.gather) against its ideal baseline and against direct publication.

One run, one process per GPU (``--world`` ranks, default 2; NCCL needs one GPU per rank), an
NCCL device group. For every T (tokens per rank; default 1, 8, 32, 128, 512, 2048, 8192, 32768)
one layer (``store_layer``: fp8_ds_mla + indexer_k) and no replicated rows:

- ``fallback``: ``cache.store_layer(..., mode="gather")`` with each rank's own slots (the slot
  travels in the packed row: ``row_bytes`` 1424) and with the engine's gathered slot mapping
  (``gathered_slot_mapping=``: 1408 bytes per row, slots not gathered);
- ``ideal``: the same bytes timed piecewise in the same process: ``nccl`` (one
  ``all_gather_into_tensor`` of T packed rows per rank, preallocated), ``insert`` (the
  one-destination insert kernel of the gathered rows, slots ready), and both as one step;
  ``fallback / ideal`` is the overhead of vmmkv's path (pack, slot extraction, Python);
- ``direct``: ``store_layer(mode="direct")`` + ``barrier()`` (two launches) and
  ``publish_layer`` (one launch); ``direct / fallback``.

Two modes: ``eager`` = host clock per step over a back-to-back loop ended by one synchronize
(launch-bound at small T, device-bound at large T); ``graph`` = device time per step of CUDA-graph
replays (``inner`` steps per graph, replayed back to back, CUDA events). Every number is the
median over ``--reps`` loops, then the slowest rank. Before timing, each T checks that the
fallback and direct publication leave identical bytes (``equal``).

``--profile`` adds, per T, where the host time of one eager ``fallback_gathered`` step goes
(vLLM's convention): ``iters`` steps under ``cProfile`` on every rank (they are
collective), rank 0's functions with the most cumulative time, per step (µs; calls per step);
printed after the table and kept in the JSON (``profile``). cProfile adds its own cost to every
Python call, so read it for shares and call counts, not as timings.

``--host-cost`` (one process, no group; ``--backend host`` for the CPU) breaks the host time of
one eager fallback store of rank 0 of 2 into its stages, for both slot forms, with the
all-gather a no-op (vmmkv's own code around it: checks, pack, views, slots, insert launch; on
the CPU the insert is a no-op too: the host reference store is not what a GPU runs). The pack
is a real ``torch.cat`` on the device. Medians of loops of 200 calls after warm-up.

``--backend host`` runs the same sweep on the CPU (host backend, gloo, no graphs, no direct
comparison of device time): it exercises this script's logic without a GPU. Prints a table,
writes JSON (``--out``); each finished T is also appended to ``<out>.partial.jsonl`` so a run cut
short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import median, own_layer_targets, per_call_ns, table, write_json  # noqa: E402

TOKENS = (1, 8, 32, 128, 512, 2048, 8192, 32768)
BS = 64
CASES_EAGER = (
    "fallback_own", "fallback_gathered", "nccl_own", "nccl_gathered", "insert", "ideal_own",
    "ideal_gathered", "direct_store_barrier", "direct_publish",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# pure logic (tested on the CPU)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` when both were measured, else None."""
    if a is None or b is None or b <= 0:
        return None
    return a / b


def summarize(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per T: every timing of every mode is the slowest rank's; ratios added:
    ``fallback/ideal`` (own and gathered slots), ``ideal_sum`` (nccl + insert timed apart),
    ``direct/fallback`` (publish vs gathered-slot fallback)."""
    rows = []
    for by_rank in zip(*per_rank, strict=True):
        t = by_rank[0]["T"]
        if any(r["T"] != t for r in by_rank):
            raise ValueError(f"ranks disagree on T: {[r['T'] for r in by_rank]}")
        row: dict[str, Any] = {
            k: v for k, v in by_rank[0].items() if k not in ("eager", "graph", "equal", "error")
        }
        equal = [r.get("equal") for r in by_rank]
        row["equal"] = None if None in equal else all(equal)
        errors = [f"rank {i}: {r['error']}" for i, r in enumerate(by_rank) if r.get("error")]
        if errors:
            row["error"] = "; ".join(errors)
        for mode in ("eager", "graph"):
            cases: dict[str, float | None] = {}
            for case in CASES_EAGER:
                got = [r.get(mode, {}).get(case) for r in by_rank]
                cases[case] = None if any(v is None for v in got) else max(got)
            if not any(v is not None for v in cases.values()):
                continue
            sums = [cases["nccl_own"], cases["insert"]], [cases["nccl_gathered"], cases["insert"]]
            for name, parts in zip(("ideal_own_sum", "ideal_gathered_sum"), sums, strict=True):
                cases[name] = None if None in parts else sum(parts)  # type: ignore[arg-type]
            cases["fallback/ideal_own"] = ratio(cases["fallback_own"], cases["ideal_own"])
            cases["fallback/ideal_gathered"] = ratio(
                cases["fallback_gathered"], cases["ideal_gathered"]
            )
            cases["direct/fallback"] = ratio(cases["direct_publish"], cases["fallback_gathered"])
            row[mode] = cases
        rows.append(row)
    return rows


def _short_path(path: str) -> str:
    """``path`` from site-packages, or from this tree's top folder."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    for top in ("vmmkv", "benchmarks", "tests"):
        if f"/{top}/" in path:
            return top + "/" + path.rsplit(f"/{top}/", 1)[1]
    return path


def top_functions(stats: Any, steps: int, top: int = 15) -> list[dict[str, Any]]:
    """The ``top`` functions of a ``pstats.Stats`` by cumulative time, per step of ``steps``:
    ``function`` (file:line(name), the file relative to site-packages or the tree), ``calls``,
    ``own_us`` (time in the function itself), ``cum_us`` (with what it called)."""
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        where = f"{_short_path(path)}:{line}({name})" if line else name
        rows.append({"function": where, "calls": ncalls / steps,
                     "own_us": tottime * 1e6 / steps, "cum_us": cumtime * 1e6 / steps})  # fmt: skip
    rows.sort(key=lambda r: r["cum_us"], reverse=True)
    return rows[:top]


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat rows for the printed table (µs; ratios)."""
    out = []
    for r in rows:
        for mode in ("eager", "graph"):
            c = r.get(mode)
            if not c:
                continue
            out.append(
                {
                    "T": r["T"],
                    "mode": mode,
                    "fallback": c["fallback_own"],
                    "ideal": c["ideal_own"],
                    "ratio": c["fallback/ideal_own"],
                    "fb(gath)": c["fallback_gathered"],
                    "ideal(gath)": c["ideal_gathered"],
                    "ratio(gath)": c["fallback/ideal_gathered"],
                    "nccl": c["nccl_own"],
                    "insert": c["insert"],
                    "direct": c["direct_publish"],
                    "direct/fb": c["direct/fallback"],
                    "equal": r["equal"],
                }  # fmt: skip
            )
    return [{k: ("-" if v is None else v) for k, v in row.items()} for row in out]


# ---------------------------------------------------------------------------------------------
# one rank


class _Timer:
    """Eager: host clock over back-to-back steps ended by one synchronize. Graph: CUDA events
    around back-to-back replays of a graph holding ``inner`` steps. Every loop starts with a
    gloo barrier of all ranks."""

    def __init__(self, device, group, iters: int, reps: int) -> None:
        self.device, self.group, self.iters, self.reps = device, group, iters, reps

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def eager(self, step) -> float:
        import torch.distributed as dist

        for _ in range(2):
            step()
        times = []
        for _ in range(self.reps):
            self._sync()
            dist.barrier(group=self.group)
            t0 = time.perf_counter()
            for _ in range(self.iters):
                step()
            self._sync()
            times.append((time.perf_counter() - t0) * 1e6 / self.iters)
        return median(times)

    def profile(self, step, top: int = 15) -> list[dict[str, Any]]:
        """``iters`` eager steps under cProfile (after a warm-up, between a sync and a barrier
        like a timed loop, the closing synchronize included): :func:`top_functions`."""
        import cProfile
        import pstats

        import torch.distributed as dist

        for _ in range(2):
            step()
        self._sync()
        dist.barrier(group=self.group)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(self.iters):
            step()
        self._sync()
        prof.disable()
        return top_functions(pstats.Stats(prof), self.iters, top)

    def graph(self, step, inner: int) -> float:
        import torch
        import torch.distributed as dist

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._sync()
        dist.barrier(group=self.group)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                step()
        graph.replay()
        times = []
        for _ in range(self.reps):
            self._sync()
            dist.barrier(group=self.group)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.iters):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / (self.iters * inner))
        del graph
        return median(times)


def _steps(cache, mla, idx, insert, t: int, rank: int, world: int, gather_group) -> dict:
    """The timed steps at ``t`` tokens per rank (inputs and buffers made here, once)."""
    import torch
    import torch.distributed as dist

    from vmmkv.gather import _Layout
    from vmmkv.ops.formats import get_format
    from vmmkv.testing.kv import layer_inputs

    device = cache.device
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gathered = torch.randperm(world * t, generator=torch.Generator().manual_seed(t)).to(device)
    slots = gathered[rank * t : (rank + 1) * t].clone()
    kv_c, k_pe, k = (x.to(device) for x in layer_inputs(1000 * t + rank, t))
    inputs = [i for kind in ("fp8_ds_mla", "indexer_k") for i in get_format(kind).inputs]
    widths = [w * dtype.itemsize for _, dtype, w in inputs]  # bytes of kv_c, k_pe, k per row
    ideal = {}  # the same bytes as the fallback gathers, packed into preallocated buffers
    for name, slot_bytes in (("own", gathered.element_size()), ("gathered", 0)):
        lay = _Layout(widths, slot_bytes)
        send = torch.zeros(t, lay.width, dtype=torch.uint8, device=device)
        recv = torch.empty(world * t, lay.width, dtype=torch.uint8, device=device)
        cols = [
            recv[:, a : a + w].view(dtype)
            for a, w, (_, dtype, _) in zip(lay.offsets, widths, inputs, strict=True)
        ]
        ideal[name] = (send, recv, cols, lay.width)

    def nccl(name):
        send, recv, _, _ = ideal[name]
        gather(recv, send, group=gather_group)

    def ideal_step(name):
        nccl(name)
        insert.store(ideal[name][2], gathered, 0)

    steps = {
        "fallback_own": lambda: cache.store_layer(mla, idx, kv_c, k_pe, k, slots, mode="gather"),
        "fallback_gathered": lambda: cache.store_layer(
            mla, idx, kv_c, k_pe, k, None, gathered_slot_mapping=gathered, mode="gather"
        ),
        "nccl_own": lambda: nccl("own"),
        "nccl_gathered": lambda: nccl("gathered"),
        "insert": lambda: insert.store(ideal["gathered"][2], gathered, 0),
        "ideal_own": lambda: ideal_step("own"),
        "ideal_gathered": lambda: ideal_step("gathered"),
    }
    if cache.direct:

        def direct_store_barrier():
            cache.store_layer(mla, idx, kv_c, k_pe, k, slots, mode="direct")
            cache.barrier()

        steps["direct_store_barrier"] = direct_store_barrier
        steps["direct_publish"] = lambda: cache.publish_layer(
            mla, idx, kv_c, k_pe, k, slots, mode="direct"
        )
    return {
        "steps": steps,
        "row_bytes_own": ideal["own"][3],
        "row_bytes_gathered": ideal["gathered"][3],
    }


def _rank(rank: int, world: int, opts: dict[str, Any]) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache
    from vmmkv.ops import prepare
    from vmmkv.testing.kv import block_stride, interleaved_views

    host = opts["backend"] == "host"
    if host:
        device, dgroup = torch.device("cpu"), None
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dgroup = dist.new_group(backend="nccl")
    group = dist.group.WORLD
    tokens = opts["tokens"]
    blocks = -(-world * max(tokens) // BS)
    chunk = 1 << 16 if host else 2 << 20
    need = blocks * block_stride(1)
    cap = -(-need // chunk) * chunk
    timer = _Timer(device, group, opts["iters"], opts["reps"])
    rows: list[dict[str, Any]] = []
    with ReplicatedKVCache(
        group, cap, device, device_group=dgroup, chunk_bytes=chunk, initial_bytes=cap
    ) as cache:
        buf = cache.allocate(need).view(torch.uint8)
        ((mla_view, idx_view),) = interleaved_views(buf, 1, blocks)
        mla = cache.bind("mla", mla_view, "fp8_ds_mla")
        idx = cache.bind("idx", idx_view, "indexer_k")
        insert = prepare((mla.local, idx.local))  # the one-destination insert of the ideal
        for t in tokens:
            row: dict[str, Any] = {"T": t, "world": world, "eager": {}, "graph": {}}
            try:
                made = _steps(cache, mla, idx, insert, t, rank, world, group if host else dgroup)
                steps = made.pop("steps")
                row.update(made)
                row["equal"] = _same_bytes(cache, buf, steps)
                for case, step in steps.items():
                    row["eager"][case] = timer.eager(step)
                if opts.get("profile"):
                    row["profile"] = timer.profile(steps["fallback_gathered"])
                if not host:
                    row["inner"] = inner = 10 if t <= 2048 else 2
                    for case, step in steps.items():
                        row["graph"][case] = timer.graph(step, inner)
                del steps, made
            except Exception as exc:  # recorded; the agreement below stops every rank
                row["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            if not _all_ok(group, "error" not in row, opts["timeout"]):
                row.setdefault("error", "stopped: another rank failed at this T")
                break
            if rank == 0 and opts.get("partial"):
                with open(opts["partial"], "a") as f:
                    f.write(json.dumps(row) + "\n")
    return rows


def _same_bytes(cache, buf, steps) -> bool | None:
    """Poison, run the fallback, snapshot; poison again, publish directly; equal bytes? (None
    without direct publication.)"""
    import torch
    import torch.distributed as dist

    if "direct_publish" not in steps:
        return None
    snaps = []
    for case in ("fallback_gathered", "direct_publish"):
        buf.fill_(0xA5)
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        dist.barrier()
        steps[case]()
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        dist.barrier()
        snaps.append(buf.clone())
    return bool(torch.equal(snaps[0], snaps[1]))


def _all_ok(group, ok: bool, timeout: float) -> bool:
    """Bounded gloo agreement: True when every rank finished this T without an error."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int64)
    work = gather(flags, torch.tensor([int(ok)]), group=group, async_op=True)
    work.wait(timeout=timedelta(seconds=timeout))
    return bool(flags.all())


# ---------------------------------------------------------------------------------------------
# --host-cost: where the host time of one eager fallback store goes


def host_cost(backend: str, tokens: list[int], world: int = 2) -> list[dict[str, Any]]:
    """Rows (stage, T, µs with own slots, µs with the gathered mapping) of rank 0 of ``world``
    in one process: a ``GatherPath`` over one layer whose all-gather is a no-op (see the
    module docstring)."""
    path, bindings, device, sync = host_path(backend, max(tokens), world)
    rows: list[dict[str, Any]] = []
    for t in tokens:
        stages = _host_stages(path, bindings, t, world, device, sync)
        rows += [{"stage": k, "T": t, **v} for k, v in stages.items()]
    path.close()
    return rows


def host_path(backend: str, max_tokens: int, world: int = 2):
    """(path, bindings, device, sync) of :func:`host_cost`: rank 0 of ``world``'s
    ``GatherPath`` over one layer of room for ``world * max_tokens`` tokens, its all-gather a
    no-op (on the host backend its insert too)."""
    import torch

    from vmmkv.cache import Binding
    from vmmkv.gather import GatherPath

    cuda = backend == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = "cuda" if cuda else None
    nb = -(-world * max_tokens // BS)
    mla_t, idx_t = own_layer_targets(nb, device, BS)
    region, table_t = mla_t.cache, mla_t.ptr_table
    views = region.view(nb * BS, -1)  # a view per binding; the stages never read it
    bindings = (Binding("mla", "fp8_ds_mla", views, mla_t, None),
                Binding("idx", "indexer_k", views, idx_t, None))  # fmt: skip
    path = GatherPath(0, world, device, table_t, None, object() if cuda else None, 60.0, False)
    path._all_gather = lambda recv, send: None  # the collectives are not what this measures:
    path._check_call = lambda *args: None  # neither the rows' all-gather nor gloo's header one
    if not cuda:  # the host reference store is not the GPU's insert
        path.prepare(bindings).store = lambda *args: None
    return path, bindings, device, sync


def _host_stages(path, bindings, t: int, world: int, device, sync) -> dict[str, dict[str, float]]:
    """Stage -> {slot form: µs per call} at ``t`` tokens (see :func:`host_cost`)."""
    import torch

    from vmmkv._store import check_inputs, own_slots
    from vmmkv.testing.kv import layer_inputs

    kinds = tuple(b.kind for b in bindings)
    entry = bindings[0].local.entry_bytes
    store = path.prepare(bindings)
    inputs = tuple(x.to(device) for x in layer_inputs(t, t))
    gathered = torch.randperm(world * t).to(device)
    forms = {"own": (gathered[:t].clone(), None), "gathered": (None, gathered)}
    stages: dict[str, dict[str, float]] = {}

    def measure(stage: str, form: str, fn) -> None:
        fn()
        stages.setdefault(stage, {})[form] = per_call_ns(fn, sync=sync) / 1e3

    for form, (mapping, gath) in forms.items():
        slots, g = own_slots(mapping, gath, 0, world)

        def checks(mapping=mapping, gath=gath):
            s, _ = own_slots(mapping, gath, 0, world)
            check_inputs(kinds, entry, inputs, s, 0, device)

        cols, all_slots = path._gather(inputs, slots, 0, t, g, False)
        measure("checks (own_slots + check_inputs)", form, checks)
        measure(
            "pack + views + slots (_gather)", form,
            lambda slots=slots, g=g: path._gather(inputs, slots, 0, t, g, False),
        )  # fmt: skip
        if device.type == "cuda":
            measure("insert (PreparedStore.store)", form,
                    lambda c=cols, a=all_slots: store.store(c, a, 0))  # fmt: skip
        measure(
            "total: GatherPath.store", form,
            lambda m=mapping, g=gath: path.store(bindings, inputs, m, 0, g),
        )  # fmt: skip
    width = sum(x.shape[1] * x.element_size() for x in inputs)
    send = torch.empty(t, width, dtype=torch.uint8, device=device)
    own = [x.view(torch.uint8) for x in inputs]
    for form in forms:
        measure("reference: torch.cat of the 3 inputs' bytes", form,
                lambda: torch.cat(own, dim=1, out=send))  # fmt: skip
    return stages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out/bench_gather.json")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--iters", type=int, default=50, help="steps per timed loop")
    ap.add_argument("--reps", type=int, default=5, help="timed loops (median)")
    ap.add_argument("--backend", choices=("cuda", "host"), default="cuda")
    ap.add_argument("--timeout", type=float, default=540.0, help="whole run, seconds")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one eager fallback_gathered step per T (cProfile)")  # fmt: skip
    ap.add_argument("--host-cost", action="store_true",
                    help="only the host-time stages of one fallback store (one process)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.host_cost:
        import torch

        if args.backend == "cuda" and not torch.cuda.is_available():
            print("bench_gather --host-cost: needs a GPU (CUDA); --backend host runs it on the "
                  "CPU", file=sys.stderr)  # fmt: skip
            return 2
        tokens = args.tokens if args.tokens != list(TOKENS) else [1, 512, 2048]
        rows = host_cost(args.backend, tokens, args.world)
        write_json(args.out, "bench_gather_host_cost", rows, options=vars(args))
        print(f"host us per eager fallback store, rank 0 of {args.world}, all-gather a no-op "
              f"({args.backend}):")  # fmt: skip
        print(table(rows, ["stage", "T", "own", "gathered"]))
        return 0
    if args.world < 2 or any(t < 1 for t in args.tokens) or args.iters < 1 or args.reps < 1:
        ap.error("--world >= 2, tokens >= 1, --iters >= 1, --reps >= 1")
    if args.backend == "cuda":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < args.world:
            print(
                f"bench_gather: needs {args.world} GPUs (one process per GPU: NCCL refuses two "
                f"ranks on one GPU), found {n}; --backend host runs the logic on the CPU",
                file=sys.stderr,
            )
            return 2
    from vmmkv.testing.spawn import run_world_raw

    partial = args.out + ".partial.jsonl"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if os.path.exists(partial):
        os.remove(partial)
    opts = dict(
        backend=args.backend, tokens=args.tokens, iters=args.iters, reps=args.reps,
        timeout=max(60.0, args.timeout / 4), partial=partial, profile=args.profile,
    )  # fmt: skip
    results = run_world_raw(_rank, args.world, args=(opts,), timeout=args.timeout)
    failed = [r for r in results if not r.ok]
    if failed:
        errors = {r.rank: r.error[-2000:] for r in failed}
        done = []
        if os.path.exists(partial):
            with open(partial) as f:
                done = [json.loads(line) for line in f if line.strip()]
        write_json(args.out, "bench_gather", done, errors=errors, options=opts)
        print(f"bench_gather: ranks failed: {errors}; partial rows (rank 0) in {args.out}")
        return 1
    rows = summarize([r.value for r in results])
    write_json(args.out, "bench_gather", rows, options=opts)
    flat = table_rows(rows)
    if flat:
        print(table(flat, list(flat[0])))
    for r in rows:
        if r.get("error"):
            print(f"T={r['T']}: {r['error']}")
        if r.get("profile"):
            print(f"T={r['T']}: host time of one eager fallback_gathered step, rank 0 (cProfile):")
            print(table(r["profile"], ["function", "calls", "own_us", "cum_us"]))
    print(f"bench_gather: JSON in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
