"""One timing loop, one percentile function and one graph capture for the tools and the
benchmarks.

``time_us`` times calls of a function: by default on the host clock with the device
synchronized before and after each call (what a caller waits for), or with ``events=True`` on a
CUDA device between two CUDA events recorded on the current stream around the call (the
stream's time; the host does not synchronize first). Local; not capture-safe (it synchronizes).
``capture_graph`` captures calls of a function into a CUDA graph on a side stream ordered after
the current one, as torch requires. Internal (see ``vmmkv.testing``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._util import require_int

__all__ = ["capture_graph", "median", "percentile", "time_us"]


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``xs``: the sample at rank ``round(q/100 * (n-1))``
    of the sorted values (no interpolation, so it is always a measured value)."""
    if not xs:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q!r}")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def median(xs: Sequence[float]) -> float:
    """The median of ``xs`` (the mean of the two middle values for an even count)."""
    return statistics.median(xs)


def _synchronize(device: Any) -> None:
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)


def time_us(
    fn: Callable[[], Any],
    *,
    iters: int,
    warmup: int = 0,
    device: Any = None,
    before: Callable[[], Any] | None = None,
    events: bool = False,
) -> list[float]:
    """Microseconds of each of ``iters`` timed calls of ``fn``, after ``warmup`` untimed ones.

    ``device`` (a ``torch.device``; None: nothing to synchronize) is synchronized around each
    host-clock measurement. ``before`` runs before each timed call, outside the measurement
    (e.g. ``dist.barrier`` so that every rank starts the step together). ``events=True`` on a
    CUDA device measures between CUDA events instead of the host clock."""
    require_int("iters", iters, lo=1)
    require_int("warmup", warmup, lo=0)
    use_events = events and getattr(device, "type", None) == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if use_events:
            import torch

            if before is not None:
                before()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            _synchronize(device)
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            _synchronize(device)
            times.append((time.perf_counter() - t0) * 1e6)
    return times


def capture_graph(fn: Callable[[], Any], device: Any) -> Any:
    """A ``torch.cuda.CUDAGraph`` of one call of ``fn`` on ``device``, captured on a side stream
    that waits for the current stream (and that the current stream waits for afterwards)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        graph.capture_begin()
        fn()
        graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph
