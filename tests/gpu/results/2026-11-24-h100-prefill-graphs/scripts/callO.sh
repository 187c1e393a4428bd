# Lease: prefill graphs (several rows): GPU tests, table, online 1024-request runs both ways, offline gRPC check.
set -u
T0=$(date +%s)
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; fi
export NANOSERVE_GPU_TESTS=1 PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
export PYTHONPATH="$PWD:$PWD/protos:/tmp/site"
M=$NANOSERVE_QWEN06B; GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU $(date -u +%H:%M:%S)"
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
timeout 120 python3 - > $OUT/prefill_graphs.md 2>$OUT/prefill_graphs.err <<'PY'
import sys; sys.path[:0] = ["tests/gpu", "tests"]
import os, pathlib
from test_model_gpu import prefill_graph_check
import torch
print(torch.cuda.get_device_name())
print("| KV | prompt tokens | graph vs eager logits, rel. L2 | same argmax | step ms, eager | step ms, graph |\n|---|---|---|---|---|---|")
for kv in ("bf16", "fp8"):
    for row in prefill_graph_check(pathlib.Path(os.environ["NANOSERVE_QWEN06B"]), kv_fp8=kv == "fp8"):
        print(f"| {kv} | {row['what']} | {row['rel']:.2e} | {row['argmax_same']} | {row['eager_ms']:.2f} | {row['graph_ms']:.2f} |")
PY
cat $OUT/prefill_graphs.md; grep -v Warn $OUT/prefill_graphs.err | tail -3
echo "t=$(( $(date +%s) - T0 ))s"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_model_gpu.py tests/gpu/test_sampling_gpu.py -k "prefill_graphs or greedy_tokens or fp8_kv or sampling" 2>&1 | tail -4 > $OUT/gputests.txt
cat $OUT/gputests.txt
echo "t=$(( $(date +%s) - T0 ))s"
B=(python3 -m client.bench --no-progress --device-name "$GPU")
O=(--request-rate 26 --num-seqs 1024)
L=(--in-process --model $M --device cuda --max-model-len 4096 --kv-cache-dtype fp8)
timeout 170 "${B[@]}" "${L[@]}" "${O[@]}" --runs 3 --json $OUT/on_local.json > $OUT/on_local.txt 2>&1
echo "t=$(( $(date +%s) - T0 ))s"
python3 -m worker_service --model $M --port 50061 --max-model-len 4096 --log-level INFO --kv-cache-dtype fp8 > $OUT/worker.log 2>&1 & WP=$!
python3 -m scheduler_service --model $M --workers 127.0.0.1:50061 --port 50051 --max-model-len 4096 --log-level WARNING > $OUT/sched.log 2>&1 & SP=$!
for i in $(seq 240); do grep -q listening $OUT/sched.log && break; sleep 0.5; done
G=(--target 127.0.0.1:50051 --client-procs 4)
timeout 40 "${B[@]}" "${G[@]}" --runs 2 --json $OUT/off_grpc.json > $OUT/off_grpc.txt 2>&1
timeout $(( 585 - ($(date +%s) - T0) )) "${B[@]}" "${G[@]}" "${O[@]}" --runs 3 --json $OUT/on_grpc.json > $OUT/on_grpc.txt 2>&1
kill $SP; wait $SP; kill $WP; wait $WP
date -u +%H:%M:%S; echo "all $(( $(date +%s) - T0 ))s"
for f in on_local off_grpc on_grpc; do echo "== $f"; grep -E "^TTFT|^ITL|^decode steps" $OUT/$f.txt | head -3; grep -A12 "runs:" $OUT/$f.txt | grep -E "runs:|TTFT|ITL|idle|tokens/m"; done
grep -i "graphs" $OUT/worker.log
tar czf /tmp/pack.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/pack.tgz $OUT/results.tgz
