# Lease G (same machine, next call): in-process bf16 offline, this session's kernels (eccd65e) vs 3ce833f, alternating.
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
M=$NANOSERVE_QWEN06B; GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU $(date -u +%H:%M:%S)"
B=(python3 -m client.bench --no-progress --device-name "$GPU" --in-process --model $M --device cuda --max-model-len 4096 --runs 3)
for r in 1 2; do
  [ $(( $(date +%s) - T0 )) -lt 420 ] || break
  PYTHONPATH="$PWD:$PWD/protos:/tmp/site" timeout 100 "${B[@]}" --json $OUT/new$r.json > $OUT/new$r.txt 2>&1
  (cd .hx/head && PYTHONPATH="$PWD:$PWD/protos:/tmp/site" timeout 100 "${B[@]}" --json $OUT/old$r.json > $OUT/old$r.txt 2>&1)
  echo "t=$(( $(date +%s) - T0 ))s"
done
for f in new1 old1 new2 old2; do echo "== $f"; grep -A12 "runs:" $OUT/$f.txt | grep -E "runs:|step wall|GPU busy|idle"; done
echo "all $(( $(date +%s) - T0 ))s"
