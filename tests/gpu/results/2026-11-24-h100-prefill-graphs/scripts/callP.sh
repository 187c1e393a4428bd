# Lease: online fp8 1024-request runs: in-process x3, gRPC 1 frontend x3, gRPC 2 frontends x3 (prefill graphs on).
set -u
T0=$(date +%s)
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; fi
export NANOSERVE_GPU_TESTS=1 PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
export PYTHONPATH="$PWD:$PWD/protos:/tmp/site"
M=$NANOSERVE_QWEN06B; GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU $(date -u +%H:%M:%S)"
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
B=(python3 -m client.bench --no-progress --device-name "$GPU" --request-rate 26 --num-seqs 1024)
L=(--in-process --model $M --device cuda --max-model-len 4096 --kv-cache-dtype fp8)
G=(--target 127.0.0.1:50051 --client-procs 4)
python3 -m worker_service --model $M --port 50061 --max-model-len 4096 --log-level WARNING --kv-cache-dtype fp8 > $OUT/worker.log 2>&1 & WP=$!
serve() {  # $1 = frontends
  python3 -m scheduler_service --model $M --workers 127.0.0.1:50061 --port 50051 --max-model-len 4096 --frontends $1 --log-level WARNING > $OUT/sched_f$1.log 2>&1 &
  SP=$!
  for i in $(seq 240); do grep -q listening $OUT/sched_f$1.log && break; sleep 0.5; done
}
serve 2
timeout 160 "${B[@]}" "${G[@]}" --runs 3 --json $OUT/grpc_f2.json > $OUT/grpc_f2.txt 2>&1
kill $SP; wait $SP
serve 1
timeout 160 "${B[@]}" "${G[@]}" --runs 3 --json $OUT/grpc_f1.json > $OUT/grpc_f1.txt 2>&1
kill $SP; wait $SP; kill $WP; wait $WP
echo "t=$(( $(date +%s) - T0 ))s"
timeout $(( 585 - ($(date +%s) - T0) )) "${B[@]}" "${L[@]}" --runs 3 --json $OUT/local.json > $OUT/local.txt 2>&1
date -u +%H:%M:%S; echo "all $(( $(date +%s) - T0 ))s"
for f in grpc_f2 grpc_f1 local; do echo "== $f"; grep -E "^TTFT|^ITL" $OUT/$f.txt | head -2; grep -A12 "runs:" $OUT/$f.txt | grep -E "runs:|TTFT|ITL|idle|tokens/m"; grep "CPU s" $OUT/$f.txt | head -1; done
tar czf /tmp/pack.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/pack.tgz $OUT/results.tgz
