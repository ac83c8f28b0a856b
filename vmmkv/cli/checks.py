"""The checks the tools run before they do anything: the spawning tools' (demo, bench:
:func:`parse_group_args`, :func:`group`, :func:`writable`, before they import torch or start a
rank) and doctor's (:func:`environment`). Each gives one line per problem; :func:`refuse`
prints them and gives the exit status 2. Local; only :func:`environment` imports torch (through
the vLLM plugin's readers), the rest neither torch nor CUDA (``vmmkv.alloc.driver`` loads
cuda.bindings only)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["at_least", "environment", "group", "parse_group_args", "refuse", "writable"]


def refuse(tool: str, errors: list[str]) -> int:
    """Print one line per error on stderr (``python -m vmmkv <tool>: error: ...``); the exit
    status of a usage error, 2."""
    for error in errors:
        print(f"python -m vmmkv {tool}: error: {error}", file=sys.stderr)
    return 2


def at_least(errors: list[str], option: str, value: int | None, lo: int) -> None:
    """Append an error when ``value`` (None: not given) is below ``lo``."""
    if value is not None and value < lo:
        errors.append(f"{option} must be >= {lo}, got {value}")


def writable(option: str, path: str, *, directory: bool) -> list[str]:
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


def parse_group_args(
    ap: argparse.ArgumentParser, argv: list[str] | None, lowest: dict[str, int]
) -> tuple[argparse.Namespace, list[str], str, int, int]:
    """A spawning tool's arguments (``ap`` holds ``--world`` and ``--backend``) and the checks
    every such tool runs: each option of ``lowest`` at least its value, then :func:`group`.
    Returns ``(args, errors, backend, world, chunk_bytes)``; the caller adds its own checks to
    ``errors`` and refuses when there are any."""
    args = ap.parse_args(argv)
    errors: list[str] = []
    for option, lo in lowest.items():
        at_least(errors, option, getattr(args, option.removeprefix("--")), lo)
    return (args, errors, *group(errors, args.backend, args.world))


def group(errors: list[str], backend: str, world: int | None) -> tuple[str, int, int]:
    """The spawning tools' ``(backend, world, chunk_bytes)``: ``auto`` resolved (cuda where a GPU
    is usable), ``world`` defaulted (the GPUs, at least 2), the chunk size from
    ``VMMKV_CHUNK_MIB`` or the default (2 MiB on CUDA, 64 KiB on the host). Appends to
    ``errors``: ``--world`` below 1, ``--backend cuda`` without a CUDA device, every invalid
    environment variable, a chunk size that is not a multiple of the backend's granularity."""
    import os

    from .. import _env
    from ..alloc import driver

    at_least(errors, "--world", world, 1)
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


def environment() -> list[str]:
    """One line per variable of vmmkv whose value its reader refuses: the library's
    (``vmmkv._env``) and the vLLM plugin's switches and elastic KV's knobs, through the plugin's
    own readers (they import torch, no vLLM module)."""
    import os

    from .. import _env
    from ..integrations import vllm
    from ..integrations.vllm import _elastic_settings as _elastic

    found = _env.problems()
    for read in (vllm.enabled, _elastic.elastic_enabled):
        try:
            read()
        except ValueError as exc:
            found.append(str(exc))
    for var in _elastic.KNOBS.values():  # one knob at a time: one line per bad knob
        if var in os.environ:
            try:  # a nominal pool: the knobs are parsed whatever the geometry
                _elastic.elastic_settings(
                    4096, 1 << 20, 64 << 20, block_size=64, max_num_batched_tokens=8192,
                    max_num_seqs=256, concurrent_batches=1, env={var: os.environ[var]},
                )  # fmt: skip
            except ValueError as exc:
                found.append(str(exc))
    return found
