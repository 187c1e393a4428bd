export PYTHONPATH=$PWD:$PWD/protos NANOSERVE_QWEN06B=/tmp/qwen3-0.6b-random
mkdir -p $OUT/a
UNIT_ARGS="-v tests/gpu/test_kernels_gpu.py -k compile" OUT=$OUT/a timeout 150 bash tests/gpu/run.sh unit > $OUT/a/unit.log 2>&1
grep -E "PASS|FAIL|SKIP|passed|failed" $OUT/a/unit.log | tail -8
timeout 90 ncu --kernel-name regex:_decode_kernel --launch-skip 2 --launch-count 1 --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,smsp__inst_executed.sum,smsp__cycles_active.avg python3 tests/gpu/results/2026-11-23-h100-kernel-limits/scripts/ncu_decode.py fp8 131 100 2048 > $OUT/a/ncu_stalls_fp8_131.txt 2>&1
grep -E "stalled|inst_executed|cycles_active" $OUT/a/ncu_stalls_fp8_131.txt | sort -k3 -n -r | head -12
OUT=$OUT/a PEER_RUNS=4 timeout 330 bash tests/gpu/run.sh peer > $OUT/a/peer.log 2>&1
grep -E "Total|Error" $OUT/a/peer.log
cd $OUT && tar czf /tmp/r.tgz a && rm -rf a && mv /tmp/r.tgz results.tgz
