#!/bin/bash
# issue 63: placeholders gathered in the decode graphs' own copy: pk (working tree) vs pk0 (a61ad11)
#
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/times.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NANOSERVE_GPU_TESTS=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
M=/tmp/qwen3-0.6b-random
pp() { export PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site; }
(cd pk && pp && python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1)
t tests
(cd pk && pp && timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_sampling_gpu.py > $R/sampling_gpu.txt 2>&1; tail -3 $R/sampling_gpu.txt)
t model
(cd pk && pp && timeout 200 python3 tests/gpu/test_model_gpu.py > $R/model.txt 2>&1; tail -9 $R/model.txt | cut -c1-80)
for n in 1 8; do for tree in pk0 pk; do
  t "host_step $tree $n"
  (cd $tree && pp && timeout 100 python3 tests/gpu/host_step.py --model $M --rows $n --steps 400 > $R/host_${tree}_$n.txt 2>&1; grep "period\|launch (all\|gpu_ms\|load\|sample \|inputs\|copy_answer" $R/host_${tree}_$n.txt)
done; done
B1=(--no-progress --target 127.0.0.1:50051 --client-procs 1 --min-input-len 256 --max-input-len 256 --min-output-len 512 --max-output-len 512 --temperature 0 --warmup 2 --runs 3)
for tree in pk0 pk; do
  t "launcher $tree"
  (cd $tree && pp
  python3 -m scheduler_service.launch --model $M --tp 1 --port 50051 --worker-base-port 50061 > $R/launch_$tree.log 2>&1 &
  LP=$!
  for i in $(seq 200); do grep -q "scheduler listening" $R/launch_$tree.log && break; sleep 1; done
  for n in 1 8; do
    timeout 100 python3 -m client.bench "${B1[@]}" --num-seqs $n > $R/launch_${tree}_b$n.txt 2>&1
    echo "$tree b$n"; grep -h "^ITL\|^step wall" $R/launch_${tree}_b$n.txt
  done
  timeout 150 python3 -m client.bench --no-progress --target 127.0.0.1:50051 --runs 1 > $R/launch_${tree}_wl.txt 2>&1
  grep -h "output tok/s  " $R/launch_${tree}_wl.txt
  kill $LP; wait $LP)
done
t end
cd $OUT && tar czf r.tgz r && rm -rf r
