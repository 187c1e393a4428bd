"""Opt-in TLS, mutual TLS, the public API key and the workers' secret, over real sockets
with certificates made by `openssl` (tests/certs.py).

One secured stack serves every test: a null worker that requires the scheduler's client
certificate and the shared secret, and a scheduler that serves TLS, requires client
certificates and an API key on its public port.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from certs import make_pki
from client import Client, NanoserveError, SamplingParams
from client.null_model import write_null_model
from nanoserve.v1 import worker_pb2, worker_pb2_grpc
from services import ROOT, Proc, start_null_worker, start_worker
from worker_service.null_worker import expected_tokens

pytestmark = pytest.mark.slow
VOCAB, MAX_LEN = 1000, 512
API_KEY, SECRET = "k3y-for-tests", "w0rker-secret"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_null_model(tmp_path_factory.mktemp("null_model"), vocab_size=VOCAB,
                            max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def eos(model_dir):
    return json.loads((model_dir / "config.json").read_text())["eos_token_id"]


@pytest.fixture(scope="module")
def stack(pki, model_dir):
    worker = start_null_worker(model_dir, extra=[
        "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
        "--tls-client-ca", str(pki.ca), "--secret", SECRET])
    sched = Proc("scheduler", [
        "scheduler_service", "--model", str(model_dir), "--workers", f"127.0.0.1:{worker.port}",
        "--port", "0", "--block-size", "16", "--log-level", "WARNING",
        "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
        "--tls-client-ca", str(pki.ca), "--worker-tls-ca", str(pki.ca),
        "--worker-tls-cert", str(pki.client_cert), "--worker-tls-key", str(pki.client_key),
        "--worker-secret", SECRET], env={"NANOSERVE_API_KEY": API_KEY})
    try:
        sched.start()
    except BaseException:
        worker.stop()
        raise
    yield worker, sched
    sched.stop()
    worker.stop()


def secure_client(pki, port, **kw) -> Client:
    opts = dict(api_key=API_KEY, tls_ca=str(pki.ca), tls_cert=str(pki.client_cert),
                tls_key=str(pki.client_key), timeout=30)
    return Client(f"127.0.0.1:{port}", **{**opts, **kw})


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(NanoserveError) as e:
        fn()
    return e.value.code


def test_generation_over_tls_with_key_and_mutual_tls_to_the_worker(stack, pki, eos):
    _, sched = stack
    prompt = [5, 6, 7]
    with secure_client(pki, sched.port) as c:
        out = c.complete(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
        streamed = [t for ch in c.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
                    for t in ch.token_ids]
    want = expected_tokens(prompt, 6, VOCAB, eos)
    assert out.token_ids == want and streamed == want and out.finish_reason == "length"


def test_public_api_needs_the_key_but_health_and_reflection_do_not(stack, pki):
    _, sched = stack
    for key in (None, "wrong-key", API_KEY + "x"):
        with secure_client(pki, sched.port, api_key=key) as c:
            assert code_of(lambda: c.complete([1, 2], SamplingParams(max_tokens=2))) \
                == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda: list(c.generate([1, 2], SamplingParams(max_tokens=2)))) \
                == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(c.model_info) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(c.stats) == grpc.StatusCode.UNAUTHENTICATED
            assert c.health() == "SERVING"
    creds = grpc.ssl_channel_credentials(pki.ca.read_bytes(), pki.client_key.read_bytes(),
                                         pki.client_cert.read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{sched.port}", creds) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = list(stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    names = {s.name for s in answers[0].list_services_response.service}
    assert "nanoserve.v1.Generation" in names


def test_public_port_refuses_plaintext_unknown_roots_and_missing_client_certs(stack, pki):
    _, sched = stack
    bad = [dict(tls_ca=None, tls_cert=None, tls_key=None),               # plaintext
           dict(tls_cert=None, tls_key=None),                             # no client cert
           dict(tls_cert=str(pki.other_cert), tls_key=str(pki.other_key)),  # stranger's cert
           dict(tls_ca=str(pki.other_ca))]                                # server not trusted
    for kw in bad:
        with secure_client(pki, sched.port, timeout=5, **kw) as c:
            assert code_of(c.health) == grpc.StatusCode.UNAVAILABLE, kw


def _worker_channel(pki, port, cert=True) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        pki.ca.read_bytes(), pki.client_key.read_bytes() if cert else None,
        pki.client_cert.read_bytes() if cert else None)
    return grpc.secure_channel(f"127.0.0.1:{port}", creds)


def _worker_calls(stub, md):
    """Every Worker RPC, as (name, thunk)."""
    def step():
        return list(stub.Step(iter([worker_pb2.StepRequest(step_id=1)]), timeout=5, metadata=md))
    return [("Info", lambda: stub.Info(worker_pb2.InfoRequest(block_size=16), timeout=5, metadata=md)),
            ("Init", lambda: stub.Init(worker_pb2.InitRequest(num_kv_blocks=1, block_size=16),
                                       timeout=5, metadata=md)),
            ("Step", step)]


def test_worker_needs_the_secret_for_all_but_health(stack, pki, eos):
    worker, sched = stack
    with _worker_channel(pki, worker.port) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        for md in ((), (("authorization", "Bearer nope"),), (("authorization", SECRET),)):
            for name, call in _worker_calls(stub, md):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, md)
        assert stub.Health(worker_pb2.HealthRequest(), timeout=5).ready
        info = stub.Info(worker_pb2.InfoRequest(block_size=16), timeout=5,
                         metadata=(("authorization", f"Bearer {SECRET}"),))
        assert info.vocab_size == VOCAB
    with _worker_channel(pki, worker.port, cert=False) as ch:   # mutual TLS: no cert, no talk
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.WorkerStub(ch).Health(worker_pb2.HealthRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(f"127.0.0.1:{worker.port}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.WorkerStub(ch).Health(worker_pb2.HealthRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with secure_client(pki, sched.port) as c:   # the stray calls harmed nothing
        assert c.complete([9, 9], SamplingParams(max_tokens=3, ignore_eos=True)).token_ids == \
            expected_tokens([9, 9], 3, VOCAB, eos)


def test_scheduler_with_the_wrong_worker_secret_exits_with_a_clear_error(stack, pki, model_dir):
    worker, _ = stack
    sched = Proc("scheduler", [
        "scheduler_service", "--model", str(model_dir), "--workers", f"127.0.0.1:{worker.port}",
        "--port", "0", "--worker-tls-ca", str(pki.ca), "--worker-tls-cert", str(pki.client_cert),
        "--worker-tls-key", str(pki.client_key), "--worker-secret", "wrong"]).launch()
    try:
        assert sched.wait_exit(60) == 1
    finally:
        sched.stop()
    assert "UNAUTHENTICATED" in sched.output()


def test_cli_key_from_environment_and_tls_flags(stack, pki):
    _, sched = stack
    base = [sys.executable, "-m", "client", "--target", f"127.0.0.1:{sched.port}",
            "--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert),
            "--tls-key", str(pki.client_key), "--timeout", "20"]
    env = dict(os.environ, NANOSERVE_API_KEY=API_KEY)
    ok = subprocess.run([*base, "info"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert '"vocab_size": 1000' in ok.stdout
    env.pop("NANOSERVE_API_KEY")
    denied = subprocess.run([*base, "info"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    flag = subprocess.run([*base, "--api-key", API_KEY, "generate", "1 2 3", "--ids",
                           "--max-tokens", "2", "--ignore-eos", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert flag.returncode == 0, flag.stderr


def test_real_worker_mutual_tls_secret_and_garbage(pki, tmp_path_factory):
    """The model worker (blocking grpc server, SyncGuard): the same rules as the null one,
    and undecodable bodies answer INVALID_ARGUMENT (gRPC's own answer would be INTERNAL)."""
    from tiny_checkpoint import tiny_qwen3_dir
    model = tiny_qwen3_dir(tmp_path_factory, vocab_size=389, num_layers=1, seed=5)
    worker = start_worker(model, extra=[
        "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
        "--tls-client-ca", str(pki.ca), "--secret", SECRET])
    good = (("authorization", f"Bearer {SECRET}"),)
    try:
        with _worker_channel(pki, worker.port) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            for name, call in _worker_calls(stub, ()):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert not stub.Health(worker_pb2.HealthRequest(), timeout=5).ready
            assert stub.Info(worker_pb2.InfoRequest(block_size=8), timeout=5,
                             metadata=good).vocab_size == 389
            for method in ("Info", "Init"):
                with pytest.raises(grpc.RpcError) as e:
                    ch.unary_unary(f"/nanoserve.v1.Worker/{method}")(b"\xff", timeout=5,
                                                                     metadata=good)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            with pytest.raises(grpc.RpcError) as e:
                list(ch.stream_stream("/nanoserve.v1.Worker/Step")(iter([b"\x0b"]), timeout=5,
                                                                   metadata=good))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with _worker_channel(pki, worker.port, cert=False) as ch:
            with pytest.raises(grpc.RpcError) as e:
                worker_pb2_grpc.WorkerStub(ch).Health(worker_pb2.HealthRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert worker.popen.poll() is None
    finally:
        worker.stop()


def test_help_never_prints_secrets_from_the_environment():
    env = dict(os.environ, NANOSERVE_API_KEY="leaked-key-1", NANOSERVE_WORKER_SECRET="leaked-2")
    for module in ("scheduler_service", "worker_service", "scheduler_service.launch"):
        out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=env,
                             capture_output=True, text=True)
        assert out.returncode == 0 and "--tls-cert" in out.stdout, out.stderr
        assert "leaked" not in out.stdout, module


def test_launch_forwards_tls_and_keeps_secrets_in_the_environment(monkeypatch):
    from scheduler_service import launch
    monkeypatch.delenv("NANOSERVE_WORKER_SECRET", raising=False)
    args = launch.parse_args(["--model", "m", "--tp", "2", "--api-key", "k", "--tls-cert", "c.pem",
                              "--tls-key", "k.pem", "--", "--block-size", "16"])
    *workers, sched = launch.commands(args)
    assert sched[-6:] == ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--block-size", "16"]
    assert not any("k" == a for cmd in (*workers, sched) for a in cmd)   # no key on a command line
    env, again = launch.secrets_env(args), launch.secrets_env(args)
    assert env["NANOSERVE_API_KEY"] == "k"
    assert len(env["NANOSERVE_WORKER_SECRET"]) >= 24   # random per launch
    assert env["NANOSERVE_WORKER_SECRET"] != again["NANOSERVE_WORKER_SECRET"]
