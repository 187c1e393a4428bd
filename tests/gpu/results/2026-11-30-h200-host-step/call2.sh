#!/bin/bash
# issue 63: the host's side of a served batch-1/8 step (tests/gpu/host_step.py) on HEAD
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NANOSERVE_GPU_TESTS=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
cd pk0; export PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
nproc; python3 -c "import platform; print(platform.processor())"; grep -m1 "model name" /proc/cpuinfo
for n in 1 8; do timeout 150 python3 tests/gpu/host_step.py --model /tmp/qwen3-0.6b-random --rows $n --steps 300 --cprofile 200 > $R/host_$n.txt 2>&1; head -20 $R/host_$n.txt; done
cd $OUT && tar czf r.tgz r && rm -rf r
