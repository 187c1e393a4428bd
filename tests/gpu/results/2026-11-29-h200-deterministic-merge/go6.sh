#!/bin/bash
# issue 68 (one H200): the split merge stopping at a row's last split: test_deterministic on CUDA,
# then profile_mixed --deterministic --profile-decode at 8 and 1 decode rows (8B), base tree (pk0)
# and this one (pk), alternating
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/times.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NANOSERVE_GPU_TESTS=1
M8=/tmp/q8
(cd pk && PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site timeout 60 python3 tests/gpu/quant_checkpoint.py $M8 Qwen3-8B bf16 2>&1 | tail -1)
t unit
(cd pk && PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_deterministic.py 2>&1 | tail -3) | tee $R/unit.txt
for n in 8 1; do for tree in pk0 pk; do
  t "$tree decode $n"
  (cd $tree && PYTHONPATH=$PWD:$PWD/protos:$PWD/tests:/tmp/site timeout 60 python3 tests/gpu/profile_mixed.py --model $M8 \
     --deterministic --profile-decode --decode $n > $R/pm_${tree}_$n.txt 2>&1)
  grep -h "^decode\|^graph replay\|^forward" $R/pm_${tree}_$n.txt
  grep -h "_split_merge_kernel\|_prefill_kernel" $R/pm_${tree}_$n.txt | head -2 | cut -c1-58,100-140
done; done
t end
cd $OUT && tar czf r.tgz r && rm -rf r
