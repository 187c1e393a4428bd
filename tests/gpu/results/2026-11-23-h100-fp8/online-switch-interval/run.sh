#!/usr/bin/env bash
# Experiment: does the worker's GIL switch interval explain the online gRPC idle?
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="$PWD:$PWD/protos:/tmp/site" PYTHONUNBUFFERED=1
M=/tmp/qwen3-0.6b-random; NANOSERVE_QWEN06B=$M python3 tests/gpu/test_model_gpu.py --make-checkpoint-only >/dev/null
for SI in 0.005 0.0005; do
  python3 -c "import sys, runpy; sys.setswitchinterval($SI); sys.argv[0] = 'worker_service'; runpy.run_module('worker_service', run_name='__main__', alter_sys=True)" \
    --model $M --port 50061 --max-model-len 4096 --log-level WARNING > $OUT/w_$SI.log 2>&1 &
  python3 -m scheduler_service --model $M --workers 127.0.0.1:50061 --port 50051 --max-model-len 4096 --log-level WARNING > $OUT/s_$SI.log 2>&1 &
  for i in $(seq 300); do grep -q listening $OUT/s_$SI.log && break; sleep 1; done
  echo "== switch interval $SI"
  python3 -m client.bench --no-progress --target 127.0.0.1:50051 --request-rate 26 --runs 2 --json $OUT/online_$SI.json 2>$OUT/b_$SI.err | grep -E "runs:|^idle|^TTFT p99|^ITL p99|^step wall|^GPU busy"
  kill %2 %1 2>/dev/null; wait
done
