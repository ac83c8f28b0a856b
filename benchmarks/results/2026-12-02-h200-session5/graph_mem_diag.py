"""(Diagnostic, not a test.) Does a process's first CUDA-graph capture keep device memory after the graph is gone?"""
import gc, torch
from vmmkv import ops

dev = torch.device("cuda:0")
def used(tag):
    torch.cuda.synchronize(dev); gc.collect(); torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    print(f"{tag:40s} used={(total-free)/2**20:10.1f} MiB  torch_reserved={torch.cuda.memory_reserved(dev)/2**20:.1f} MiB", flush=True)
    return total - free
x = torch.ones(1024, device=dev)
ops.warm_up(dev)
a = used("after context + warm_up")
for i in range(3):
    s = torch.cuda.Stream(dev)
    g = torch.cuda.CUDAGraph()
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        g.capture_begin(); x.add_(1); g.capture_end()
    torch.cuda.current_stream(dev).wait_stream(s)
    used(f"capture {i} (graph alive)")
    g.replay()
    used(f"replay {i} (graph alive)")
    del g, s
    b = used(f"graph {i} dropped")
    print(f"  delta vs baseline {(b-a)/2**20:.1f} MiB", flush=True)
