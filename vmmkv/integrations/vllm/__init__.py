"""vmmkv as the KV-cache memory of vLLM 0.34.0 under prefill context parallelism (PCP).

A ``vllm.general_plugins`` entry point (``vmmkv = vmmkv.integrations.vllm:register``); vLLM
calls :func:`register` in each of its processes. It does nothing unless ``VLLM_USE_VMMKV=1``.
Enabled, it checks the installed vLLM's version (``SUPPORTED_VLLM``; :class:`UnsupportedVLLM`
otherwise) and, once the process imports MRV2's model runner (a GPU worker; API server and
engine core never do), patches the vLLM call sites listed in ``vmmkv.integrations.vllm._install``
(where vLLM looks them up, all or nothing, each site's parameters checked first): in each worker
whose PCP group has more than one rank,

- with vLLM's extensible KV cache (0.34's default), its buffer is vmmkv's
  (``_buffer.PeerKVBuffer``): one :class:`VllmKVCache` whose every commit and release is
  collective over the PCP group, vLLM keeping the sizing, views, sleep, discard and shutdown;
  the lending of KV memory for a weight update is agreed across the group;
- with it off, ``allocate_kv_cache`` builds a :class:`VllmKVCache`: one
  :class:`vmmkv.ReplicatedKVCache` over vLLM's PCP ``GroupCoordinator`` (its ``cpu_group`` for
  the rendezvous, its ``device_group`` for the gather fallback), vLLM's own views over
  ``cache.allocate(size)``, every layer bound. Each allocation replaces (closes) the previous
  cache: MRV2 allocates a profiling cache, tears it down, then allocates the real one; MRV2's
  ``GPUModelRunner.shutdown`` closes it too;
- the PCP gather + insert pairs (``maybe_gather_mla_latent_cache_inputs`` +
  ``concat_and_cache_mla``, ``maybe_gather_indexer_k`` + ``indexer_k_quant_and_cache``) become
  one store through the cache: direct publication (each rank writes its rows into every
  replica, then the cache barrier, before attention reads them), or vmmkv's gather fallback
  when the cache is not direct. ``num_local_only`` per PCP case (MLA and indexer each from
  their own metadata's ``num_decode_tokens``): replicated draft decodes (unexpanded slot
  mapping): all rows, local only; ``pcp_shard_decode_requests`` (DCP == 1): 0, every row is
  published; DCP > 1: ``num_decode_tokens`` (decode rows local at rank 0's slots, vLLM's
  canonical writer of replicated rows; prefill rows through vmmkv's gather path, since vLLM
  shards the KV cache over the DCP ranks then: ``_cache.pcp_store_plan``);
- ``KVBlockZeroer.zero_block_ids`` runs the cache barrier after vLLM's zeroing, and MRV2's
  ``copy_kv_cache_blocks_inplace`` again after vLLM's copy-on-write block copies.

**Zeroing hazard** (why the barrier after zeroing): vLLM zeroes the blocks it hands out in a
step, in the own replica, before the step's forward (``needs_kv_cache_zeroing``: on for
Mamba or mixed-precision caches, which the MLA + indexer pair is). With direct publication a
faster peer may already have written this step's rows into those blocks of this replica;
zeroing afterwards wipes them. The barrier after zeroing orders every rank's zeroing before
every rank's first publication of the step (a peer passes it only after this rank zeroed). It
costs one barrier per step that allocates blocks, and every rank zeroes the same blocks (the
scheduler's output is the same on every worker), so every rank calls it equally often.
Replicated zeroing (each rank zeroing the block in every replica) was rejected: it races the
same way (a peer's late zero write against this rank's own rows) and multiplies the zeroing
traffic by the group size. Growth needs no barrier of its own: vmmkv's resize zeroes the new
blocks and synchronizes before the agreement that lets a peer write them. docs/design.md,
"Zeroing and copy order", has which blocks and bytes vLLM zeroes and why vmmkv still zeroes.

Supported (anything else is refused with :class:`UnsupportedKVCache` naming the layer and spec,
or the layout): DeepSeek-V3.2-style caches (``fp8_ds_mla`` MLA layers + indexer K layers,
bfloat16 activations) in layouts LBHNC, LBNHC (vLLM's default), BLHNC, BLNHC; no HiSparse, no
kernel-block splitting, no micro-batching (DBO), no KV-transfer connector (none is tested on
vmmkv memory: its chunks are not registered RDMA-capable, and a connector's own memory pool
would be bypassed). The bytes are the ones the installed vLLM writes: the MLA kind from
``vmmkv.ops.formats.mla_kind_for(vllm.__version__)`` (0.34: power-of-two tile scales,
``fp8_ds_mla_ue8m0``), the indexer kind from vLLM's own ``mqa_logits_use_mx_scales()``
(``indexer_k``; ``indexer_k_mxfp8`` on SM100).

Growth: :meth:`VllmKVCache.grow`/``shrink`` in blocks for both layout families (segments from
vLLM's ``KVCacheTensor`` numbers). vLLM's block pool cannot be resized, so an engine that
commits fewer blocks than ``num_blocks`` must keep vLLM's block ids below
``committed_blocks``; the zeroing and copy wrappers refuse larger ids before vLLM's kernels
run.

Elastic KV (``VLLM_VMMKV_ELASTIC=1``, with ``VLLM_USE_VMMKV=1``; block-major layouts only): the
committed blocks follow load. In every process that imports ``vllm.v1.engine.core`` (at once
if it did before ``register`` ran, else through an import hook: vLLM loads its plugins once per
process, possibly first, and a forked or in-process engine core never loads them again) the
plugin installs ``_install.ENGINE_SITES``: vLLM's block
pool hands out only committed blocks, uncached ones lowest id first, and the scheduler asks for
grows (two phases: new blocks are handed out after a worker's output confirms them) and
releases (in band, after a calm time; idle: through ``collective_rpc``) on every
``SchedulerOutput``. Each worker
applies the request collectively at the top of ``update_requests`` (``WORKER_SITES``). The
workers start at the floor both sides compute from the config. ``_elastic`` has the policy,
docs/design.md "Elastic KV in vLLM" its measured reasons. Stats: :func:`elastic_stats` (the
pool's, through vLLM's engine-core utility call ``STATS_UTILITY``) and :func:`worker_stats`
(each rank's committed blocks and bytes, through ``collective_rpc``).

Sleep mode (``Worker.sleep``/``wake_up``/``discard``, e.g. RL frameworks between rollouts): the
plugin registers the sleep-mode backend ``vmmkv`` with vLLM's ``SleepModeBackendFactory``
(select it with ``--sleep-mode-backend vmmkv``). It wraps vLLM's ``cumem`` backend, which keeps
handling weights, runtime state and graphs. Sleep (any level) and ``discard`` of ``kv_cache``
release the KV cache's memory on every PCP rank (a collective ``shrink(0)``: own chunks
decommitted, peers' chunks unmapped); a wake with ``kv_cache`` in its tags, or with no tags,
restores the committed blocks zeroed, at the same addresses (vLLM's views and captured CUDA
graphs stay valid); a wake without ``kv_cache`` keeps them released. vLLM's own backend would
leave vmmkv's memory untouched (it is outside vLLM's pool), so another backend is refused at
allocation whenever vLLM's sleep allocator is on (``enable_cumem_allocator``, which
``enable_sleep_mode`` turns on: vLLM offers sleep and KV release through the backend without
sleep mode too). vmmkv's small device tensors (peer pointers, bounds, error counter, barrier
state) are built outside vLLM's CuMem pools, which vLLM allocates the KV cache in, so no sleep
backend drops them. ``--sleep-mode-offload-cudagraph`` is refused under the ``vmmkv`` backend
(vLLM offloads graphs only under ``cumem``). See ``_sleep``.

Contract: :func:`register`/:func:`unregister` are local and idempotent; :func:`patched` is a
context manager for tests (install, then unregister on exit). ``unregister`` restores every
site and closes the cache it allocated (vLLM's views of it become invalid). The stores and the
zeroing and copy barriers are collective over the PCP group, as vLLM's own gathers are.

The modules, in the order of vLLM's lifecycle: this one (the entry point) and ``_support`` (the
version and config checks); ``_allocation`` (the allocation sites) over ``_cache``
(:class:`VllmKVCache`), ``_layout`` (the plan and the views) and ``_buffer`` (vLLM's extensible
buffer and the chunk it commits in); ``_stores`` (the gather + insert, zeroing and block-copy
sites); ``_elastic_engine`` (elastic KV in the engine core) over the policy ``_elastic``
(``_elastic_settings``, ``_elastic_queue``, ``_elastic_load``, ``_elastic_holes``);
``_elastic_worker`` (elastic KV in each worker); ``_sleep`` and ``_lending`` (sleep mode, KV
lending for weight updates). ``_install`` holds the site tables and installs them, ``_state`` the
per-process state. The tests' and benchmarks' tooling is ``vmmkv.testing.vllm``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ..._env import boolean
from ._install import (
    install,
    install_when_engine_core_loads,
    install_when_worker_starts,
    installed,
    uninstall,
)
from ._state import UnsupportedVLLM, active_cache, original
from ._support import SUPPORTED_VLLM, check_vllm_version, vllm_indexer_kind, vllm_mla_kind

__all__ = [
    "ENV",
    "STATS_UTILITY",
    "SUPPORTED_VLLM",
    "KVCachePlan",
    "StorePlan",
    "UnsupportedKVCache",
    "UnsupportedVLLM",
    "VllmKVCache",
    "VmmkvSleepModeBackend",
    "active_cache",
    "check_vllm_version",
    "create_views",
    "elastic_stats",
    "enabled",
    "installed",
    "original",
    "patched",
    "pcp_store_plan",
    "plan_kv_cache",
    "register",
    "unregister",
    "vllm_indexer_kind",
    "vllm_mla_kind",
    "worker_stats",
]

log = logging.getLogger(__name__)

ENV = "VLLM_USE_VMMKV"

_LAZY = {
    "KVCachePlan": "_layout",
    "UnsupportedKVCache": "_layout",
    "create_views": "_layout",
    "plan_kv_cache": "_layout",
    "StorePlan": "_cache",
    "VllmKVCache": "_cache",
    "pcp_store_plan": "_cache",
    "VmmkvSleepModeBackend": "_sleep",
    "STATS_UTILITY": "_elastic_engine",
    "elastic_stats": "_elastic_engine",
    "worker_stats": "_elastic_worker",
}


def __getattr__(name: str) -> Any:  # the vLLM-importing modules load on first use only
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def enabled() -> bool:
    """``VLLM_USE_VMMKV``: true enables the plugin; false or unset leaves vLLM untouched."""
    return boolean(ENV)


def register() -> None:
    """vLLM's ``vllm.general_plugins`` hook, run in every vLLM process. ``VLLM_USE_VMMKV=1``:
    check the installed vLLM's version (package metadata; :class:`UnsupportedVLLM` names vmmkv
    and the supported release otherwise) and patch the call sites when the process starts an
    MRV2 GPU worker (``install_when_worker_starts``): the API server and engine-core processes
    import no vLLM module on vmmkv's behalf. With ``VLLM_VMMKV_ELASTIC=1`` also elastic mode's
    engine sites once the process imports ``vllm.v1.engine.core``
    (``install_when_engine_core_loads``). Unset or '0': nothing. Idempotent."""
    from ._elastic_settings import ELASTIC_ENV, elastic_enabled

    if elastic_enabled() and not enabled():
        raise ValueError(f"{ELASTIC_ENV}=1 needs {ENV}=1 (elastic KV is vmmkv's KV cache)")
    if enabled():
        install_when_worker_starts()
        if elastic_enabled():  # the engine sites: now, or once vllm.v1.engine.core is imported
            install_when_engine_core_loads()


def unregister() -> None:
    """Restore vLLM's call sites and close the cache the plugin allocated. Idempotent."""
    uninstall()


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """Install the patches (whatever ``VLLM_USE_VMMKV`` says) for the duration of the block."""
    install()
    try:
        yield
    finally:
        uninstall()
