#!/bin/bash
# issue 63: decode attention merged by the last split program + 32-key tiles when split (pk) vs HEAD (pk0);
# CUDA tests; the deployed path (launcher) at batch 1 / 8 / workload, in-process batch 1 (issue 72), peer
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/times.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | tail -1
env -u PYTHONPATH python3 -m pip install -q --no-deps peer/flash_attn-*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NANOSERVE_GPU_TESTS=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
M=/tmp/qwen3-0.6b-random
(cd pk && PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site python3 tests/gpu/test_model_gpu.py --make-checkpoint-only 2>&1 | tail -1)
t tests
(cd pk && PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_kernels_attention.py tests/test_kernels_kv_fp8.py tests/gpu/test_kernels_gpu.py 2>&1 | tail -4) | tee $R/tests.txt
for n in 1 8; do for tree in pk0 pk pk0 pk; do
  t "$tree decode $n"
  (cd $tree && PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site timeout 60 python3 tests/gpu/profile_mixed.py --model $M --profile-decode --decode $n > $R/pm_${tree}_$n.txt 2>&1)
  grep -h "^graph replay" $R/pm_${tree}_$n.txt; grep -h "_decode_kernel\|_decode_merge" $R/pm_${tree}_$n.txt | head -2 | cut -c1-60,100-150
done; done
cd pk; export PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site
B1=(--client-procs 1 --min-input-len 256 --max-input-len 256 --min-output-len 512 --max-output-len 512 --temperature 0 --warmup 2 --runs 3)
t launcher
python3 -m scheduler_service.launch --model $M --tp 1 --port 50051 --worker-base-port 50061 > $R/launch.log 2>&1 &
LP=$!
for i in $(seq 200); do grep -q "scheduler listening" $R/launch.log && break; sleep 1; done
for n in 1 8; do
  timeout 100 python3 -m client.bench --no-progress --target 127.0.0.1:50051 --num-seqs $n "${B1[@]}" > $R/launch_b$n.txt 2>&1
  echo "launcher b$n"; grep -h "^ITL\|^step wall\|GPU idle" $R/launch_b$n.txt
done
timeout 150 python3 -m client.bench --no-progress --target 127.0.0.1:50051 --runs 3 > $R/launch_wl.txt 2>&1
grep -h "output tok/s  \|GPU idle" $R/launch_wl.txt
kill $LP; wait $LP
t inproc
timeout 200 python3 -m client.bench --no-progress --in-process --model $M --num-seqs 1 "${B1[@]}" > $R/inproc_b1.txt 2>&1
echo "in-process b1"; grep -h "^ITL\|^step wall\|GPU idle" $R/inproc_b1.txt
t model
timeout 150 python3 tests/gpu/test_model_gpu.py > $R/model.txt 2>&1; tail -25 $R/model.txt
t peer
(cd .. && env -u PYTHONPATH timeout 150 bash peer/run_nano_vllm.sh $M 3 > $R/peer.txt 2>&1); tail -3 $R/peer.txt
t end
cd $OUT && tar czf r.tgz r && rm -rf r
