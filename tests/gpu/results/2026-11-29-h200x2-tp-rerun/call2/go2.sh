#!/bin/bash
# issue 69, call 2 (2x H200): run.sh deploy and deploy-features at TP=1 and TP=2 (0.6B), one run each
cd "$(dirname "$0")"
export PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site PYTHONUNBUFFERED=1 NANOSERVE_GPU_TESTS=1
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/times.txt; }
python3 -c "import grpc" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../whl/*.whl 2>&1 | tail -1
export NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1; M=$NANOSERVE_QWEN06B
t deploy
timeout -k 5 300 python3 tests/gpu/deploy_check.py --model $M --out $R/deploy --runs 1 > $R/deploy.md 2>&1
t deploy done; grep -h "^| \|failed check\|^FAIL" $R/deploy.md
A=/dev/shm/adapters; [ -d $A/a3 ] || python3 tests/gpu/make_adapters.py "$M" $A 4 16 > /dev/null 2>&1
t features
timeout -k 5 230 python3 tests/gpu/deploy_check.py --model "$M" --out $R/features --tp 1,2 --runs 1 \
  --skip-compose --adapter a1 --bench-args="--adapters a0,a1,a2,a3" \
  --worker-args="--max-loras 4 --max-lora-rank 16 --host-kv-cache-gb 4" \
  --scheduler-args="--lora-modules a0=$A/a0,a1=$A/a1,a2=$A/a2,a3=$A/a3" > $R/features.md 2>&1
t features done; grep -h "^| \|failed check\|^FAIL" $R/features.md
cd $OUT && tar czf r.tgz r && rm -rf r
