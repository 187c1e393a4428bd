"""CPU seconds per process of the null stack during bench runs (experiment helper)."""
import os, subprocess, sys, time
sys.path.insert(0, os.getcwd())
from client.null_stack import NullStack

TCK = os.sysconf("SC_CLK_TCK")

def tree(pid):
    out = [pid]
    try:
        kids = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except FileNotFoundError:
        kids = []
    for k in kids:
        out += tree(int(k))
    return out

def cpu(pid):
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / TCK
    except FileNotFoundError:
        return 0.0

def name(pid):
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:90]
    except FileNotFoundError:
        return "?"

