#!/bin/bash
# call 5 (same 2x H200 lease): nano-vllm (peer) on the 0.6B and the 8B; bench.py sets its own PYTHONPATH,
# so flash-attn goes into the system site
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/times.txt; }
env -u PYTHONPATH python3 -m pip install -q --no-index --no-deps --no-cache-dir ../peer/flash_attn-*.whl 2>&1 | tail -2
env -u PYTHONPATH python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)"
t peer 0.6b; timeout -k 5 130 env -u PYTHONPATH bash ../peer/run_nano_vllm.sh /tmp/qwen3-0.6b-random 3 2>&1 | tee $R/peer06.txt
t peer 8b; timeout -k 5 150 env -u PYTHONPATH bash ../peer/run_nano_vllm.sh /dev/shm/q8 2 2>&1 | tee $R/peer8.txt
t end
cd $OUT && tar czf r.tgz r && rm -rf r
