#!/bin/bash
# issue 63: decode attention key tile at batch 1/8 in the runner's graph; GEMV with two tiles in flight
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/times.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NANOSERVE_GPU_TESTS=1
cd pk; export PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site
M=/tmp/qwen3-0.6b-random
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
for n in 1 8; do for bn in 0 32 16; do
  t "decode $n block_n $bn"
  NANOSERVE_DECODE_BLOCK_N=$bn timeout 100 python3 tests/gpu/profile_mixed.py --model $M --profile-decode --decode $n > $R/pm_${n}_$bn.txt 2>&1
  grep -h "^decode\|^graph replay" $R/pm_${n}_$bn.txt; grep -h "_decode_kernel\|_decode_merge" $R/pm_${n}_$bn.txt | head -2 | cut -c1-70,100-150
done; done
t gemv
timeout 360 python3 tests/gpu/bench_gemv.py --hbm-tbs 4.8 --sweep --shapes "8B qkv,8B o,8B gate_up,8B down,0.6B qkv,0.6B o,0.6B gate_up,0.6B down" > $R/gemv.md 2>&1
cat $R/gemv.md
t end
cd $OUT && tar czf r.tgz r && rm -rf r
