import os, sys
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
sys.path.insert(0, os.path.dirname(__file__))
from paged_attention_tma import decode_tma
from kernels.paged_attention import paged_decode
from kernels.kv_quant import quantize_ref
from tests import paged_kv
torch.manual_seed(0)
B, hkv, g, d, page = 5, 8, 2, 128, 64
ctx = torch.tensor([1, 170, 64, 0, 129], dtype=torch.int32)
need = (ctx + page - 1) // page
nb = int(need.sum()) + 2
perm = torch.randperm(nb).to(torch.int32)
table = torch.zeros(B, max(1, int(need.max())), dtype=torch.int32); s = 0
for i, n in enumerate(need.tolist()):
    table[i, :n] = perm[s:s+n]; s += n
k = torch.randn(nb, page, hkv, d); v = torch.randn_like(k)
q = torch.randn(B, hkv * g, d, dtype=torch.bfloat16)
kq, ks = quantize_ref(k.view(-1, hkv, d)); vq, vs = quantize_ref(v.view(-1, hkv, d))
kq, vq = paged_kv.head_major(kq.view(k.shape)), paged_kv.head_major(vq.view(v.shape))
for i, n in enumerate(ctx.tolist()):   # NaN bytes in the slots past each context
    if n % page:
        last = table[i, n // page]
        kq.view(torch.uint8)[last, n % page:] = 0x7F
        vq.view(torch.uint8)[last, n % page:] = 0x7F
ks, vs = ks.view(nb, page), vs.view(nb, page)
for i, n in enumerate(ctx.tolist()):   # and NaN scales there (the interpreter widens 0x7F finitely)
    if n % page:
        ks[table[i, n // page], n % page:] = float("nan")
        vs[table[i, n // page], n % page:] = float("nan")
ref = paged_decode(q, kq, vq, table, ctx, d ** -0.5, k_scale=ks, v_scale=vs)
for bn in (32, 64):
    out = decode_tma(q, kq, vq, table, ctx, d ** -0.5, ks, vs, block_n=bn)
    err = (out.float() - ref.float()).abs().max().item()
    print(bn, err)
    assert err < 2e-2, err

# bf16 cache
kb, vb = paged_kv.head_major(k.to(torch.bfloat16)), paged_kv.head_major(v.to(torch.bfloat16))
for i, n in enumerate(ctx.tolist()):
    if n % page:
        vb[table[i, n // page], n % page:] = float("nan")
        kb[table[i, n // page], n % page:] = float("nan")
ref = paged_decode(q, kb, vb, table, ctx, d ** -0.5)
for bn in (32, 64):
    out = decode_tma(q, kb, vb, table, ctx, d ** -0.5, block_n=bn)
    err = (out.float() - ref.float()).abs().max().item()
    print("bf16", bn, err)
    assert err < 2e-2, err
