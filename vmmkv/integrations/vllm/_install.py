"""The plugin's installer: the tables of every vLLM 0.34.0 call site the plugin replaces, each
patched where vLLM looks it up, and their installation: all or nothing, each site's parameters
checked first, deferred by an import hook until the process imports the module that needs them,
restored by :func:`uninstall`. PCP runs only on vLLM's v2 model runner (MRV2), so only MRV2's
sites are patched. What each site is replaced by, and why, is in the module that replaces it
(its docstring's table):

- ``_allocation``: ``allocate_kv_cache``, vLLM's extensible KV cache's ``ExtensibleTensor`` and
  ``ExtensibleKVCache.__init__``, ``GPUModelRunner.shutdown``;
- ``_stores``: the PCP gathers and inserts, ``KVBlockZeroer.zero_block_ids``,
  ``copy_kv_cache_blocks_inplace``, ``MLAAttention._gather_pcp_cache_inputs``;
- ``_lending``: ``_release_for_weight_update``;
- ``_elastic_worker`` (``WORKER_SITES``, elastic mode): ``GPUModelRunner.update_requests``,
  ``execute_model``, ``sample_tokens``, ``Worker.compile_or_warm_up_model``,
  ``Worker.extend_kv_cache``;
- ``_elastic_engine`` (``ENGINE_SITES``, elastic mode, in the engine core): the scheduler's
  ``__init__``, ``schedule`` and ``update_from_output``, the engine core's input loop, its
  stats utility.

This module imports every site module; no site module imports it. Not a patch: :func:`install`
registers the ``vmmkv`` sleep-mode backend with vLLM's ``SleepModeBackendFactory`` (``_sleep``).

Installation (:func:`install`) is all or nothing: the installed vLLM's version must be in
``SUPPORTED_VLLM`` (checked from the package metadata, ``_support.check_vllm_version``,
without importing vLLM) and every site must exist with the parameters recorded here from 0.34.0;
otherwise :class:`UnsupportedVLLM` names vmmkv, the supported release and every site that moved,
and nothing is patched. :func:`install_when_worker_starts` (what ``register()`` uses) defers the
installation until the process has imported vLLM's GPU worker module, so vLLM's API server and
engine-core processes never import vLLM modules on vmmkv's behalf.

The patches and the import hooks live in ``_state``; this module writes them.

Local, not thread-safe: install/uninstall from one thread, like vLLM's worker.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

from ._allocation import _allocate, _shutdown, capture_spec, make_buffer
from ._elastic_engine import (
    STATS_UTILITY,
    _process_input_queue,
    _schedule,
    _scheduler_init,
    _stats_utility,
    _update_from_output,
)
from ._elastic_worker import _extend, _stamping, _update_requests, _warmup
from ._lending import agreed_lending
from ._state import _STATE, ABSENT, UnsupportedVLLM, _Patch, close_active
from ._stores import (
    _copy,
    _gather_indexer,
    _gather_into_buffers,
    _gather_mla,
    _insert_indexer,
    _insert_mla,
    _zero,
)
from ._support import SUPPORTED_VLLM, check_vllm_version

__all__ = [
    "ENGINE_SITES",
    "WORKER_SITES",
    "install",
    "install_engine",
    "install_when_engine_core_loads",
    "install_when_worker_starts",
    "installed",
    "uninstall",
]

log = logging.getLogger(__name__)

# The module whose import marks a process that runs a GPU worker: vLLM's worker class lives there,
# and it imports MRV2's model runner while it loads (through its warmup module), so the runner's
# sites exist once it has run. Hooking the runner's module instead fired in the middle of this
# one's import, where elastic mode's Worker site did not exist yet (UnsupportedVLLM at start).
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
ENGINE_MODULE = "vllm.v1.engine.core"  # elastic mode's engine sites (EngineCoreProc) live here


def installed() -> bool:
    return bool(_STATE.patches)


# (module, attribute path, replacement factory, the parameters vLLM 0.34.0 gives it): every use
# site vLLM 0.34.0's MRV2 worker looks these up at
_SITES: tuple[tuple[str, str, Callable[..., Any], tuple[str, ...]], ...] = (
    (
        "vllm.v1.worker.gpu.attn_utils", "allocate_kv_cache", _allocate,
        ("kv_cache_config", "device", "layout", "kernel_block_sizes", "allocate"),
    ),
    (
        "vllm.models.deepseek_v32.attention", "maybe_gather_mla_latent_cache_inputs", _gather_mla,
        ("kv_c_normed", "k_pe", "slot_mapping", "num_decode_tokens", "use_pcp",
         "pcp_shard_decode_requests"),
    ),
    (
        "vllm.model_executor.layers.attention.mla_attention",
        "maybe_gather_mla_latent_cache_inputs", _gather_mla,
        ("kv_c_normed", "k_pe", "slot_mapping", "num_decode_tokens", "use_pcp",
         "pcp_shard_decode_requests"),
    ),
    (
        "vllm.model_executor.layers.sparse_attn_indexer", "maybe_gather_indexer_k",
        _gather_indexer,
        ("k", "slot_mapping", "num_decode_tokens", "use_pcp", "pcp_shard_decode_requests"),
    ),
    (
        "vllm._custom_ops", "concat_and_cache_mla", _insert_mla,
        ("kv_c", "k_pe", "kv_cache", "slot_mapping", "kv_cache_dtype", "scale", "skip_scale"),
    ),
    (
        "vllm._custom_ops", "indexer_k_quant_and_cache", _insert_indexer,
        ("k", "kv_cache", "slot_mapping", "quant_block_size", "kv_cache_dtype"),
    ),
    ("vllm.v1.worker.utils", "KVBlockZeroer.zero_block_ids", _zero, ("self", "block_ids")),
    (
        "vllm.v1.worker.gpu.model_runner", "copy_kv_cache_blocks_inplace", _copy,
        ("kv_caches", "num_blocks", "kv_cache_block_copies"),
    ),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.shutdown", _shutdown, ("self",)),
    (
        "vllm.model_executor.layers.attention.mla_attention",
        "MLAAttention._gather_pcp_cache_inputs", _gather_into_buffers,
        ("self", "kv_c_normed", "k_pe", "slot_mapping"),
    ),
    # vLLM's extensible KV cache over vmmkv's buffer (_allocation) and the lending (_lending)
    (
        "vllm.v1.worker.extensible_kv_cache", "ExtensibleTensor", lambda _orig: make_buffer,
        ("max_num_bytes", "device", "num_segments", "segment_capacities",
         "export_handle_types"),
    ),
    (
        "vllm.v1.worker.extensible_kv_cache", "ExtensibleKVCache.__init__", capture_spec,
        ("self", "kv_cache_config", "device", "layout", "export_handle_types"),
    ),
    (
        "vllm.v1.worker.extensible_kv_cache", "_release_for_weight_update", agreed_lending,
        ("kv_cache", "model", "reclaimable", "fail_if_short"),
    ),
)  # fmt: skip


WORKER_SITES: tuple[tuple[str, str, Callable[..., Any], tuple[str, ...]], ...] = (
    (
        "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.update_requests", _update_requests,
        ("self", "scheduler_output"),
    ),
    (
        "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model", _stamping,
        ("self", "scheduler_output", "intermediate_tensors", "dummy_run",
         "skip_attn_for_dummy_run", "is_profile", "context_len", "valid_dummy_state_slots",
         "randomize_inputs"),
    ),
    (
        "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens", _stamping,
        ("self", "grammar_output"),
    ),
    (
        "vllm.v1.worker.gpu_worker", "Worker.compile_or_warm_up_model", _warmup, ("self",),
    ),
    ("vllm.v1.worker.gpu_worker", "Worker.extend_kv_cache", _extend, ("self", "num_blocks")),
)  # fmt: skip


ENGINE_SITES: tuple[tuple[str, str, Callable[..., Any], tuple[str, ...] | None], ...] = (
    (
        "vllm.v1.core.sched.scheduler", "Scheduler.__init__", _scheduler_init,
        ("self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size",
         "hash_block_size", "mm_registry", "include_finished_set", "log_stats"),
    ),
    (
        "vllm.v1.core.sched.scheduler", "Scheduler.schedule", _schedule,
        ("self", "throttle_prefills"),
    ),
    (
        "vllm.v1.core.sched.scheduler", "Scheduler.update_from_output", _update_from_output,
        ("self", "scheduler_output", "model_runner_output"),
    ),
    ("vllm.v1.engine.core", "EngineCoreProc._process_input_queue", _process_input_queue, ("self",)),
    ("vllm.v1.engine.core", f"EngineCore.{STATS_UTILITY}", _stats_utility, None),
)  # fmt: skip


def _lookup(module: str, path: str, added: bool = False) -> tuple[Any, str, Any]:
    owner: Any = importlib.import_module(module)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, name, (getattr(owner, name, ABSENT) if added else getattr(owner, name))


# a site's parameters: those 0.34.0 gives it, or None for an attribute the plugin adds (absent
# from vLLM: an engine-core utility method, which vLLM's client calls by name)
Sites = tuple[tuple[str, str, Callable[..., Any], tuple[str, ...] | None], ...]


def _patches_for(sites: Sites) -> list[_Patch]:
    """The patches of ``sites``, checked: the vLLM version first, then that every site exists
    with the parameters 0.34.0 gives it (or, for an added attribute, that it does not exist);
    :class:`UnsupportedVLLM` lists every problem and nothing is patched. Imports the vLLM
    modules that hold the sites."""
    version = check_vllm_version()
    patches, problems = [], []
    for module, path, factory, params in sites:
        try:
            owner, name, current = _lookup(module, path, added=params is None)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{module}.{path}: missing ({type(exc).__name__}: {exc})")
            continue
        if params is None:
            if current is not ABSENT:
                problems.append(f"{module}.{path}: exists in this vLLM (vmmkv adds it)")
            else:
                patches.append(_Patch(owner, name, ABSENT, factory(None)))
            continue
        try:
            got = tuple(inspect.signature(current).parameters)
        except (TypeError, ValueError) as exc:
            got = (f"<no signature: {exc}>",)
        if got != params:
            problems.append(f"{module}.{path}: parameters {got}, expected {params}")
            continue
        patches.append(_Patch(owner, name, current, factory(current)))
    if problems:
        from ... import __version__

        raise UnsupportedVLLM(
            f"vmmkv {__version__}'s vLLM plugin (written for vllm{SUPPORTED_VLLM}) cannot patch "
            f"the installed vLLM {version}; nothing was patched: " + "; ".join(problems)
        )
    return patches


def _apply(patches: list[_Patch], where: str) -> list[_Patch]:
    for p in patches:
        setattr(p.owner, p.name, p.replacement)
    log.info("vmmkv: replaced %d vLLM call sites (%s)", len(patches), where)
    return patches


def install(sites: Sites = ()) -> None:
    """Patch every worker site, all or nothing (idempotent; :func:`_patches_for` checks them
    first), with elastic mode's worker sites when ``VLLM_VMMKV_ELASTIC=1``. ``sites``: tests
    only (default: every site of 0.34.0)."""
    if _STATE.patches:
        return
    from ._elastic_settings import elastic_enabled

    if not sites:
        sites = _SITES
        if elastic_enabled():
            sites += WORKER_SITES
    patches = _patches_for(sites)
    from ._sleep import register_backend  # vLLM's sleep-mode factory: the "vmmkv" backend

    register_backend()
    _STATE.patches = _apply(patches, "worker")


def install_engine() -> None:
    """Elastic mode's engine-core sites (``ENGINE_SITES``), all or nothing,
    idempotent. ``register()`` calls it in the process that runs vLLM's ``EngineCore``."""
    if _STATE.engine_patches:
        return
    _STATE.engine_patches = _apply(_patches_for(ENGINE_SITES), "engine core, elastic KV")


class _InstallHook(importlib.abc.MetaPathFinder):
    """Runs ``install`` right after ``module`` has been executed (its first import), once; the
    hook is the one ``_STATE.<slot>`` holds until then."""

    def __init__(self, module: str, install: Callable[[], None], slot: str) -> None:
        self.module, self.install, self.slot = module, install, slot

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module or getattr(_STATE, self.slot) is not self:
            return None
        sys.meta_path.remove(self)  # find the real spec below, once
        setattr(_STATE, self.slot, None)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        install = self.install

        def exec_then_install(module):
            exec_module(module)
            install()

        loader.exec_module = exec_then_install
        return spec


def _when_imported(module: str, install: Callable[[], None], slot: str) -> None:
    """``install()`` now if ``module`` is imported, else right after its first import."""
    if module in sys.modules:
        install()
        return
    hook = _InstallHook(module, install, slot)
    setattr(_STATE, slot, hook)
    sys.meta_path.insert(0, hook)


def install_when_worker_starts() -> None:
    """Check the vLLM version now (no vLLM import), then install the patches when this process
    has imported vLLM's GPU worker module (``WORKER_MODULE``): at once if it already did. vLLM's
    API server and engine-core processes never import it, so they import nothing of vLLM on
    vmmkv's behalf. Idempotent."""
    check_vllm_version()
    if _STATE.patches or _STATE.hook is not None:
        return
    _when_imported(WORKER_MODULE, install, "hook")


def install_when_engine_core_loads() -> None:
    """Elastic mode's engine sites (:func:`install_engine`) when this process imports vLLM's
    engine-core module (``ENGINE_MODULE``): at once if it already did. vLLM loads its plugins
    once per process, possibly before that import (``EngineArgs`` does), and an engine core
    forked or run in process never loads them again: the hook hands the sites over to it.
    Idempotent."""
    check_vllm_version()
    if _STATE.engine_patches or _STATE.engine_hook is not None:
        return
    _when_imported(ENGINE_MODULE, install_engine, "engine_hook")


def uninstall() -> None:
    """Restore every patched site, drop pending records, close the active cache (its views,
    which vLLM may still hold, are invalid afterwards), remove the pending import hooks.
    Idempotent."""
    for slot in ("hook", "engine_hook"):
        hook = getattr(_STATE, slot)
        if hook is not None and hook in sys.meta_path:
            sys.meta_path.remove(hook)
        setattr(_STATE, slot, None)
    patches, _STATE.patches = _STATE.patches + _STATE.engine_patches, []
    _STATE.engine_patches = []
    for p in reversed(patches):
        if getattr(p.owner, p.name, None) is p.replacement:
            if p.original is ABSENT:
                delattr(p.owner, p.name)
            else:
                setattr(p.owner, p.name, p.original)
        else:
            log.warning("vmmkv: %s.%s was patched again by someone else; left as it is",
                        getattr(p.owner, "__name__", p.owner), p.name)  # fmt: skip
    close_active("the plugin is unregistered")
