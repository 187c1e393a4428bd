# Lease: GPU restart test; online fp8 with 1024 requests: in-process x3, gRPC x3 (1 frontend), gRPC x2 (2 frontends).
set -u
T0=$(date +%s)
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; fi
export NANOSERVE_GPU_TESTS=1 PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
export PYTHONPATH="$PWD:$PWD/protos:/tmp/site"
M=$NANOSERVE_QWEN06B; GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU $(date -u +%H:%M:%S)"
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_model_gpu.py -k second_scheduler > $OUT/gputest.txt 2>&1; tail -2 $OUT/gputest.txt
B=(python3 -m client.bench --no-progress --device-name "$GPU" --request-rate 26 --num-seqs 1024)
L=(--in-process --model $M --device cuda --max-model-len 4096 --kv-cache-dtype fp8)
timeout 200 "${B[@]}" "${L[@]}" --runs 3 --json $OUT/local_online.json > $OUT/local_online.txt 2>&1
python3 -m worker_service --model $M --port 50061 --max-model-len 4096 --log-level WARNING --kv-cache-dtype fp8 > $OUT/worker.log 2>&1 &
serve() {  # $1 = tag, $2 = frontends
  python3 -m scheduler_service --model $M --workers 127.0.0.1:50061 --port 50051 --max-model-len 4096 --frontends $2 --log-level WARNING > $OUT/sched_$1.log 2>&1 &
  SP=$!
  for i in $(seq 240); do grep -q listening $OUT/sched_$1.log && break; sleep 0.5; done
}
G=(--target 127.0.0.1:50051 --client-procs 4)
serve f1 1
timeout 200 "${B[@]}" "${G[@]}" --runs 3 --json $OUT/grpc_f1_online.json > $OUT/grpc_f1_online.txt 2>&1
kill $SP; wait $SP
if [ $(( $(date +%s) - T0 )) -lt 420 ]; then
  serve f2 2
  timeout $(( 575 - ($(date +%s) - T0) )) "${B[@]}" "${G[@]}" --runs 2 --json $OUT/grpc_f2_online.json > $OUT/grpc_f2_online.txt 2>&1
  kill $SP; wait $SP
fi
kill %1; wait
date -u +%H:%M:%S
for f in local_online grpc_f1_online grpc_f2_online; do echo "== $f"; grep -A14 "runs:" $OUT/$f.txt | grep -E "runs:|TTFT|ITL|idle|tokens/m"; done
tail -n 2 $OUT/*.log
tar czf /tmp/pack.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/pack.tgz $OUT/results.tgz
