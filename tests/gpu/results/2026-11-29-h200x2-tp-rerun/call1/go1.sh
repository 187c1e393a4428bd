#!/bin/bash
# issue 69, call 1 (2x H200): Qwen3-8B bf16 TP=1 vs TP=2 through the launcher (workload x2, batch 1
# and 8 x3), then Qwen3-30B-A3B bf16 TP=2 (cold start, rank-1 SIGKILL -> next token, workload, batch 1)
cd "$(dirname "$0")"
export PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site PYTHONUNBUFFERED=1 NANOSERVE_GPU_TESTS=1
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/times.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../whl/*.whl 2>&1 | tail -1
nvidia-smi -L | tee $R/gpus.txt; GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
t ckpt
M8=/dev/shm/q8; M30=/dev/shm/q30
CUDA_VISIBLE_DEVICES=1 timeout 200 python3 tests/gpu/quant_checkpoint.py $M30 Qwen3-30B-A3B bf16 > $R/ckpt30.log 2>&1 &
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 tests/gpu/quant_checkpoint.py $M8 Qwen3-8B bf16 > $R/ckpt8.log 2>&1
wait; t ckpt done; tail -n 2 $R/ckpt*.log
B=(timeout -k 5 120 python3 -m client.bench --no-progress --device-name "$GPU" --target 127.0.0.1:50051 --timeout 300)
B1=(--client-procs 1 --min-input-len 256 --max-input-len 256 --min-output-len 512 --max-output-len 512 --temperature 0 --warmup 2 --runs 3)
serve() {  # MODEL TP TAG
  setsid python3 -m scheduler_service.launch --model $1 --tp $2 --port 50051 \
    --worker-args "--max-model-len 4096" -- --max-model-len 4096 > $R/launch_$3.log 2>&1 < /dev/null &
  LP=$!; for i in $(seq 150); do grep -q "scheduler listening" $R/launch_$3.log && break; sleep 1; done
  t "$3 listening after ${i}s"
}
stop() { kill -TERM $LP; for i in $(seq 20); do kill -0 $LP 2>/dev/null || break; sleep 1; done
  kill -KILL -- -$LP 2>/dev/null; wait $LP 2>/dev/null; sleep 2; }
show() { grep -h "output tok/s  \|^ITL\|^TTFT\|^step wall\|GPU idle\|per decode step" -A0 $R/$1.txt | head -12; }
for tp in 1 2; do
  serve $M8 $tp q8_tp$tp
  "${B[@]}" --runs 2 --json $R/q8_tp${tp}_big.json > $R/q8_tp${tp}_big.txt 2>&1; t q8 tp$tp big; show q8_tp${tp}_big
  for n in 1 8; do
    "${B[@]}" "${B1[@]}" --num-seqs $n --json $R/q8_tp${tp}_b$n.json > $R/q8_tp${tp}_b$n.txt 2>&1; t q8 tp$tp b$n; show q8_tp${tp}_b$n
  done
  stop
done
t 30b deploy_check
timeout -k 5 200 python3 tests/gpu/deploy_check.py --model $M30 --out $R/d30 --tp 2 --skip-compose --runs 1 \
  --kill-after 5000 --bench-args "--num-seqs 64" > $R/d30.md 2>&1
t 30b deploy_check done; grep -h "^| launcher\|failed check" $R/d30.md
grep -h "start-up:\|Init:\|^launch:" $R/d30/launch_tp2.log | cut -c1-300 | head -12
serve $M30 2 q30_tp2
"${B[@]}" --runs 1 --json $R/q30_big.json > $R/q30_big.txt 2>&1; t q30 big; show q30_big
"${B[@]}" "${B1[@]}" --num-seqs 1 --json $R/q30_b1.json > $R/q30_b1.txt 2>&1; t q30 b1; show q30_b1
stop
t end
cd $OUT && tar czf r.tgz r && rm -rf r
