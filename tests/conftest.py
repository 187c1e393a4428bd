"""Test-wide setup: Triton runs in its CPU interpreter, GPU tests skip without a GPU."""
import os

# Must be set before anything imports triton.
if not os.environ.get("NANOSERVE_GPU_TESTS"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("NANOSERVE_TEST_ORDER") == "reverse":
        reverse_within_modules(items)
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


def reverse_within_modules(items: list) -> None:
    """Each module's tests last to first (modules keep their order). A test that passes only
    because others of its module ran before it (filled counters, warmed services) fails
    then: CI runs the suite this way, developers the other (NANOSERVE_TEST_ORDER=reverse)."""
    modules: dict = {}
    for item in items:
        modules.setdefault(item.module, []).append(item)
    items[:] = [item for tests in modules.values() for item in reversed(tests)]


def pytest_sessionfinish(session, exitstatus):
    """No service process outlives the run, even one whose test failed before cleanup."""
    import sys
    services = sys.modules.get("services")    # imported only if some test started services
    if services is not None:
        left = services.stop_all()
        if left:
            print(f"\nstopped {len(left)} process(es) left running by tests: {', '.join(left)}")
