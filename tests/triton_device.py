"""What the Triton kernel tests share: where their kernels run. On CPU, Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton); on the GPU host,
NANOSERVE_GPU_TESTS=1 keeps the real kernels and the tests run on CUDA."""
from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
needs_triton = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                  reason="Triton needs CUDA or TRITON_INTERPRET=1")
