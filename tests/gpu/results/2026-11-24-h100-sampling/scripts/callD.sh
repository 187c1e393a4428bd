# Lease D: an offline prefill step's kernels; the paged prefill kernel's configs (+ unmasked interior tiles); flash-attn for reference.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/fa .peer/flash_attn-2.8.3-*.whl
export NANOSERVE_GPU_TESTS=1 PYTHONUNBUFFERED=1 NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
export PYTHONPATH="$PWD:$PWD/protos:/tmp/site:/tmp/fa"
echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) $(date -u +%H:%M:%S)"
python3 tests/gpu/test_model_gpu.py --make-checkpoint-only > /dev/null 2>&1
timeout 500 python3 .hx/prefill_exp.py model 2>&1 | grep -v Warn | tee $OUT/prefill_exp.md
echo "all $(( $(date +%s) - T0 ))s"
