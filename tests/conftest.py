"""Test-wide setup: Triton runs in its CPU interpreter, GPU tests skip without a GPU."""
import os

# Must be set before anything imports triton.
if not os.environ.get("NANOSERVE_GPU_TESTS"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """No service process outlives the run, even one whose test failed before cleanup."""
    import sys
    services = sys.modules.get("services")    # imported only if some test started services
    if services is not None:
        left = services.stop_all()
        if left:
            print(f"\nstopped {len(left)} process(es) left running by tests: {', '.join(left)}")
