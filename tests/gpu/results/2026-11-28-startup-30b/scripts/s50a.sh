#!/usr/bin/env bash
# 2x H100, issue 49: symm_mem GIL probe with switch intervals; 30B-A3B TP=2 cold start +
# rank-1 kill at HEAD (first run: cold Triton cache; its restart: warm), then a warm start.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/protos:/tmp/site NANOSERVE_GPU_TESTS=1 PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
R=/tmp/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee $OUT/summary.txt
( for a in "spin" "spin 0.0005" "spin 0.0001" "copy" "copy 0.0001"; do
    timeout 60 python3 tests/gpu/symm_mem_gil.py $a 2>&1 | tail -1; done
  TORCH_SYMMMEM_IMPLICIT_POOL=0 timeout 60 python3 tests/gpu/symm_mem_gil.py spin 2>&1 | sed 's/^/IMPLICIT_POOL=0 /' | tail -1
) | tee -a $OUT/summary.txt
el probe | tee -a $OUT/summary.txt
M=/dev/shm/qwen3-30b-a3b
timeout 300 python3 tests/gpu/moe_check.py checkpoint $M > $R/ckpt30b.log 2>&1; el ckpt30b | tee -a $OUT/summary.txt
tail -3 $R/ckpt30b.log >> $OUT/summary.txt; du -sh $M >> $OUT/summary.txt
D=$PWD/tests/gpu/deploy_check.py
run() {  # NAME EXTRA TIMEOUT
  timeout $3 python3 $D --model $M --out $R/$1 --tp 2 --skip-compose --runs 1 \
     --bench-args "--num-seqs 64" $2 > $R/$1.md 2>&1
  { el $1; grep -h "^| launcher\|failed check" $R/$1.md | cut -c1-300
    grep -h "start-up:\|joined\|Init:\|^launch:" $R/$1/launch_tp2.log | sed 's/^.*nanoserve.worker //' | cut -c1-420; } | tee -a $OUT/summary.txt
  (cd $R && tar czf $OUT/raw.tgz --exclude='*.safetensors' .)
}
run q30_kill "--kill-after 5000" 300
run q30_warm "--skip-kill" 200
