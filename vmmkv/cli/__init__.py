"""The command-line tools, apart from the library: ``python -m vmmkv demo|bench|doctor`` and the
``vmmkv`` console script both dispatch through :func:`main`.

Each tool is a module of this package with ``parser()`` (its ``argparse`` parser, built with
:func:`tool_parser`: ``--help`` prints the module docstring as plain text and every option's
help, then exits 0) and ``main(argv) -> int`` (the exit status). Tools check every argument and
every environment variable they read (``vmmkv._env``) before they import torch or spawn a rank,
through ``vmmkv.cli.checks``: a wrong one exits 2 with one line per error on stderr, no
traceback.
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
    "main",
    "plain",
    "rank_reports",
    "tool_parser",
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
        if argv[1:]:
            extra = " ".join(argv[1:])
            print(
                f"python -m vmmkv: error: --version takes no arguments, got {extra!r}",
                file=sys.stderr,
            )
            return 2
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
