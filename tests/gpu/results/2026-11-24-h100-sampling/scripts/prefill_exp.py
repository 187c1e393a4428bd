"""One-off: where an offline prefill step's GPU time goes (8k tokens of U[100,1024] prompts),
and the paged prefill kernel's configs, with and without unmasked interior tiles."""
import collections, itertools, os, sys
sys.path[:0] = [".hx", "tests/gpu", "tests", "."]
import torch
from torch.profiler import ProfilerActivity, profile
from bench_decode_attention import gpu_time_ms
from kernels.kv_quant import quantize_ref
import kernels.paged_attention as pa
import pa_split
import paged_kv

g = torch.Generator().manual_seed(0)
lens = []
while True:
    n = int(torch.randint(100, 1025, (1,), generator=g))
    if sum(lens) + n > 8192:
        break
    lens.append(n)
T = sum(lens)
print(torch.cuda.get_device_name(), f"prefill of {len(lens)} prompts, {T} tokens")

if "model" in sys.argv:
    from kernels.attention import select_backend
    from models.loader import load_model
    from test_model_gpu import main_checkpoint
    model, _ = load_model(str(main_checkpoint()), dtype=torch.bfloat16, device="cuda",
                          attn_backend=select_backend("triton", "cuda"))
    kv = paged_kv.PagedKV(model, lens, block_size=256)
    pos, meta = kv.metadata([(i, 0, n) for i, n in enumerate(lens)])
    ids = torch.randint(0, 10000, (T,), generator=g).cuda()
    last = (meta.cu_seqlens_q[1:] - 1).long()
    step = lambda: model.compute_logits(model(ids, pos, meta).index_select(0, last))
    with torch.inference_mode():
        for _ in range(3): step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5): step()
            torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += 1; per[e.name][1] += e.device_time
    tot = sum(t for _, t in per.values()) / 5
    print(f"\nmodel prefill step: GPU busy {tot/1e3:.2f} ms ({T/tot*1e6/1e3:.0f}k tok/s)\n| kernel | calls | us/step | % |\n|---|---|---|---|")
    for name, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"| {name[:80]} | {c/5:.0f} | {t/5:.0f} | {100*t/5/tot:.1f} |")

page, hkv, hq, d = 256, 8, 16, 128
need = [-(-n // page) for n in lens]
nb = sum(need)
perm = torch.randperm(nb, generator=g).to(torch.int32)
table = torch.zeros(len(lens), max(need), dtype=torch.int32); s = 0
for i, n in enumerate(need):
    table[i, :n] = perm[s:s + n]; s += n
table = table.cuda()
k = torch.randn(nb, page, hkv, d, dtype=torch.bfloat16, device="cuda"); v = torch.randn_like(k)
q = torch.randn(T, hq, d, dtype=torch.bfloat16, device="cuda")
ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")
flops = sum(4 * n * (n + 1) / 2 * hq * d for n in lens)
cases = {"bf16": (paged_kv.head_major(k), paged_kv.head_major(v), None, None)}
kq, ks = quantize_ref(k.view(-1, hkv, d)); vq, vs = quantize_ref(v.view(-1, hkv, d))
cases["fp8"] = (paged_kv.head_major(kq.view(k.shape)), paged_kv.head_major(vq.view(k.shape)),
                ks.view(nb, page), vs.view(nb, page))
print(f"\n| kv | kernel | block_m | block_n | warps | stages | us | TFLOP/s | max abs diff vs default |\n|---|---|---|---|---|---|---|---|---|")
for kvname, (kc, vc, ksc, vsc) in cases.items():
    ref = pa.paged_prefill(q, kc, vc, table, ctx, cu, max(lens), d ** -0.5, k_scale=ksc, v_scale=vsc)
    grid = itertools.product((pa, pa_split), (64, 128), (32, 64, 128), (4, 8), (2, 3))
    if kvname == "fp8":
        grid = [(m, *c) for m in (pa, pa_split) for c in ((64, 64, 4, 2), (128, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2))]
    for mod, bm, bn, w, st in grid:
        cfg = mod.PrefillConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
        fn = lambda: mod.paged_prefill(q, kc, vc, table, ctx, cu, max(lens), d ** -0.5, k_scale=ksc, v_scale=vsc, config=cfg)
        try:
            out = fn(); err = float((out.float() - ref.float()).abs().max())
            us = gpu_time_ms(fn, reps=20) * 1e3
        except Exception as e:
            print(f"| {kvname} | {mod.__name__} | {bm} | {bn} | {w} | {st} | fail {type(e).__name__} | | |"); continue
        print(f"| {kvname} | {mod.__name__.split('.')[-1]} | {bm} | {bn} | {w} | {st} | {us:.1f} | {flops/us/1e6:.0f} | {err:.1e} |", flush=True)
try:
    from kernels.flash_attn_backend import flash_prefill
    kc, vc = cases["bf16"][:2]
    cuk = cu
    fn = lambda: flash_prefill(q, kc, vc, cu, cuk, max(lens), max(lens), table, d ** -0.5)
    ref = pa.paged_prefill(q, kc, vc, table, ctx, cu, max(lens), d ** -0.5)
    err = float((fn().float() - ref.float()).abs().max())
    us = gpu_time_ms(fn, reps=20) * 1e3
    print(f"| bf16 | flash-attn 2.8.3 varlen paged | | | | | {us:.1f} | {flops/us/1e6:.0f} | {err:.1e} |")
except Exception as e:
    print("flash-attn:", type(e).__name__, e)
