#!/usr/bin/env bash
# 2x H100, issue 49: the grouped loader vs the mapped one (4-layer 30B-A3B, one rank's load,
# base = 6866bfc's tree), then 30B-A3B TP=2 through the launcher with this tree: cold start +
# rank-1 kill (first start: cold Triton cache; its restart: warm, from standby spares), warm start.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/protos:/tmp/site NANOSERVE_GPU_TESTS=1 PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
R=/tmp/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee $OUT/summary.txt
M=/dev/shm/qwen3-30b-a3b
timeout 100 python3 tests/gpu/moe_check.py checkpoint /dev/shm/q30l4 --layers 4 > $R/ckpt4.log 2>&1
for t in this base this base; do
  d=$PWD; [ $t = base ] && d=$PWD/.device/base
  (cd $d && PYTHONPATH=$d:$d/protos:/tmp/site timeout 60 python3 $OLDPWD/tests/gpu/bench_loader.py /dev/shm/q30l4 --runs 2 2>&1 | sed "s/^/$t: /" | tail -2)
done | tee -a $OUT/summary.txt
rm -rf /dev/shm/q30l4; el loader | tee -a $OUT/summary.txt
timeout 150 python3 tests/gpu/moe_check.py checkpoint $M > $R/ckpt30b.log 2>&1; el ckpt30b | tee -a $OUT/summary.txt
timeout 100 python3 tests/gpu/bench_loader.py $M --runs 1 2>&1 | tail -1 | tee -a $OUT/summary.txt
D=$PWD/tests/gpu/deploy_check.py
run() {  # NAME EXTRA TIMEOUT
  timeout $3 python3 $D --model $M --out $R/$1 --tp 2 --skip-compose --runs 1 \
     --bench-args "--num-seqs 64" $2 > $R/$1.md 2>&1
  { el $1; grep -h "^| launcher\|failed check" $R/$1.md | cut -c1-300
    grep -h "start-up:\|standing by\|joined\|Init:\|^launch:" $R/$1/launch_tp2.log | sed 's/^.*nanoserve.worker //' | cut -c1-420; } | tee -a $OUT/summary.txt
  (cd $R && tar czf $OUT/raw.tgz --exclude='*.safetensors' .)
}
run q30_kill "--kill-after 5000" 220
run q30_warm "--skip-kill" 120
