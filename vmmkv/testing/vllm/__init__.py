"""Internal helpers of the vLLM plugin's tests and benchmarks (``vmmkv.integrations.vllm``): no
API promise; this package imports nothing, ``configs``, ``trace`` and ``workloads`` import vLLM
where they need it (lazily), the engine harness's modules at import.

- ``configs``: DeepSeek-V3.2-shaped ``VllmConfig``s and ``KVCacheConfig``s built by vLLM 0.34.0's
  own functions on the CPU, and vLLM's own distributed groups over gloo;
- ``trace``: seeded load traces through vLLM's own ``Scheduler`` with or without elastic KV;
- ``workloads``: seeded workload families in simulated seconds, for the elastic tests and
  ``benchmarks/bench_elastic.py``;
- the engine harness, vLLM 0.34.0's own engine on the CPU host backend (``docs/design.md``,
  "Tested inside a real vLLM engine"): ``engine`` (shapes, configs, the engine client, the stub table's
  checks), ``host`` (the process-wide stubs of what needs a GPU, listed in ``STUBS``),
  ``worker`` (vLLM's ``Worker`` with the harness's RPCs), ``model`` (a DeepSeek-V3.2-shaped
  model of vLLM's own attention layers and KV call sites), ``reference`` (a plain buffer written
  by vLLM's unpatched path, compared with vmmkv's cache every step).
"""
