#!/bin/bash
# final.sh ROUNDS: base vs after trees, the issue's table, alternating; one line per run set.
# The trees (from the repo root):
#   git archive a04ed88 scheduler_service worker_service client | tar -x -C .bench/after
#   the same into .bench/base, then: git show a3fe764:scheduler_service/engine.py and
#   git show 33032ca:worker_service/null_worker.py over theirs (pipeline.py, device_clock.py removed)
# depth2-vs-4.log: /tmp/b/ab.sh, the working tree at a04ed88 with NANOSERVE_MAX_PIPELINE_DEPTH=2 / 4.
cd /work/main
for r in $(seq $1); do
 for cfg in "1.0 1" "1.0 8" "1.0 16" "0.3 1" "0.3 8" "0.3 16" "7 nano"; do read s b <<< "$cfg"
  for t in base after; do
   if [ "$b" = nano ]; then w="--runs 3"; else w="--num-seqs $b --min-input-len 128 --max-input-len 128 --min-output-len 512 --max-output-len 512 --runs 3"; fi
   out=$(cd .bench/$t && PYTHONPATH=$PWD:/work/main/protos /work/main/.venv/bin/python -m client.bench --null-worker --step-ms $s $w 2>&1)
   echo "r$r s$s b$b $t load $(cut -d' ' -f1 /proc/loadavg) | $(echo "$out" | grep -E '^step wall ms|^host M|^output tok/s  ' | tr -s ' ' | tr '\n' ' ')"
  done
 done
done
