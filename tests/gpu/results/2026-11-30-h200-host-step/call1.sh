#!/bin/bash
# issue 63: runs rows merged in-kernel (pk = HEAD + runs-merge.patch) vs HEAD (pk0): CUDA tests,
# replay A/B, launcher with --profile-steps, in-process b1 (run.sh smallstep)
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/times.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NANOSERVE_GPU_TESTS=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random PYTHONPATH=/tmp/site
BASE=$PWD/pk0
cd pk
t unit
(PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_kernels_attention.py 2>&1 | tail -3) | tee $R/unit_attn.txt
t smallstep
SMALLSTEP_BASE=$BASE OUT=$R timeout 420 bash tests/gpu/run.sh smallstep 2>&1 | tee $R/smallstep.txt
t end
cd $OUT && tar czf r.tgz r && rm -rf r
