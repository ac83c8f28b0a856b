"""bench_prefill's KV-update paths (see ``bench_prefill.py``'s docstring): ``direct`` and
``vmmkv_gather`` (vmmkv's ``ReplicatedKVCache.publish_layer``), ``vllm_gather`` (vLLM 0.33.0's
all-gathers then inserts, with vmmkv's local-only store kernels), ``symm_mem`` (torch symmetric
memory with vmmkv's fused store kernel); the Main-KV kind they store (``mla_kind``) and the
``KVTarget`` s over a plain buffer (``_targets``).

``update`` is collective for the paths that exchange (every rank calls it for the same layer in
the same order: all-gathers, the device barrier); building a path is local. A path owns none of
the caches and buffers it writes (the rank keeps and closes them); ``close`` drops what it
holds (``symm_mem``: its stores and handle).
"""

from __future__ import annotations

from .model import _Workload

PATHS = ("direct", "vllm_gather", "vmmkv_gather", "symm_mem")
BASELINE = "vllm_gather"


def mla_kind(indexer_kind: str) -> str:
    """The Main-KV kind to bind: ``fp8_ds_mla_ue8m0`` (vLLM 0.33.0's bytes) where the formats
    table has it with the store combinations used here, else ``fp8_ds_mla``."""
    from vmmkv.ops.formats import FORMATS, STORE_KINDS

    want = "fp8_ds_mla_ue8m0"
    if want in FORMATS and {(want,), (want, indexer_kind)} <= set(STORE_KINDS):
        return want
    return "fp8_ds_mla"


class _Update:
    """One KV-update path: ``update(layer, kv_c, k_pe, k, wl)`` writes the layer's rows of every
    rank into this rank's replica (and, for the direct paths, into the peers'); ``buf`` is the
    replica's bytes (the layout starts at its first byte), ``read`` the attention's views of it,
    ``errors`` the out-of-range counter of its targets."""

    name = ""

    def __init__(self, buf, read, errors) -> None:
        self.buf, self.read, self.errors = buf, read, errors
        self.drop_first = False  # testing (--drop-update): skip layer 0's update

    def update(self, layer: int, kv_c, k_pe, k, wl: _Workload) -> None:
        if self.drop_first and layer == 0:
            return
        self._update(layer, kv_c, k_pe, k, wl)

    def _update(self, layer, kv_c, k_pe, k, wl) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Direct(_Update):
    name = "direct"

    def __init__(self, cache, buf, bindings, read) -> None:
        super().__init__(buf, read, cache.error_counter)
        self.cache, self.bindings = cache, bindings

    def _update(self, layer, kv_c, k_pe, k, wl) -> None:
        mla, idx = self.bindings[layer]
        self.cache.publish_layer(mla, idx, kv_c, k_pe, k, wl.own)


class _VmmkvGather(_Direct):
    name = "vmmkv_gather"

    def _update(self, layer, kv_c, k_pe, k, wl) -> None:
        mla, idx = self.bindings[layer]
        self.cache.publish_layer(mla, idx, kv_c, k_pe, k, None,
                                 gathered_slot_mapping=wl.gslots, mode="gather")  # fmt: skip


class _VllmGather(_Update):
    """vLLM 0.33.0's order per layer: gather k, insert the indexer cache; gather kv_c and k_pe,
    insert the MLA cache (see the module docstring)."""

    name = "vllm_gather"

    def __init__(self, buf, read, targets, errors, group, world) -> None:
        import torch.distributed as dist

        from vmmkv import ops

        super().__init__(buf, read, errors)
        self.mla = [ops.prepare((m,)) for m, _ in targets]
        self.idx = [ops.prepare((i,)) for _, i in targets]
        self.group, self.world = group, world
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def _all(self, x):
        import torch

        out = torch.empty((self.world * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        self._gather(out, x, group=self.group)
        return out

    def _update(self, layer, kv_c, k_pe, k, wl) -> None:
        self.idx[layer].store((self._all(k),), wl.gslots)
        self.mla[layer].store((self._all(kv_c), self._all(k_pe)), wl.gslots)


class _SymmMem(_Update):
    name = "symm_mem"

    def __init__(self, tensor, handle, read, targets, errors) -> None:
        from vmmkv import ops

        super().__init__(tensor, read, errors)
        self.handle = handle
        self.stores = [ops.prepare((m, i)) for m, i in targets]

    def _update(self, layer, kv_c, k_pe, k, wl) -> None:
        self.stores[layer].store((kv_c, k_pe, k), wl.own)
        self.handle.barrier()

    def close(self) -> None:
        self.stores = []
        self.handle = None


def _targets(buf, ptr_table, my_rank: int, views, kinds: tuple[str, str]):
    """``(fp8_ds_mla, indexer_k)`` KVTargets per layer over the views of ``buf`` (offsets from
    its first byte, the same in every buffer of ``ptr_table``) and their error counter."""
    import torch

    from vmmkv._store import target_geometry
    from vmmkv.ops.kv import KVTarget

    dev = buf.device
    shared = dict(ptr_table=ptr_table, my_rank=my_rank, cache=buf,
                  committed_bytes=torch.tensor([buf.numel()], dtype=torch.int64, device=dev),
                  error_counter=torch.zeros(1, dtype=torch.int32, device=dev))  # fmt: skip
    base, size = buf.data_ptr(), buf.numel()
    out = [
        tuple(KVTarget(**target_geometry(v, kind, base, size), **shared)
              for v, kind in zip((mla, idx), kinds, strict=True))
        for mla, idx in views
    ]  # fmt: skip
    return out, shared["error_counter"]
