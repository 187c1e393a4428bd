#!/bin/bash
# issue 63: pk0 = 969b15b (norms in the GEMV) vs pk = + q/k norm, rotary and KV store in the decode attention
# kernel, LM head on cuBLAS, host-side cuts (plan, events, host image)
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/times.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NANOSERVE_GPU_TESTS=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
M=/tmp/qwen3-0.6b-random
pp() { export PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site; }
(cd pk && pp && python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1)
t "kernel tests on cuda"
(cd pk && pp && timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py tests/test_kernels_norm_rotary.py -k "prologue or decode or qk_norm" > $R/kernels_cuda.txt 2>&1; tail -4 $R/kernels_cuda.txt)
t "eager on/off bitwise, 1 and 8 rows"
(cd pk && pp && for n in 1 8; do timeout 100 python3 ../normcheck.py $M NORM_ROTARY_IN_ATTENTION $n 2>&1 | grep -v Loading > $R/eager_bitwise_$n.txt; head -4 $R/eager_bitwise_$n.txt; done)
for n in 1 8; do for tree in pk0 pk; do
  t "profile_decode $tree b$n"
  (cd $tree && pp && timeout 100 python3 tests/gpu/profile_decode.py --batch $n --hbm-tbs 4.8 --variants fused+gemv > $R/prof_${tree}_b$n.txt 2>&1; grep "kernels, GPU\|replay" $R/prof_${tree}_b$n.txt)
done; done
for n in 1 8; do for tree in pk0 pk; do
  t "host_step $tree $n"
  (cd $tree && pp && timeout 100 python3 tests/gpu/host_step.py --model $M --rows $n --steps 400 > $R/host_${tree}_$n.txt 2>&1; grep "period\|launch (all\|gpu_ms\|plan\|load" $R/host_${tree}_$n.txt)
done; done
B1=(--no-progress --target 127.0.0.1:50051 --client-procs 1 --min-input-len 256 --max-input-len 256 --min-output-len 512 --max-output-len 512 --temperature 0 --warmup 2 --runs 3)
for run in pk0:1 pk:0 pk:1 pk0:1 pk:1; do
  tree=${run%:*}; k=${run#*:}; tag=${tree}_$k
  t "launcher $tag"
  (cd $tree && pp
  NANOSERVE_NORM_ROTARY_IN_ATTENTION=$k python3 -m scheduler_service.launch --model $M --tp 1 --port 50051 --worker-base-port 50061 > $R/launch_$tag.log 2>&1 &
  LP=$!
  for i in $(seq 200); do grep -q "scheduler listening" $R/launch_$tag.log && break; sleep 1; done
  for p in "1,2,3,4,5,6,7,8" "17,250,3,99,41" "5,5,5,5,200,201,202,203,9,8,7"; do
    timeout 30 python3 -m client --target 127.0.0.1:50051 generate --ids "$p" --max-tokens 96 --temperature 0 --json 2>/dev/null | python3 -c 'import sys, json; print([i for l in sys.stdin for i in json.loads(l)["token_ids"]])' >> $R/greedy_$tag.txt 2>&1
  done
  md5sum $R/greedy_$tag.txt
  for n in 1 8; do
    timeout 100 python3 -m client.bench "${B1[@]}" --num-seqs $n > $R/launch_${tag}_b$n.txt 2>&1
    echo "$tag b$n"; grep -h "^step wall" $R/launch_${tag}_b$n.txt
  done
  if [ "$k" = 1 ]; then timeout 120 python3 -m client.bench --no-progress --target 127.0.0.1:50051 --runs 2 > $R/launch_${tag}_wl.txt 2>&1
  grep -h "output tok/s  " $R/launch_${tag}_wl.txt; fi
  kill $LP; wait $LP)
done
t end
cd $OUT && tar czf r.tgz r && rm -rf r
