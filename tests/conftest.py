"""Shared test configuration: tests marked ``gpu`` skip cleanly unless CUDA VMM is usable."""

import pytest

from vmmkv.alloc import driver


def pytest_collection_modifyitems(config, items):
    if driver.cuda_usable():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device: {driver.why_no_cuda()}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
