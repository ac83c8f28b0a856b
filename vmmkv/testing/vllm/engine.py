"""The engine harness: a real vLLM 0.34.0 engine on the CPU, vmmkv's plugin inside it, every call
the plugin's sites receive made by vLLM's own code.

What runs is vLLM's: its engine-core client (``EngineCoreClient.make_client``, multiprocess,
the frontend's side), which starts the engine core process (``EngineCoreProc``: its handshake,
busy loop, ``_initialize_kv_caches``, ``step`` or ``step_with_batch_queue``, the real
``Scheduler`` or ``AsyncScheduler``), whose ``MultiprocExecutor`` starts one ``WorkerProc`` per
rank (vLLM's TP, PCP and DCP groups on gloo; ``collective_rpc`` over its shared-memory queue)
running vLLM's GPU ``Worker`` and MRV2's ``GPUModelRunner``. vmmkv's plugin loads through vLLM's
``vllm.general_plugins`` entry point (``VLLM_USE_VMMKV=1``), as in a deployment. What a CPU cannot
run is replaced, and only that: ``host.STUBS`` lists each stub with its reason; the worker is
``worker.HarnessWorker`` and the model ``model.HarnessModel``. :func:`foreign_objects` finds
every vmmkv object installed in a vLLM module or class of a process, so that a test can show
that nothing beyond the plugin's sites and those stubs is replaced.

The expected bytes are vLLM's own gather plus vmmkv's reference insert (``reference``), not
vLLM's CUDA kernels: the reference writer is proven byte-equal to them on the GPU
(``tests/test_kernels_gpu.py``, ``tests/test_quant_exact_gpu.py``).

:class:`Engine` runs in a process of its own (the launcher: the tests start one with
``vmmkv.testing.spawn``), with :meth:`Spec.env` in its environment before vLLM is imported;
vLLM forks the engine core and the workers from it, which inherit the process-wide stubs. Not
thread-safe; one engine per launcher at a time. ``close`` shuts the engine down (vLLM's own
shutdown, every worker's model runner closing its vmmkv cache).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Engine", "Shape", "Spec", "foreign_objects"]

BLOCK_BYTES_PER_LAYER = 64 * (656 + 132)  # DeepSeek-V3.2: an MLA page and an indexer page


@dataclass(frozen=True)
class Shape:
    """A deployment's parallel shape: TP x PCP ranks, DCP (1, PCP or TP x PCP: vLLM's rule)."""

    tp: int
    pcp: int
    dcp: int = 1

    def __str__(self) -> str:
        return f"tp{self.tp}xpcp{self.pcp}-dcp{self.dcp}"

    @property
    def world(self) -> int:
        return self.tp * self.pcp


# the shapes a deployment uses, within vLLM's rule that DCP under PCP is 1, PCP or TP x PCP
SHAPES = (
    Shape(1, 2, 1), Shape(1, 2, 2), Shape(2, 2, 1), Shape(2, 2, 2), Shape(2, 2, 4),
    Shape(1, 4, 1), Shape(1, 4, 4),
)  # fmt: skip

# elastic mode's knob for a cache of ~130 blocks: 0.5 MiB chunks (5 blocks of 2 layers, 100,864 B
# each); the watermark and the floor are elastic mode's own (the floor, two steps of a full token
# budget, is below what warmup addresses: warmup has to grow and come back down)
ELASTIC_KNOBS = {"VMMKV_CHUNK_MIB": "0.5"}


@dataclass
class Spec:
    """One engine: shape, vLLM's extensible KV cache on or off, elastic KV on or off, sync or
    async scheduling, the layout (None: vLLM's default), the model's layers, the bytes
    "profiling" finds for the KV cache and the blocks "free after capture" (extensible),
    vLLM's scheduler limits, and extra environment (vmmkv's knobs)."""

    shape: Shape
    extensible: bool = True
    elastic: bool = False
    async_scheduling: bool = False
    layout: str | None = "BLNHC"
    layers: int = 2
    kv_blocks: int = 131  # what "profiling" finds room for: an uneven block count ...
    kv_extra_bytes: int = 12345  # ... plus a remainder
    budget_blocks: int = 117  # "free after capture" under the extensible cache (< capacity)
    max_num_batched_tokens: int = 128
    max_num_seqs: int = 16
    env_extra: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        parts = [str(self.shape), "ext" if self.extensible else "own",
                 "elastic" if self.elastic else "fixed", "async" if self.async_scheduling
                 else "sync"]  # fmt: skip
        return "-".join(parts)

    def env(self) -> dict[str, str]:
        """What the launcher's environment needs before vLLM is imported."""
        from . import host

        env = {
            **host.ENV,
            "VLLM_USE_VMMKV": "1",
            "VLLM_VMMKV_ELASTIC": "1" if self.elastic else "0",
            host.KV_BYTES_ENV: str(
                self.kv_blocks * self.layers * BLOCK_BYTES_PER_LAYER + self.kv_extra_bytes
            ),
            host.BUDGET_ENV: str(self.budget_blocks),
        }
        if self.elastic:
            env.update(ELASTIC_KNOBS)
        env.update(self.env_extra)
        return env


def vllm_config(spec: Spec) -> Any:
    """vLLM's config of ``spec`` as a deployment would give it, plus the harness's worker
    class and load format, and the extensible cache switched on after vLLM's check (a stub:
    vLLM refuses it off CUDA)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        LoadConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )  # fmt: skip

    from . import model
    from .configs import BLOCK_SIZE, CACHE_DTYPE, model_config

    # vmmkv's own allocation sleeps through vmmkv's sleep-mode backend (vLLM's default, cumem,
    # knows only vLLM's pool), which needs sleep mode on: as a user of it runs the engine
    sleep = {} if spec.extensible else {"enable_sleep_mode": True, "sleep_mode_backend": "vmmkv"}
    mc = model_config(spec.layers, **sleep)
    cfg = VllmConfig(
        model_config=mc,
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype=CACHE_DTYPE),
        parallel_config=ParallelConfig(
            tensor_parallel_size=spec.shape.tp,
            prefill_context_parallel_size=spec.shape.pcp,
            decode_context_parallel_size=spec.shape.dcp,
            distributed_executor_backend="mp",
            worker_cls="vmmkv.testing.vllm.worker.HarnessWorker",
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=spec.max_num_batched_tokens,
            max_num_seqs=spec.max_num_seqs,
            max_model_len=mc.max_model_len,
            is_encoder_decoder=False,
            async_scheduling=spec.async_scheduling,
        ),
        load_config=LoadConfig(load_format=model.LOAD_FORMAT),
    )
    if spec.layout is not None:
        cfg.cache_config.kv_cache_layout = spec.layout
    cfg.cache_config.enable_extensible_kv_cache = spec.extensible
    return cfg


class Engine:
    """A running engine of ``spec`` and its client (module docstring). Every wait is bounded:
    :meth:`run` by ``timeout``, the utility calls by vLLM's own timeouts."""

    def __init__(self, spec: Spec) -> None:
        missing = {k: v for k, v in spec.env().items() if os.environ.get(k) != v}
        if missing:
            raise RuntimeError(f"the launcher's environment lacks {missing} (set before vLLM)")
        from . import host, model

        host.install()
        host.preload()
        model.register_loader()
        from vllm.v1.engine.core_client import EngineCoreClient
        from vllm.v1.executor.abstract import Executor

        self.spec = spec
        self.config = vllm_config(spec)
        self.client = EngineCoreClient.make_client(
            multiprocess_mode=True, asyncio_mode=False, vllm_config=self.config,
            executor_class=Executor.get_class(self.config), log_stats=False,
        )  # fmt: skip
        self.finished: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self._next = 0

    # -- requests --------------------------------------------------------------------------------
    def submit(self, prompt: list[int], max_tokens: int) -> str:
        """Add one request (greedy, EOS ignored); returns its id."""
        import numpy as np
        from vllm import SamplingParams
        from vllm.v1.engine import EngineCoreRequest

        rid = f"req-{self._next}"
        self._next += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.client.add_request(
            EngineCoreRequest(
                request_id=rid, prompt_token_ids=np.asarray(prompt, dtype=np.int32),
                mm_features=None, sampling_params=params, pooling_params=None,
                arrival_time=time.time(), lora_request=None, cache_salt=None,
                data_parallel_rank=None,
            )
        )  # fmt: skip
        self.tokens[rid] = []
        return rid

    def run(self, timeout: float = 120.0) -> None:
        """Take the engine's outputs until every submitted request finished."""
        deadline = time.monotonic() + timeout
        while len(self.finished) < len(self.tokens):
            if time.monotonic() > deadline:
                left = sorted(set(self.tokens) - set(self.finished))
                raise TimeoutError(
                    f"{str(self.spec)}: requests {left} unfinished after {timeout} s"
                )
            self._take(self.client.get_output())

    def run_some(self, outputs: int = 4, timeout: float = 120.0) -> None:
        """Take up to ``outputs`` of the engine's outputs (fewer once every request finished)."""
        deadline = time.monotonic() + timeout
        for _ in range(outputs):
            if len(self.finished) == len(self.tokens):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{str(self.spec)}: no output for {timeout} s")
            self._take(self.client.get_output())

    def _take(self, out: Any) -> None:
        for o in out.outputs:
            self.tokens[o.request_id] += list(o.new_token_ids)
            if o.finish_reason is not None:
                self.finished[o.request_id] = self.tokens[o.request_id]

    # -- the workers -----------------------------------------------------------------------------
    def rpc(self, method: str, *args: Any) -> list[Any]:
        """``collective_rpc`` of a worker method by name (vLLM's executor, every worker)."""
        return self.client.collective_rpc(method, args=args)

    def check(self, when: str) -> list[dict[str, Any]]:
        """Every worker's reference checks now (collective), then its state."""
        return self.rpc("harness_check", when)

    def close(self) -> None:
        self.client.shutdown()


def prompts(seed: int, n: int, *, shared: int = 0, vocab: int = 512) -> list[list[int]]:
    """``n`` prompts of 40-300 tokens from ``seed``; with ``shared``, every prompt starts with
    the same ``shared`` tokens (prefix-cache hits)."""
    import random

    rng = random.Random(seed)
    head = [rng.randrange(1, vocab) for _ in range(shared)]
    return [head + [rng.randrange(1, vocab) for _ in range(rng.randrange(40, 300))]
            for _ in range(n)]  # fmt: skip


def _label(owner: Any, name: str) -> str:
    if isinstance(owner, type(sys)):
        return f"{owner.__name__}.{name}"
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"{type(owner).__module__}.{type(owner).__qualname__}().{name}"


def _vmmkv_made(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or getattr(type(obj), "__module__", "")
    return isinstance(module, str) and module.split(".")[0] == "vmmkv"


def foreign_objects() -> dict[str, list[str]]:
    """In this process: ``foreign``, every vmmkv-made object that a vLLM module, a class defined
    in one or vLLM's platform object holds; ``plugin``, the plugin's installed sites; ``harness``,
    the vmmkv-made objects ``host`` installed in vLLM; ``replaced``, every attribute ``host``
    set (torch's and plain values too). A test asserts ``foreign == plugin | harness`` and
    compares ``replaced`` with the stubs ``host.STUBS`` lists."""
    from vllm.platforms import current_platform

    from vmmkv.integrations.vllm._state import _STATE

    from . import host

    found = set()
    for modname, module in list(sys.modules.items()):
        if not modname.startswith("vllm") or module is None:
            continue
        for name, value in list(vars(module).items()):
            if _vmmkv_made(value) and not name.startswith("__"):
                found.add(_label(module, name))
            if isinstance(value, type) and value.__module__ == modname:
                for attr, v in list(vars(value).items()):
                    if _vmmkv_made(v):
                        found.add(_label(value, attr))
    for name, value in vars(current_platform).items():
        if _vmmkv_made(value):
            found.add(_label(current_platform, name))
    plugin = {_label(p.owner, p.name) for p in _STATE.patches + _STATE.engine_patches}
    harness = {_label(r.owner, r.name) for r in host.REPLACED if _vmmkv_made(r.replacement)}
    harness = {h for h in harness if h.startswith("vllm")}  # the scan reads vLLM's objects
    replaced = {_label(r.owner, r.name) for r in host.REPLACED}
    return {"foreign": sorted(found), "plugin": sorted(plugin), "harness": sorted(harness),
            "replaced": sorted(replaced)}  # fmt: skip
