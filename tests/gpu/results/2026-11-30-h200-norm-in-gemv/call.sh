#!/bin/bash
# issue 63: NANOSERVE_NORM_IN_GEMV=1 (the norms in the one-token GEMV's prologue) on CUDA: tests, replay, host_step, launcher off/on
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/times.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NANOSERVE_GPU_TESTS=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
M=/tmp/qwen3-0.6b-random
cd pk; export PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
t "gemv tests on cuda (knob on)"
NANOSERVE_NORM_IN_GEMV=1 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gemv.py > $R/gemv_cuda.txt 2>&1; tail -3 $R/gemv_cuda.txt
t "model (knob on)"
NANOSERVE_NORM_IN_GEMV=1 timeout 200 python3 tests/gpu/test_model_gpu.py > $R/model_on.txt 2>&1; tail -9 $R/model_on.txt
for k in 0 1 0 1; do
  t "profile_decode b1 knob=$k"
  NANOSERVE_NORM_IN_GEMV=$k timeout 120 python3 tests/gpu/profile_decode.py --batch 1 --hbm-tbs 4.8 --variants fused+gemv > $R/prof_b1_$k.txt 2>&1; grep -i "replay\|kernels\|floor" $R/prof_b1_$k.txt | head -5
done
for n in 1 8; do for k in 0 1; do
  t "host_step $n knob=$k"
  NANOSERVE_NORM_IN_GEMV=$k timeout 100 python3 tests/gpu/host_step.py --model $M --rows $n --steps 400 > $R/host_${k}_$n.txt 2>&1; grep "period\|launch (all\|gpu_ms" $R/host_${k}_$n.txt
done; done
B1=(--no-progress --target 127.0.0.1:50051 --client-procs 1 --min-input-len 256 --max-input-len 256 --min-output-len 512 --max-output-len 512 --temperature 0 --warmup 2 --runs 3)
for k in 0 1; do
  t "launcher knob=$k"
  NANOSERVE_NORM_IN_GEMV=$k python3 -m scheduler_service.launch --model $M --tp 1 --port 50051 --worker-base-port 50061 > $R/launch_$k.log 2>&1 &
  LP=$!
  for i in $(seq 200); do grep -q "scheduler listening" $R/launch_$k.log && break; sleep 1; done
  for n in 1 8; do
    timeout 100 python3 -m client.bench "${B1[@]}" --num-seqs $n > $R/launch_${k}_b$n.txt 2>&1
    echo "knob=$k b$n"; grep -h "^ITL\|^step wall" $R/launch_${k}_b$n.txt
  done
  kill $LP; wait $LP
done
t end
cd $OUT && tar czf r.tgz r && rm -rf r
