"""Where --deterministic stops being batch-invariant on this device, with the scenarios of
tests/test_deterministic.py (its tiny float32 checkpoint, its Stepper):

1. every scenario's logits against the sequence alone, eager and with CUDA graphs: which
   steps differ in which mode;
2. eager, for each scenario that differs: every module's output for the watched row,
   compared (torch.equal) in the order the modules ran, step by step from the last step
   back (a prefill step's rows against the same prompt positions alone); prints the first
   modules that differ;
3. on CUDA, the sequence alone replayed from CUDA graphs against the same steps eager (and
   the K/V it left in the cache, layer by layer: the fused q/k norm + rotary + store runs
   inside the attention module),
   module by module: hooks registered before the capture clone each module's output
   inside the graph, so every replay refreshes those copies.

    NANOSERVE_GPU_TESTS=1 python tests/gpu/find_variance.py [SCENARIO ...]
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

# each step of the watched sequence: (its first row in the step, its rows, [(module, output)])
Trace = list[tuple[int, int, list[tuple[str, torch.Tensor]]]]


class Captured:
    """Module outputs cloned inside each captured graph, by (kind, bucket), and which graph
    the last step replayed: set up before the runner captures (patches the graph classes)."""

    def __init__(self) -> None:
        import worker_service.cuda_graphs as cg
        self.outs: dict[tuple[str, int], list[tuple[str, torch.Tensor]]] = {}
        self.label: tuple[str, int] | None = None     # the graph being captured
        self.replayed: tuple[str, int] | None = None  # the last one loaded for a replay
        me = self
        for cls, kind, fwd in ((cg.DecodeGraphs, "decode", "_forward"),
                               (cg.PrefillGraphs, "prefill", "forward")):
            def forward(self, bucket, _f=getattr(cls, fwd), _k=kind):
                me.label = (_k, bucket)
                return _f(self, bucket)

            def load(self, *a, _f=cls.load, _k=kind, **k):
                bucket = _f(self, *a, **k)
                me.replayed = (_k, bucket)
                return bucket
            setattr(cls, fwd, forward)
            cls.load = load

    def hook(self, name: str, t) -> None:
        """Keep a capture's output; eager ones are not ours."""
        if isinstance(t, torch.Tensor) and torch.cuda.is_current_stream_capturing():
            self.outs.setdefault(self.label, []).append((name, t.detach().clone()))


def runner(path: str, eager: bool, captured: Captured | None = None):
    from test_deterministic import BS, GPU_LIMITS, SPLIT_LEN
    from triton_device import DEVICE
    from worker_service.model_runner import ModelRunner, RunnerConfig
    r = ModelRunner(RunnerConfig(model_dir=path, device=DEVICE, dtype="float32",
                                 attention_backend="auto", kv_cache_gb=0.01, max_model_len=256,
                                 deterministic=True, enforce_eager=eager, **GPU_LIMITS))
    if captured is not None:
        for name, m in r.model.named_modules():
            def keep(_m, _i, out, name=name or "model") -> None:   # (None: output kept)
                captured.hook(name, out[0] if isinstance(out, tuple) else out)
            m.register_forward_hook(keep)
    r.backend.split_len = SPLIT_LEN   # before init_kv: CUDA graphs freeze it at capture
    r.init_kv(96, BS)
    return r


def logits_check(r, names: list[str], label: str) -> list[str]:
    """The test's own comparison: which steps differ, per scenario."""
    from test_deterministic import SCENARIOS, alone
    ref, bad = alone(r), []
    for name in names:
        got = SCENARIOS[name](r)
        diff = [i for i, (x, y) in enumerate(zip(ref, got)) if not torch.equal(x, y)]
        d = max(((ref[i] - got[i]).abs().max().item() for i in diff), default=0.0)
        print(f"  {label:6s} {name:16s} {'steps ' + str(diff) + f' differ, max |d| {d:.3g}' if diff else 'equal'}")
        if diff:
            bad.append(name)
    return bad


def traced(r, scenario, captured: Captured | None = None) -> Trace:
    """Run a scenario with every module hooked; keep the watched row's slice of each
    module output that has one row per token of the step. With `captured` (a runner with
    graphs), a step that replayed a graph reads that graph's copies instead."""
    import test_deterministic as td
    seen: list[tuple[str, torch.Tensor]] = []
    handles = []
    for name, m in r.model.named_modules():
        def f(_m, _i, out, name=name or "model"):
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor):
                seen.append((name, t.detach().clone()))
        handles.append(m.register_forward_hook(f))
    trace: Trace = []
    call = td.Stepper.__call__

    def hooked(self, prefills=(), decodes=(), drop=()):
        first, n, pos = None, 0, 0
        for sid, toks, _s, _t in prefills:
            if sid == td.T:
                first, n = pos, len(toks)
            pos += len(toks)
        for i, (sid, _tok) in enumerate(decodes):
            if sid == td.T:
                first, n = pos + i, 1
        rows = pos + len(decodes)
        seen.clear()
        if captured is not None:
            captured.replayed = None
        out = call(self, prefills, decodes, drop)
        step = seen
        if captured is not None and captured.replayed is not None:
            kind, rows = captured.replayed   # (a replay's rows: the step's, then padding)
            step = captured.outs[captured.replayed]
        if first is not None:
            mods = [(nm, t[first:first + n].clone()) for nm, t in step
                    if t.dim() and t.shape[0] == rows]
            trace.append((first, n, mods + [("logits", out[td.T][None])]))
        return out

    td.Stepper.__call__ = hooked
    try:
        scenario(r)
    finally:
        td.Stepper.__call__ = call
        for h in handles:
            h.remove()
    return trace


def modules_check(r, names: list[str], graphs=None, captured: Captured | None = None) -> None:
    """Each scenario against the sequence alone, eager; with `graphs`: the sequence alone
    replayed against it eager."""
    from test_deterministic import SCENARIOS, alone
    ref = traced(r, alone)
    runs = ([("alone replayed from graphs", traced(graphs, alone, captured))] if graphs
            else [(f"{name} (eager)", traced(r, SCENARIOS[name])) for name in names])
    if graphs:
        kv_check(r, graphs)
    for label, got in runs:
        print(f"== {label}: modules, from the last step back")
        for back, ((_f, n_ref, a_mods), (first, n, b_mods)) in enumerate(zip(ref[::-1], got[::-1])):
            if n > n_ref:
                break   # (a re-prefill of decoded tokens: no step alone to compare with)
            bad = 0
            theirs = dict(b_mods)   # (a module with rows only where they sample: one side)
            for na, a in a_mods:
                if na not in theirs:
                    continue
                a, b = a[-n:], theirs[na]   # a prefill's last n positions: the same prompt positions
                if not torch.equal(a, b):
                    print(f"  step -{back + 1} (row {first}, {n} rows) {na}: "
                          f"max |d| {(a - b).abs().max().item():.3g} {tuple(a.shape)}")
                    bad += 1
                    if bad == 4:
                        break
            if not bad:
                print(f"  step -{back + 1} (row {first}, {n} rows): every module equal")


def kv_check(eager, graphs) -> None:
    """The sequence alone left its K/V in the same blocks of both runners (Blocks(0)):
    the first layer whose cached K or V differ (the fused q/k norm + rotary + store runs
    inside the attention module, so the hooks cannot see it apart)."""
    from test_deterministic import BS, PROMPT_LEN, Blocks
    blocks = Blocks(0).take(PROMPT_LEN + 3)
    n = PROMPT_LEN + 3
    for i, (a, b) in enumerate(zip(eager.attn_layers, graphs.attn_layers)):
        for name in ("k_cache", "v_cache"):
            x = getattr(a, name)[blocks].flatten(0, 1)[:n]
            y = getattr(b, name)[blocks].flatten(0, 1)[:n]
            if not torch.equal(x, y):
                rows = (x != y).flatten(1).any(1).nonzero().flatten().tolist()
                print(f"== KV: layer {i} {name} differs at positions {rows[:8]}{'...' if len(rows) > 8 else ''}"
                      f" (max |d| {(x.float() - y.float()).abs().max().item():.3g}; block size {BS})")
                return
    print("== KV: every layer's cached K and V equal (a difference is the attention kernel's)")


def main() -> None:
    from test_deterministic import SCENARIOS
    from tiny_checkpoint import make_tiny_qwen3
    path = tempfile.mkdtemp()
    make_tiny_qwen3(path)
    names = sys.argv[1:] or [n for n in SCENARIOS if n != "verify_rows"]
    eager = runner(path, eager=True)
    print("== logits against the sequence alone")
    bad = logits_check(eager, names, "eager")
    if bad or eager.device.type != "cuda":
        modules_check(eager, bad or names[:1])
    if eager.device.type == "cuda":
        captured = Captured()
        graphs = runner(path, eager=False, captured=captured)
        logits_check(graphs, names, "graphs")
        modules_check(eager, names, graphs, captured)


if __name__ == "__main__":
    main()
