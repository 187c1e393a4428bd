# Lease 7: decode attention with whole tiles unmasked (working tree) vs 7660387 (.hx/base):
# kernel GB/s, the decode-step profile, in-process bf16 offline; GPU attention tests.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export NANOSERVE_GPU_TESTS=1 PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
M=$NANOSERVE_QWEN06B; GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU $(date -u +%H:%M:%S)"
NEW="$PWD"; BASE="$PWD/.hx/base"
A=(--batch 256 --kv bf16,fp8 --groups 2 --contexts "U[100,2048];U[100,1024];2048;100" --configs default)
for t in new base; do
  D=$NEW; [ $t = base ] && D=$BASE
  (cd $D && PYTHONPATH="$D:$D/protos:/tmp/site" timeout 120 python3 tests/gpu/bench_decode_attention.py "${A[@]}" > $OUT/attn_$t.md 2>&1)
done
for t in new base; do echo "== attn $t"; grep "^| " $OUT/attn_$t.md | grep -v -- "---"; done
echo "t=$(( $(date +%s) - T0 ))s"
PYTHONPATH="$NEW:$NEW/protos:/tmp/site" python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
for t in new base; do
  D=$NEW; [ $t = base ] && D=$BASE
  (cd $D && PYTHONPATH="$D:$D/protos:/tmp/site" timeout 100 python3 tests/gpu/profile_decode.py > $OUT/profile_$t.md 2>&1)
  echo "== profile $t"; grep -E "^### fused|^CUDA graph|_decode_kernel" $OUT/profile_$t.md
done
echo "t=$(( $(date +%s) - T0 ))s"
B=(python3 -m client.bench --no-progress --device-name "$GPU" --in-process --model $M --device cuda --max-model-len 4096 --runs 3)
i=0
for t in new base new; do
  [ $(( $(date +%s) - T0 )) -lt 400 ] || break
  i=$((i + 1))
  D=$NEW; [ $t = base ] && D=$BASE
  (cd $D && PYTHONPATH="$D:$D/protos:/tmp/site" timeout 100 "${B[@]}" --json $OUT/off_${i}_$t.json > $OUT/off_${i}_$t.txt 2>&1)
  echo "t=$(( $(date +%s) - T0 ))s $t"
done
(PYTHONPATH="$NEW:$NEW/protos:/tmp/site" timeout $(( 585 - ($(date +%s) - T0) )) python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "attention or compile" 2>&1 | tail -3 | tee $OUT/attn_tests.txt)
for f in $OUT/off_*.txt; do echo "== $f"; grep -A12 "runs:" $f | grep -E "runs:|step wall|GPU busy"; done
echo "all $(( $(date +%s) - T0 ))s"
