"""The public API from another language: a Node.js client (@grpc/grpc-js + proto-loader,
no generated code) streams Generate from the real services and must see exactly what a
Python stub sees for the same greedy request.

Node and npm are required (CI has Node 20 and registry access): a missing toolchain is a
failure, not a skip, so this cross-language check can't silently stop running. The npm
install is cached in tests/node/node_modules, keyed on package-lock.json.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from nanoserve.v1 import generate_pb2, generate_pb2_grpc
from services import start_scheduler, start_worker
from tiny_checkpoint import tiny_qwen3_dir

pytestmark = pytest.mark.slow
NODE_DIR = Path(__file__).resolve().parent / "node"
VOCAB = 389
# Written after a successful `npm ci`; holds the lockfile hash it installed.
STAMP = NODE_DIR / "node_modules" / ".nanoserve-lock-sha256"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` not found on PATH: tests/test_node_client.py needs Node.js >= 18 "
                    f"and npm (CI provides Node 20); install them, e.g. `apt-get install nodejs npm`",
                    pytrace=False)
    return path


@pytest.fixture(scope="module")
def node():
    node = _tool("node")
    npm = _tool("npm")
    lock_hash = hashlib.sha256((NODE_DIR / "package-lock.json").read_bytes()).hexdigest()
    if not (STAMP.exists() and STAMP.read_text().strip() == lock_hash):
        # `npm ci` installs exactly the committed lockfile (and wipes node_modules first).
        proc = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR,
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            pytest.fail(f"npm ci failed in {NODE_DIR}:\n{proc.stdout}\n{proc.stderr}", pytrace=False)
        STAMP.write_text(lock_hash + "\n")
    return node


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tiny_qwen3_dir(tmp_path_factory, vocab_size=VOCAB, num_layers=2, seed=3)
    worker = start_worker(model_dir)
    sched = None
    try:
        sched = start_scheduler(model_dir, [worker.port])
        yield f"127.0.0.1:{sched.port}"
    finally:
        if sched:
            sched.stop()
        worker.stop()


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server)
    yield generate_pb2_grpc.GenerationStub(channel)
    channel.close()


def run_node(node: str, target: str, request: dict) -> tuple[int, dict]:
    proc = subprocess.run([node, "generate.js", target, json.dumps(request)], cwd=NODE_DIR,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode in (0, 1), f"node client crashed:\n{proc.stdout}\n{proc.stderr}"
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


# The same requests, once as proto3 JSON-ish dicts (proto field names) for Node.
REQUESTS = {
    "token_ids": {"token_ids": {"ids": [5, 17, 42, 99, 250, 7, 8]},
                  "sampling": {"temperature": 0, "max_tokens": 24}},
    # Multi-byte UTF-8 in and out: the text deltas must concatenate to the same string.
    "text": {"text": "héllo wörld 日本語", "sampling": {"temperature": 0, "max_tokens": 20,
                                                        "ignore_eos": True}},
}


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_node_stream_matches_python_stub(node, server, stub, name):
    request = REQUESTS[name]
    py_chunks = list(stub.Generate(generate_pb2.GenerateRequest(**_to_pb_kwargs(request)), timeout=60))
    py_ids = [t for c in py_chunks for t in c.token_ids]

    rc, out = run_node(node, server, request)
    assert rc == 0, out
    assert out["token_ids"] == py_ids and py_ids
    assert out["text"] == "".join(c.text for c in py_chunks)
    assert out["finish_reason"] == generate_pb2.FinishReason.Name(py_chunks[-1].finish_reason)
    assert out["finish_reason"] in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH")
    if request["sampling"].get("ignore_eos"):
        assert out["finish_reason"] == "FINISH_REASON_LENGTH"
        assert len(py_ids) == request["sampling"]["max_tokens"]
    usage, py_usage = out["usage"], py_chunks[-1].usage
    assert usage["completion_tokens"] == len(py_ids)
    assert usage["prompt_tokens"] == py_usage.prompt_tokens > 0
    assert out["num_messages"] >= 1 and out["request_id"]


def test_node_out_of_vocab_is_invalid_argument(node, server):
    rc, out = run_node(node, server, {"token_ids": {"ids": [5, VOCAB]},
                                      "sampling": {"temperature": 0, "max_tokens": 4}})
    assert rc == 1, out
    assert out["error"]["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0] == 3
    assert out["error"]["name"] == "INVALID_ARGUMENT"
    assert "vocabulary" in out["error"]["details"]


def _to_pb_kwargs(request: dict) -> dict:
    kwargs = dict(request)
    if "token_ids" in kwargs:
        kwargs["token_ids"] = generate_pb2.TokenIds(**kwargs["token_ids"])
    kwargs["sampling"] = generate_pb2.SamplingParams(**kwargs["sampling"])
    return kwargs
