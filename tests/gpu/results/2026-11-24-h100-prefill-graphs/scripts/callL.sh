# Lease: where the control plane's CPU goes on the GPU host (py-spy), fp8, gRPC and in-process.
set -u
T0=$(date +%s)
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; fi
export NANOSERVE_GPU_TESTS=1 PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
export PYTHONPATH="$PWD:$PWD/protos:/tmp/site"
M=$NANOSERVE_QWEN06B; GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU $(date -u +%H:%M:%S) cpus $(nproc)"; lscpu | grep -E "Model name|MHz" | head -3
chmod +x .hx/py-spy; .hx/py-spy --version
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
S=.hx/spy_tree.py
B=(python3 -m client.bench --no-progress --device-name "$GPU")
L=(--in-process --model $M --device cuda --max-model-len 4096 --kv-cache-dtype fp8)
python3 -m worker_service --model $M --port 50061 --max-model-len 4096 --log-level WARNING --kv-cache-dtype fp8 > $OUT/worker.log 2>&1 & WP=$!
python3 -m scheduler_service --model $M --workers 127.0.0.1:50061 --port 50051 --max-model-len 4096 --log-level WARNING > $OUT/sched.log 2>&1 & SP=$!
for i in $(seq 240); do grep -q listening $OUT/sched.log && break; sleep 0.5; done
echo "up $(( $(date +%s) - T0 ))s"
G=(--target 127.0.0.1:50051 --client-procs 4)
# offline gRPC: 2 runs, spy 6 s inside the second
( sleep 9; python3 $S $OUT off_grpc 5 $WP $SP > $OUT/off_grpc_pids.txt ) & SPY=$!
timeout 120 "${B[@]}" "${G[@]}" --runs 3 --json $OUT/off_grpc.json > $OUT/off_grpc.txt 2>&1
wait $SPY
# online gRPC: 3 runs of 512 requests, spy 12 s inside the third
( sleep 56; python3 $S $OUT on_grpc 12 $WP $SP > $OUT/on_grpc_pids.txt ) & SPY=$!
timeout 170 "${B[@]}" "${G[@]}" --request-rate 26 --num-seqs 512 --runs 3 --json $OUT/on_grpc.json > $OUT/on_grpc.txt 2>&1
wait $SPY
kill $SP; wait $SP; kill $WP; wait $WP
echo "grpc done $(( $(date +%s) - T0 ))s"
# in-process online: 3 runs of 512, spy 12 s inside the third (bench process itself)
"${B[@]}" "${L[@]}" --request-rate 26 --num-seqs 512 --runs 3 --json $OUT/on_local.json > $OUT/on_local.txt 2>&1 & BP=$!
( sleep 70; python3 $S $OUT on_local 12 $BP > $OUT/on_local_pids.txt ) &
timeout $(( 580 - ($(date +%s) - T0) )) tail --pid=$BP -f /dev/null; kill $BP 2>/dev/null; wait
date -u +%H:%M:%S; echo "all $(( $(date +%s) - T0 ))s"
cat $OUT/*_pids.txt
for f in off_grpc on_grpc on_local; do echo "== $f"; grep -A16 "runs:" $OUT/$f.txt | grep -E "runs:|tok/s|TTFT|ITL|idle|tokens/m|step"; done
for f in $OUT/*_[0-9].txt; do echo "#### $f"; python3 .hx/spy_top.py $f 12 | head -30; done
tail -n 2 $OUT/*.log; head -c 600 $OUT/*.err
tar czf /tmp/pack.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/pack.tgz $OUT/results.tgz
