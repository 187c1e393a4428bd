#!/bin/bash
# issue 72 GPU check (steps per message 1 vs 3 through gRPC, in-process batch 1, launcher) + 63 profile
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/times.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | tail -1
env -u PYTHONPATH python3 -m pip install -q --no-deps peer/flash_attn-*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NANOSERVE_GPU_TESTS=1
cd pk; export PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site
M=/tmp/qwen3-0.6b-random
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
t small
SMALL_VAR=NANOSERVE_STEPS_PER_MESSAGE SMALL_VALS="1 3" SMALL_CONFIGS="$M:" OUT=$R/small timeout 400 bash tests/gpu/run.sh small > $R/small.txt 2>&1
grep -v "^$" $R/small.txt | tail -20
B1=(--num-seqs 1 --client-procs 1 --min-input-len 256 --max-input-len 256 --min-output-len 512 --max-output-len 512 --temperature 0 --warmup 2 --runs 3)
t inproc
timeout 200 python3 -m client.bench --no-progress --in-process --model $M "${B1[@]}" > $R/inproc_b1.txt 2>&1
grep -h "output tok/s  \|^ITL\|^step wall\|GPU idle" $R/inproc_b1.txt
t launcher
python3 -m scheduler_service.launch --model $M --tp 1 --port 50051 --worker-base-port 50061 > $R/launch.log 2>&1 &
LP=$!
for i in $(seq 200); do grep -q "scheduler listening" $R/launch.log && break; sleep 1; done
timeout 100 python3 -m client.bench --no-progress --target 127.0.0.1:50051 "${B1[@]}" > $R/launch_b1.txt 2>&1
grep -h "output tok/s  \|^ITL\|^step wall\|GPU idle" $R/launch_b1.txt
timeout 150 python3 -m client.bench --no-progress --target 127.0.0.1:50051 --runs 3 > $R/launch_wl.txt 2>&1
grep -h "output tok/s  \|per decode step\|GPU idle" $R/launch_wl.txt
kill $LP; wait $LP
t profile
timeout 200 python3 tests/gpu/profile_decode.py --batch 1 --hbm-tbs 4.8 --variants fused+gemv > $R/prof_b1.txt 2>&1
tail -60 $R/prof_b1.txt
t peer
(cd .. && env -u PYTHONPATH timeout 200 bash peer/run_nano_vllm.sh $M 3 > $R/peer.txt 2>&1); tail -5 $R/peer.txt
t end
cd $OUT && tar czf r.tgz r && rm -rf r
