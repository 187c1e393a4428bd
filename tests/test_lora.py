"""Multi-LoRA serving against Hugging Face transformers + PEFT (the reference).

Three random PEFT adapters (non-zero B) of different ranks, modules and scalings on a tiny
Qwen3: our model's logits with each adapter equal PEFT's, a batch mixing the adapters and
the base equals each served alone, and through the real services (worker with two slots
for three adapters: LRU swaps) greedy tokens equal PEFT's generate, over gRPC and the
OpenAI API (the `openai` SDK picks an adapter by model name). A mutation that gives a row
its neighbour's adapter must fail the comparison.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
import json
import os
import shutil
import signal

import grpc
import numpy as np
import pytest
import torch
import transformers

from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import free_port, named_children, start_scheduler, start_worker, wait_until
from tiny_checkpoint import tiny_qwen3_dir

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {   # name: (rank, alpha, modules, rsLoRA)
    "all8": (8, 16, ALL, False),
    "qv4": (4, 8, ["q_proj", "v_proj"], True),
    "mlp16": (16, 8, ["o_proj", "gate_proj", "down_proj"], False),
}
MAX_RANK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen3_dir(tmp_path_factory, vocab_size=389, num_layers=2, seed=5)


def _base(model_dir):
    return transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """name -> (directory, the PEFT model serving it); the directories share one parent, the
    services' --adapter-root below."""
    out = {}
    root = tmp_path_factory.mktemp("adapters")
    for i, (name, (r, alpha, modules, rs)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=modules, use_rslora=rs,
                              init_lora_weights=False, lora_dropout=0.0)
        model = peft.get_peft_model(_base(model_dir), cfg).eval()
        path = root / name
        model.save_pretrained(path)
        out[name] = (path, model)
    return out


@torch.no_grad()
def peft_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(n):
        ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


# ---- the model with adapters in slots, in-process ------------------------------------------

def _runner(model_dir, adapters, max_loras):
    from nanoserve.v1 import worker_pb2
    from worker_service.model_runner import ModelRunner, RunnerConfig
    runner = ModelRunner(RunnerConfig(str(model_dir), device="cpu", dtype="float32",
                                      kv_cache_gb=0.01, max_loras=max_loras, max_lora_rank=MAX_RANK))
    runner.adapters.set_adapters([worker_pb2.Adapter(id=i + 1, name=n, path=str(adapters[n][0]))
                                  for i, n in enumerate(ADAPTERS)])
    runner.init_kv(64, 8)
    return runner


def _prefill_logits(runner, prompts: list[list[int]], adapter_ids: list[int], step_id=1):
    """Last-token logits of a one-step prefill of every prompt (rows = prompts)."""
    from kernels.attention import AttentionMetadata
    from nanoserve.v1 import worker_pb2
    req = worker_pb2.StepRequest(step_id=step_id)
    blocks = 0
    for i, (p, a) in enumerate(zip(prompts, adapter_ids)):
        n = -(-len(p) // 8)
        req.seqs.add(seq_id=step_id * 100 + i, num_tokens=len(p), start_pos=0, sample=True,
                     reset_block_table=True, adapter_id=a,
                     block_table_i32=np.arange(blocks, blocks + n, dtype="<i4").tobytes())
        blocks += n
    req.token_ids_i32 = np.array([t for p in prompts for t in p], "<i4").tobytes()
    plan = runner.table.plan(req)
    with torch.inference_mode():
        logits = runner.forward(plan).out
    runner.table.commit(plan)
    return logits


def test_logits_equal_peft_mixed_batch(model_dir, adapters):
    """One prefill step mixing the base and three adapters (two slots would not hold them:
    four slots here) gives each row PEFT's logits for its adapter; a row given its
    neighbour's adapter does not."""
    runner = _runner(model_dir, adapters, max_loras=4)
    base = _base(model_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 389, (n,), generator=gen).tolist() for n in (13, 7, 21, 9)]
    ids = [0, 1, 2, 3]   # base, all8, qv4, mlp16
    got = _prefill_logits(runner, prompts, ids)
    refs = [base] + [adapters[n][1] for n in ADAPTERS]
    with torch.no_grad():
        want = [m(input_ids=torch.tensor([p])).logits[0, -1] for m, p in zip(refs, prompts)]
    for i in range(4):
        torch.testing.assert_close(got[i], want[i], rtol=1e-4, atol=1e-4)
        if i:   # the adapter changes the logits (so the check above can fail)
            with torch.no_grad():
                plain = base(input_ids=torch.tensor([prompts[i]])).logits[0, -1]
            assert (want[i] - plain).abs().max() > 1e-2
    # mutation: every row's neighbour's adapter
    shifted = _prefill_logits(runner, prompts, ids[1:] + ids[:1], step_id=2)
    for i in range(4):
        assert (shifted[i] - want[i]).abs().max() > 1e-3


def test_one_token_through_the_gemv_equals_peft(model_dir, adapters, monkeypatch):
    """One token per step (batch-1 decode's shape) on the Triton kernels (interpreter):
    every layer's GEMV adds the adapter's delta in its epilogue (kernels/gemv.py GemvLora)
    after the shrink; logits equal PEFT's for each adapter and the base."""
    import kernels.gemv
    from models.lora import LoraSlots
    monkeypatch.setattr(kernels.gemv, "ON_CPU", True)
    monkeypatch.setattr(LoraSlots, "use_kernels", True)
    fused = []
    real = kernels.gemv._gemv_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                fused.append(kw["HAS_LORA"])
                return real[grid](*a, **kw)
            return launch
    monkeypatch.setattr(kernels.gemv, "_gemv_kernel", Spy())
    runner = _runner(model_dir, adapters, max_loras=4)
    refs = [_base(model_dir)] + [adapters[n][1] for n in ADAPTERS]
    for step, (aid, model) in enumerate(zip([0, 1, 2, 3], refs)):
        prompt = [17 + 31 * step]
        got = _prefill_logits(runner, [prompt], [aid], step_id=step + 1)[0]
        with torch.no_grad():
            want = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert sum(fused) >= 3 * 2   # the adapters' layers (2 decoder layers) took the epilogue


def test_lru_swap_keeps_results(model_dir, adapters, tmp_path_factory):
    """Two slots, five adapters used in turn, two at a time: every step loads what it
    lacks, evicting the least recently used adapter the step does not use, and each row
    still equals PEFT."""
    from nanoserve.v1 import worker_pb2
    extra = {}
    for i, (name, r, modules) in enumerate([("o4", 4, ["o_proj"]),
                                           ("ud8", 8, ["up_proj", "down_proj"])]):
        torch.manual_seed(200 + i)
        model = peft.get_peft_model(_base(model_dir), peft.LoraConfig(
            r=r, lora_alpha=r, target_modules=modules, init_lora_weights=False)).eval()
        path = tmp_path_factory.mktemp(f"lora_{name}")
        model.save_pretrained(path)
        extra[name] = (path, model)
    every = {**adapters, **extra}
    runner = _runner(model_dir, adapters, max_loras=2)
    runner.adapters.set_adapters([worker_pb2.Adapter(id=i + 1, name=n, path=str(every[n][0]))
                                  for i, n in enumerate(every)])
    prompts = [list(range(5, 20)), list(range(40, 51))]
    refs = list(every.values())
    with torch.no_grad():
        want = {(a, j): refs[a - 1][1](input_ids=torch.tensor([prompts[j]])).logits[0, -1]
                for a in range(1, 6) for j in range(2)}
    pairs = [(1, 2), (3, 4), (5, 1), (2, 3), (4, 4), (5, 2), (1, 5)]
    lru: list[int] = []   # the expected residents, least recently used first
    for step, (a, b) in enumerate(pairs, start=1):
        got = _prefill_logits(runner, prompts, [a, b], step_id=step)
        torch.testing.assert_close(got[0], want[(a, 0)], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[1], want[(b, 1)], rtol=1e-4, atol=1e-4)
        used = sorted({a, b})
        lru = [x for x in lru if x not in used] + [x for x in used if x in lru]
        for x in (x for x in used if x not in lru):
            if len(lru) == 2:
                lru.pop(next(i for i, y in enumerate(lru) if y not in used))
            lru.append(x)
        assert list(runner.adapters.slot_of) == lru


def test_bad_adapters_refused(model_dir, adapters, tmp_path):
    """Rank over the maximum, a module the base lacks, a shape that does not match, a
    malformed file: AdapterError with the reason, the served set unchanged."""
    from nanoserve.v1 import worker_pb2
    from worker_service.adapters import AdapterError
    runner = _runner(model_dir, adapters, max_loras=2)
    before = dict(runner.adapters.adapters)

    def variant(name: str, edit_cfg=None, edit_weights=None):
        from safetensors.torch import load_file, save_file
        src = adapters["all8"][0]
        d = tmp_path / name
        d.mkdir()
        cfg = json.loads((src / "adapter_config.json").read_text())
        w = load_file(src / "adapter_model.safetensors")
        if edit_cfg:
            edit_cfg(cfg)
        if edit_weights:
            w = edit_weights(w)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        save_file(w, d / "adapter_model.safetensors")
        return d

    def first(w, fn):
        k = next(k for k in sorted(w) if "q_proj.lora_B" in k)
        w[k] = fn(w[k])
        return w

    cases = {
        "rank": (variant("rank", lambda c: c.update(r=32)), "exceeds --max-lora-rank"),
        "shape": (variant("shape", edit_weights=lambda w: first(w, lambda t: t[:-1])), "base model needs"),
        "module": (variant("module", edit_weights=lambda w: {
            **w, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(389, 8)}), "can adapt"),
        "dora": (variant("dora", lambda c: c.update(use_dora=True)), "use_dora"),
    }
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 8}')
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    cases["file"] = (broken, "cannot read")
    for name, (path, why) in cases.items():
        with pytest.raises(AdapterError, match=why):
            runner.adapters.set_adapters([worker_pb2.Adapter(id=9, name=name, path=str(path))])
        assert runner.adapters.adapters == before


# ---- through the services -----------------------------------------------------------------

@pytest.fixture(scope="module")
def served(model_dir, adapters):
    worker = start_worker(model_dir, extra=["--max-loras", "2", "--max-lora-rank", str(MAX_RANK)])
    sched = None
    try:
        http = free_port()
        sched = start_scheduler(model_dir, [worker.port], extra=[
            # predictions proposed whatever the CPU's measured row cost (adaptive k made
            # the prediction test flaky: a slow step could price every proposal out)
            "--http-port", str(http), "--served-model-name", "tiny", "--no-speculative-adaptive",
            "--lora-modules", *[f"{n}={adapters[n][0]}" for n in ADAPTERS]])
        yield worker, sched, http
    finally:
        if sched:
            sched.stop()
        worker.stop()


def _grpc_greedy(stub, prompt, n, adapter=""):
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), adapter=adapter,
        sampling=generate_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return [t for c in stub.Generate(req, timeout=120) for t in c.token_ids]


def test_services_greedy_equal_peft(served, model_dir, adapters):
    """Base + three adapters at once through gRPC, twice over one shared 24-token prefix
    (three blocks of 8: the prefix cache must keep each adapter's KV apart), with two GPU
    slots: every stream equals PEFT greedy for its adapter."""
    _, sched, _ = served
    base = _base(model_dir)
    prefix = list(range(30, 54))
    jobs = [(prefix + [t], name) for t in (7, 11) for name in ["", *ADAPTERS]]
    want = [peft_greedy(adapters[n][1] if n else base, p, 12) for p, n in jobs]
    with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        info = stub.GetModelInfo(generate_pb2.ModelInfoRequest())
        assert list(info.adapters) == list(ADAPTERS)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda j: _grpc_greedy(stub, j[0], 12, j[1]), jobs))
        assert got == want
        assert len({tuple(w) for w in want[:4]}) == 4   # the adapters answer differently
        with pytest.raises(grpc.RpcError) as e:
            _grpc_greedy(stub, prefix, 4, "nope")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in e.value.details()


def test_openai_sdk_picks_adapter_by_model(served, model_dir, adapters):
    openai = pytest.importorskip("openai")
    _, _, http = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x")
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", *ADAPTERS}
    assert models["qv4"].model_extra.get("parent") == "tiny"
    prompt = list(range(60, 75))
    for name in ["tiny", "qv4", "mlp16"]:
        ref = _base(model_dir) if name == "tiny" else adapters[name][1]
        out = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == _decode(model_dir, peft_greedy(ref, prompt, 8))
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=prompt, max_tokens=2)


def _decode(model_dir, ids):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return tok.decode(ids, skip_special_tokens=True)


def test_tp2_equals_peft(model_dir, adapters):
    """TP=2 (gloo): A sharded like a row-parallel layer's input, B like a column-parallel
    layer's output, no collective of the adapters' own; greedy equals PEFT."""
    from services import start_tp_workers
    workers = start_tp_workers(model_dir, 2, extra=["--max-loras", "2", "--max-lora-rank",
                                                    str(MAX_RANK)])
    sched = None
    try:
        sched = start_scheduler(model_dir, [w.port for w in workers], extra=[
            "--lora-modules", *[f"{n}={adapters[n][0]}" for n in ADAPTERS]])
        prompt = list(range(80, 97))
        with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            for name in ADAPTERS:
                assert _grpc_greedy(stub, prompt, 10, name) == \
                    peft_greedy(adapters[name][1], prompt, 10), name
    finally:
        if sched:
            sched.stop()
        for w in workers:
            w.stop()


def test_graph_inputs_carry_adapter_slots(model_dir, adapters):
    """The CUDA graphs' computation (DecodeGraphs.load + _forward, PrefillGraphs.load +
    forward: what a replay runs) with adapter slots in their static buffer gives the eager
    step's logits, padding rows included (slot -1); with every slot -1 it does not. A mixed
    step split over both (SplitGraphs) keeps each row's slots."""
    from worker_service.cuda_graphs import DecodeGraphs, PrefillGraphs, rows_out
    from worker_service.executors import StepInputs
    runner = _runner(model_dir, adapters, max_loras=2)
    store = runner.adapters
    prompts = [list(range(10, 23)), list(range(40, 49)), list(range(3, 9))]
    _prefill_logits(runner, prompts, [1, 0, 3])
    from nanoserve.v1 import worker_pb2
    req = worker_pb2.StepRequest(step_id=2)
    req.decode.seq_ids_u64 = np.array([100, 101, 102], "<u8").tobytes()
    req.decode.token_ids_i32 = np.array([7, 8, 9], "<i4").tobytes()
    plan = runner.table.plan(req)
    kv = runner.kv_cache.clone()
    with torch.inference_mode():
        eager = runner.forward(plan).out
        runner.kv_cache.copy_(kv)
        slots = store.slots(runner.table.adapter[plan.rows], plan.num_tokens)
        assert sorted(slots.tolist()) == [-1, 0, 1]
        dg = DecodeGraphs(runner.model, runner.backend, 8, runner.max_model_len, 8,
                          runner.num_kv_heads, runner.device, store.ctx, 2)
        bs = dg.load(StepInputs(plan, lora=slots))
        assert dg.lora_slot[:bs].tolist() == [*slots.tolist()] + [-1] * (bs - 3)
        torch.testing.assert_close(dg._forward(bs).out[:3], eager, rtol=1e-4, atol=1e-4)
        runner.kv_cache.copy_(kv)
        dg.load(StepInputs(plan))
        assert (dg._forward(bs).out[:3] - eager).abs().max() > 1e-3   # the base model's
        runner.kv_cache.copy_(kv)
        # a one-sequence prefill through the prefill graph's inputs
        req = worker_pb2.StepRequest(step_id=3)
        req.seqs.add(seq_id=7, num_tokens=11, start_pos=0, sample=True, reset_block_table=True,
                     adapter_id=2, block_table_i32=np.arange(20, 22, dtype="<i4").tobytes())
        req.token_ids_i32 = np.arange(50, 61, dtype="<i4").tobytes()
        plan = runner.table.plan(req)
        eager = runner.forward(plan).out
        slots = store.slots(runner.table.adapter[plan.rows], plan.num_tokens)
        pg = PrefillGraphs(runner.model, 64, runner.max_model_len, 8, runner.device, store.ctx, 2)
        padded = rows_out(plan, *pg.forward(pg.load(StepInputs(plan, lora=slots)))).out
        torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
        # a prompt beside the three decode rows through SplitGraphs (its decode replay and
        # its prefill replay): each half carries its own rows' adapter slots
        from test_prefill_graphs import without_graphs
        from worker_service.cuda_graphs import SplitGraphs
        req = worker_pb2.StepRequest(step_id=4)
        req.seqs.add(seq_id=8, num_tokens=9, start_pos=0, sample=True, reset_block_table=True,
                     adapter_id=1, block_table_i32=np.arange(24, 26, dtype="<i4").tobytes())
        req.token_ids_i32 = np.arange(60, 69, dtype="<i4").tobytes()
        req.decode.seq_ids_u64 = np.array([100, 101, 102], "<u8").tobytes()
        req.decode.token_ids_i32 = np.array([7, 8, 9], "<i4").tobytes()
        plan = runner.table.plan(req)
        runner.kv_cache.copy_(kv)
        eager = runner.forward(plan).out
        runner.kv_cache.copy_(kv)
        slots = store.slots(runner.table.adapter[plan.rows], plan.num_tokens)
        assert len(set(slots.tolist())) == 3          # -1 (base), 0 and 1 among the rows
        without_graphs(dg, lambda b: dg._forward(b).out)
        without_graphs(pg, pg.forward)
        split, step = SplitGraphs(dg, pg), StepInputs(plan, lora=slots)
        assert split.fits(step)
        torch.testing.assert_close(split.run(step).out, eager, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def rooted(model_dir, adapters):
    """A worker and a scheduler that loads adapters at run time from the adapters' parent
    (--adapter-root), behind an API key: (worker, scheduler, HTTP base URL, the root)."""
    root = adapters["all8"][0].parent
    worker = start_worker(model_dir, extra=["--max-loras", "2", "--max-lora-rank", str(MAX_RANK)])
    sched = None
    try:
        http = free_port()
        sched = start_scheduler(model_dir, [worker.port], extra=[
            "--http-port", str(http), "--served-model-name", "tiny", "--api-key", "k",
            "--adapter-root", str(root), "--lora-modules", f"all8={adapters['all8'][0]}"])
        yield worker, sched, f"http://127.0.0.1:{http}/v1", root
    finally:
        if sched:
            sched.stop()
        worker.stop()


AUTH = [("authorization", "Bearer k")]
HEADERS = {"Authorization": "Bearer k"}


def test_load_unload_at_run_time(rooted, adapters):
    """gRPC LoadAdapter / UnloadAdapter and OpenAI's /v1/load_lora_adapter /
    /v1/unload_lora_adapter (behind the API key) while a request streams: an adapter named
    relative to --adapter-root (or by an absolute path inside it) serves PEFT's tokens at
    once, a bad one is refused with the reason and changes nothing, an adapter with a request
    in flight cannot be unloaded, an unloaded one is NOT_FOUND, and an engine-core restart
    keeps the set."""
    _, sched, url, root = rooted
    auth, headers = AUTH, HEADERS
    prompt = list(range(100, 117))
    with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)

        def greedy(name, n=8):
            req = generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt), adapter=name,
                sampling=generate_pb2.SamplingParams(temperature=0.0, max_tokens=n,
                                                     ignore_eos=True))
            return [t for c in stub.Generate(req, timeout=120, metadata=auth) for t in c.token_ids]

        # a long stream on all8 keeps it busy while the set changes
        long = stub.Generate(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt), adapter="all8",
            sampling=generate_pb2.SamplingParams(temperature=0.0, max_tokens=300,
                                                 ignore_eos=True)), timeout=120, metadata=auth)
        first = next(long)
        r = stub.LoadAdapter(generate_pb2.LoadAdapterRequest(name="qv4", path="qv4"),
                             metadata=auth)   # the documented form: relative to the root
        assert list(r.adapters) == ["all8", "qv4"]
        assert greedy("qv4") == peft_greedy(adapters["qv4"][1], prompt, 8)
        with pytest.raises(grpc.RpcError) as e:
            stub.UnloadAdapter(generate_pb2.UnloadAdapterRequest(name="all8"), metadata=auth)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as e:   # the API key guards these too
            stub.LoadAdapter(generate_pb2.LoadAdapterRequest(name="x", path="mlp16"))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        rest = [t for c in long for t in c.token_ids]
        assert len(first.token_ids) + len(rest) == 300

        # HTTP: load mlp16 (an absolute path inside the root), refuse a broken one, unload qv4
        assert _http("POST", f"{url}/load_lora_adapter", json={"lora_name": "mlp16"},
                     headers=headers).status == 400   # no path
        assert _http("POST", f"{url}/load_lora_adapter", json={
            "lora_name": "m", "lora_path": "mlp16"}).status == 401
        ok = _http("POST", f"{url}/load_lora_adapter", headers=headers, json={
            "lora_name": "mlp16", "lora_path": str(adapters["mlp16"][0])})
        assert ok.status == 200, ok.text
        bad = root / "rank64"
        bad.mkdir(exist_ok=True)
        (bad / "adapter_config.json").write_text('{"r": 64, "lora_alpha": 8}')
        refused = _http("POST", f"{url}/load_lora_adapter", headers=headers, json={
            "lora_name": "bad", "lora_path": "rank64"})
        assert refused.status == 400 and "max-lora-rank" in _message(refused)
        again = _http("POST", f"{url}/load_lora_adapter", headers=headers, json={
            "lora_name": "mlp16", "lora_path": "mlp16"})
        assert again.status == 400 and "already" in again.text
        assert _http("POST", f"{url}/unload_lora_adapter", headers=headers,
                     json={"lora_name": "qv4"}).status == 200
        assert _http("POST", f"{url}/unload_lora_adapter", headers=headers,
                     json={"lora_name": "qv4"}).status == 404
        models = json.loads(_http("GET", f"{url}/models", headers=headers).text)["data"]
        assert [m["id"] for m in models] == ["tiny", "all8", "mlp16"]
        with pytest.raises(grpc.RpcError) as e:
            greedy("qv4")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert greedy("mlp16") == peft_greedy(adapters["mlp16"][1], prompt, 8)

        # the engine core dies: the new one serves the same set
        os.kill(named_children(sched.popen.pid)["ns-engine-core"], signal.SIGKILL)
        assert wait_until(lambda: _served(stub, auth) == ["all8", "mlp16"], timeout=60)
        assert greedy("mlp16") == peft_greedy(adapters["mlp16"][1], prompt, 8)
        assert list(stub.GetModelInfo(generate_pb2.ModelInfoRequest(),
                                      metadata=auth).adapters) == ["all8", "mlp16"]
        # leave the set as the fixture started it
        stub.UnloadAdapter(generate_pb2.UnloadAdapterRequest(name="mlp16"), metadata=auth)


def test_run_time_loading_is_off_by_default(served):
    """Without --adapter-root, loading and unloading at run time are PERMISSION_DENIED / 403
    (saying how to turn them on), whatever the path; --lora-modules still serve."""
    _, sched, http = served
    url = f"http://127.0.0.1:{http}/v1"
    with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        for call, req in ((stub.LoadAdapter, generate_pb2.LoadAdapterRequest(name="x", path="qv4")),
                          (stub.UnloadAdapter, generate_pb2.UnloadAdapterRequest(name="qv4"))):
            with pytest.raises(grpc.RpcError) as e:
                call(req, timeout=30)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "--adapter-root" in e.value.details()
        assert list(stub.GetModelInfo(generate_pb2.ModelInfoRequest()).adapters) == list(ADAPTERS)
    for route, body in (("load_lora_adapter", {"lora_name": "x", "lora_path": "/etc/passwd"}),
                        ("unload_lora_adapter", {"lora_name": "qv4"})):
        r = _http("POST", f"{url}/{route}", json=body)
        assert r.status == 403 and "--adapter-root" in _message(r), r.text
        _reveals_nothing(_message(r))


def test_run_time_paths_stay_inside_the_root(rooted, adapters, tmp_path):
    """Loads that resolve outside --adapter-root are PERMISSION_DENIED / 403, a valid adapter
    out there included: an absolute path, `..`, a symlinked directory or symlinked files
    pointing out. A missing directory is NOT_FOUND / 404 and one without a PEFT adapter
    INVALID_ARGUMENT / 400. No answer holds a path or an OS error (the worker's log has the
    detail), and none changes the served set; a symlink to a directory inside the root loads."""
    worker, sched, url, root = rooted
    outside = tmp_path / "outside"   # a valid adapter, outside the root
    shutil.copytree(adapters["qv4"][0], outside)
    case = root / tmp_path.name       # this test's own directory under the root
    case.mkdir()
    (case / "link_out").symlink_to(outside, target_is_directory=True)
    (case / "files_out").mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (case / "files_out" / f).symlink_to(outside / f)
    (case / "link_in").symlink_to(adapters["qv4"][0], target_is_directory=True)
    (case / "empty").mkdir()
    (case / "garbage").mkdir()
    (case / "garbage" / "adapter_config.json").write_text("{not json")
    up = os.path.relpath(outside, root)   # ../../.../outside
    mine = case.name

    def load(path: str) -> _Reply:
        return _http("POST", f"{url}/load_lora_adapter", headers=HEADERS,
                     json={"lora_name": "probe", "lora_path": path})

    expected = {
        403: [str(outside), up, f"qv4/../{up}", f"{mine}/link_out", f"{mine}/files_out",
              "/etc/passwd", "/root/.ssh", "../../../../etc/shadow", "/", ".."],
        404: ["nope", f"{mine}/nope", "qv4/adapter_config.json"],
        400: [f"{mine}/empty", f"{mine}/garbage"],
    }
    for status, paths in expected.items():
        for path in paths:
            r = load(path)
            assert r.status == status, (path, r.text)
            _reveals_nothing(_message(r))
    log = worker.output(None)
    assert str(outside) in log and "/etc/passwd" in log   # the detail stays with the worker
    with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        for path in (str(outside), f"{mine}/link_out", up):
            with pytest.raises(grpc.RpcError) as e:
                stub.LoadAdapter(generate_pb2.LoadAdapterRequest(name="probe", path=path),
                                 metadata=AUTH, timeout=60)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, path
            _reveals_nothing(e.value.details())
        assert _served(stub, AUTH) == ["all8"]
        # a symlink that stays inside the root is fine
        assert load(f"{mine}/link_in").status == 200
        stub.UnloadAdapter(generate_pb2.UnloadAdapterRequest(name="probe"), metadata=AUTH)


def _message(r: "_Reply") -> str:
    return json.loads(r.text)["error"]["message"]


def _reveals_nothing(message: str) -> None:
    """An error a caller sees: no host path, no OS error text."""
    low = message.lower()
    assert "/" not in message and "errno" not in low, message
    assert not any(s in low for s in ("no such file", "not a directory", "permission denied",
                                      "is a directory", "etc", "tmp", "pytest")), message


def _served(stub, auth) -> list[str] | None:
    """The adapters a (re)started engine core serves, once it answers."""
    try:
        stub.GetStats(generate_pb2.StatsRequest(), metadata=auth, timeout=5)   # the core answers
        return list(stub.GetModelInfo(generate_pb2.ModelInfoRequest(), metadata=auth,
                                      timeout=5).adapters)
    except grpc.RpcError:
        return None


@dataclass
class _Reply:
    status: int
    text: str


def _http(method: str, url: str, json: dict | None = None, headers: dict | None = None) -> _Reply:
    import json as json_
    import urllib.error
    import urllib.request
    data = None if json is None else json_.dumps(json).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return _Reply(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return _Reply(e.code, e.read().decode())


FAMILIES = {   # checkpoint kwargs, adapted modules
    "qwen2": (dict(qwen2=True, vocab_size=389, seed=6), ALL),
    "llama": (dict(llama=True, vocab_size=389, seed=7), ["q_proj", "v_proj", "down_proj"]),
    # attention everywhere, and the MLP of its one dense layer (1); experts are not adapted
    "qwen3-moe": (dict(vocab_size=389, num_layers=3, seed=10, moe=dict(
        num_experts=5, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=32,
        mlp_only_layers=[1])), ["q_proj", "k_proj", "v_proj", "o_proj"]),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_equal_peft(tmp_path_factory, family):
    """Qwen2 (q/k/v biases), Llama and Qwen3-MoE (attention modules) with an adapter: a
    prefill's logits equal PEFT's; the MoE model refuses an adapter on its experts."""
    from nanoserve.v1 import worker_pb2
    from worker_service.adapters import AdapterError
    kw, modules = FAMILIES[family]
    path = tiny_qwen3_dir(tmp_path_factory, **kw)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(3)
    ref = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=modules,
                                                    init_lora_weights=False)).eval()
    out = tmp_path_factory.mktemp(f"lora_{family}")
    ref.save_pretrained(out)
    adapters = {"a": (out, ref)}
    from worker_service.model_runner import ModelRunner, RunnerConfig
    runner = ModelRunner(RunnerConfig(str(path), device="cpu", dtype="float32", kv_cache_gb=0.01,
                                      max_loras=1, max_lora_rank=MAX_RANK))
    runner.adapters.set_adapters([worker_pb2.Adapter(id=1, name="a", path=str(out))])
    runner.init_kv(64, 8)
    prompt = list(range(20, 37))
    got = _prefill_logits(runner, [prompt], [1])[0]
    with torch.no_grad():
        want = adapters["a"][1](input_ids=torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if family == "qwen3-moe":
        from safetensors.torch import load_file, save_file
        bad = tmp_path_factory.mktemp("lora_moe_experts")
        (bad / "adapter_config.json").write_text((out / "adapter_config.json").read_text())
        w = load_file(out / "adapter_model.safetensors")
        key = "base_model.model.model.layers.0.mlp.experts.0.up_proj"
        w[f"{key}.lora_A.weight"], w[f"{key}.lora_B.weight"] = torch.ones(8, 64), torch.ones(32, 8)
        save_file(w, bad / "adapter_model.safetensors")
        with pytest.raises(AdapterError, match="can adapt"):
            runner.adapters.set_adapters([worker_pb2.Adapter(id=2, name="b", path=str(bad))])


def test_prediction_verified_through_adapter_rows(served, model_dir, adapters):
    """A predicted output verified in multi-row decode steps: every row uses the request's
    adapter (the row -> slot map covers verify rows), so the tokens stay PEFT's and the
    right prediction is accepted."""
    _, sched, _ = served
    prompt = list(range(120, 140))
    want = peft_greedy(adapters["all8"][1], prompt, 16)
    with grpc.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        req = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt), adapter="all8",
            sampling=generate_pb2.SamplingParams(
                temperature=0.0, max_tokens=16, ignore_eos=True,
                prediction=generate_pb2.Prediction(token_ids=generate_pb2.TokenIds(ids=want))))
        chunks = list(stub.Generate(req, timeout=120))
    assert [t for c in chunks for t in c.token_ids] == want
    usage = next(c.usage for c in chunks if c.HasField("usage"))
    assert usage.accepted_prediction_tokens >= 8
