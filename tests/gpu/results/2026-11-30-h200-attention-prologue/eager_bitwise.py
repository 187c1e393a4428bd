"""Diagnostic: decode steps (argv[3] rows) of the random 0.6B with a kernel_choice knob (argv[2]) off vs on, bitwise, per layer."""
import sys, torch
from kernels.attention import select_backend
from models.loader import load_model
from models import kernel_choice
from paged_kv import PagedKV
path, knob, nrows = sys.argv[1], sys.argv[2], int(sys.argv[3])
model, _ = load_model(path, dtype=torch.bfloat16, device="cuda", attn_backend=select_backend("triton", "cuda", kv_fp8=False))
layers = model.model.layers
gen = torch.Generator().manual_seed(3)
prompt = torch.randint(0, 300, (256 + 24,), generator=gen)
caps = []
hooks = [l.register_forward_hook(lambda m, a, out, i=i: caps.append((i, out[0].clone(), out[1].clone()))) for i, l in enumerate(layers)]
def run(on):
    setattr(kernel_choice, knob, on)
    kv = PagedKV(model, [len(prompt)] * nrows, block_size=256)
    out, per = [], []
    with torch.inference_mode():
        pos, meta = kv.metadata([(i, 0, 256) for i in range(nrows)])
        model.compute_logits(model(torch.cat([prompt[:256]] * nrows).cuda(), pos, meta))
        for s in range(256, len(prompt)):
            caps.clear()
            pos, meta = kv.metadata([(i, s, s + 1) for i in range(nrows)], is_decode=True)
            out.append(model.compute_logits(model(torch.stack([prompt[s]] * nrows).cuda(), pos, meta)).float())
            per.append(list(caps))
    return out, per
a, pa = run(False); a2, _ = run(False); b, pb = run(True); b2, _ = run(True)
print("off twice equal:", all(torch.equal(x, y) for x, y in zip(a, a2)), " on twice equal:", all(torch.equal(x, y) for x, y in zip(b, b2)))
for s, (x, y) in enumerate(zip(a, b)):
    d = (x - y).abs().max().item()
    print(f"step {s}: max |logit diff| {d:.3g}  argmax {x.argmax(-1).tolist()} {y.argmax(-1).tolist()}")
    if d and s < 3:
        for (i, h0, r0), (_, h1, r1) in zip(pa[s], pb[s]):
            print(f"   layer {i}: mlp out diff {(h0.float()-h1.float()).abs().max().item():.3g} ({(h0 != h1).sum().item()} elems)  residual diff {(r0.float()-r1.float()).abs().max().item():.3g} ({(r0 != r1).sum().item()})")
