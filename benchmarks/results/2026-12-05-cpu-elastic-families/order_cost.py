"""The cost of keeping prefix-cache entries: elastic KV's policy on the workload families with
uncached free blocks first (as shipped) and with the earlier order (the lowest free id, cached
or not), seeds 0-2. Writes ``order_cost.json`` beside this file.

usage (a vLLM 0.34.0 venv, the repository on PYTHONPATH): python order_cost.py ramp,wave,long,zipf
"""

from __future__ import annotations

import heapq
import json
import os
import sys


def lowest_any(self):
    """``LowestIdFreeQueue._pop`` of 2026-12-04: the lowest free id, cached or not."""
    heap, low = self._uncached, self._low
    while heap and heap[0] not in low:
        heapq.heappop(heap)
    u = heap[0] if heap else None
    c = min(self.lru) if self.lru else None
    if c is not None and (u is None or c < u):
        self.cached_taken += 1
        return self.lru.pop(c)
    heapq.heappop(heap)
    low.remove(u)
    return self.blocks[u]


def main() -> None:
    os.environ.update({"VLLM_USE_VMMKV": "1", "VLLM_VMMKV_ELASTIC": "1"})
    from vmmkv.integrations.vllm import _elastic_queue, _install
    from vmmkv.testing.vllm.workloads import FamilyRun, summary

    _install.install_engine()
    shipped, out = _elastic_queue.LowestIdFreeQueue._pop, {}
    keys = ("committed_mean", "committed_peak", "hit_tokens", "over_need", "preemptions")
    for family in sys.argv[1].split(","):
        for seed in (0, 1, 2):
            for name, pop in (("uncached-first", shipped), ("lowest-any", lowest_any)):
                _elastic_queue.LowestIdFreeQueue._pop = pop
                run = FamilyRun(trace=family, seed=seed)
                run.run()
                got = summary(run)
                row = {k: got[k] for k in keys} | {"drain": got["phases"].get("drain")}
                out.setdefault(family, {}).setdefault(name, []).append(row)
            print(family, seed, {n: rows[-1] for n, rows in out[family].items()}, flush=True)
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "order_cost.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
