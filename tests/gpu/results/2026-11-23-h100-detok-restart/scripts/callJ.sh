# Lease: online fp8 with 1024 requests: in-process x3, gRPC x3 (1 frontend).
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
serve() {  # $1 = tag, $2 = frontends
  python3 -m scheduler_service --model $M --workers 127.0.0.1:50061 --port 50051 --max-model-len 4096 --frontends $2 --log-level WARNING > $OUT/sched_$1.log 2>&1 &
  SP=$!
  for i in $(seq 240); do grep -q listening $OUT/sched_$1.log && break; sleep 0.5; done
}
worker() { python3 -m worker_service --model $M --port 50061 --max-model-len 4096 --log-level WARNING --kv-cache-dtype fp8 > $OUT/worker_$1.log 2>&1 & WP=$!; }
G=(--target 127.0.0.1:50051 --client-procs 4)
timeout 190 "${B[@]}" "${L[@]}" --runs 3 --json $OUT/local_online.json > $OUT/local_online.txt 2>&1
worker b; serve f1 1
timeout $(( 590 - ($(date +%s) - T0) )) "${B[@]}" "${G[@]}" --runs 3 --json $OUT/grpc_f1_online.json > $OUT/grpc_f1_online.txt 2>&1
kill $SP; wait $SP; kill $WP; wait $WP

date -u +%H:%M:%S
for f in local_online grpc_f1_online; do echo "== $f"; grep -A14 "runs:" $OUT/$f.txt | grep -E "runs:|TTFT|ITL|idle|tokens/m"; done
tail -n 2 $OUT/*.log
tar czf /tmp/pack.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/pack.tgz $OUT/results.tgz
