"""Exit without close on CUDA: a rank whose process exits with its ReplicatedKVCache open.

The scenario of ``tests/test_exit.py`` (written once there: ``_exit_case``), on CUDA VMM regions:
two ranks, one process per GPU when two GPUs are visible, else both on GPU 0 (the fault suite's
device choice, ``tests.test_faults._ordinals``). The victim (rank 1) publishes one step with
rank 0, then exits with its cache open: its function returns, a global holds the cache at
interpreter shutdown, or ``os._exit``; each is its own case.

What must hold, besides what holds on the host backend (no hang: the victim is gone within
10 s; no stderr noise in either rank, CUDA_ERROR_*, "Exception ignored", tracebacks and warnings
included; the survivor reads its own replica, and the victim's through its mapping, byte-exact
after the victim is gone; its close takes < 2 s; its fds back to its baseline):
- while the survivor alone maps the dead rank's chunks, they are still allocated: the device
  memory of every GPU used is at least the baseline plus the committed bytes of every replica
  living there (the check below can fail);
- once the survivor closed, the device memory of EVERY GPU used (both, or the one shared) is
  back to its baseline: the dead rank's exported chunks were freed with the last mapping.

How the memory is measured, and why so: ``cuMemGetInfo`` (``tests.helpers.device_memory_in_use``,
the fault suite's probe), read in the survivor, the process that stays alive through the whole
measurement. Its reading is device-wide (every process's memory), so it sees the victim's chunks
and the victim's context. The survivor's own CUDA contexts (on its GPU and, with two GPUs, the
one it opens on the victim's GPU to read it) exist from its warm-up on, before the baseline,
so they are in every reading and cancel out; the victim creates its context only after the
baseline, and that context is gone (settled, up to 15 s) when the after-reading is taken. NVML's
``nvmlDeviceGetMemoryInfo`` would read the same device-wide figure without a context, but needs
the CUDA ordinal mapped to an NVML device by UUID (NVML ignores CUDA_VISIBLE_DEVICES) and adds
nothing here: the survivor has its contexts anyway. The baseline is taken after a warm-up of
the survivor's own (the fault suite's: a one-rank cache cycle with every NVRTC kernel loaded, an
import of chunks made on every GPU used; plus a read of such chunks through a mapping), before
the victim touches its device.

Tolerance: the after-reading may exceed the baseline by less than two allocation granules (< 4
MiB on an H200), room for one 2 MiB page of the driver's own context bookkeeping, and none for a
chunk: a chunk here is four granules (8 MiB on an H200) and the dead rank's replica alone is two.
"""

from __future__ import annotations

import pytest

from tests.test_exit import HOWS, RUN_LIMIT, WORLD, _exit_case
from vmmkv.testing.markers import requires_gpu


@requires_gpu
@pytest.mark.timeout(2 * RUN_LIMIT["cuda"])
@pytest.mark.parametrize("how", HOWS)
def test_a_rank_exiting_with_an_open_cuda_cache_leaves_the_survivor_clean_on_every_gpu(how):
    from vmmkv.alloc import driver

    res = _exit_case(how, "cuda")  # no hang, no noise, replicas exact, fds and memory released
    ordinals = res["ordinals"]
    assert ordinals == ([0, 1] if driver.device_count() >= WORLD else [0]), res
    base, held = res["baseline"]["memory"], res["held"]
    measured = sorted(str(k) for k in ordinals)  # JSON keys
    for probe in (base, held, res["after"]["memory"]):
        assert sorted(probe) == measured, res
    # while the survivor alone mapped the dead rank's chunks, they were allocated: every GPU
    # holds at least the replicas living on it (the release check above can fail)
    for k in ordinals:
        replicas = sum(1 for r in range(WORLD) if ordinals[r % len(ordinals)] == k)
        grew = held[str(k)] - base[str(k)]
        assert grew >= replicas * res["committed"], (f"cuda:{k}", grew, replicas, res)
