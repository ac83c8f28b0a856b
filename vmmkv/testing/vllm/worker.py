"""The engine harness's worker: vLLM 0.34's own GPU ``Worker`` on a host device.

:class:`HarnessWorker` is what ``parallel_config.worker_cls`` names (vLLM's hook for a worker
class), imported by vLLM in each worker process, which installs the worker-side stubs
(``host.install_worker``) and registers the model's load format there. It replaces only what
needs a GPU: ``init_device`` (a CPU device, then vLLM's own ``init_worker_distributed_environment``
on gloo and its own workspace and MRV2 model runner) and ``determine_available_memory`` (memory
profiling: ``VMMKV_HARNESS_KV_BYTES``). It observes ``annotate_profile`` (vLLM's profiling hook,
entered with every step's ``SchedulerOutput``) for the reference, and adds ``harness_*`` methods
that the tests call by name through vLLM's ``collective_rpc``. Every other method is vLLM's:
``initialize_from_config``, ``compile_or_warm_up_model`` (kernel warmup, ``warmup_kernels``,
``run_kv_cache_sizing_warmup``, the shrink before capture), ``extend_kv_cache``,
``execute_model``, ``sample_tokens``, ``sleep``, ``wake_up``, ``discard``, ``reload_weights``
(the KV cache lent for a weight update), ``shutdown``.

Local to the worker process; the harness methods that check (``harness_check``) are collective
over the worker's PCP group, as the steps are.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.v1.worker import gpu_worker

from . import host, model
from .reference import Reference, cache_memory

__all__ = ["HarnessWorker"]

GPU_BYTES = 80 << 30  # the memory snapshot's device: an 80 GiB GPU

host.install_worker()
model.register_loader()


class HarnessWorker(gpu_worker.Worker):
    """vLLM's GPU worker with a host device and a fixed memory figure (module docstring)."""

    reference: Reference | None = None

    def init_device(self) -> None:
        from vllm.utils.mem_utils import MemorySnapshot
        from vllm.v1.worker.utils import request_memory

        self.device = torch.device("cpu")

        gpu_worker.init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank, "gloo"
        )
        self.init_snapshot = MemorySnapshot(
            free_memory=GPU_BYTES, total_memory=GPU_BYTES, device=self.device,
            auto_measure=False,
        )  # fmt: skip
        self.requested_memory = request_memory(self.init_snapshot, self.cache_config)
        self._init_workspace_and_model_runner()

    def determine_available_memory(self) -> int:
        return int(os.environ[host.KV_BYTES_ENV])

    def annotate_profile(self, scheduler_output: Any) -> Any:
        ref = self._reference()
        if ref is not None:
            ref.observe(scheduler_output)
        return super().annotate_profile(scheduler_output)

    # -- called by the tests through collective_rpc (by name) ----------------------------------
    def harness_check(self, when: str = "rpc") -> dict[str, Any]:
        """Collective over the PCP group: the reference's checks now, then this worker's
        state (:meth:`harness_state`)."""
        ref = self._reference()
        if ref is not None:
            ref.check(when)
        return self.harness_state()

    def harness_state(self) -> dict[str, Any]:
        """Local: what this worker holds. ``committed``: vmmkv's committed blocks (None
        without a cache); ``vllm_committed``: vLLM's count under its extensible cache;
        ``memory``: what the kernel shows mapped and open of vmmkv's memory
        (``reference.cache_memory``); the reference's record; the plugin's stats."""
        from vllm.distributed.parallel_state import get_pcp_group, get_tp_group

        from vmmkv.integrations.vllm import active_cache, worker_stats

        cache = active_cache()
        ext = getattr(self.model_runner, "extensible_kv_cache", None)
        ref = self._reference()
        return {
            "rank": self.rank,
            "tp_rank": get_tp_group().rank_in_group,
            "pcp_rank": get_pcp_group().rank_in_group,
            "committed": None if cache is None else cache.committed_blocks,
            "committed_set": None if cache is None else cache.committed_block_set,
            "vllm_committed": None if ext is None else ext.num_committed_blocks,
            "memory": None if cache is None else cache_memory(cache),
            "stats": worker_stats(self),
            "reference": None if ref is None else ref.state(),
            "allocator_calls": list(host.HostAllocator.calls),
        }

    def harness_set_free_memory(self, nbytes: int, ranks: Any = None) -> None:
        """The free device memory the stub reports on global ``ranks`` (all: None)."""
        if ranks is None or self.rank in ranks:
            host.set_free_memory(nbytes)

    def harness_fail_commits(self, ranks: Any, count: int = 1) -> None:
        """The next ``count`` chunk creations of vmmkv's cache fail with an out-of-memory on
        global ``ranks`` (a device allocation refused there only)."""
        from vmmkv.alloc.host import HostError
        from vmmkv.integrations.vllm import active_cache

        if self.rank not in ranks:
            return
        backend = active_cache().cache.region.region._backend
        real = backend.create
        left = [count]

        def create(size: int) -> Any:
            if left[0] > 0:
                left[0] -= 1
                raise HostError(12, f"out of memory injected on rank {self.rank}")
            return real(size)

        backend.create = create

    def harness_foreign(self) -> dict[str, Any]:
        """Every vmmkv object installed in a vLLM module or class of this process
        (``engine.foreign_objects``), what this class defines over vLLM's ``Worker``, and the
        model runner's class (vLLM's own ``GPUModelRunner``, not a subclass)."""
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        from .engine import foreign_objects

        own = sorted(k for k in vars(HarnessWorker) if not k.startswith("__"))
        runner = type(self.model_runner)
        return {**foreign_objects(), "worker_defines": own,
                "runner": f"{runner.__module__}.{runner.__qualname__}",
                "runner_is_vllms": runner is GPUModelRunner}  # fmt: skip

    def _reference(self) -> Reference | None:
        runner = getattr(self, "model_runner", None)
        mdl = getattr(runner, "model", None)
        if mdl is None:
            return None
        if self.reference is None or self.reference.model is not mdl:
            self.reference = Reference(runner, mdl)
            mdl.reference = self.reference
        return self.reference
