# Lease: fp8 offline+online in-process, gRPC new detokenizer, gRPC old detokenizer, gRPC new again.
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; fi
export PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
NEWPP="$PWD:$PWD/protos:/tmp/site"
rm -rf /tmp/old && mkdir /tmp/old && cp -r scheduler_service client protos worker_service kernels models /tmp/old/
cp .hx/detokenizer_old.py /tmp/old/scheduler_service/detokenizer.py
OLDPP="/tmp/old:/tmp/old/protos:/tmp/site"
export PYTHONPATH=$NEWPP
M=$NANOSERVE_QWEN06B; GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU $(date -u +%H:%M:%S)"
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
B=(python3 -m client.bench --no-progress --device-name "$GPU")
L=(--in-process --model $M --device cuda --max-model-len 4096 --kv-cache-dtype fp8)
timeout 80 "${B[@]}" "${L[@]}" --runs 3 --json $OUT/local.json > $OUT/local.txt 2>&1
timeout 110 "${B[@]}" "${L[@]}" --request-rate 26 --runs 5 --json $OUT/local_online.json > $OUT/local_online.txt 2>&1
python3 -m worker_service --model $M --port 50061 --max-model-len 4096 --log-level WARNING --kv-cache-dtype fp8 > $OUT/worker.log 2>&1 &
serve() {  # $1 = tag, PYTHONPATH chosen by caller
  python3 -m scheduler_service --model $M --workers 127.0.0.1:50061 --port 50051 --max-model-len 4096 --log-level WARNING > $OUT/sched_$1.log 2>&1 &
  SP=$!
  for i in $(seq 120); do grep -q listening $OUT/sched_$1.log && break; sleep 0.5; done
}
G=(--target 127.0.0.1:50051 --client-procs 4)
serve new
timeout 70 "${B[@]}" "${G[@]}" --runs 5 --json $OUT/grpc_new.json > $OUT/grpc_new.txt 2>&1
timeout 90 "${B[@]}" "${G[@]}" --request-rate 26 --runs 5 --json $OUT/grpc_new_online.json > $OUT/grpc_new_online.txt 2>&1
kill $SP; wait $SP
PYTHONPATH=$OLDPP serve old
timeout 90 "${B[@]}" "${G[@]}" --request-rate 26 --runs 5 --json $OUT/grpc_old_online.json > $OUT/grpc_old_online.txt 2>&1
kill $SP; wait $SP
serve new2
timeout 60 "${B[@]}" "${G[@]}" --request-rate 26 --runs 3 --json $OUT/grpc_new2_online.json > $OUT/grpc_new2_online.txt 2>&1
kill $SP; wait $SP
kill %1; wait
date -u +%H:%M:%S
for f in local local_online grpc_new grpc_new_online grpc_old_online grpc_new2_online; do echo "== $f"; grep -A14 "runs:" $OUT/$f.txt | grep -E "runs:|output tok|TTFT|ITL|idle|tokens/m"; done
tail -n 3 $OUT/*.log
tar czf /tmp/pack.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/pack.tgz $OUT/results.tgz
