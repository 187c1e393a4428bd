"""Embeddings and reranker scores (issue 67) through the real services, against Hugging Face.

One tiny random Qwen3 checkpoint served with --task generate,embed,score, so embeddings,
scores and generations share steps. The references: HF's last hidden state at the last
token, L2-normalised (Qwen3-Embedding's last-token pooling), and HF's softmax over the
logits of the two score tokens at the last position (Qwen3-Reranker's yes/no judgement).
Block size 8 and a 64-token budget, so prompts are chunked and share prefix blocks.
"""
from __future__ import annotations

import concurrent.futures as cf

import grpc
import pytest
import torch
import transformers

from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import start_scheduler, start_worker
from tiny_checkpoint import tiny_qwen3_dir

pytestmark = pytest.mark.slow
BLOCK = 8
TASKS = "generate,embed,score"
SCORE_TOKENS = ("y", "n")   # one token each in the tiny vocabulary ("yes" is two)
# Scores are probabilities in float32: the reduction order changes with prefix-cache hits and
# chunk boundaries (CI's reverse order measured 1.9e-5 apart on a score of 0.053); a wrong
# token, row or LM-head row moves a score by far more.
SCORE_TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen3_dir(tmp_path_factory, vocab_size=389, num_layers=2, seed=5)


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def services(model_dir):
    worker = start_worker(model_dir, extra=["--task", TASKS])
    sched = None
    try:
        sched = start_scheduler(model_dir, [worker.port], block_size=BLOCK, extra=[
            "--task", TASKS, "--score-tokens", ",".join(SCORE_TOKENS),
            "--max-num-batched-tokens", "64", "--http-port", "0"])
        yield worker, sched
    finally:
        if sched:
            sched.stop()
        worker.stop()


@pytest.fixture(scope="module")
def stub(services):
    channel = grpc.insecure_channel(f"127.0.0.1:{services[1].port}")
    yield generate_pb2_grpc.GenerationStub(channel)
    channel.close()


@torch.no_grad()
def hf_embedding(hf, ids: list[int], dimensions: int = 0) -> torch.Tensor:
    h = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(h[:dimensions] if dimensions else h, dim=-1)


@torch.no_grad()
def hf_score(hf, ids: list[int], yes: int, no: int) -> float:
    logits = hf(torch.tensor([ids])).logits[0, -1, [yes, no]]
    return torch.softmax(logits, dim=-1)[0].item()


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0).item()


TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Paged attention stores keys and values in fixed-size blocks. " * 3,
         "héllo wörld",
         "x"]


def test_embeddings_equal_hf_last_token_pooling(stub, hf, tokenizer):
    resp = stub.Embed(generate_pb2.EmbedRequest(
        inputs=[generate_pb2.EmbedInput(text=t) for t in TEXTS]), timeout=60)
    assert [e.index for e in resp.embeddings] == list(range(len(TEXTS)))
    total = 0
    for text, e in zip(TEXTS, resp.embeddings):
        ids = tokenizer(text)["input_ids"]
        total += len(ids)
        assert len(e.values) == hf.config.hidden_size
        assert cosine(e.values, hf_embedding(hf, ids)) >= 0.99999
        assert abs(sum(v * v for v in e.values) - 1.0) < 1e-4
    assert resp.usage.prompt_tokens == total


def test_embeddings_matryoshka_and_token_ids(stub, hf):
    ids = list(range(10, 60))
    resp = stub.Embed(generate_pb2.EmbedRequest(
        inputs=[generate_pb2.EmbedInput(token_ids=generate_pb2.TokenIds(ids=ids))],
        dimensions=16), timeout=60)
    (e,) = resp.embeddings
    assert len(e.values) == 16
    assert cosine(e.values, hf_embedding(hf, ids, 16)) >= 0.99999


def test_scores_equal_hf_yes_no_softmax(stub, hf, tokenizer):
    from scheduler_service.pooling import RERANK_PREFIX, RERANK_SUFFIX, rerank_middle
    yes, no = (tokenizer.convert_tokens_to_ids(t) for t in SCORE_TOKENS)
    query = "what stores keys and values?"
    docs = ["Paged attention stores keys and values in fixed-size blocks.",
            "The quick brown fox jumps over the lazy dog.", "日本語"]
    resp = stub.Score(generate_pb2.ScoreRequest(query=query, documents=docs), timeout=60)
    assert len(resp.scores) == len(docs)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]   # noqa: E731
    for doc, got in zip(docs, resp.scores):
        ids = enc(RERANK_PREFIX) + enc(rerank_middle(query, doc)) + enc(RERANK_SUFFIX)
        assert got == pytest.approx(hf_score(hf, ids, yes, no), abs=SCORE_TOL)
    # the shared prefix (system prompt, instruction, query) was computed once
    assert resp.usage.cached_tokens > 0


def test_pooling_mixed_with_generation_in_one_batch(stub, hf, tokenizer):
    """Generations, embeddings and scores at once: each as it would be alone."""
    prompt = tokenizer("Once upon a time")["input_ids"]
    gen_req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=generate_pb2.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    alone = stub.Complete(gen_req, timeout=60).token_ids
    with cf.ThreadPoolExecutor(8) as pool:
        gens = [pool.submit(stub.Complete, gen_req, timeout=120) for _ in range(3)]
        embs = [pool.submit(stub.Embed, generate_pb2.EmbedRequest(
            inputs=[generate_pb2.EmbedInput(text=t) for t in TEXTS]), timeout=120)
            for _ in range(3)]
        scores = [pool.submit(stub.Score, generate_pb2.ScoreRequest(
            query="q", documents=TEXTS), timeout=120) for _ in range(2)]
        for f in gens:
            assert list(f.result().token_ids) == list(alone)
        for f in embs:
            for text, e in zip(TEXTS, f.result().embeddings):
                assert cosine(e.values, hf_embedding(hf, tokenizer(text)["input_ids"])) >= 0.99999
        first = scores[0].result().scores
        assert scores[1].result().scores == pytest.approx(first, abs=SCORE_TOL)


def test_errors(stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(generate_pb2.EmbedRequest(inputs=[generate_pb2.EmbedInput(text="")]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(generate_pb2.EmbedRequest(), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    long = generate_pb2.EmbedInput(token_ids=generate_pb2.TokenIds(ids=[5] * 600))
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(generate_pb2.EmbedRequest(inputs=[long]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "truncate" in e.value.details()
    resp = stub.Embed(generate_pb2.EmbedRequest(inputs=[long], truncate=True), timeout=60)
    assert resp.usage.prompt_tokens == 512
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(generate_pb2.EmbedRequest(inputs=[generate_pb2.EmbedInput(text="a")],
                                             dimensions=10_000), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = stub.GetModelInfo(generate_pb2.ModelInfoRequest(), timeout=30)
    assert info.task == TASKS and info.hidden_size == 64


# ---------------------------------------------------------------------------- HTTP
def _post(port: int, path: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_openai_sdk_embeddings_create(services, hf, tokenizer):
    import base64

    import numpy as np
    import openai
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{services[1].http_port}/v1",
                           api_key="none")
    resp = client.embeddings.create(input=TEXTS[:2], model=_model(services),
                                    encoding_format="float")
    assert [d.index for d in resp.data] == [0, 1]
    for text, d in zip(TEXTS, resp.data):
        assert cosine(d.embedding, hf_embedding(hf, tokenizer(text)["input_ids"])) >= 0.99999
    assert resp.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS[:2])
    # the SDK's default asks for base64 and decodes it; dimensions cut and renormalise
    small = client.embeddings.create(input=TEXTS[0], model=_model(services), dimensions=8)
    assert len(small.data[0].embedding) == 8
    ref = hf_embedding(hf, tokenizer(TEXTS[0])["input_ids"], 8)
    assert cosine(small.data[0].embedding, ref) >= 0.99999
    status, raw = _post(services[1].http_port, "/v1/embeddings",
                        {"input": [[10, 11, 12]], "encoding_format": "base64"})
    assert status == 200
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    assert cosine(vec.tolist(), hf_embedding(hf, [10, 11, 12])) >= 0.99999


def _model(services) -> str:
    import json
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{services[1].http_port}/v1/models") as r:
        return json.loads(r.read())["data"][0]["id"]


def test_http_score_and_rerank(services, stub):
    port = services[1].http_port
    docs = ["Paged attention stores keys and values.", "The lazy dog.", "héllo"]
    want = list(stub.Score(generate_pb2.ScoreRequest(query="what stores keys?", documents=docs),
                           timeout=60).scores)
    status, body = _post(port, "/score", {"text_1": "what stores keys?", "text_2": docs})
    assert status == 200, body
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-6)
    status, body = _post(port, "/v1/rerank", {"query": "what stores keys?", "documents": docs,
                                              "top_n": 2, "return_documents": True})
    assert status == 200, body
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in body["results"]] == best
    assert body["results"][0]["document"]["text"] == docs[best[0]]
    assert body["results"][0]["relevance_score"] == pytest.approx(want[best[0]], abs=1e-6)
    status, body = _post(port, "/v1/embeddings", {"input": ""})
    assert status == 400 and "empty" in body["error"]["message"]


def test_task_mismatch_is_invalid_argument(model_dir, tmp_path):
    """An embed-only deployment refuses generation (and scores); a generate-only one
    refuses embeddings: INVALID_ARGUMENT / 400, with the reason."""
    from services import served
    with served(model_dir, [start_worker(model_dir, extra=["--task", "embed"])],
                block_size=BLOCK, extra=["--http-port", "0"]) as stub:
        assert stub.GetModelInfo(generate_pb2.ModelInfoRequest(), timeout=30).task == "embed"
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(generate_pb2.GenerateRequest(text="hi"), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "serves embed" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(generate_pb2.ScoreRequest(query="q", documents=["d"]), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(stub.Embed(generate_pb2.EmbedRequest(
            inputs=[generate_pb2.EmbedInput(text="hi")]), timeout=30).embeddings) == 1
    with served(model_dir, [start_worker(model_dir)], block_size=BLOCK) as stub:
        with pytest.raises(grpc.RpcError) as e:
            stub.Embed(generate_pb2.EmbedRequest(inputs=[generate_pb2.EmbedInput(text="hi")]),
                       timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "serves generate" in e.value.details()


def test_client_cli_and_auth(model_dir, capsys):
    """Client.embed / score, the CLI's embed and score, and an API key on both APIs (a
    null worker: made-up values, real control plane)."""
    from client.__main__ import main as cli
    from client.client import Client, NanoserveError
    from services import start_null_worker
    worker = start_null_worker(model_dir, extra=["--task", "embed,score"])
    sched = None
    try:
        sched = start_scheduler(model_dir, [worker.port], block_size=BLOCK, extra=[
            "--api-key", "k3y", "--http-port", "0", "--score-tokens", "y,n"])
        target = f"127.0.0.1:{sched.port}"
        with Client(target, api_key="k3y") as c:
            assert c.model_info().task == "embed,score"
            vecs = c.embed(["hello", [5, 6, 7]], dimensions=8, priority=-3)
            assert [len(v) for v in vecs] == [8, 8]
            assert c.score("q", ["a", "b"]) == [0.5, 0.5]
        with Client(target) as c, pytest.raises(NanoserveError) as e:
            c.embed("hello")
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert _post(sched.http_port, "/v1/embeddings", {"input": "hi"})[0] == 401
        status, body = _post(sched.http_port, "/v1/embeddings", {"input": "hi"}, key="k3y")
        assert status == 200 and len(body["data"][0]["embedding"]) == 1024
        assert cli(["embed", "--target", target, "--api-key", "k3y", "--dimensions", "4",
                    "a", "b"]) == 0
        assert len(capsys.readouterr().out.splitlines()) == 2
        assert cli(["score", "--target", target, "--api-key", "k3y", "q", "d1", "d2"]) == 0
        assert capsys.readouterr().out.split() == ["0.500000", "0.500000"]
    finally:
        if sched:
            sched.stop()
        worker.stop()


def test_tensor_parallel_pooling(model_dir, hf, tokenizer):
    """Two ranks: the score's LM head rows are sharded over the vocabulary (one
    all-reduce); rank 0 answers."""
    from services import served, start_tp_workers
    workers = start_tp_workers(model_dir, 2, extra=["--task", "embed,score"])
    with served(model_dir, workers, block_size=BLOCK, extra=["--score-tokens", "y,n"]) as stub:
        ids = tokenizer(TEXTS[1])["input_ids"]
        (e,) = stub.Embed(generate_pb2.EmbedRequest(inputs=[generate_pb2.EmbedInput(
            token_ids=generate_pb2.TokenIds(ids=ids))]), timeout=60).embeddings
        assert cosine(e.values, hf_embedding(hf, ids)) >= 0.99999
        from scheduler_service.pooling import RERANK_PREFIX, RERANK_SUFFIX, rerank_middle
        enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]   # noqa: E731
        yes, no = (tokenizer.convert_tokens_to_ids(t) for t in SCORE_TOKENS)
        (got,) = stub.Score(generate_pb2.ScoreRequest(query="q?", documents=["dog"]),
                            timeout=60).scores
        ids = enc(RERANK_PREFIX) + enc(rerank_middle("q?", "dog")) + enc(RERANK_SUFFIX)
        assert got == pytest.approx(hf_score(hf, ids, yes, no), abs=SCORE_TOL)


@pytest.mark.parametrize("files,config,name,want", [
    ((), {"architectures": ["Qwen3ForCausalLM"]}, "Qwen3-0.6B", "generate"),
    ((), {"architectures": ["Qwen3ForCausalLM"]}, "Qwen3-Reranker-0.6B", "score"),
    (("modules.json",), {"architectures": ["Qwen3ForCausalLM"]}, "my-model", "embed"),
    ((), {"architectures": ["Qwen3Model"]}, "m", "embed"),
    ((), {"architectures": ["Qwen3ForCausalLM"]}, "Qwen3-Embedding-8B", "embed"),
])
def test_task_auto_rule(tmp_path, files, config, name, want):
    import json

    from nanoserve import model_task
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    for f in files:
        (d / f).write_text("[]")
    assert model_task.resolve("auto", str(d)) == (want,)
    assert model_task.resolve("generate, embed", str(d)) == ("generate", "embed")
    with pytest.raises(ValueError):
        model_task.resolve("classify", str(d))


def test_a_pooling_flood_does_not_starve_decode():
    """Pooling sequences end at their prefill, so nothing bounds a flood of them: the
    scheduler puts a decode step between their prefills."""
    from scheduler_service.scheduler import Scheduler, SchedulerConfig
    from scheduler_service.sequence import SamplingOptions, Sequence
    s = Scheduler(SchedulerConfig(num_kv_blocks=256, block_size=8, max_num_batched_tokens=32))
    gen = Sequence(1, list(range(10)), SamplingOptions(max_tokens=50, ignore_eos=True))
    s.add(gen)
    s.postprocess(s.schedule(), [7])   # its prefill: now it decodes
    for i in range(20):
        s.add(Sequence(100 + i, list(range(20, 52)), SamplingOptions(max_tokens=1, pooling=1)))
    kinds = []
    for _ in range(12):
        batch = s.schedule()
        kinds.append("decode" if not batch.is_prefill else "pool")
        s.postprocess(batch, [5] * sum(batch.sample))
    assert kinds[:6] == ["pool", "decode"] * 3


def test_one_step_mixing_samples_and_pooling_rows(model_dir, hf):
    """The worker alone: one prefill step of a generation, an embedding and a score row;
    the samples keep their places (a 0 for each pooling row) and the pooled values follow
    in request order."""
    import numpy as np

    from nanoserve.v1 import worker_pb2
    from worker_service.model_runner import ModelRunner, RunnerConfig
    r = ModelRunner(RunnerConfig(model_dir=str(model_dir), device="cpu", dtype="float32",
                                 kv_cache_gb=0.01, tasks=("generate", "embed", "score")))
    r.init_kv(32, 8)
    prompts = [list(range(3, 20)), list(range(30, 41)), list(range(50, 59))]
    req = worker_pb2.StepRequest(step_id=1)
    K = worker_pb2.WorkerPooling
    for i, (ids, kind) in enumerate(zip(prompts, (0, K.KIND_SCORE, K.KIND_EMBED))):
        w = req.seqs.add(seq_id=i, num_tokens=len(ids), start_pos=0, reset_block_table=True,
                         sample=True, block_table_i32=np.arange(3 * i, 3 * i + 3,
                                                                dtype="<i4").tobytes())
        w.pooling.kind = kind
        w.pooling.yes_token_id, w.pooling.no_token_id = 7, 9
        w.pooling.dimensions = 0
    req.token_ids_i32 = np.array(sum(prompts, []), "<i4").tobytes()
    resp = r.step(req)
    sampled = np.frombuffer(resp.sampled_token_ids_i32, "<i4").tolist()
    with torch.no_grad():
        want_gen = hf(torch.tensor([prompts[0]])).logits[0, -1].argmax().item()
    assert sampled == [want_gen, 0, 0]
    assert np.frombuffer(resp.pooled_sizes_i32, "<i4").tolist() == [1, 64]
    pooled = np.frombuffer(resp.pooled_f32, "<f4")
    assert pooled[0] == pytest.approx(hf_score(hf, prompts[1], 7, 9), abs=SCORE_TOL)
    assert cosine(pooled[1:].tolist(), hf_embedding(hf, prompts[2])) >= 0.99999


def test_truncation_keeps_the_end_of_text_token():
    """truncate: an embedding input keeps its first tokens and the end-of-text token its
    tokenizer appended (the token whose hidden state is the embedding); a reranker prompt
    loses its document's end, never the query or the judgement suffix."""
    from types import SimpleNamespace

    from scheduler_service.pooling import Pooling

    class Tok:
        eos_token_ids = frozenset({0})

        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text] + ([0] if add_special_tokens else [])

    gen = SimpleNamespace(tokenizer=Tok(), limits=SimpleNamespace(
        max_model_len=400, max_kv_tokens=10_000, vocab_size=1000))
    p = Pooling(gen, ("embed", "score"), 64)
    ids = p.embed_prompt(text="x" * 500, truncate=True)
    assert len(ids) == 400 and ids[-1] == 0 and ids[:-1] == [ord("x")] * 399
    with pytest.raises(Exception, match="truncate"):
        p.embed_prompt(text="x" * 500)
    prompt = p.score_prompt("what?", "d" * 500, truncate=True)
    assert len(prompt) == 400
    text = "".join(map(chr, prompt))
    assert "<Query>: what?" in text and text.endswith("</think>\n\n")
    with pytest.raises(Exception, match="without its document"):
        p.score_prompt("q" * 300, "d", truncate=True)
