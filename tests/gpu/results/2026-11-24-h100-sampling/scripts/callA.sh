# Lease A: fused sampling split over the vocab vs the one-program-per-row kernel (HEAD):
# kernel times, the decode-step profile with sampling, in-process bf16 offline A/B.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export NANOSERVE_GPU_TESTS=1 PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
export PYTHONPATH="$PWD:$PWD/protos:/tmp/site"
M=$NANOSERVE_QWEN06B; GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU $(date -u +%H:%M:%S) cpus $(nproc)"
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
echo "t=$(( $(date +%s) - T0 ))s ckpt"
python3 tests/gpu/bench_sampling.py > $OUT/samplers_new.md 2>&1
PYTHONPATH="$PWD/.hx:$PYTHONPATH" python3 tests/gpu/bench_sampling.py --module sampling_old > $OUT/samplers_old.md 2>&1
cat $OUT/samplers_new.md $OUT/samplers_old.md | grep -v Warn
echo "t=$(( $(date +%s) - T0 ))s"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_sampling_gpu.py -k fused 2>&1 | tail -3
timeout 100 python3 tests/gpu/profile_decode.py > $OUT/profile.md 2>&1; grep -E "^###|^CUDA graph|gumbel" $OUT/profile.md
echo "t=$(( $(date +%s) - T0 ))s"
B=(python3 -m client.bench --no-progress --device-name "$GPU" --in-process --model $M --device cuda --max-model-len 4096 --runs 3)
timeout 100 "${B[@]}" --json $OUT/new1.json > $OUT/new1.txt 2>&1
echo "t=$(( $(date +%s) - T0 ))s"
(cd .hx/head && PYTHONPATH="$PWD:$PWD/protos:/tmp/site" timeout 100 "${B[@]}" --json $OUT/old1.json > $OUT/old1.txt 2>&1)
echo "t=$(( $(date +%s) - T0 ))s"
timeout $(( 590 - ($(date +%s) - T0) )) "${B[@]}" --json $OUT/new2.json > $OUT/new2.txt 2>&1
date -u +%H:%M:%S; echo "all $(( $(date +%s) - T0 ))s"
for f in new1 old1 new2; do echo "== $f"; grep -A12 "runs:" $OUT/$f.txt | grep -E "runs:|step wall|GPU busy"; done
