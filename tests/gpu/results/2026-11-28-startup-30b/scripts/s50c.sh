#!/usr/bin/env bash
# 2x H100, issue 49, final code: the standard deploy check (0.6B: launcher TP=1/TP=2, rank-1
# SIGKILL, compose flags), then 8B FP8 TP=2 start-up and rank-1 kill -> next token.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/protos:/tmp/site NANOSERVE_GPU_TESTS=1 PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee $OUT/summary.txt
DEPLOY_ARGS="--runs 1" OUT=/tmp/d timeout 320 bash tests/gpu/run.sh deploy > $OUT/dep.txt 2>&1
el deploy | tee -a $OUT/summary.txt; tail -12 $OUT/dep.txt >> $OUT/summary.txt
(cd /tmp/d && grep -h "start-up:\|standing by\|joined\|Init:\|^launch:" deploy/launch_tp2.log | sed 's/^.*nanoserve.worker //' | cut -c1-400 > $OUT/tp2_lines.txt
 tar czf $OUT/deploy_raw.tgz deploy.md deploy/*.log deploy/*.txt deploy/deploy.json 2>/dev/null)
R=/tmp/r; mkdir -p $R; M=/dev/shm/qwen3-8b
timeout 100 python3 tests/gpu/fp8_check.py checkpoint $M > $R/ckpt8b.log 2>&1; el ckpt8b | tee -a $OUT/summary.txt
D=$PWD/tests/gpu/deploy_check.py
run() {  # NAME EXTRA TIMEOUT
  timeout $3 python3 $D --model $M --out $R/$1 --tp 2 --skip-compose --runs 1 --bench-args "--num-seqs 64" \
     --worker-args "--quantization fp8 --kv-cache-dtype fp8" $2 > $R/$1.md 2>&1
  { el $1; grep -h "^| launcher\|failed check" $R/$1.md | cut -c1-300
    grep -h "start-up:\|standing by\|joined\|Init:\|^launch:" $R/$1/launch_tp2.log | sed 's/^.*nanoserve.worker //' | cut -c1-420; } | tee -a $OUT/summary.txt
  (cd $R && tar czf $OUT/raw8b.tgz --exclude='*.safetensors' .)
}
run q8_kill "--kill-after 5000" 110
run q8_warm "--skip-kill" 60
run q8_kill2 "--kill-after 5000" 90
