#!/bin/bash
# issue 69, call 3 (2x H200): int4 (AWQ) 0.6B TP=1 vs TP=2; priority under a flood at TP=2;
# --deterministic at TP=2 refused
cd "$(dirname "$0")"
export PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site PYTHONUNBUFFERED=1 NANOSERVE_GPU_TESTS=1
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/times.txt; }
python3 -c "import grpc" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../whl/*.whl 2>&1 | tail -1
export NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1; M=$NANOSERVE_QWEN06B
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
Q=/dev/shm/q06awq; [ -f $Q/config.json ] || timeout 60 python3 tests/gpu/quant_checkpoint.py $Q Qwen3-0.6B awq > $R/ckpt_awq.log 2>&1
t awq
timeout -k 5 150 python3 tests/gpu/deploy_check.py --model $Q --out $R/awq --tp 1,2 --runs 1 --skip-compose \
  --kill-after 3000 --bench-args "--num-seqs 64" > $R/awq.md 2>&1
t awq done; grep -h "^| \|failed check\|^FAIL" $R/awq.md
t det
timeout -k 5 60 python3 -m scheduler_service.launch --model $M --tp 2 --deterministic --port 50051 > $R/det_tp2.log 2>&1
echo "launcher --deterministic --tp 2: rc $?"; grep -i "deterministic\|error" $R/det_tp2.log | head -5
setsid python3 -m scheduler_service.launch --model $M --tp 2 --port 50051 \
  --worker-args "--max-model-len 4096" -- --max-model-len 4096 > $R/launch_mixed.log 2>&1 < /dev/null &
LP=$!; for i in $(seq 150); do grep -q "scheduler listening" $R/launch_mixed.log && break; sleep 1; done
t mixed listening after ${i}s
timeout -k 5 150 python3 -m client.bench --no-progress --device-name "$GPU" --target 127.0.0.1:50051 \
  --mixed --num-seqs 256 --json $R/mixed_tp2.json > $R/mixed_tp2.txt 2>&1
t mixed done; tail -n 25 $R/mixed_tp2.txt
kill -TERM $LP; for i in $(seq 20); do kill -0 $LP 2>/dev/null || break; sleep 1; done; kill -KILL -- -$LP 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
