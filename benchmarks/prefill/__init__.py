"""The pieces of ``benchmarks/bench_prefill.py``, whose module docstring describes the benchmark:

- ``model``: the model's shapes, the workloads and their plan, the forward stand-in and the
  attention's reads of the cache (no torch at import);
- ``paths``: the KV-update paths under test (``direct``, ``vllm_gather``, ``vmmkv_gather``,
  ``symm_mem``) and the KV kinds they store;
- ``rank``: what one rank does (setup, verification, timed steps, growth) and its entry point;
- ``report``: the ranks' records merged, the summary rows, the markdown tables and the plot.

Imported as the package ``prefill`` with ``benchmarks/`` on ``sys.path`` (as ``bench_prefill.py``
and ``tests/test_bench_prefill.py`` set it up), next to ``common``.
"""
