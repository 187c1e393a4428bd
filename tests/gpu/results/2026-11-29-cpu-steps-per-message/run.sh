#!/bin/bash
# Null worker, 2-core VM: steps per message 1 (each step its own stream write) against 2 and 3,
# alternating rounds; prints each run's step wall median (client.bench's middle column).
cd "$(dirname "$0")/../../../.."
B=(.venv/bin/python -m client.bench --null-worker --min-input-len 128 --max-input-len 128
   --min-output-len 512 --max-output-len 512 --runs 3 --no-progress)
for round in 1 2; do for S in 0.3 1.0; do for N in 1 8 16; do for k in 1 2 3; do
  w=$(NANOSERVE_STEPS_PER_MESSAGE=$k timeout 200 "${B[@]}" --step-ms $S --num-seqs $N 2>&1 \
      | grep '^step wall ms' | tail -1 | awk '{print $4" ("$5"-"$6")"}')
  echo "round $round S=$S N=$N per_message=$k step wall ms $w"
done; done; done; done
