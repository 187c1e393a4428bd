"""Does torch's first symmetric-memory allocation need the GIL while it runs? (issue 49)

A TP worker allocates its peer-memory buffer (models/fast_all_reduce.allocate) in a thread
beside the weights load. This times that first `symm_mem.empty` in a thread while the main
thread either spins in Python (holding the GIL but for the interpreter's switches) or
copies 256 MiB host -> device in a loop (releasing it), and reports the allocation's time,
the main loop's longest stall and the copies' bandwidth.

    python tests/gpu/symm_mem_gil.py spin; python tests/gpu/symm_mem_gil.py copy
    python tests/gpu/symm_mem_gil.py spin 0.0001   # the interpreter's switch interval, s

A thread waiting for the GIL gets it at the holder's next switch (every 5 ms by default):
if the allocation takes the GIL thousands of times, a shorter interval shortens its wait.
"""
import sys
import threading
import time

import torch

dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
torch.empty(1, device=dev)
mode = sys.argv[1] if len(sys.argv) > 1 else "spin"
if len(sys.argv) > 2:
    sys.setswitchinterval(float(sys.argv[2]))
done, took = threading.Event(), []


def alloc() -> None:
    from torch.distributed import _symmetric_memory as symm_mem
    t = time.perf_counter()
    symm_mem.empty(8 << 20, dtype=torch.uint8, device=dev)
    took.append(time.perf_counter() - t)
    done.set()


host = torch.empty(256 << 20, dtype=torch.uint8)   # pageable, as the loader's tensors
gpu = torch.empty_like(host, device=dev)
threading.Thread(target=alloc, daemon=True).start()
t0 = last = time.perf_counter()
gap, n, copies = 0.0, 0, 0
while not done.is_set() or time.perf_counter() - t0 < 1:
    if mode == "copy":
        gpu.copy_(host)
        torch.cuda.synchronize()
        copies += 1
    now = time.perf_counter()
    gap, last, n = max(gap, now - last), now, n + 1
print(f"{mode} (switch {sys.getswitchinterval() * 1e3:g} ms): empty took {took[0]:.2f} s; main loop max gap {gap:.3f} s over {n} iterations "
      f"in {last - t0:.2f} s; {copies * 0.25 / (last - t0):.1f} GB/s of H2D")
