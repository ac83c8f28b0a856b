"""The command-line tools, apart from the library: ``python -m vmmkv demo|bench|doctor`` and the
``vmmkv`` console script both dispatch through :func:`main`.

Each tool is a module of this package with ``parser()`` (its ``argparse`` parser, built with
:func:`tool_parser`: ``--help`` prints the module docstring as plain text and every option's
help, then exits 0) and ``main(argv) -> int`` (the exit status). Tools check every argument and
every environment variable they read (``vmmkv._env``) before they import torch or spawn a rank:
a wrong one exits 2 with one line per error on stderr (:func:`usage_errors`), no traceback.
Tools write for a person: they print, and every tool opens with one banner line from
:func:`banner` (``vmmkv <tool>: ...``).
Timings taken on the host backend check that the steps run, nothing more: the tools that print
them say so (:data:`HOST_TIMINGS`). Tools that start processes (demo, bench) do so through
``vmmkv.testing.spawn``, the only place that sets the NVLink-multicast-off variables.
Importing this package imports neither torch nor CUDA.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "COMMANDS",
    "HOST_TIMINGS",
    "banner",
    "check_group",
    "main",
    "plain",
    "rank_reports",
    "require_at_least",
    "tool_parser",
    "usage_errors",
    "writable_errors",
]

log = logging.getLogger(__name__)

# command -> (module, one-line summary for the usage text)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "vmmkv.cli.demo",
        "spawn a PCP group, publish KV rows directly into every replica, grow after\n"
        "           CUDA-graph capture, verify byte for byte, report (host backend without a GPU)",
    ),
    "doctor": (
        "vmmkv.cli.doctor",
        "versions, VMM / fd / fabric / P2P support, and whether direct mode can work",
    ),
    "bench": (
        "vmmkv.cli.bench",
        "store / barrier benchmark sweep with JSON output (and a plot with matplotlib)",
    ),
}

USAGE = (
    "usage: python -m vmmkv COMMAND [options]   (or: vmmkv COMMAND [options])\n"
    "       python -m vmmkv --version\n\ncommands:\n"
    + ("".join(f"  {name:<8} {summary}\n" for name, (_, summary) in COMMANDS.items()))
)


# The one line every tool prints next to timings taken on the host backend.
HOST_TIMINGS = (
    "host backend: timings are functional checks, not performance (memfd + mmap on the CPU, "
    "stores through the pure-torch reference; run on GPUs to measure)"
)


def plain(text: str) -> str:
    """Docstring text for a terminal: RST literals (two backticks around) and roles lose
    their markup."""
    text = re.sub(r"``([^`]*)``", r"\1", text)
    return re.sub(r":(?:func|class|data|meth|mod):`~?([^`]*)`", r"\1", text)


class _ToolParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse adds the usage text)
        self.exit(2, f"{self.prog}: error: {message}\n")


def tool_parser(tool: str, doc: str) -> argparse.ArgumentParser:
    """The parser of ``python -m vmmkv <tool>``: ``doc`` (the tool's module docstring) as
    plain text, its line breaks kept. A malformed option exits 2 with one line."""
    return _ToolParser(
        prog=f"python -m vmmkv {tool}",
        description=plain(doc),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def usage_errors(tool: str, errors: list[str]) -> int:
    """Print one line per error on stderr (``python -m vmmkv <tool>: error: ...``); the exit
    status of a usage error, 2."""
    for error in errors:
        print(f"python -m vmmkv {tool}: error: {error}", file=sys.stderr)
    return 2


def require_at_least(errors: list[str], option: str, value: int | None, lo: int) -> None:
    """Append an error when ``value`` (None: not given) is below ``lo``."""
    if value is not None and value < lo:
        errors.append(f"{option} must be >= {lo}, got {value}")


def writable_errors(option: str, path: str, *, directory: bool) -> list[str]:
    """[] when the tool can write ``path``: a directory (created if missing) or a file in an
    existing directory; else one line naming the option, the path and the reason. Probes by
    creating and removing a temporary file there."""
    import errno
    import os
    import tempfile

    target = os.path.abspath(path)
    where = target if directory else os.path.dirname(target)
    try:
        if directory:
            os.makedirs(where, exist_ok=True)
        elif os.path.isdir(target):
            raise IsADirectoryError(errno.EISDIR, "it is a directory")
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        return [f"{option} {path}: cannot write there ({exc.strerror or exc})"]
    return []


def check_group(errors: list[str], backend: str, world: int | None) -> tuple[str, int, int]:
    """The spawning tools' ``(backend, world, chunk_bytes)``: ``auto`` resolved (cuda where a GPU
    is usable), ``world`` defaulted (the GPUs, at least 2), the chunk size from
    ``VMMKV_CHUNK_MIB`` or the default (2 MiB on CUDA, 64 KiB on the host). Appends to
    ``errors``: ``--world`` below 1, ``--backend cuda`` without a CUDA device, every invalid
    environment variable, a chunk size that is not a multiple of the backend's granularity."""
    import os

    from .. import _env
    from ..alloc import driver

    require_at_least(errors, "--world", world, 1)
    if backend == "auto":
        backend = "cuda" if driver.cuda_usable() else "host"
    elif backend == "cuda" and not driver.cuda_usable():
        errors.append("no CUDA device: use --backend host")
    if world is None:
        world = max(2, driver.device_count()) if backend == "cuda" else 2
    errors += _env.problems()
    granularity = (2 << 20) if backend == "cuda" else os.sysconf("SC_PAGE_SIZE")
    chunk = (2 << 20) if backend == "cuda" else (1 << 16)
    try:
        chunk = _env.chunk_bytes() or chunk
    except ValueError:
        pass  # in errors already, through _env.problems()
    if chunk % granularity:
        errors.append(
            f"{_env.CHUNK_MIB}={os.environ.get(_env.CHUNK_MIB)!r} is {chunk} bytes: the {backend} "
            f"backend needs a multiple of {granularity} bytes"
        )
    return backend, world, chunk


def add_group_args(ap: argparse.ArgumentParser) -> None:
    """The ``--world`` and ``--backend`` options the spawning tools (demo, bench) share."""
    ap.add_argument("--world", type=int, default=None, help="ranks (default: GPUs, at least 2)")
    ap.add_argument(
        "--backend",
        choices=("auto", "cuda", "host"),
        default="auto",
        help="memory backend: cuda (VMM on GPUs), host (memfd + mmap, no GPU: timings are "
        "functional checks only) or auto (cuda where a GPU is usable; default)",
    )


def banner(tool: str, text: str) -> None:
    """The one banner style of every tool: ``vmmkv <tool>: <text>`` on stdout, flushed."""
    print(f"vmmkv {tool}: {text}", flush=True)


def rank_reports(
    fn: Callable[[int, int, dict[str, Any]], dict[str, Any]],
    world: int,
    opts: dict[str, Any],
    timeout: float,
) -> list[dict[str, Any]]:
    """``fn(rank, world, opts)`` on ``world`` spawned ranks in a gloo group
    (``vmmkv.testing.spawn``); one report dict per rank in rank order, ``{"rank", "error"}`` for
    a rank that raised, died or timed out."""
    from ..testing.spawn import run_world_raw

    results = run_world_raw(fn, world, args=(opts,), timeout=timeout)
    return [r.value if r.ok else {"rank": r.rank, "error": r.error} for r in results]


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a tool; 2 with the usage text on an
    unknown command or none."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        from .. import __version__

        print(f"vmmkv {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:  # the tools' own log lines (e.g. a skipped plot)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return importlib.import_module(COMMANDS[cmd][0]).main(rest)
