"""Where the host time of one eager gather-fallback store goes on the GPU host, below the
stages of ``bench_gather.py --host-cost``: the cost of each torch call the store makes (median
µs per call, timed alone) and a cProfile of 3000 stores per slot form (T = 1, rank 0 of 2,
all-gather a no-op). Run from the repository root: python3 <this file> [--backend host]."""

import cProfile
import io
import pstats
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_gather import host_path  # noqa: E402
from common import per_call_ns  # noqa: E402

from vmmkv._store import check_inputs, own_slots  # noqa: E402
from vmmkv.testing.kv import layer_inputs  # noqa: E402

backend = "host" if "--backend" in sys.argv and sys.argv[-1] == "host" else "cuda"
path, bindings, device, sync = host_path(backend, 1, 2)
dev_index = device.index or 0
inputs = tuple(x.to(device) for x in layer_inputs(1, 1))
gathered = torch.randperm(2).to(device)
own = gathered[:1].clone()
kinds = tuple(b.kind for b in bindings)
entry = bindings[0].local.entry_bytes
send = torch.empty(1, 1408, dtype=torch.uint8, device=device)
typed = send.view(torch.bfloat16)
u8 = [x.view(torch.uint8) for x in inputs]

calls = {
    "own_slots (gathered form)": lambda: own_slots(None, gathered, 0, 2),
    "check_inputs": lambda: check_inputs(kinds, entry, inputs, own, 0, device),
    "path.prepare(bindings)": lambda: path.prepare(bindings),
    "x.view(torch.uint8)": lambda: inputs[0].view(torch.uint8),
    "x[0:1]": lambda: inputs[0][0:1],
    "x.is_contiguous()": lambda: inputs[0].is_contiguous(),
    "x.shape[1] * x.element_size()": lambda: inputs[0].shape[1] * inputs[0].element_size(),
    "torch.cat(3 bf16, out=typed)": lambda: torch.cat(inputs, dim=1, out=typed),
    "torch.cat(3 u8, out=send)": lambda: torch.cat(u8, dim=1, out=send),
    "empty launch: send.zero_()": lambda: send.zero_(),
}
if device.type == "cuda":
    calls |= {
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "torch.cuda.current_stream(dev).cuda_stream":
            lambda: torch.cuda.current_stream(device).cuda_stream,
        "torch._C._cuda_getCurrentRawStream(i)":
            lambda: torch._C._cuda_getCurrentRawStream(dev_index),
        "torch.cuda.current_device()": torch.cuda.current_device,
    }
print(f"torch {torch.__version__}, device {device}")
print("µs per call, each call timed alone (median of 7 loops of 200)")
for name, fn in calls.items():
    fn()
    print(f"{per_call_ns(fn, sync=sync) / 1e3:8.2f}  {name}")

for form, (m, g) in {"own": (own, None), "gathered": (None, gathered)}.items():
    def store(m=m, g=g):
        path.store(bindings, inputs, m, 0, g)

    store()
    print(f"\n== {form} slots: GatherPath.store {per_call_ns(store, sync=sync) / 1e3:.2f} µs/call;"
          " cProfile of 3000 calls, by own time")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3000):
        store()
    prof.disable()
    if sync:
        torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
    print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))
path.close()
