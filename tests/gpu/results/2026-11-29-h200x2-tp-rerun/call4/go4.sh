#!/bin/bash
# call 4 (same 2x H200 lease): nano-vllm on the 0.6B and 8B (peer), then issue 68's decode-step check
cd "$(dirname "$0")"
export PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site PYTHONUNBUFFERED=1 NANOSERVE_GPU_TESTS=1
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/times.txt; }
python3 -c "import grpc" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../whl/*.whl 2>&1 | tail -1
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
t peer 0.6b; timeout -k 5 150 bash ../peer/run_nano_vllm.sh /tmp/qwen3-0.6b-random 3 2>&1 | tee $R/peer06.txt
[ -f /dev/shm/q8/config.json ] || timeout 100 python3 tests/gpu/quant_checkpoint.py /dev/shm/q8 Qwen3-8B bf16 > /dev/null 2>&1
t peer 8b; timeout -k 5 150 bash ../peer/run_nano_vllm.sh /dev/shm/q8 2 2>&1 | tee $R/peer8.txt
for d in "" --deterministic; do
  t "profile_mixed $d"
  timeout -k 5 90 python3 tests/gpu/profile_mixed.py --model /dev/shm/q8 --profile-decode $d > $R/pm$d.txt 2>&1
  tail -n 25 $R/pm$d.txt
done
t end
cd $OUT && tar czf r.tgz r && rm -rf r
