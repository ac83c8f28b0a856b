"""The cost of the prefix-preserving order: the same policy with the previous order (the lowest
free id first, cached or not) on the families."""
import os, sys, json, heapq
os.environ.update({"VLLM_USE_VMMKV":"1","VLLM_VMMKV_ELASTIC":"1"})
from vmmkv.integrations.vllm import _patches
_patches.install_engine()
from vmmkv.integrations.vllm import _elastic
from vmmkv.integrations.vllm.workloads import FamilyRun, summary
orig = _elastic.LowestIdFreeQueue._pop
def any_pop(self):
    heap, low = self._uncached, self._low
    while heap and heap[0] not in low:
        heapq.heappop(heap)
    u = heap[0] if heap else None
    c = min(self.lru) if self.lru else None
    if c is not None and (u is None or c < u):
        self.cached_taken += 1
        return self.lru.pop(c)
    heapq.heappop(heap); low.remove(u)
    return self.blocks[u]
out = {}
for fam in sys.argv[1].split(","):
    for seed in (0, 1, 2):
        for name, pop in (("uncached-first", orig), ("lowest-any", any_pop)):
            _elastic.LowestIdFreeQueue._pop = pop
            r = FamilyRun(trace=fam, seed=seed); r.run(); sm = summary(r)
            out.setdefault(fam, {}).setdefault(name, []).append({k: sm[k] for k in ("committed_mean", "committed_peak", "hit_tokens", "over_need", "preemptions")} | {"drain": sm["phases"].get("drain")})
        print(fam, seed, {n: out[fam][n][-1] for n in out[fam]}, flush=True)
json.dump(out, open("/tmp/benchout/order_cost.json", "w"), indent=1)
