"""NVRTC build of the vmmkv kernels, with an on-disk cubin cache.

Contract:
- Sources: the top-level ``csrc/`` of a source checkout when it exists, else the installed
  package data ``vmmkv._csrc``. Every ``#include "x.cuh"`` of a source is resolved in that folder
  and handed to NVRTC in memory, so the cache key covers exactly what is compiled.
- Options: ``-std=c++17 --gpu-architecture=sm_XX -default-device``, never fast-math (the KV
  formats need IEEE division and accurate ``log2f``). Test builds only: ``VMMKV_TEST_DEFINES``
  (space-separated ``VMMKV_TEST_NAME[=integer]``, e.g. ``VMMKV_TEST_LAG_NS=50000``, the lag hook
  of csrc/barrier.cuh) adds ``-D`` options; anything else in it is refused. ``VMMKV_CSRC_DIR``
  replaces the source folder (the GPU tests build mutated copies of csrc/ there). Both enter the
  cache key like any source or option, so such cubins never replace production ones. When the CUDA headers are found
  (:func:`cuda_include_dir`), ``cuda_fp8.h`` provides the fp8 conversion; otherwise the kernels
  use an equivalent built-in one (the same PTX instruction on sm_89+, an exact software path
  below). A failed compile with the headers falls back to the built-in path with a warning.
- Cache: ``$VMMKV_CACHE_DIR`` or ``${XDG_CACHE_HOME:-~/.cache}/vmmkv/kernels``. Key = sha256 of
  the source text (with its csrc headers), the options, the NVRTC version, the arch and the fp8
  header text used. Files are written to a temporary file in the same folder and renamed into
  place (atomic for concurrent processes); a corrupt or short file is ignored and rebuilt. An
  unwritable cache folder only disables caching.
- ``compile_all(arch)`` needs no GPU. ``load_module(ordinal)`` compiles for the device's arch,
  loads the modules under the device's primary context and keeps them for the life of the
  process (cached per device and key; never unloaded: captured graphs may still use them).
  When loading one module (or finding one of its functions) fails, the modules this call
  loaded already are unloaded before the error propagates; nothing is cached then.
- Nothing here is collective. Not capture-safe the first time (compiles, loads); afterwards
  ``load_module`` is a dictionary lookup.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import tempfile
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vmmkv.alloc import driver

_log = logging.getLogger(__name__)

__all__ = [
    "KERNELS",
    "BuildError",
    "LoadedKernels",
    "arch_of_device",
    "cache_dir",
    "cache_key",
    "compile_all",
    "compile_options",
    "compile_ptx",
    "compile_source",
    "csrc_dir",
    "cuda_include_dir",
    "load_module",
    "nvrtc_version",
    "read_source",
    "test_defines",
]

# Every kernel source and the extern "C" entry points it defines.
KERNELS: dict[str, tuple[str, ...]] = {
    "kv_store.cu": (
        "vmmkv_store_ds_mla",
        "vmmkv_store_indexer_k",
        "vmmkv_store_layer",
        "vmmkv_publish_rows",
        "vmmkv_store_ds_mla_barrier",
        "vmmkv_store_indexer_k_barrier",
        "vmmkv_store_layer_barrier",
        "vmmkv_publish_rows_barrier",
        # the indexer_k_mxfp8 variants (UE8M0 x4 scales) of the stores that write an indexer
        "vmmkv_store_indexer_k_mxfp8",
        "vmmkv_store_layer_mxfp8",
        "vmmkv_store_indexer_k_mxfp8_barrier",
        "vmmkv_store_layer_mxfp8_barrier",
        # the fp8_ds_mla_ue8m0 variants (power-of-two tile scales) of the stores that write MLA
        "vmmkv_store_ds_mla_ue8m0",
        "vmmkv_store_layer_ue8m0",
        "vmmkv_store_layer_ue8m0_mxfp8",
        "vmmkv_store_ds_mla_ue8m0_barrier",
        "vmmkv_store_layer_ue8m0_barrier",
        "vmmkv_store_layer_ue8m0_mxfp8_barrier",
    ),
    "barrier.cu": ("vmmkv_barrier", "vmmkv_noop"),
}

_BASE_OPTIONS = ("-std=c++17", "-default-device")
_FP8_HEADERS = ("cuda_fp8.h", "cuda_fp8.hpp")
_CACHE_MAGIC = b"VMMKV-CUBIN\x01"
_CACHE_HEADER = struct.Struct("<12sQ32s")  # magic, cubin length, sha256(cubin)
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


class BuildError(RuntimeError):
    """NVRTC failed. ``log`` holds the compiler log (may be empty)."""

    def __init__(self, message: str, log: str = ""):
        self.log = log
        super().__init__(message + (f"\n--- NVRTC log ---\n{log}" if log else ""))


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except Exception as exc:  # pragma: no cover - broken installs only
        raise BuildError(f"cuda.bindings.nvrtc is not importable: {exc}") from exc
    return nvrtc


def _check(nvrtc: Any, out: Any, what: str) -> Any:
    if not isinstance(out, tuple):
        out = (out,)
    code, rest = out[0], out[1:]
    if code != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise BuildError(f"{what} failed: {getattr(code, 'name', code)}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    major, minor = _check(nvrtc, nvrtc.nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


# ---------------------------------------------------------------------------------------------
# Sources and headers


def csrc_dir() -> Path:
    """The folder holding the CUDA sources: the checkout's csrc/ first, then vmmkv._csrc."""
    import vmmkv

    override = os.environ.get("VMMKV_CSRC_DIR")
    if override:
        folder = Path(override)
        if not (folder / "kv_store.cu").is_file():
            raise FileNotFoundError(f"VMMKV_CSRC_DIR={override!r} holds no kv_store.cu")
        return folder
    checkout = Path(vmmkv.__file__).resolve().parents[1] / "csrc"
    if (checkout / "kv_store.cu").is_file():
        return checkout
    from importlib import resources

    packaged = Path(str(resources.files("vmmkv._csrc")))
    if (packaged / "kv_store.cu").is_file():
        return packaged
    raise FileNotFoundError(f"vmmkv CUDA sources not found in {checkout} nor in vmmkv._csrc")


def read_source(name: str, folder: Path | None = None) -> tuple[str, dict[str, str]]:
    """The text of ``name`` and of every csrc header it includes (transitively), by name."""
    folder = folder or csrc_dir()
    text = (folder / name).read_text()
    headers: dict[str, str] = {}
    pending = list(_INCLUDE_RE.findall(text))
    while pending:
        inc = pending.pop()
        if inc in headers:
            continue
        path = folder / inc
        if not path.is_file():
            raise BuildError(f'{name}: #include "{inc}" not found in {folder}')
        headers[inc] = path.read_text()
        pending.extend(_INCLUDE_RE.findall(headers[inc]))
    return text, headers


_include_lock = threading.Lock()
_include_cache: dict[str, str | None] = {}


def _has_fp8_headers(folder: str | os.PathLike[str] | None) -> bool:
    return bool(folder) and all(os.path.isfile(os.path.join(folder, h)) for h in _FP8_HEADERS)


def _include_candidates() -> Iterable[str | None]:
    try:  # pip wheels (nvidia/cu13/include, nvidia/cuda_runtime/include), conda, CUDA_HOME...
        from cuda import pathfinder

        yield pathfinder.find_nvidia_header_directory("cudart")
    except Exception as exc:  # older pathfinder without "cudart", or nothing found
        _log.debug("cuda.pathfinder found no cudart headers: %s", exc)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            yield os.path.join(os.environ[var], "include")
    yield "/usr/local/cuda/include"
    versioned = sorted(Path("/usr/local").glob("cuda-*/include"), reverse=True)
    yield from (str(p) for p in versioned)


def cuda_include_dir() -> str | None:
    """The folder with ``cuda_fp8.h`` (and what it includes), or None to use the built-in
    conversion. ``VMMKV_CUDA_INCLUDE`` overrides: a folder, or ``none`` to force built-in."""
    override = os.environ.get("VMMKV_CUDA_INCLUDE")
    with _include_lock:
        if override in _include_cache:
            return _include_cache[override]
        if override is not None:
            if override.lower() in ("", "none", "0"):
                found = None
            elif _has_fp8_headers(override):
                found = str(Path(override).resolve())
            else:
                raise BuildError(f"VMMKV_CUDA_INCLUDE={override!r} holds no {_FP8_HEADERS[0]}")
        else:
            found = next(
                (str(Path(c).resolve()) for c in _include_candidates() if _has_fp8_headers(c)),
                None,
            )
        _include_cache[override] = found
        return found


def compile_options(arch: str, include_dir: str | None) -> list[str]:
    if not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
    opts = [*_BASE_OPTIONS, f"--gpu-architecture={arch}"]
    if include_dir:
        opts += ["-DVMMKV_HAVE_CUDA_FP8_H=1", f"-I{include_dir}"]
    return opts + test_defines()


_TEST_DEFINE = re.compile(r"VMMKV_TEST_[A-Z0-9_]+(=-?\d+)?")


def test_defines() -> list[str]:
    """``-D`` options of ``VMMKV_TEST_DEFINES`` (test builds only; see the module docstring)."""
    value = os.environ.get("VMMKV_TEST_DEFINES", "").split()
    bad = [d for d in value if not _TEST_DEFINE.fullmatch(d)]
    if bad:
        raise BuildError(
            f"VMMKV_TEST_DEFINES may hold only VMMKV_TEST_NAME[=integer] items, got {bad}"
        )
    return [f"-D{d}" for d in value]


def _fp8_header_text(include_dir: str | None) -> bytes:
    if not include_dir:
        return b""
    return b"".join(Path(include_dir, h).read_bytes() for h in _FP8_HEADERS)


def cache_key(
    name: str,
    source: str,
    headers: dict[str, str],
    options: list[str],
    arch: str,
    version: tuple[int, int],
    extra: bytes = b"",
) -> str:
    """sha256 over everything that determines the cubin."""
    h = hashlib.sha256()

    def put(data: bytes) -> None:
        h.update(struct.pack("<Q", len(data)))
        h.update(data)

    put(b"vmmkv-cubin-v1")
    put(name.encode())
    put(source.encode())
    for inc in sorted(headers):
        put(inc.encode())
        put(headers[inc].encode())
    for opt in options:
        put(opt.encode())
    put(arch.encode())
    put(f"{version[0]}.{version[1]}".encode())
    put(extra)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# On-disk cache


def cache_dir() -> Path:
    env = os.environ.get("VMMKV_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vmmkv" / "kernels"


def _cache_path(folder: Path, name: str, arch: str, key: str) -> Path:
    return folder / f"{Path(name).stem}-{arch}-{key}.cubin"


def _read_cached(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _CACHE_HEADER.size:
        return None
    magic, length, digest = _CACHE_HEADER.unpack_from(data)
    cubin = data[_CACHE_HEADER.size :]
    if magic != _CACHE_MAGIC or length != len(cubin) or hashlib.sha256(cubin).digest() != digest:
        _log.warning("ignoring corrupt vmmkv kernel cache file %s", path)
        return None
    return cubin


def _write_cached(path: Path, cubin: bytes) -> None:
    blob = _CACHE_HEADER.pack(_CACHE_MAGIC, len(cubin), hashlib.sha256(cubin).digest()) + cubin
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
    except OSError as exc:
        _log.info("vmmkv kernel cache disabled (%s): %s", path.parent, exc)
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old file or the complete new one
    except OSError as exc:
        _log.info("vmmkv kernel cache write failed (%s): %s", path, exc)
        try:
            os.unlink(tmp)
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------
# Compilation


def _nvrtc_compile(
    name: str, source: str, headers: dict[str, str], options: list[str], *, ptx: bool = False
) -> bytes:
    nvrtc = _nvrtc()
    inc_names = sorted(headers)
    prog = _check(
        nvrtc,
        nvrtc.nvrtcCreateProgram(
            source.encode(),
            name.encode(),
            len(inc_names),
            [headers[n].encode() for n in inc_names],
            [n.encode() for n in inc_names],
        ),
        "nvrtcCreateProgram",
    )
    try:
        opts = [o.encode() for o in options]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = _check(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log_buf = b" " * size
        _check(nvrtc, nvrtc.nvrtcGetProgramLog(prog, log_buf), "nvrtcGetProgramLog")
        log = log_buf.rstrip(b"\x00 ").decode(errors="replace").strip()
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise BuildError(
                f"NVRTC failed to compile {name} ({getattr(result, 'name', result)}); "
                f"options: {' '.join(options)}",
                log,
            )
        if ptx:
            size = _check(nvrtc, nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            text = b" " * size
            _check(nvrtc, nvrtc.nvrtcGetPTX(prog, text), "nvrtcGetPTX")
            return bytes(text).rstrip(b"\x00")
        size = _check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        if size == 0 or not cubin.startswith(b"\x7fELF"):
            raise BuildError(f"NVRTC returned no cubin for {name} ({' '.join(options)})", log)
        return bytes(cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@dataclass(frozen=True)
class _Build:
    name: str
    arch: str
    key: str
    cubin: bytes
    from_cache: bool
    options: tuple[str, ...]


def _build(name: str, arch: str, include_dir: str | None) -> _Build:
    source, headers = read_source(name)
    options = compile_options(arch, include_dir)
    key = cache_key(
        name, source, headers, options, arch, nvrtc_version(), _fp8_header_text(include_dir)
    )
    path = _cache_path(cache_dir(), name, arch, key)
    cubin = _read_cached(path)
    if cubin is not None:
        return _Build(name, arch, key, cubin, True, tuple(options))
    cubin = _nvrtc_compile(name, source, headers, options)
    _write_cached(path, cubin)
    return _Build(name, arch, key, cubin, False, tuple(options))


_fallback_warned: set[str] = set()


def _build_with_fallback(name: str, arch: str) -> _Build:
    include_dir = cuda_include_dir()
    if include_dir is None:
        return _build(name, arch, None)
    try:
        return _build(name, arch, include_dir)
    except BuildError as exc:
        # e.g. headers of a newer toolkit than this NVRTC: the built-in conversion is equivalent
        result = _build(name, arch, None)
        if include_dir not in _fallback_warned:
            _fallback_warned.add(include_dir)
            warnings.warn(
                f"vmmkv: compiling with cuda_fp8.h from {include_dir} failed; using the "
                f"built-in fp8 conversion instead. {exc}",
                RuntimeWarning,
                stacklevel=3,
            )
        return result


def compile_source(name: str, arch: str) -> bytes:
    """The cubin of one kernel source for ``arch`` (e.g. ``'sm_90'``), through the disk cache."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel source {name!r}; expected one of {sorted(KERNELS)}")
    return _build_with_fallback(name, arch).cubin


def compile_ptx(name: str, arch: str, include_dir: str | None = None) -> str:
    """The PTX of one source for ``arch`` (uncached; for inspection and tests)."""
    source, headers = read_source(name)
    virtual = f"--gpu-architecture=compute_{arch[3:]}"
    options = [
        virtual if o.startswith("--gpu-architecture=") else o
        for o in compile_options(arch, include_dir)
    ]
    return _nvrtc_compile(name, source, headers, options, ptx=True).decode()


def compile_all(arch: str) -> dict[str, bytes]:
    """Cubins of every kernel source for ``arch``; needs NVRTC only, no GPU."""
    return {name: compile_source(name, arch) for name in KERNELS}


# ---------------------------------------------------------------------------------------------
# Loading


def arch_of_device(ordinal: int) -> str:
    driver.ensure_init()  # warm_up may be the process's first driver call
    dev = driver.call(driver.cu.cuDeviceGet, ordinal, device=ordinal)
    attr = driver.cu.CUdevice_attribute
    major = driver.call(
        driver.cu.cuDeviceGetAttribute,
        attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        dev,
        device=ordinal,
    )
    minor = driver.call(
        driver.cu.cuDeviceGetAttribute,
        attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        dev,
        device=ordinal,
    )
    return f"sm_{int(major)}{int(minor)}"


@dataclass
class LoadedKernels:
    """Kernel handles of one device. Owned by this module for the life of the process."""

    ordinal: int
    arch: str
    keys: dict[str, str]
    context: int  # the primary context the modules are loaded in
    modules: dict[str, Any] = field(repr=False)
    functions: dict[str, Any] = field(repr=False)

    def function(self, name: str) -> Any:
        try:
            return self.functions[name]
        except KeyError:
            raise KeyError(f"no kernel {name!r}; loaded: {sorted(self.functions)}") from None


def _unload(modules: dict[str, Any], ordinal: int, cause: BaseException) -> None:
    """Unload what a failed ``load_module`` loaded (nothing launched them yet); ``cause``
    stays the error the caller sees, a failed unload is only logged."""
    for name, mod in modules.items():
        try:
            driver.call(driver.cu.cuModuleUnload, mod, device=ordinal, source=name)
        except Exception as exc:
            _log.warning(
                "vmmkv: unloading %s on device %d after a failed load (%s) failed: %s",
                name, ordinal, cause, exc,
            )  # fmt: skip


_load_lock = threading.Lock()
_loaded: dict[tuple[int, tuple[str, ...]], LoadedKernels] = {}
_latest: dict[int, LoadedKernels] = {}


def load_module(ordinal: int) -> LoadedKernels:
    """Compile (or fetch from the disk cache) and load every kernel for device ``ordinal``.

    The first call per device does the work; later calls return the same handles without any
    driver call, so launching code may call this on every launch.
    """
    hit = _latest.get(ordinal)
    if hit is not None:
        return hit
    with _load_lock:
        hit = _latest.get(ordinal)
        if hit is not None:
            return hit
        arch = arch_of_device(ordinal)
        builds = {name: _build_with_fallback(name, arch) for name in KERNELS}
        ident = (ordinal, tuple(builds[n].key for n in sorted(builds)))
        loaded = _loaded.get(ident)
        if loaded is None:
            modules: dict[str, Any] = {}
            functions: dict[str, Any] = {}
            with driver.primary_context(ordinal) as ctx:
                try:
                    for name, b in builds.items():
                        mod = driver.call(
                            driver.cu.cuModuleLoadData, b.cubin, device=ordinal, source=name
                        )
                        modules[name] = mod
                        for fn in KERNELS[name]:
                            functions[fn] = driver.call(
                                driver.cu.cuModuleGetFunction, mod, fn.encode(), device=ordinal
                            )
                except BaseException as exc:
                    _unload(modules, ordinal, exc)
                    raise
            loaded = LoadedKernels(
                ordinal, arch, {n: b.key for n, b in builds.items()}, int(ctx), modules, functions
            )
            _loaded[ident] = loaded
        _latest[ordinal] = loaded
        return loaded
