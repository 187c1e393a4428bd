# Lease B: sampling variants (v1 one Philox per id, v2 rand4x, v3 rand4x + log2); GPU tests after
# the graphs' staging/capture refactor and the new sampler; the step profile.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export NANOSERVE_GPU_TESTS=1 PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
export PYTHONPATH="$PWD:$PWD/protos:/tmp/site"
M=$NANOSERVE_QWEN06B; GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU $(date -u +%H:%M:%S) cpus $(nproc)"
python3 tests/gpu/bench_sampling.py > $OUT/samplers_v2.md 2>&1
PYTHONPATH="$PWD/.hx:$PYTHONPATH" python3 tests/gpu/bench_sampling.py --module sampling_v1 > $OUT/samplers_v1.md 2>&1
PYTHONPATH="$PWD/.hx:$PYTHONPATH" python3 tests/gpu/bench_sampling.py --module sampling_v3 > $OUT/samplers_v3.md 2>&1
PYTHONPATH="$PWD/.hx:$PYTHONPATH" python3 tests/gpu/bench_sampling.py --module sampling_old --n 131 > $OUT/samplers_old.md 2>&1
for v in old v1 v2 v3; do echo "== $v"; grep "^| " $OUT/samplers_$v.md | grep -v variant; done
echo "t=$(( $(date +%s) - T0 ))s"
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_sampling_gpu.py tests/gpu/test_model_gpu.py -k "sampling or penal or overlapped or prefill_graphs or greedy_tokens or fp8_kv" 2>&1 | tee $OUT/gputests.txt | tail -5
echo "t=$(( $(date +%s) - T0 ))s"
timeout $(( 585 - ($(date +%s) - T0) )) python3 tests/gpu/profile_decode.py > $OUT/profile.md 2>&1; grep -E "^###|^CUDA graph|gumbel" $OUT/profile.md
date -u +%H:%M:%S; echo "all $(( $(date +%s) - T0 ))s"
