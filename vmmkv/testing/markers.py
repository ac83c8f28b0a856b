"""pytest markers for vmmkv's tests (imports pytest; the rest of ``vmmkv.testing`` does not).

``requires_gpu`` marks a test ``gpu`` and skips it, with the reason, where no CUDA device is
usable, so the GPU suites skip cleanly on CPU-only CI even without the repository's conftest.
"""

from __future__ import annotations

import pytest

from ..alloc import driver

__all__ = ["requires_gpu"]


def _skip_gpu() -> pytest.MarkDecorator:
    usable = driver.cuda_usable()
    return pytest.mark.skipif(not usable, reason=f"needs a CUDA device: {driver.why_no_cuda()}")


def requires_gpu(obj):
    """Decorator for test functions/classes: ``pytest.mark.gpu`` + skip without CUDA."""
    return pytest.mark.gpu(_skip_gpu()(obj))
