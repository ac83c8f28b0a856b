"""Shared helpers for the benchmark scripts: a printed table, a JSON record with the machine,
and the timing helpers of ``vmmkv.testing.timing`` (one percentile, one timing loop)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from collections.abc import Callable
from typing import Any

from vmmkv.testing.timing import median, percentile, time_us

__all__ = [
    "arguments",
    "device_name",
    "machine",
    "median",
    "per_call_ns",
    "percentile",
    "rank_device",
    "ranks_per_config",
    "resolve_backend",
    "table",
    "time_us",
    "timed",
    "write_json",
]


def arguments(doc: str, name: str) -> argparse.ArgumentParser:
    """The parser every benchmark starts from: its docstring's first line as the description
    and ``--out`` (default ``bench-out/<name>.json``)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default=f"bench-out/{name}.json", help="where the JSON goes")
    return ap


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpus"] = torch.cuda.device_count()
    except Exception:
        pass
    return info


def per_call_ns(fn: Callable[[], Any], n: int = 200, reps: int = 7, sync: Any = "cuda") -> float:
    """Median host ns per call of ``fn`` over ``reps`` loops of ``n`` calls (the device is
    synchronized between loops, outside the measurement, so the launch queue never fills;
    ``sync=None``: no device)."""
    import time

    import torch

    wait = torch.cuda.synchronize if sync == "cuda" else (lambda: None)
    per = []
    for _ in range(reps):
        wait()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        per.append((time.perf_counter_ns() - t0) / n)
    wait()
    return median(per)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` took (host clock; ``fn`` must synchronize what it times)."""
    return time_us(fn, iters=1)[0] * 1e-6


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def ranks_per_config(fn: Callable[..., Any], world: int, cfg: Any, count: int,
                     timeout: float) -> list[list[dict[str, Any]]]:  # fmt: skip
    """``fn(rank, world, cfg)`` on ``world`` spawned ranks, each returning one result per
    configuration (``count``); a rank that failed gives ``count`` copies of its error."""
    from vmmkv.testing.spawn import run_world_raw

    results = run_world_raw(fn, world, args=(cfg,), timeout=timeout)
    return [r.value if r.ok else [{"rank": r.rank, "error": r.error[-600:]}] * count
            for r in results]  # fmt: skip


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``host``; other names as given."""
    if backend != "auto":
        return backend
    import torch

    return "cuda" if torch.cuda.is_available() else "host"


def rank_device(rank: int, backend: str) -> Any:
    """The device of ``rank``: GPU ``rank % count`` (made current: ranks share the GPUs) under
    ``cuda``, else the CPU."""
    import torch

    if backend != "cuda":
        return torch.device("cpu")
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def device_name(backend: str) -> str:
    """What the JSON records as the device: the GPU's name, or ``host``."""
    if backend != "cuda":
        return "host"
    import torch

    return torch.cuda.get_device_name(0)


def write_json(path: str, name: str, rows: list[dict[str, Any]], **extra: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"benchmark": name, "machine": machine(), "rows": rows, **extra}, f, indent=1)


def own_layer_targets(num_blocks: int, device: Any, block_size: int = 64) -> tuple[Any, Any]:
    """(fp8_ds_mla, indexer_k) ``KVTarget``s of one layer in a new zeroed region on ``device``:
    ``num_blocks`` MLA blocks, then as many indexer blocks, behind a one-entry table (the own
    replica only, rank 0). For the host-cost tools, which time the Python around the stores;
    the region is real, so a GPU run may also launch the kernels into it."""
    import torch

    from vmmkv.ops.formats import INDEXER_ENTRY_BYTES as IDX
    from vmmkv.ops.formats import MLA_ENTRY_BYTES as MLA
    from vmmkv.ops.kv import KVTarget

    bs = block_size
    region = torch.zeros(num_blocks * bs * (MLA + IDX), dtype=torch.uint8, device=device)
    geo = dict(ptr_table=torch.tensor([region.data_ptr()], dtype=torch.int64, device=device),
               my_rank=0, num_blocks=num_blocks, block_size=bs,
               committed_bytes=torch.tensor([region.numel()], device=device),
               error_counter=torch.zeros(1, dtype=torch.int32, device=device), cache=region)  # fmt: skip
    mla = KVTarget(kind="fp8_ds_mla", offset_bytes=0, block_stride=bs * MLA, entry_stride=MLA,
                   entry_bytes=MLA, **geo)  # fmt: skip
    idx = KVTarget(kind="indexer_k", offset_bytes=num_blocks * bs * MLA, block_stride=bs * IDX,
                   entry_stride=IDX, entry_bytes=IDX, **geo)  # fmt: skip
    return mla, idx
