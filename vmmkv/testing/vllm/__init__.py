"""Internal helpers of the vLLM plugin's tests and benchmarks (``vmmkv.integrations.vllm``): no
API promise; each submodule imports vLLM where it needs it (lazily), this package nothing.

- ``configs``: DeepSeek-V3.2-shaped ``VllmConfig``s and ``KVCacheConfig``s built by vLLM 0.34.0's
  own functions on the CPU, and vLLM's own distributed groups over gloo;
- ``trace``: seeded load traces through vLLM's own ``Scheduler`` with or without elastic KV;
- ``workloads``: seeded workload families in simulated seconds, for the elastic tests and
  ``benchmarks/bench_elastic.py``.
"""
