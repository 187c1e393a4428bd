# Lease G (same machine): online 1024-request runs, fp8, 26 req/s, in-process x3 vs gRPC x3 (auto frontends) on eccd65e; no offline.
set -u
T0=$(date +%s)

export NANOSERVE_GPU_TESTS=1 PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
export PYTHONPATH="$PWD:$PWD/protos:/tmp/site"
M=$NANOSERVE_QWEN06B; GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU $(date -u +%H:%M:%S) cpus $(nproc)"
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
B=(python3 -m client.bench --no-progress --device-name "$GPU")
O=(--request-rate 26 --num-seqs 1024)
L=(--in-process --model $M --device cuda --max-model-len 4096 --kv-cache-dtype fp8)
G=(--target 127.0.0.1:50051 --client-procs 4)
timeout 170 "${B[@]}" "${L[@]}" "${O[@]}" --runs 3 --json $OUT/on_local.json > $OUT/on_local.txt 2>&1
echo "t=$(( $(date +%s) - T0 ))s"
python3 -m worker_service --model $M --port 50061 --max-model-len 4096 --log-level WARNING --kv-cache-dtype fp8 > $OUT/worker.log 2>&1 & WP=$!
python3 -m scheduler_service --model $M --workers 127.0.0.1:50061 --port 50051 --max-model-len 4096 --log-level WARNING > $OUT/sched.log 2>&1 & SP=$!
for i in $(seq 240); do grep -q listening $OUT/sched.log && break; sleep 0.5; done
timeout $(( 590 - ($(date +%s) - T0) )) "${B[@]}" "${G[@]}" "${O[@]}" --runs 3 --json $OUT/on_grpc.json > $OUT/on_grpc.txt 2>&1
kill $SP; wait $SP; kill $WP; wait $WP
date -u +%H:%M:%S; echo "all $(( $(date +%s) - T0 ))s"
grep listening $OUT/sched.log
for f in on_local on_grpc; do echo "== $f"; grep -A12 "runs:" $OUT/$f.txt | grep -E "runs:|TTFT|ITL|idle|tokens/m"; done

