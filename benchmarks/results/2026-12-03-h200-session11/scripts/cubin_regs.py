"""Registers per thread and stack frame bytes of every kernel NVRTC builds, from the cubins (no
GPU). Run from the repository root: PYTHONPATH=. python3 <this> [sm_90] (VMMKV_CSRC_DIR picks a
variant's sources). Session 11 read the variants' counts with an earlier inline copy of this."""

import sys

from tests.test_nvrtc import EIATTR_FRAME_SIZE, EIATTR_REGCOUNT, nv_info
from vmmkv.ops import build

for src, cubin in build.compile_all(sys.argv[1] if len(sys.argv) > 1 else "sm_90").items():
    regs, frame = nv_info(cubin, EIATTR_REGCOUNT), nv_info(cubin, EIATTR_FRAME_SIZE)
    for name in build.KERNELS[src]:
        print(f"{src} {name} registers={regs[name]} frame={frame.get(name, 0)}")
