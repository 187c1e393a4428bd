"""Decode step graph replay ms with / without L2 weight prefetch (batch 131, U[100,1024])."""
import os, sys, statistics
sys.path.insert(0, "tests/gpu"); sys.path.insert(0, "tests"); sys.path.insert(0, os.path.dirname(__file__))
import torch
import models.activation
from kernels.attention import select_backend
from models.loader import load_model
from paged_kv import PagedKV
from test_model_gpu import main_checkpoint
from profile_decode import _graph_step_ms
from l2_prefetch import l2_prefetch
from models.qwen3 import kv_cache_layers

model, _ = load_model(str(main_checkpoint()), dtype=torch.bfloat16, device="cuda",
                      attn_backend=select_backend("triton", "cuda"))
layers = model.model.layers
g = torch.Generator().manual_seed(0)
batch = int(os.environ.get("BATCH", "131"))
ctx = torch.randint(100, 1025, (batch,), generator=g).tolist()
ids = torch.randint(0, 10000, (batch,), generator=g).cuda()
MODE = {"v": None}
orig = [l.self_attn.attn.forward for l in layers]
for i, l in enumerate(layers):
    nxt = layers[i + 1].self_attn.qkv_proj.weight if i + 1 < len(layers) else model.lm_head.weight
    ws = [l.self_attn.o_proj.weight, l.mlp.gate_up_proj.weight, l.mlp.down_proj.weight, nxt]
    def fwd(*a, _o=orig[i], _ws=ws, **k):
        if MODE["v"] is not None:
            m, which = MODE["v"]
            l2_prefetch(_ws if which == "all" else _ws[:3], mode=m)
        return _o(*a, **k)
    l.self_attn.attn.forward = fwd
x = torch.ones(1 << 28, dtype=torch.bfloat16, device="cuda")
for _ in range(30): x.sum()
print("| kv | variant | graph ms/step (5 x 50 replays: min / median / max) |\n|---|---|---|")
for fp8 in (True, False):
    kv = PagedKV(model, ctx, block_size=256, fp8=fp8)
    if fp8:
        kv.kv.copy_(torch.randn(kv.kv.shape, device="cuda").to(kv.kv.dtype)); kv.scales.fill_(1.0)
    else:
        kv.kv.normal_()
    pos, meta = kv.metadata([(i, n - 1, n) for i, n in enumerate(ctx)], is_decode=True)
    models.activation.FUSED = True
    def step():
        return model.compute_logits(model(ids, pos, meta))
    res = {}
    variants = [None, (2, "all"), (3, "all"), (2, "3")]
    for rep in range(5):
        for v in variants:
            MODE["v"] = v
            res.setdefault(v, []).append(_graph_step_ms(step))
    MODE["v"] = None
    base = step()
    MODE["v"] = (2, "all"); again = step(); MODE["v"] = None
    assert torch.equal(base, again)
    for v, t in res.items():
        print(f"| {'fp8' if fp8 else 'bf16'} | {v} | {min(t):.3f} / {statistics.median(t):.3f} / {max(t):.3f} |", flush=True)
    del kv
