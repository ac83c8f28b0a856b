"""(Diagnostic, not a test.) Does a process's first CUDA-graph capture keep device memory after
the graph is gone? Prints the device memory in use (every process's) at each step."""

import gc

import torch

from vmmkv import ops

DEV = torch.device("cuda:0")


def used(tag: str) -> int:
    torch.cuda.synchronize(DEV)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(DEV)
    reserved = torch.cuda.memory_reserved(DEV) / 2**20
    print(f"{tag:40s} used={(total - free) / 2**20:10.1f} MiB  torch_reserved={reserved:.1f} MiB")
    return total - free


def main() -> None:
    x = torch.ones(1024, device=DEV)
    ops.warm_up(DEV)
    base = used("after context + warm_up")
    for i in range(3):
        stream = torch.cuda.Stream(DEV)
        graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream(DEV))
        with torch.cuda.stream(stream):
            graph.capture_begin()
            x.add_(1)
            graph.capture_end()
        torch.cuda.current_stream(DEV).wait_stream(stream)
        used(f"capture {i} (graph alive)")
        graph.replay()
        used(f"replay {i} (graph alive)")
        del graph, stream
        print(f"  delta vs baseline {(used(f'graph {i} dropped') - base) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
