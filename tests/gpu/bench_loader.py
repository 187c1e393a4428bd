"""Time the weights load of one TP rank (issue 49): build the model on a GPU and load this
rank's shards from a checkpoint directory, as a worker's 'weights' start-up phase does.

    python tests/gpu/bench_loader.py DIR [--tp 2 --rank 0] [--runs 2]

Prints the load time and the checkpoint's bytes / time. Run it from another tree
(PYTHONPATH) to time that tree's loader on the same files."""
import argparse
import glob
import os
import time

import torch

from models.loader import load_model
from models.parallel import TPGroup

p = argparse.ArgumentParser()
p.add_argument("dir")
p.add_argument("--tp", type=int, default=2)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--runs", type=int, default=2)
args = p.parse_args()
nbytes = sum(os.path.getsize(f) for f in glob.glob(os.path.join(args.dir, "*.safetensors")))
torch.cuda.set_device(args.rank)
torch.empty(1, device="cuda")
for run in range(args.runs):
    t = time.perf_counter()
    model, _ = load_model(args.dir, tp=TPGroup(rank=args.rank, size=args.tp), device="cuda")
    torch.cuda.synchronize()
    took = time.perf_counter() - t
    print(f"load {run + 1}: {took:.2f} s, {nbytes / took / 1e9:.1f} GB/s of checkpoint "
          f"({nbytes / 1e9:.1f} GB, TP rank {args.rank} of {args.tp})", flush=True)
    del model
    torch.cuda.empty_cache()
