#!/bin/bash
# issue 63: the 0.6B draft for the 8B ("count" models: every draft right), batch 1 and 8, after
# the host-side cuts (HEAD): plain vs draft in one lease
cd "$(dirname "$0")"
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site
cd pk && DRAFT_PARTS=" " DRAFT_CONFIGS="none /dev/shm/qwen3-0.6b-count" DRAFT_RUNS=2 OUT=$R timeout 540 bash tests/gpu/run.sh draft 2>&1 | tail -30
cd $OUT && tar czf r.tgz r && rm -rf r
