"""One store_layer launch at T tokens, D=1, consecutive slots (for ncu)."""

import sys

import torch

sys.path.insert(0, "benchmarks")
from common import own_layer_targets

from vmmkv import ops

T = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
mla, idx = own_layer_targets(2 * T // 64, "cuda")
g = torch.Generator(device="cuda").manual_seed(1)
kv_c = torch.randn(T, 512, device="cuda", generator=g).bfloat16()
k_pe = torch.randn(T, 64, device="cuda", generator=g).bfloat16()
k = torch.randn(T, 128, device="cuda", generator=g).bfloat16()
slots = torch.arange(T, device="cuda")
for _ in range(4):
    ops.store_layer(mla, idx, kv_c, k_pe, k, slots)
torch.cuda.synchronize()
print("ok")
