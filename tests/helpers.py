"""Small helpers shared by several test files (one copy each, instead of one per file).

Local, not collective; nothing here is capture-safe or meant for production. Every helper that
opens an fd closes it before returning; the fault injectors return the function that undoes them.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)


def fd_count() -> int:
    """How many fds this process holds now."""
    return len(os.listdir("/proc/self/fd"))


def random_bytes(n: int, seed: int, device="cpu") -> torch.Tensor:
    """``n`` random bytes in 1..255 (never zero, so an unwritten, zeroed byte can never pass for
    a written one), drawn on the CPU from ``seed`` and then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), generator=gen, dtype=torch.uint8).to(device)


def random_replicas(count: int, nbytes: int, generator: torch.Generator) -> list[torch.Tensor]:
    """``count`` CPU replicas of ``nbytes`` random bytes in 1..255 each, drawn in turn from
    ``generator`` (which the caller goes on drawing its inputs from)."""
    return [
        torch.randint(1, 256, (nbytes,), generator=generator, dtype=torch.uint8)
        for _ in range(count)
    ]


def commit_random(region, nbytes: int, seed: int) -> torch.Tensor:
    """Commit the first ``nbytes`` of ``region`` and fill them with ``random_bytes(nbytes, seed)``;
    returns those bytes (on the region's device)."""
    region.commit(nbytes)
    data = random_bytes(nbytes, seed, region.device)
    region.tensor()[:nbytes].copy_(data)
    return data


def map_all_chunks(region, peer) -> None:
    """Export every committed chunk of ``region`` and map it into ``peer`` (a PeerRegion of it),
    closing each exported fd whether or not the mapping succeeds."""
    for c in region.chunks():
        fd = region.export_chunk(c)
        try:
            peer.map_fd(fd, c)
        finally:
            os.close(fd)


def struct_layout(struct: str, header: str, fields: list[str]) -> dict[str, int]:
    """The byte offset of each field of ``vmmkv::<struct>`` (declared in ``header``) and its
    ``sizeof`` (key ``"sizeof"``), as NVRTC lays them out for sm_90.

    Read from PTX rather than asserted with ``__builtin_offsetof``, which NVRTC 13.0 (the one
    torch 2.14's CUDA build pins) does not have: a kernel stores each offset as a compile-time
    constant, and every ``st.global.u64 [%rd+8*i], %rdN`` after ``mov.u64 %rdN, value`` gives
    entry ``i``. Works with any NVRTC that compiles the kernels."""
    from vmmkv.ops import build

    names = [*fields, "sizeof"]
    lines = [
        f"  out[{i}] = (unsigned long long)((const char*)&p->{f} - (const char*)p);"
        for i, f in enumerate(fields)
    ]
    lines.append(f"  out[{len(fields)}] = sizeof(vmmkv::{struct});")
    source = (
        f'#include "{header}"\n'
        'extern "C" __global__ void vmmkv_layout(unsigned long long* out) {\n'
        f"  const vmmkv::{struct}* p = nullptr;\n" + "\n".join(lines) + "\n}\n"
    )
    _, headers = build.read_source("kv_store.cu")
    options = build.compile_options("sm_90", None)
    ptx = build._nvrtc_compile("layout.cu", source, headers, options, ptx=True).decode()
    consts = dict(re.findall(r"mov\.u64\s+(%rd\d+),\s*(\d+);", ptx))
    got: dict[str, int] = {}
    for off, reg in re.findall(r"st\.global\.u64\s+\[%rd\d+(?:\+(\d+))?\],\s*(%rd\d+);", ptx):
        got[names[int(off or 0) // 8]] = int(consts[reg])
    assert sorted(got) == sorted(names), f"PTX of the layout probe: {sorted(got)}\n{ptx}"
    return got


def packed_layout(fields: list[str], sizes: list[int]) -> dict[str, int]:
    """Offsets (and ``"sizeof"``) of ``fields`` packed back to back as the host mirror packs."""
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return {**dict(zip(fields, offsets, strict=True)), "sizeof": sum(sizes)}


def fail_peer_mapping_on(rank_to_fail: int, rank: int):
    """On ``rank_to_fail`` (this process being ``rank``) make every ``PeerRegion.map_fd`` raise a
    CudaError "injected mapping failure"; other ranks are untouched. Returns the undo."""
    from vmmkv.alloc import CudaError, PeerRegion

    real = PeerRegion.map_fd
    if rank == rank_to_fail:

        def fail(self, fd, chunk):
            raise CudaError("cuMemMap", None, "injected mapping failure", {"rank": rank})

        PeerRegion.map_fd = fail
    return lambda: setattr(PeerRegion, "map_fd", real)


# --------------------------------------------------------------------------------------------
# fault injection and leak accounting for multi-process fault tests (tests/test_faults.py)
# --------------------------------------------------------------------------------------------


def kill_self(marker: str | None = None, note: str = "") -> None:
    """SIGKILL this process now; ``marker`` (a path) gets ``note`` appended just before, so that
    a test can tell where the process died."""
    import signal
    import time

    if marker is not None:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, note.encode())
        finally:
            os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached: the signal is delivered before kill() returns


def kill_at(owner, name: str, *, after: bool = False, marker: str | None = None):
    """Make the next call of ``owner.name`` (a class's method or a module's function) SIGKILL
    this process (``kill_self(marker, name)``): before the real call, or once it returned with
    ``after=True``. Returns the undo (for a process that never reached the call)."""
    real = getattr(owner, name)

    def hook(*args, **kwargs):
        if not after:
            kill_self(marker, name)
        out = real(*args, **kwargs)
        kill_self(marker, name)
        return out

    setattr(owner, name, hook)
    return lambda: setattr(owner, name, real)


def delay_at(owner, name: str, seconds: float):
    """Make every call of ``owner.name`` start ``seconds`` late (a slow rank). Returns the undo."""
    import time

    real = getattr(owner, name)

    def hook(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    setattr(owner, name, hook)
    return lambda: setattr(owner, name, real)


def process_gone(pid: int, timeout: float) -> bool:
    """True once process ``pid`` has exited (a zombie, not yet reaped by its parent, counts:
    the kernel released its files and memory at exit), polling up to ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


SHM_LEDGER_ENV = "VMMKV_TEST_SHM_LEDGER"


class ShmLedger:
    """The ``/dev/shm`` names that this test's own processes linked (test-only): a leak check
    that other vmmkv processes of the machine cannot disturb. The parent sets
    ``VMMKV_TEST_SHM_LEDGER`` to a file (:meth:`enable`); every process that calls
    :func:`record_shm_exports` appends each by-value name it links to that file, flushed before
    the name is returned (so a rank killed right after the export still leaves its record)."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def enable(self, monkeypatch) -> ShmLedger:
        open(self.path, "a").close()
        monkeypatch.setenv(SHM_LEDGER_ENV, self.path)
        record_shm_exports()  # this process too (the one-process tests)
        return self

    def names(self) -> list[str]:
        with open(self.path) as f:
            return sorted({line.strip() for line in f if line.strip()})

    def left(self) -> list[str]:
        """The recorded names that still exist."""
        from vmmkv.alloc.host import SHM_DIR

        return [n for n in self.names() if os.path.exists(os.path.join(SHM_DIR, n))]


def record_shm_exports() -> None:
    """In a process of a test using :class:`ShmLedger`: record every name
    ``HostBackend.export_value`` links (idempotent; nothing without the ledger variable)."""
    path = os.environ.get(SHM_LEDGER_ENV)
    from vmmkv.alloc.host import HostBackend

    real = HostBackend.export_value
    if not path or getattr(real, "_vmmkv_ledger", None) == path:
        return
    real = getattr(real, "_vmmkv_real", real)

    def export_value(self, ptr, size, tag):
        value = real(self, ptr, size, tag=tag)
        with open(path, "a") as f:
            f.write(value.decode() + "\n")
        return value

    export_value._vmmkv_ledger, export_value._vmmkv_real = path, real
    HostBackend.export_value = export_value


def shm_ledger_left() -> list[str]:
    """In a child: the names of the test's ledger that still exist (nothing without one)."""
    path = os.environ.get(SHM_LEDGER_ENV)
    return ShmLedger(path).left() if path else []


def rank_device(backend: str, rank: int, world: int) -> torch.device:
    """Host: the CPU. CUDA: one GPU per rank when there are enough, else every rank on GPU 0
    (set as the process's current device)."""
    if backend == "host":
        return torch.device("cpu")
    ordinals = list(range(world)) if torch.cuda.device_count() >= world else [0]
    dev = torch.device("cuda", ordinals[rank % len(ordinals)])
    torch.cuda.set_device(dev)
    return dev


def shard_step_rows(seed: int, prank: int, world: int, blocks, rows: int, block_size: int):
    """One layer's inputs in vLLM's 'shard' PCP case (DCP 1, every row published), for tests of
    memory and ordering (the slot mappings vLLM's PCPManager makes are tested in
    ``test_vllm_pcp``): every rank's ``rows`` rows (generator seed ``seed + rank``), row i in
    block ``blocks[i % len(blocks)]`` at an offset of the rank's own, row 2 padding. Returns
    (this rank's kv_c, k_pe, k, the expanded mapping, every rank's ((kv_c, k_pe, k), slots))."""

    def rows_of(r):
        g = torch.Generator().manual_seed(seed + r)
        return [torch.randn(rows, w, generator=g).mul(3).to(torch.bfloat16) for w in (512, 64, 128)]

    slots = []
    for r in range(world):
        s = torch.tensor([blocks[i % len(blocks)] * block_size + 8 * r + i for i in range(rows)])
        s[2] = -1
        slots.append(s)
    kv_c, k_pe, k = rows_of(prank)
    return kv_c, k_pe, k, torch.cat(slots), [(rows_of(r), slots[r]) for r in range(world)]


def fds_not_sockets() -> int:
    """How many fds this process holds that are not sockets (memfds, exported handles, device
    files, pipes): a leak check that a socket of the process group, which the kernel or gloo
    may close when a peer dies, cannot disturb."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # the fd of the listing itself, closed meanwhile
            pass
    return n


def device_memory_in_use(ordinals) -> dict[int, int]:
    """Device memory in use (cuMemGetInfo: every process's) on each CUDA device of
    ``ordinals``, after synchronizing them and emptying torch's cache. Creates the primary
    context of a device on first use (measure once before the baseline, so that it counts)."""
    for k in ordinals:
        torch.cuda.synchronize(k)
    torch.cuda.empty_cache()
    out = {}
    for k in ordinals:
        free, total = torch.cuda.mem_get_info(k)
        out[k] = total - free
    return out


def settled_device_memory(ordinals, ceiling: dict[int, int], timeout: float = 15.0):
    """``device_memory_in_use(ordinals)`` once every device is at or below ``ceiling`` (the
    driver releases a dead process's memory asynchronously), or the last sample at the
    deadline."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        used = device_memory_in_use(ordinals)
        if all(used[k] <= ceiling[k] for k in ordinals) or time.monotonic() >= deadline:
            return used
        time.sleep(0.1)


# --------------------------------------------------------------------------------------------
# a KV-cache step over a ReplicatedKVCache, and its oracle (tests/test_faults.py, test_soak.py)
# --------------------------------------------------------------------------------------------


def layer_buffers(tokens: int, device) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Static inputs of one ``fp8_ds_mla`` + ``indexer_k`` layer store on ``device``: zeroed
    ``[tokens, width]`` tensors in the order ``get_format(kind).inputs`` lists them (MLA first),
    and int64 slots of -1 (``tokens``), for a step to fill and a captured graph to read."""
    from vmmkv.ops.formats import get_format

    inputs = [
        torch.zeros(tokens, width, dtype=dtype, device=device)
        for kind in ("fp8_ds_mla", "indexer_k")
        for _, dtype, width in get_format(kind).inputs
    ]
    return inputs, torch.full((tokens,), -1, dtype=torch.int64, device=device)


class KVStep:
    """``layers`` layer-interleaved KV layers (``vmmkv.testing.kv``) in one buffer allocated
    from ``cache`` at its region's base, bound to the cache; static device inputs of
    ``max_tokens`` rows (what a captured step reads), refilled by ``load``; ``step`` stores
    every layer then runs the cache's barrier. ``expected`` is the pure-torch oracle."""

    def __init__(self, cache, layers: int, max_tokens: int) -> None:
        from vmmkv.testing.kv import BLOCK_SIZE, block_stride, interleaved_views

        self.cache, self.layers, self.max_tokens = cache, layers, max_tokens
        self.stride = block_stride(layers)
        self.num_blocks = cache.capacity_bytes // self.stride
        self.block_size = BLOCK_SIZE
        # the whole capacity (an engine that grows later): only committed blocks are touched
        self.buf = cache.allocate(self.num_blocks * self.stride, reserve=True).view(torch.uint8)
        if self.buf.data_ptr() != cache.region.base_ptr:
            raise ValueError("KVStep needs the cache's first allocation (at the region's base)")
        self.bound = [
            (cache.bind(f"mla.{i}", m, "fp8_ds_mla"), cache.bind(f"idx.{i}", x, "indexer_k"))
            for i, (m, x) in enumerate(interleaved_views(self.buf, layers, self.num_blocks))
        ]
        self.inputs, self.slots = layer_buffers(max_tokens, cache.device)

    def blocks(self, committed_bytes: int | None = None) -> int:
        """How many whole blocks lie in the committed prefix (default: the cache's now)."""
        n = self.cache.committed_bytes if committed_bytes is None else committed_bytes
        return min(self.num_blocks, n // self.stride)

    def slot_range(self, first_block: int, end_block: int) -> range:
        return range(first_block * self.block_size, end_block * self.block_size)

    @staticmethod
    def spread(pool: range, world: int, per_rank: int, seed: int) -> list[torch.Tensor]:
        """``per_rank`` distinct slots of ``pool`` for each rank (no two ranks share one)."""
        if world * per_rank > len(pool):
            raise ValueError(f"{world} x {per_rank} slots do not fit in {len(pool)}")
        perm = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))
        picked = perm[: world * per_rank] + pool.start
        return [picked[r * per_rank : (r + 1) * per_rank].clone() for r in range(world)]

    @staticmethod
    def batch(seed: int, slots: torch.Tensor):
        """``(kv_c, k_pe, k, slots)`` on the CPU: random non-zero inputs for ``slots``."""
        from vmmkv.testing.kv import layer_inputs

        return (*layer_inputs(seed, slots.numel()), slots)

    def load(self, batch) -> None:
        """Copy ``batch`` into the static inputs; the rows after it become padding (slot -1)."""
        n = batch[3].numel()
        if n > self.max_tokens:
            raise ValueError(f"{n} tokens exceed the {self.max_tokens} static rows")
        self.slots.fill_(-1)
        for dst, src in zip((*self.inputs, self.slots), batch, strict=True):
            dst[:n].copy_(src.to(dst.device))

    def step(self) -> None:
        """Every layer's store of the static inputs, then the cache's barrier."""
        kv_c, k_pe, k = self.inputs
        for mla, idx in self.bound:
            self.cache.store_layer(mla, idx, kv_c, k_pe, k, self.slots)
        self.cache.barrier()

    def publish_checked(self, rank: int, world: int, tokens: int, seed: int, what: str) -> None:
        """Collective, every rank alive: poison the own replica (``seed + rank``), then every rank
        stores ``tokens`` random tokens into slots no other rank uses (``seed + 1``) and every
        replica must equal the oracle byte for byte (``check`` naming ``what``)."""
        import torch.distributed as dist

        before = self.poison(0, self.cache.committed_bytes, seed=seed + rank)
        dist.barrier()  # nobody writes into a replica before its owner poisoned it
        slots = KVStep.spread(self.slot_range(0, self.blocks()), world, tokens, seed=seed + 1)
        batches = [KVStep.batch(100 * (r + 1), slots[r]) for r in range(world)]
        self.load(batches[rank])
        self.step()
        self.check(self.expected(before, batches), what)

    def capture(self):
        """A CUDA graph of ``step`` (after one eager step, which every rank must also run)."""
        dev = self.cache.device
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            graph.capture_begin()
            self.step()
            graph.capture_end()
        torch.cuda.current_stream(dev).wait_stream(stream)
        return graph

    def poison(self, start: int, end: int, seed: int) -> torch.Tensor:
        """Fill own replica bytes ``[start, end)`` of the buffer with ``random_bytes``; returns
        a CPU copy of the buffer's first ``end`` bytes as they are now (a copy also on the host
        backend, where ``.cpu()`` would alias the region)."""
        self.buf[start:end].copy_(random_bytes(end - start, seed, self.buf.device))
        self.sync()
        return self.buf[:end].to("cpu", copy=True)

    def sync(self) -> None:
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize(self.cache.device)

    def expected(self, before: torch.Tensor, batches) -> torch.Tensor:
        """The oracle: ``before`` (the first bytes of the buffer, on the CPU) after every batch
        was stored into every layer, in order (slots must lie in ``before``'s whole blocks)."""
        from vmmkv.testing.kv import expected_replica

        blocks = before.numel() // self.stride
        return expected_replica(
            before[: blocks * self.stride], batches, layers=self.layers, num_blocks=blocks
        )

    def check(self, want: torch.Tensor, what: str) -> None:
        """Own replica's first ``want.numel()`` bytes equal ``want`` (AssertionError naming the
        rank, the step and where the first differences are)."""
        self.sync()
        got = self.buf[: want.numel()].to("cpu", copy=True)
        if not torch.equal(got, want):
            bad = (got != want).nonzero().flatten()
            raise AssertionError(
                f"rank {self.cache.rank}: {what}: {bad.numel()} bytes differ from the oracle, "
                f"first at {bad[:4].tolist()}"
            )


def run_tool_main(main, argv: list[str], out) -> tuple[dict, str]:
    """A benchmark tool's ``main()`` run in this process as ``argv`` would run it (its ranks
    are spawned): the JSON it wrote to ``out`` (a path, named in ``argv``) and what it printed."""
    import contextlib
    import io
    import json
    import sys

    stdout, old = io.StringIO(), sys.argv
    sys.argv = argv
    try:
        with contextlib.redirect_stdout(stdout):
            main()
    finally:
        sys.argv = old
    return json.loads(out.read_text()), stdout.getvalue()


# --------------------------------------------------------------------------------------------
# ranks as plain interpreters, for tests of how a process exits (tests/test_exit*.py)
# --------------------------------------------------------------------------------------------


class ScriptRun(NamedTuple):
    """One rank's plain interpreter: ``returncode`` (None: still running at the deadline, then
    killed), and everything it wrote to stdout and stderr."""

    returncode: int | None
    stdout: str
    stderr: str


def last_line(rank: int, returncode: int | None, stdout: bytes | str, stderr: bytes | str) -> str:
    """The last line rank ``rank`` printed to stdout (its result). A rank that printed none died
    before its result: AssertionError naming the rank, its exit status and its last stderr
    lines, instead of an IndexError that hides why."""
    out = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout
    lines = out.strip().splitlines()
    if lines:
        return lines[-1]
    err = stderr.decode(errors="replace") if isinstance(stderr, bytes) else (stderr or "")
    tail = "\n".join(err.strip().splitlines()[-20:]) or "(nothing on stderr)"
    raise AssertionError(
        f"rank {rank} ended before printing its result (exit status {returncode}); "
        f"the end of its stderr:\n{tail}"
    )


def run_rank_scripts(
    script: str, world: int, args=(), timeout: float = 60.0, env: dict[str, str] | None = None
) -> list[ScriptRun]:
    """Run ``python -c script <rank> *args`` once per rank at the same time; results in rank order.

    For tests of a rank's own exit: the spawner's children return into its child loop (which
    destroys the group and sends a result) and share the parent's stderr, so these are plain
    interpreters whose exit is their own and whose stdout/stderr are kept apart (in files: no
    pipe can fill and block a rank). Each runs in its own session with the repository first on
    ``PYTHONPATH``, the spawner's ``MULTICAST_OFF`` defaults, no ``VMMKV_DIRECT`` and ``env`` on
    top (e.g. a ``world_store``'s). Bounded: a
    rank still running ``timeout`` seconds after the start is killed with its process group.
    Local; the caller owns nothing afterwards (every rank reaped, every file closed)."""
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    from vmmkv._util import require_int, require_timeout
    from vmmkv.testing.spawn import MULTICAST_OFF

    require_int("world", world, lo=1)
    timeout = require_timeout("timeout", timeout)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    extra = env or {}
    env = {**MULTICAST_OFF, **os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env.pop("VMMKV_DIRECT", None)
    env.update(extra)
    deadline = time.monotonic() + timeout
    files, procs, codes = [], [], []
    try:
        for rank in range(world):
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            files.append((out, err))
            argv = [sys.executable, "-c", script, str(rank), *(str(a) for a in args)]
            kw = dict(stdout=out, stderr=err, env=env, cwd=root, start_new_session=True)
            procs.append(subprocess.Popen(argv, **kw))
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for proc in procs:
            if proc.poll() is None:  # unreaped: its pid (and group id) cannot be reused yet
                for kill in (os.killpg, os.kill):
                    try:
                        kill(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.wait()
        texts = []
        for pair in files:
            for f in pair:
                f.seek(0)
                texts.append(f.read().decode(errors="replace"))
                f.close()
    return [ScriptRun(codes[r], texts[2 * r], texts[2 * r + 1]) for r in range(world)]


# What a clean exit never prints: lower-cased substrings of a stderr line, and the prefix of
# torch's C++ warning/error/fatal log lines ("[W1130 12:00:00 ...]").
_NOISE = (
    "traceback", "exception ignored", "error", "warning", "cuda", "leak", "segmentation",
    "fatal", "terminate called", "abort", "core dumped",
)  # fmt: skip
_CXX_LOG = re.compile(r"^\[[WEF]\d")


def stderr_noise(stderr: str) -> list[str]:
    """The lines of ``stderr`` that a clean run never prints (tracebacks, "Exception ignored",
    warnings, errors, anything naming CUDA such as CUDA_ERROR_*, crashes, torch's C++ log)."""
    return [
        line
        for line in stderr.splitlines()
        if any(w in line.lower() for w in _NOISE) or _CXX_LOG.match(line)
    ]


# --------------------------------------------------------------------------------------------
# two ranks store two layers of given kinds through a ReplicatedKVCache, in both modes
# (tests/test_formats_mx.py, tests/test_formats_mla_ue8m0.py)
# --------------------------------------------------------------------------------------------

KINDS_LAYERS = 2
KINDS_BLOCKS = 4
KINDS_GUARD = 4096
KINDS_OWN = [13, 5]  # each rank's own tokens (rank r: KINDS_OWN[r % 2])
KINDS_DECODE = 3  # replicated decode tokens, stored as num_local_only
KINDS_BAD_SLOTS = 5  # out-of-range tokens counted: store_layer (2), the second store, publish (2)


@dataclass(frozen=True)
class KindsScenario:
    """What ``kinds_cache_worker`` stores: the MLA and indexer kinds both layers are bound as;
    ``second``, the store that follows ``store_layer`` (layer 0) with the same inputs, into
    layer 1's one view ("store_ds_mla" or "store_indexer_k"); ``contrast``, (MLA kind, indexer
    kind) whose oracle must differ from this one's on these inputs; the own replica's poison
    seed is ``poison_seed + rank``."""

    mla_kind: str
    idx_kind: str
    second: str
    contrast: tuple[str, str]
    poison_seed: int


def kinds_batches(world: int, seed: int):
    """[(kv_c, k_pe, k, slots)] on the CPU: the shared decode batch, then each rank's own batch
    (rank 0's with a padding and an out-of-range slot); slots unique across batches."""
    from vmmkv.testing.kv import BLOCK_SIZE, layer_inputs

    perm = torch.randperm(KINDS_BLOCKS * BLOCK_SIZE, generator=torch.Generator().manual_seed(seed))
    out, at = [], 0
    for who in range(-1, world):
        n = KINDS_DECODE if who < 0 else KINDS_OWN[who % len(KINDS_OWN)]
        slots = perm[at : at + n].clone()
        at += n
        if who == 0:
            slots[1], slots[4] = -1, KINDS_BLOCKS * BLOCK_SIZE + 7
        kv_c, k_pe, k = layer_inputs(seed * 10 + who + 1, n)
        k[0, :] *= 1e4  # one row far from the others: its own exponent byte
        out.append((kv_c, k_pe, k, slots))
    return out


def kinds_oracle(
    poison: torch.Tensor, world: int, scenario: KindsScenario, mla_kind: str, idx_kind: str
) -> torch.Tensor:
    """``poison`` after every rank's batches of ``scenario``'s stores, inserted by the pure-torch
    reference as ``mla_kind`` and ``idx_kind``."""
    from vmmkv.ops import reference as R
    from vmmkv.testing.kv import interleaved_views

    want = poison.clone()
    (mla0, idx0), (mla1, idx1) = interleaved_views(
        want, KINDS_LAYERS, KINDS_BLOCKS, offset=KINDS_GUARD
    )
    second = (mla1, None) if scenario.second == "store_ds_mla" else (None, idx1)
    # seed 1: store_layer(layer 0), the second store (layer 1); seed 2: publish_layer(layer 1)
    for seed, views in ((1, ((mla0, idx0), second)), (2, ((mla1, idx1),))):
        for kv_c, k_pe, k, slots in kinds_batches(world, seed):
            for mla, idx in views:
                if mla is not None:
                    R.insert_ds_mla(mla, kv_c, k_pe, slots, kind=mla_kind)
                if idx is not None:
                    R.insert_indexer_k(idx, k, slots, kind=idx_kind)
    return want


def kinds_cache_worker(rank: int, world: int, backend: str, scenario: KindsScenario):
    """One rank (``run_world``): in each mode, poison its replica, store, check every byte of
    it against ``kinds_oracle``; returns {mode: (error count, cache.direct)}."""
    import torch.distributed as dist

    from vmmkv import ReplicatedKVCache
    from vmmkv.gather import pad_tokens
    from vmmkv.testing.kv import block_stride, interleaved_views

    device = "cpu" if backend == "host" else "cuda:0"
    chunk = 1 << 21 if backend == "cuda" else 1 << 16
    total = 2 * KINDS_GUARD + KINDS_BLOCKS * block_stride(KINDS_LAYERS)
    cap = -(-total // chunk) * chunk
    out = {}
    with ReplicatedKVCache(
        dist.group.WORLD, cap, device, chunk_bytes=chunk, backend=backend, initial_bytes=cap
    ) as cache:
        buf = cache.allocate(total).view(torch.uint8)
        (mla0, idx0), (mla1, idx1) = interleaved_views(
            buf, KINDS_LAYERS, KINDS_BLOCKS, offset=KINDS_GUARD
        )
        b_mla0 = cache.bind("mla0", mla0, scenario.mla_kind)
        b_mla1 = cache.bind("mla1", mla1, scenario.mla_kind)
        b_idx0 = cache.bind("idx0", idx0, scenario.idx_kind)
        b_idx1 = cache.bind("idx1", idx1, scenario.idx_kind)
        pad_to = max(KINDS_OWN[r % len(KINDS_OWN)] for r in range(world))

        def inputs(seed):
            """Decode rows first (replicated), then this rank's rows padded to pad_to."""
            dec, *own = kinds_batches(world, seed)
            padded, slots = pad_tokens(own[rank][:3], own[rank][3], pad_to)
            cat = [torch.cat([d, o]).to(device) for d, o in zip(dec, (*padded, slots), strict=True)]
            return cat[:3], cat[3].to(torch.int32)

        for mode in ("direct", "gather"):
            g = torch.Generator().manual_seed(scenario.poison_seed + rank)
            poison = torch.randint(1, 256, (total,), generator=g, dtype=torch.uint8)
            buf.copy_(poison.to(device))
            cache.error_counter.zero_()
            dist.barrier()
            (kv_c, k_pe, k), slots = inputs(1)
            cache.store_layer(b_mla0, b_idx0, kv_c, k_pe, k, slots,
                              num_local_only=KINDS_DECODE, mode=mode)  # fmt: skip
            if scenario.second == "store_ds_mla":
                cache.store_ds_mla(b_mla1, kv_c, k_pe, slots, num_local_only=KINDS_DECODE,
                                   mode=mode)  # fmt: skip
            else:
                cache.store_indexer_k(b_idx1, k, slots, num_local_only=KINDS_DECODE, mode=mode)
            cache.barrier()
            (kv_c, k_pe, k), slots = inputs(2)
            cache.publish_layer(b_mla1, b_idx1, kv_c, k_pe, k, slots,
                                num_local_only=KINDS_DECODE, mode=mode)  # fmt: skip
            if backend == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            got = buf.cpu()
            want = kinds_oracle(poison, world, scenario, scenario.mla_kind, scenario.idx_kind)
            contrast = kinds_oracle(poison, world, scenario, *scenario.contrast)
            assert not torch.equal(want, contrast)  # the kinds make a real difference
            assert torch.equal(got, want), (
                f"rank {rank} mode {mode}: {(got != want).sum().item()} bytes differ, first at "
                f"{(got != want).nonzero()[:4].flatten().tolist()}"
            )
            out[mode] = (int(cache.error_counter.item()), cache.direct)
            dist.barrier()
    return out


def check_kinds_results(out: list) -> None:
    """``kinds_cache_worker``'s results: direct mode counts only rank 0's own bad tokens, gather
    mode every rank's (every rank inserts every rank's tokens); every rank went direct."""
    for rank, res in enumerate(out):
        assert res["direct"] == (KINDS_BAD_SLOTS * (rank == 0), True)
        assert res["gather"] == (KINDS_BAD_SLOTS, True)


def cpu_layer_targets(
    replicas: list[torch.Tensor], num_blocks: int, my_rank: int, mla_kind: str, idx_kind: str
):
    """(MLA target, indexer target) of one layer over CPU byte ``replicas`` (rank r's replica is
    ``replicas[r]``): ``num_blocks`` MLA blocks, then as many indexer blocks; one error counter
    shared by both. For the wrappers' checks and the host backend (a CPU target cannot launch)."""
    from vmmkv.ops.formats import INDEXER_ENTRY_BYTES as IDX
    from vmmkv.ops.formats import MLA_ENTRY_BYTES as MLA
    from vmmkv.ops.kv import KVTarget
    from vmmkv.testing.kv import BLOCK_SIZE as BS

    table = torch.tensor([r.data_ptr() for r in replicas], dtype=torch.int64)
    common = dict(ptr_table=table, my_rank=my_rank, num_blocks=num_blocks, block_size=BS,
                  committed_bytes=torch.tensor([replicas[0].numel()]),
                  error_counter=torch.zeros(1, dtype=torch.int32), cache=replicas[my_rank])  # fmt: skip
    mla = KVTarget(kind=mla_kind, offset_bytes=0, block_stride=BS * MLA, entry_stride=MLA,
                   entry_bytes=MLA, **common)  # fmt: skip
    idx = KVTarget(kind=idx_kind, offset_bytes=num_blocks * BS * MLA, block_stride=BS * IDX,
                   entry_stride=IDX, entry_bytes=IDX, **common)  # fmt: skip
    return mla, idx


# --------------------------------------------------------------------------------------------
# tests against the installed vLLM (tests/test_vllm_*.py)
# --------------------------------------------------------------------------------------------

# vLLM's KV block layouts the plugin supports (each test names them: the spec, not the code's list)
VLLM_LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")


def vllm_world_fixture(rank_fn, world: int, timeout: float):
    """A module-scoped fixture whose value is every rank's result of ``rank_fn(rank, world,
    port)``, run once on ``world`` spawned ranks that join vLLM's groups themselves (on the
    ``port`` of a ``world_store``; ``run_world(..., init_group=False)``). Assign it to the
    fixture's name."""
    import pytest

    from vmmkv.testing.spawn import run_world, world_store

    @pytest.fixture(scope="module")
    def ranks():
        with world_store() as store:
            return run_world(
                rank_fn, world, args=(store.port,), init_group=False, env=store.env,
                timeout=timeout,
            )  # fmt: skip

    return ranks


# how to install what the vLLM tests need: README.md's vLLM test line without its pytest part
# (tests/test_readme.py checks that the two agree)
VLLM_INSTALL = (
    "pip install -r requirements/vllm-0.34.0.txt && pip install --no-deps vllm==0.34.0 && "
    "pip install -e '.[test]'"
)


def vllm_marks() -> list:
    """A vLLM test file's ``pytestmark``: the ``vllm`` marker, and a clean skip where vllm is
    not installed, naming the README's install route."""
    import importlib.util

    import pytest

    return [
        pytest.mark.vllm,
        pytest.mark.skipif(
            importlib.util.find_spec("vllm") is None,
            reason="vllm is not installed: in a virtual environment of its own, "
            f'{VLLM_INSTALL} (README.md, "Running vLLM with vmmkv")',
        ),
    ]
