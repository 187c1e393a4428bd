#!/bin/bash
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NANOSERVE_GPU_TESTS=1
cd pk && PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "in_kernel" -s 2>&1 | grep -v "^$" | tail -12
