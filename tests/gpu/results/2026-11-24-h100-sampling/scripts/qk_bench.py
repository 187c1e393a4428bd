"""One-off: the fused q/k norm + rotary (+ KV store) kernel, one program a token (HEAD) vs two."""
import sys
sys.path[:0] = [".hx", "tests/gpu", "tests", "."]
import torch
from bench_decode_attention import gpu_time_ms
import qk_old
from kernels import qk_norm_rotary as new
from kernels.attention import new_kv_cache
from kernels.kv_quant import FP8_DTYPE
print(torch.cuda.get_device_name())
print("| tokens | kv | one program a token, us | two, us | max diff q | max diff cache |\n|---|---|---|---|---|---|")
for T in (131, 256, 7929):
    for fp8 in (False, True):
        g = torch.Generator(device="cuda").manual_seed(0)
        qkv = torch.randn(T, (16 + 8 + 8) * 128, device="cuda", generator=g).bfloat16()
        w = torch.rand(2, 128, device="cuda", generator=g).bfloat16() + 0.5
        pos = torch.randint(0, 4000, (T,), device="cuda", generator=g)
        cs = torch.randn(4096, 128, device="cuda", generator=g)
        nb = T // 256 + 4
        res = {}
        slots = torch.randperm(nb * 256, device="cuda", generator=g)[:T].int()
        for name, mod in (("old", qk_old), ("new", new)):
            cache = new_kv_cache(1, nb, 256, 8, 128, torch.bfloat16, "cuda").zero_()
            if fp8:
                cache = cache.to(FP8_DTYPE)
            scales = torch.zeros(2, nb, 256, device="cuda") if fp8 else None
            x = qkv.clone()
            q, k, v = x[:, :2048].view(T, 16, 128), x[:, 2048:3072].view(T, 8, 128), x[:, 3072:].view(T, 8, 128)
            kw = dict(v=v, k_cache=cache[0, 0], v_cache=cache[1, 0], slot_mapping=slots,
                      k_scale=scales[0] if fp8 else None, v_scale=scales[1] if fp8 else None)
            mod.qk_norm_rotary(q, k, w[0], w[1], 1e-6, pos, cs, **kw)
            res[name] = (x.clone(), cache.float().clone())
            x.copy_(qkv)
            res[name + "_us"] = gpu_time_ms(lambda: mod.qk_norm_rotary(q, k, w[0], w[1], 1e-6, pos, cs, **kw)) * 1e3
        dq = float((res["old"][0].float() - res["new"][0].float()).abs().max())
        dc = float((res["old"][1] - res["new"][1]).abs().max())
        print(f"| {T} | {'fp8' if fp8 else 'bf16'} | {res['old_us']:.1f} | {res['new_us']:.1f} | {dq:.1e} | {dc:.1e} |")
