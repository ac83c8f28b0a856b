"""Internal helpers for vmmkv's tests, tools (``vmmkv.cli``) and benchmarks: no API promise.

- ``spawn``: the one multi-process spawner (own process group, parent-death signal, kill on
  timeout, never hangs); the only place that sets the NVLink-multicast-off variables; the one
  way ranks meet (``world_store``: a store the spawning process hosts on a port bound once).
- ``kv``: the layer-interleaved view layout, random non-zero store inputs, and the oracle
  (expected replica bytes through ``vmmkv.ops.reference``).
- ``timing``: one timing loop and one percentile function.
- ``markers``: pytest markers (``requires_gpu``); imports pytest, the others do not.
- ``vllm``: the vLLM plugin's test and benchmark tooling (configs, traces, workload families);
  its modules import vLLM lazily.

Names here may change with the tests that use them. Importing this package imports nothing
heavy; each submodule imports what it needs.
"""
