#!/bin/bash
# issue 63: decode attention key tile at batch 1/8 in the runner's graph; issue 72: batch 8 at 3 vs 1 steps a message, alternating
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/times.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NANOSERVE_GPU_TESTS=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
cd pk; export PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site
M=/tmp/qwen3-0.6b-random
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only 2>&1 | tail -1
for n in 1 8; do for bn in 0 32 16; do
  t "decode $n block_n $bn"
  NANOSERVE_DECODE_BLOCK_N=$bn timeout 100 python3 tests/gpu/profile_mixed.py --model $M --profile-decode --decode $n > $R/pm_${n}_$bn.txt 2>&1
  grep -h "^decode\|^graph replay" $R/pm_${n}_$bn.txt; grep -h "_decode_kernel\|_decode_merge" $R/pm_${n}_$bn.txt | head -2 | cut -c1-70,100-150
done; done
t small
SMALL_VAR=NANOSERVE_STEPS_PER_MESSAGE SMALL_VALS="3 1 3 1" SMALL_CONFIGS="$M:" OUT=$R/small timeout 300 bash tests/gpu/run.sh small > $R/small.txt 2>&1
grep "^== \|step wall\|GPU busy" $R/small.txt
t end
cd $OUT && tar czf r.tgz r && rm -rf r
