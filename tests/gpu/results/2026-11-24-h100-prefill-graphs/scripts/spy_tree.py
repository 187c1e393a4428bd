"""py-spy every process under the given root pids for D seconds (experiment helper).
usage: spy_tree.py OUTDIR TAG DURATION PID [PID ...]"""
import os, subprocess, sys
sys.path.insert(0, os.path.dirname(__file__))
from cpu_util import tree, name, cpu

out, tag, dur = sys.argv[1], sys.argv[2], sys.argv[3]
pids = [p for root in sys.argv[4:] for p in tree(int(root)) if "resource_tracker" not in name(p)]
spy = os.path.join(os.path.dirname(__file__), "py-spy")
c0 = {p: cpu(p) for p in pids}
procs = [subprocess.Popen([spy, "record", "-p", str(p), "-d", dur, "-r", "200", "-f", "raw", "--nonblocking",
                           "--threads", "-o", f"{out}/{tag}_{i}.txt"], stdout=subprocess.DEVNULL,
                          stderr=open(f"{out}/{tag}_{i}.err", "w")) for i, p in enumerate(pids)]
for pr in procs:
    pr.wait()
for i, p in enumerate(pids):
    print(f"{tag}_{i} pid {p} cpu {cpu(p) - c0[p]:.2f}s over {dur}s: {name(p)[:80]}")
