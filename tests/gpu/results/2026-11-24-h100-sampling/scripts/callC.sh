# Lease C: nano-vllm x4, then bf16 and fp8 offline in-process x3 and gRPC x5 (one server each), after the sampling kernels (954a725).
set -u
T0=$(date +%s)
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; fi
export PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
M=$NANOSERVE_QWEN06B; GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU $(date -u +%H:%M:%S)"
PYTHONPATH="$PWD:$PWD/protos:/tmp/site" python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
timeout 230 bash .peer/run_nano_vllm.sh $M 4 > $OUT/peer.txt 2>&1; cat $OUT/peer.txt
export PYTHONPATH="$PWD:$PWD/protos:/tmp/site"
B=(python3 -m client.bench --no-progress --device-name "$GPU")
for kv in bf16 fp8; do
  [ $(( $(date +%s) - T0 )) -lt 360 ] || break
  X=(); [ $kv = fp8 ] && X=(--kv-cache-dtype fp8)
  timeout 90 "${B[@]}" --in-process --model $M --device cuda --max-model-len 4096 "${X[@]}" --runs 3 --json $OUT/local_$kv.json > $OUT/local_$kv.txt 2>&1
  python3 -m worker_service --model $M --port 50061 --max-model-len 4096 --log-level WARNING "${X[@]}" > $OUT/worker_$kv.log 2>&1 &
  WP=$!
  python3 -m scheduler_service --model $M --workers 127.0.0.1:50061 --port 50051 --max-model-len 4096 --log-level WARNING > $OUT/sched_$kv.log 2>&1 &
  SP=$!
  for i in $(seq 240); do grep -q listening $OUT/sched_$kv.log && break; sleep 0.5; done
  timeout 90 "${B[@]}" --target 127.0.0.1:50051 --client-procs 4 --runs 5 --json $OUT/grpc_$kv.json > $OUT/grpc_$kv.txt 2>&1
  kill $SP; wait $SP; kill $WP; wait $WP
done
date -u +%H:%M:%S
for f in local_bf16 grpc_bf16 local_fp8 grpc_fp8; do echo "== $f"; grep -A14 "runs:" $OUT/$f.txt | grep -E "runs:|output tok|idle|tokens/m"; done

echo "all $(( $(date +%s) - T0 ))s"
