"""Diagnostic: one-row decode steps of the random 0.6B with the norms in the GEMVs vs without, bitwise, per layer."""
import sys, torch
from kernels.attention import select_backend
from models.loader import load_model
from models import kernel_choice
from paged_kv import PagedKV
path = sys.argv[1]
model, _ = load_model(path, dtype=torch.bfloat16, device="cuda", attn_backend=select_backend("triton", "cuda", kv_fp8=False))
layers = model.model.layers
gen = torch.Generator().manual_seed(3)
prompt = torch.randint(0, 300, (256 + 24,), generator=gen)
caps = []
hooks = [l.register_forward_hook(lambda m, a, out, i=i: caps.append((i, out[0].clone(), out[1].clone()))) for i, l in enumerate(layers)]
def run(on):
    kernel_choice.NORM_IN_GEMV = on
    kv = PagedKV(model, [len(prompt)], block_size=256)
    out, per = [], []
    with torch.inference_mode():
        pos, meta = kv.metadata([(0, 0, 256)])
        model.compute_logits(model(prompt[:256].cuda(), pos, meta))
        for s in range(256, len(prompt)):
            caps.clear()
            pos, meta = kv.metadata([(0, s, s + 1)], is_decode=True)
            out.append(model.compute_logits(model(prompt[s:s + 1].cuda(), pos, meta)).float())
            per.append(list(caps))
    return out, per
a, pa = run(False); a2, _ = run(False); b, pb = run(True); b2, _ = run(True)
print("off twice equal:", all(torch.equal(x, y) for x, y in zip(a, a2)), " on twice equal:", all(torch.equal(x, y) for x, y in zip(b, b2)))
for s, (x, y) in enumerate(zip(a, b)):
    d = (x - y).abs().max().item()
    print(f"step {s}: max |logit diff| {d:.3g}  argmax {x.argmax().item()} {y.argmax().item()}")
    if d and s < 3:
        for (i, h0, r0), (_, h1, r1) in zip(pa[s], pb[s]):
            print(f"   layer {i}: mlp out diff {(h0.float()-h1.float()).abs().max().item():.3g} ({(h0 != h1).sum().item()} elems)  residual diff {(r0.float()-r1.float()).abs().max().item():.3g} ({(r0 != r1).sum().item()})")
# the norm alone on a real layer input, CUDA: rms_norm then gemv vs GemvNorm
from kernels.gemv import gemv, GemvNorm
from kernels.rmsnorm import rms_norm
l0 = layers[1]
_, h, r = pa[0][0]
w = l0.self_attn.qkv_proj.weight
nw = l0.input_layernorm.weight
n1, s1 = rms_norm(h, nw, l0.input_layernorm.eps, r.clone())
ro = torch.empty_like(r)
y1 = gemv(n1, w); y2 = gemv(h, w, norm=GemvNorm(nw, l0.input_layernorm.eps, r.clone(), ro))
print("kernel level (layer 1 qkv, real inputs): gemv equal", torch.equal(y1, y2), " sum equal", torch.equal(s1, ro),
      " max diff", (y1.float() - y2.float()).abs().max().item())
# rstd: the norm kernel vs torch-like fp32
