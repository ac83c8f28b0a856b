"""vmmkv.ops: CUDA sources (csrc/) built with NVRTC, launches on torch's current stream, torch
custom ops (namespace ``vmmkv``) and the pure-torch reference of the KV byte formats.

- ``formats``: the table of KV kinds (``fp8_ds_mla``, ``fp8_ds_mla_ue8m0``, ``indexer_k``,
  ``indexer_k_mxfp8``, ``rows``), ``indexer_kind_for(capability)``, the indexer kind vLLM
  writes on a GPU, and ``mla_kind_for(vllm_version)``, the MLA kind a vLLM release writes.
- ``reference``: quantizers and inserters (the test oracle and the host backend's store path).
- ``build``: NVRTC build and on-disk cubin cache; ``compile_all(arch)`` needs no GPU.
- ``kv``: ``KVTarget`` and the fused stores into every replica.
- ``barrier``: ``DeviceBarrier``, the system-scope barrier among ranks (its host side, the
  control page and the watchdog: ``barrier_control``).
- ``prepared``: ``prepare(targets) -> PreparedStore``, the per-binding fast path: ``store`` and
  ``publish`` (stores + barrier in one launch).
Importing this package registers the custom ops; it needs no GPU.
"""

from .barrier import BarrierAborted, BarrierTimeout, DeviceBarrier
from .formats import indexer_kind_for, mla_kind_for
from .kv import (
    KVTarget,
    publish_layer,
    publish_rows,
    store_ds_mla,
    store_indexer_k,
    store_layer,
)
from .launch import warm_up
from .prepared import HostPreparedStore, PreparedStore, prepare
from .reference import (
    insert_ds_mla,
    insert_ds_mla_ue8m0,
    insert_indexer_k,
    insert_indexer_k_mxfp8,
    insert_rows,
    quantize_ds_mla,
    quantize_ds_mla_ue8m0,
    quantize_indexer_k,
    quantize_indexer_k_mxfp8,
)

__all__ = [
    "BarrierAborted",
    "BarrierTimeout",
    "DeviceBarrier",
    "HostPreparedStore",
    "KVTarget",
    "PreparedStore",
    "insert_ds_mla",
    "insert_ds_mla_ue8m0",
    "indexer_kind_for",
    "insert_indexer_k",
    "insert_indexer_k_mxfp8",
    "insert_rows",
    "mla_kind_for",
    "prepare",
    "publish_layer",
    "publish_rows",
    "quantize_ds_mla",
    "quantize_ds_mla_ue8m0",
    "quantize_indexer_k",
    "quantize_indexer_k_mxfp8",
    "store_ds_mla",
    "store_indexer_k",
    "store_layer",
    "warm_up",
]
