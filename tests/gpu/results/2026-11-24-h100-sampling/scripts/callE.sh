# Lease E: sampling with lg2.approx (v4) vs v2; q/k norm+rotary two programs a token vs one;
# GPU tests of both; decode-step profile.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export NANOSERVE_GPU_TESTS=1 PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
export PYTHONPATH="$PWD:$PWD/protos:/tmp/site"
echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) $(date -u +%H:%M:%S)"
python3 tests/gpu/bench_sampling.py --n 64,131,256 > $OUT/samplers_v4.md 2>&1
PYTHONPATH="$PWD/.hx:$PYTHONPATH" python3 tests/gpu/bench_sampling.py --n 64,131,256 --module sampling_v2 > $OUT/samplers_v2.md 2>&1
for v in v2 v4; do echo "== $v"; grep "^| " $OUT/samplers_$v.md | grep -v variant; done
timeout 120 python3 .hx/qk_bench.py 2>&1 | grep -v Warn | tee $OUT/qk.md
echo "t=$(( $(date +%s) - T0 ))s"
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_sampling_gpu.py tests/gpu/test_kernels_gpu.py tests/gpu/test_model_gpu.py -k "fused or norm_rotary or greedy_tokens or fp8_kv or logits_match" 2>&1 | tee $OUT/gputests.txt | tail -4
echo "t=$(( $(date +%s) - T0 ))s"
timeout $(( 585 - ($(date +%s) - T0) )) python3 tests/gpu/profile_decode.py > $OUT/profile.md 2>&1; grep -E "^###|^CUDA graph|gumbel|qk_norm" $OUT/profile.md
echo "all $(( $(date +%s) - T0 ))s"
