set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site; fi
export PYTHONPATH="$PWD:$PWD/protos:$PYTHONPATH" PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
M=$NANOSERVE_QWEN06B; GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
B=(python3 -m client.bench --no-progress --device-name "$GPU" --request-rate 26 --runs 3)
timeout 110 "${B[@]}" --in-process --model $M --device cuda --max-model-len 4096 --kv-cache-dtype fp8 --json $OUT/local_online.json > $OUT/local.txt 2>&1
python3 -m worker_service --model $M --port 50061 --max-model-len 4096 --log-level WARNING --kv-cache-dtype fp8 > $OUT/worker.log 2>&1 &
python3 -m scheduler_service --model $M --workers 127.0.0.1:50061 --port 50051 --max-model-len 4096 --frontends 2 --log-level WARNING > $OUT/scheduler.log 2>&1 &
for i in $(seq 120); do grep -q listening $OUT/scheduler.log && break; sleep 1; done
timeout 70 "${B[@]}" --target 127.0.0.1:50051 --client-procs 1 --json $OUT/grpc_online_p1.json > $OUT/grpc_p1.txt 2>&1
timeout 70 "${B[@]}" --target 127.0.0.1:50051 --client-procs 4 --json $OUT/grpc_online_p4.json > $OUT/grpc_p4.txt 2>&1
kill %2 %1; wait
for f in local grpc_p1 grpc_p4; do echo "== $f"; grep -A12 "runs:" $OUT/$f.txt | grep -E "runs:|TTFT|ITL|idle|tokens/m"; done
