"""One decode launch at batch B (fp8 or bf16) for ncu to profile (argv: kv batch lo hi)."""
import sys
import torch
from kernels.paged_attention import paged_decode
from tests.gpu.bench_decode_attention import make_case

kv, batch, lo, hi = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
c = make_case(batch, lo, hi, 16, 8, fp8=kv == "fp8")
for _ in range(3):
    paged_decode(c["q"], c["k"], c["v"], c["table"], c["ctx"], c["scale"],
                 k_scale=c.get("k_scale"), v_scale=c.get("v_scale"))
torch.cuda.synchronize()
