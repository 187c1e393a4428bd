set -x
export OUT=${OUT:-/tmp/o}; mkdir -p $OUT
which ncu nsys; nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
UNIT_ARGS="tests/gpu/test_kernels_gpu.py tests/test_kernels_attention.py tests/test_kernels_kv_fp8.py" timeout 200 bash tests/gpu/run.sh unit > $OUT/unit.log 2>&1; tail -3 $OUT/unit.log
ATTN_ARGS="--batch 131 --kv fp8,bf16 --groups 2 --contexts U[100,2048];U[100,1024];1;100 --splits 1,2,3,4 --orders random,longest --configs default" timeout 200 bash tests/gpu/run.sh attn > $OUT/attn131.log 2>&1
ATTN_ARGS="--batch 256 --kv fp8 --groups 2 --contexts 1;100;U[100,2048] --configs default" timeout 100 bash tests/gpu/run.sh attn > $OUT/attn256.log 2>&1
timeout 150 bash tests/gpu/run.sh profile > $OUT/profile.log 2>&1
if which ncu; then
  export PYTHONPATH=$PWD:$PWD/protos
  timeout 120 ncu --kernel-name regex:_decode_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats --section MemoryWorkloadAnalysis python3 tests/gpu/results/2026-11-23-h100-kernel-limits/scripts/ncu_decode.py fp8 131 100 2048 > $OUT/ncu_fp8_131.txt 2>&1
fi
cd $OUT && tar czf /tmp/r.tgz . && rm -rf $OUT/* && mv /tmp/r.tgz $OUT/results.tgz
