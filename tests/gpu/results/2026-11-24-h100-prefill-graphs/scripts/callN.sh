# Lease: GPU tests after prefill graphs; the prefill step table; online 1024-request runs both ways.
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
print("| KV | prompt tokens (+ cached) | graph vs eager logits, rel. L2 | same argmax | step ms, eager | step ms, graph |\n|---|---|---|---|---|---|")
for kv in ("bf16", "fp8"):
    for row in prefill_graph_check(pathlib.Path(os.environ["NANOSERVE_QWEN06B"]), kv_fp8=kv == "fp8"):
        print(f"| {kv} | {row['n']} (+{row['start']}) | {row['rel']:.2e} | {row['argmax_same']} | {row['eager_ms']:.2f} | {row['graph_ms']:.2f} |")
PY
cat $OUT/prefill_graphs.md; grep -v Warn $OUT/prefill_graphs.err | tail -3
echo "t=$(( $(date +%s) - T0 ))s"
timeout 270 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_model_gpu.py tests/gpu/test_sampling_gpu.py -k "prefill_graphs or greedy_tokens or fp8_kv or penal or top_logprobs or sampling" 2>&1 | tail -4 > $OUT/gputests.txt
cat $OUT/gputests.txt
echo "t=$(( $(date +%s) - T0 ))s"
B=(python3 -m client.bench --no-progress --device-name "$GPU" --request-rate 26 --num-seqs 1024)
L=(--in-process --model $M --device cuda --max-model-len 4096 --kv-cache-dtype fp8)
timeout $(( 585 - ($(date +%s) - T0) )) "${B[@]}" "${L[@]}" --runs 3 --json $OUT/on_local.json > $OUT/on_local.txt 2>&1
date -u +%H:%M:%S; echo "all $(( $(date +%s) - T0 ))s"
for f in on_local; do echo "== $f"; grep -A12 "runs:" $OUT/$f.txt | grep -E "runs:|TTFT|ITL|idle|tokens/m"; done
tar czf /tmp/pack.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/pack.tgz $OUT/results.tgz
