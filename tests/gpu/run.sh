#!/usr/bin/env bash
# GPU checks and benchmarks on a GPU host, from the repo root:
#   kernels  Triton kernels vs torch references at Qwen3-0.6B sizes
#   model    our Qwen3 vs Hugging Face (bf16 logits; greedy tokens through the real services)
#   bench    client.bench reference workload, in-process and through gRPC
#   unit     the CPU kernel tests (tests/test_kernels_*.py) on CUDA
#   attn     paged decode attention GB/s and % of HBM peak (batch 256, GQA 2/4/8, config sweep)
#   profile  per-kernel GPU time of one decode step at batch 131, fused vs unfused
#   tp       TP=2 vs TP=1 on two GPUs (Qwen3-0.6B and 8B shapes): logits, tokens, decode tok/s
# On the lent device machine: carry .whl (grpcio, grpcio-health-checking, grpcio-reflection,
# protobuf matching the generated stubs) and the generated protos/nanoserve/v1/*_pb2*.py.
#   bash tests/gpu/run.sh [kernels] [model] [bench]     (default: all)
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD:$PWD/protos${PYTHONPATH:+:$PYTHONPATH}"
export NANOSERVE_GPU_TESTS=1 PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=${NANOSERVE_QWEN06B:-/tmp/qwen3-0.6b-random}
OUT=${OUT:-/tmp/nanoserve-gpu}; mkdir -p "$OUT"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU"
python3 -c "import torch, triton, transformers, grpc, google.protobuf as pb; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__)"
rc=0
for w in ${*:-kernels model bench}; do
  echo "== $w"
  case $w in
    kernels|model|tp) python3 "tests/gpu/test_${w}_gpu.py" 2>&1 | tee "$OUT/$w.md" || rc=1 ;;
    unit) python3 -m pytest -q -p no:cacheprovider tests/test_kernels_*.py 2>&1 | tee "$OUT/unit.md" || rc=1 ;;
    attn) python3 tests/gpu/bench_decode_attention.py 2>&1 | tee "$OUT/attn.md" || rc=1 ;;
    profile) python3 tests/gpu/profile_decode.py 2>&1 | tee "$OUT/profile.md" || rc=1 ;;
    bench)
      python3 tests/gpu/test_model_gpu.py --make-checkpoint-only >/dev/null || rc=1
      M=$NANOSERVE_QWEN06B
      python3 -m client.bench --in-process --model "$M" --device cuda --max-model-len 4096 \
        --json "$OUT/bench_inprocess.json" 2>"$OUT/bench_inprocess.err" | tee "$OUT/bench_inprocess.txt" || rc=1
      python3 -m worker_service --model "$M" --port 50061 --max-model-len 4096 --log-level WARNING \
        > "$OUT/worker.log" 2>&1 &
      python3 -m scheduler_service --model "$M" --workers 127.0.0.1:50061 --port 50051 \
        --max-model-len 4096 --log-level WARNING > "$OUT/scheduler.log" 2>&1 &
      for i in $(seq 300); do grep -q listening "$OUT/scheduler.log" && break; sleep 1; done
      python3 -m client.bench --target 127.0.0.1:50051 --device-name "$GPU" \
        --json "$OUT/bench_grpc.json" 2>"$OUT/bench_grpc.err" | tee "$OUT/bench_grpc.txt" || rc=1
      kill %2 %1 2>/dev/null; wait
      tail -5 "$OUT/worker.log" "$OUT/scheduler.log" "$OUT/bench_grpc.err" "$OUT/bench_inprocess.err" ;;
  esac
done
exit $rc
