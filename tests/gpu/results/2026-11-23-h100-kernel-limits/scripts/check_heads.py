import os
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
from kernels.paged_attention import paged_decode
from kernels.kv_quant import quantize_ref
from tests import paged_kv
import importlib.util, sys
sys.path.insert(0, os.path.dirname(__file__))
from decode_heads import decode_heads

torch.manual_seed(0)
dev = "cpu"
for fp8 in (False, True):
    for heads, bn in ((2, 32), (4, 64), (2, 64), (8,128)):
        B, hkv, g, d, page = 5, 8, 2, 128, 64
        ctx = torch.tensor([1, 170, 65, 0, 129], dtype=torch.int32)
        need = (ctx + page - 1) // page
        nb = int(need.sum()) + 2
        perm = torch.randperm(nb).to(torch.int32)
        table = torch.zeros(B, int(need.max()), dtype=torch.int32); s = 0
        for i, n in enumerate(need.tolist()):
            table[i, :n] = perm[s:s+n]; s += n
        dtype = torch.float32
        k = torch.randn(nb, page, hkv, d, dtype=dtype); v = torch.randn_like(k)
        q = torch.randn(B, hkv * g, d, dtype=dtype)
        kw = {}
        if fp8:
            kq, ks = quantize_ref(k.view(-1, hkv, d)); vq, vs = quantize_ref(v.view(-1, hkv, d))
            k, v = kq.view(k.shape), vq.view(v.shape)
            kw = dict(k_scale=ks.view(nb, page), v_scale=vs.view(nb, page))
        k, v = paged_kv.head_major(k), paged_kv.head_major(v)
        ref = paged_decode(q, k, v, table, ctx, d ** -0.5, **kw)
        out = decode_heads(q, k, v, table, ctx, d ** -0.5, heads=heads, block_n=bn, **kw)
        err = (out - ref).abs().max().item()
        print("fp8" if fp8 else "fp32", heads, bn, err)
        assert err < 1e-3, err
