"""Where --deterministic stops being batch-invariant on this device: one prompt prefilled
alone, then beside a neighbour and in two chunks, every module's output for the prompt's
rows compared (torch.equal) in the order the modules ran; prints the first that differ.
The tiny float32 checkpoint of tests/test_deterministic.py, eager, or with --graphs CUDA
graphs as the test's runner captures them.

    NANOSERVE_GPU_TESTS=1 python tests/gpu/find_variance.py [--graphs]
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))


def main() -> None:
    from test_deterministic import (BS, GPU_LIMITS, PROMPT_LEN, SPLIT_LEN, Blocks, Stepper,
                                    tokens, watched)
    from tiny_checkpoint import make_tiny_qwen3
    from triton_device import DEVICE
    from worker_service.model_runner import ModelRunner, RunnerConfig
    path = tempfile.mkdtemp()
    make_tiny_qwen3(path)
    r = ModelRunner(RunnerConfig(model_dir=path, device=DEVICE, dtype="float32",
                                 attention_backend="auto", kv_cache_gb=0.01, max_model_len=256,
                                 deterministic=True, enforce_eager="--graphs" not in sys.argv,
                                 **GPU_LIMITS))
    r.init_kv(96, BS)
    r.backend.split_len = SPLIT_LEN
    seen: list[tuple[str, torch.Tensor]] = []

    def hook(name):
        def f(_m, _i, out):
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor):
                seen.append((name, t.detach().clone()))
        return f

    for name, m in r.model.named_modules():
        m.register_forward_hook(hook(name or "model"))
    prompt, _ = watched(r.vocab_size)
    gen = torch.Generator().manual_seed(3)

    def run(steps) -> list[tuple[str, torch.Tensor]]:
        s, blocks = Stepper(r), Blocks(0)
        table = blocks.take(PROMPT_LEN + 3)
        out = []
        for prefills in steps(table, blocks):
            seen.clear()
            logits = s(prefills=prefills)[1]
            out.append(list(seen) + [("logits", logits)])
        s.forget_all()
        return out

    alone = run(lambda t, b: [[(1, prompt, 0, t)]])[0]
    other = tokens(gen, 37, r.vocab_size)
    beside = run(lambda t, b: [[(1, prompt, 0, t), (2, other, 0, b.take(40))]])[0]
    after = run(lambda t, b: [[(2, other, 0, b.take(40)), (1, prompt, 0, t)]])[0]
    # 80 + 60 tokens: past GPU_LIMITS' 128-token prefill graphs, so under --graphs the
    # prompt alone replays a graph and beside this neighbour runs eager
    longer = tokens(gen, 60, r.vocab_size)
    eager = run(lambda t, b: [[(1, prompt, 0, t), (2, longer, 0, b.take(64))]])[0]
    chunks = run(lambda t, b: [[(1, prompt[:16], 0, t)], [(1, prompt[16:], 16, None)]])[1]
    whole, n = slice(0, PROMPT_LEN), PROMPT_LEN - 16
    # (label, its trace, the prompt's rows in the trace alone, the same rows in this one)
    for label, got, mine, theirs in (
            ("beside a 37-token prompt", beside, whole, whole),
            ("after a 37-token prompt", after, whole, slice(37, 37 + PROMPT_LEN)),
            ("beside a 60-token prompt", eager, whole, whole),
            ("second of two chunks (16 + 64)", chunks, slice(16, PROMPT_LEN), slice(0, n))):
        print(f"== {label}")
        ref = alone
        if len(ref) != len(got):   # (graphs: a step that replayed one ran no hooks)
            ref, got = ref[-1:], got[-1:]
        bad = 0
        for (name, a), (other_name, b) in zip(ref, got):
            assert name == other_name, (name, other_name)
            if name == "logits":   # (under CUDA graphs the hooks see only the capture)
                print(f"  the prompt's last logits {'equal' if torch.equal(a, b) else 'DIFFER'}")
                continue
            if a.dim() == 0 or a.shape[0] != PROMPT_LEN or b.shape[0] < theirs.stop:
                continue
            if not torch.equal(a[mine], b[theirs]):
                print(f"  {name}: max |d| {(a[mine] - b[theirs]).abs().max().item():.3g} "
                      f"{tuple(a.shape)}")
                bad += 1
                if bad == 6:
                    break
        if not bad:
            print("  every module's output equal")

if __name__ == "__main__":
    main()
