"""What one rank of bench_prefill does (see ``bench_prefill.py``'s docstring): set up every
path's cache (each construction timed twice), then per step verify the paths against each other
and time the forwards and the KV updates alone, and the growth check; ``_rank_main`` is the
entry point ``vmmkv.testing.spawn`` runs in every rank's process.

Collective over the rank's gloo group (and NCCL on CUDA): every rank runs the same steps in the
same order, agreeing on skips (the budget guard) and failures (a verification error raises on
every rank). ``_Rank.close`` (local, runs after errors too) releases every path, the vmmkv
cache and the buffers; ``_rank_main`` always calls it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from vmmkv._util import ceil_div, round_up
from vmmkv.testing.kv import BLOCK_SIZE

from .model import DEEPSEEK_V32, SCALE_AT, TINY, WorkloadSpec, _Model, _read_views, _Workload, steps
from .paths import (
    BASELINE,
    PATHS,
    _Direct,
    _SymmMem,
    _targets,
    _Update,
    _VllmGather,
    _VmmkvGather,
    mla_kind,
)
from .report import NAME, merge_ranks

POISON = 0xA5


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
            buf = self.cache.allocate(self.capacity, reserve=True).view(torch.uint8)
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

        def first_forward(path):
            """The path's forward (captured on CUDA), run once on every rank; the byte range
            of the workload's blocks."""
            fwd = runner(path)
            wl.reset()
            self.timed(fwd)
            self.barrier()
            return fwd, *wl.byte_range(self.stride)

        vm = self.paths.get("direct") or self.paths.get("vmmkv_gather")
        reference = None
        if vm is not None:
            fwd, lo, hi = first_forward(vm)
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
            fwd, lo, hi = first_forward(sy)
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
