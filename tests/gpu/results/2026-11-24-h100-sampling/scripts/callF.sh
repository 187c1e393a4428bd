# Lease F: GPU tests on the final kernels (eccd65e): kernel tests on CUDA (incl. the CPU kernel
# tests run on CUDA), sampling, model vs HF, prefill graphs; the decode-step profile.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export NANOSERVE_GPU_TESTS=1 PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
export PYTHONPATH="$PWD:$PWD/protos:/tmp/site"
echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) $(date -u +%H:%M:%S)"
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py tests/test_kernels_norm_rotary.py tests/test_kernels_kv_fp8.py tests/test_kernels_activation.py tests/test_prefill_graphs.py 2>&1 | tail -3 | tee $OUT/unit_on_cuda.txt
echo "t=$(( $(date +%s) - T0 ))s"
timeout 360 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/gpu/test_sampling_gpu.py tests/gpu/test_model_gpu.py 2>&1 | tail -6 | tee $OUT/gputests.txt
echo "t=$(( $(date +%s) - T0 ))s"
timeout $(( 590 - ($(date +%s) - T0) )) python3 tests/gpu/profile_decode.py > $OUT/profile.md 2>&1; grep -E "^###|^CUDA graph" $OUT/profile.md
echo "all $(( $(date +%s) - T0 ))s"
