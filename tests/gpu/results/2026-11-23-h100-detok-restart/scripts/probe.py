import os, sys, time, subprocess, threading, statistics, random
sys.path[:0] = ["/tmp/lat", "/tmp/lat/protos"]
import grpc
from client.null_stack import NullStack
from nanoserve.v1 import generate_pb2, generate_pb2_grpc
load = sys.argv[1] == "load"
with NullStack(step_ms=3) as s:
    time.sleep(1)
    bg = None
    if load:
        bg = subprocess.Popen([sys.executable, "-m", "client.bench", "--target", s.target, "--no-progress", "--runs", "1", "--request-rate", "26", "--num-seqs", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": "/tmp/lat:/tmp/lat/protos"})
        time.sleep(6)
    ch = grpc.insecure_channel(s.target); stub = generate_pb2_grpc.GenerationStub(ch)
    rng = random.Random(0)
    client = {}
    for i in range(60):
        ids = [rng.randrange(10000) for _ in range(560)]
        t0 = time.monotonic()
        it = stub.Generate(generate_pb2.GenerateRequest(request_id=f"probe{i}", token_ids=generate_pb2.TokenIds(ids=ids), sampling=generate_pb2.SamplingParams(max_tokens=4, ignore_eos=True)))
        first = None
        for m in it:
            if first is None: first = time.monotonic()
        client[f"probe{i}"] = (t0, first)
        time.sleep(0.05 + rng.random() * 0.02)
    if bg: bg.wait()
    lines = [l for log in s.logs for l in log if l.startswith("LAT")]
fe = {}; by_seq = {}
order_sub = []
for l in lines:
    p = l.split()
    if p[1] == "fe": fe[p[2]] = (float(p[4]), float(p[6]))
    elif p[1] == "fesub": order_sub.append((float(p[3]), int(p[2])))
    else: by_seq.setdefault(int(p[2]), {})[p[1]] = float(p[3])
rows = []
for rid, (call, yld) in fe.items():
    # the submit that followed this call most closely
    sub = min((t, sq) for t, sq in order_sub if t >= call)
    sq = sub[1]; c = by_seq.get(sq, {})
    t0, first = client[rid]
    if not all(k in c for k in ("coreadd", "coresched", "coreout", "feout")): continue
    rows.append(dict(c2fe=call - t0, fe_handle=sub[0] - call, fe2core=c["coreadd"] - sub[0], queue=c["coresched"] - c["coreadd"],
                     step=c["coreout"] - c["coresched"], core2fe=c["feout"] - c["coreout"], fe_yield=yld - c["feout"], fe2client=first - yld, ttft=first - t0))
print(len(rows), "probes", "load" if load else "idle")
for k in rows[0]:
    v = sorted(r[k] * 1e3 for r in rows)
    print(f"{k:10s} p50 {statistics.median(v):7.3f}  p90 {v[int(0.9*len(v))]:7.3f}  max {v[-1]:7.3f} ms")
