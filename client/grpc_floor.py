"""What gRPC Python itself costs on this machine: the floor under any control plane built on it.

A server process answers the public Generate RPC with canned messages (no model, no
scheduler, no tokenizer) and a grpc.aio client calls it the way client.bench does: 256
streams at a time, a prompt of 560 ids each. It prints the CPU time, client and server
apart, of one RPC and of one extra streamed message, and what that allows: output tokens
per second when every token is a message and client and server share the machine's cores.
`python -m client.bench --null-worker --step-ms 0` cannot beat this bound, whatever the
scheduler does, unless several tokens share a message.

    python -m client.grpc_floor [--rpcs 2560] [--messages 100] [--cores 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import time
from pathlib import Path

import grpc
import grpc.aio

from nanoserve.v1 import generate_pb2, generate_pb2_grpc

CONCURRENCY = 256
PROMPT_LEN = 560


class _Canned(generate_pb2_grpc.GenerationServicer):
    """Answers Generate with `messages` one-token messages, the last one finishing."""

    def __init__(self, messages: int):
        self.messages = messages

    async def Generate(self, request, context):
        for i in range(self.messages - 1):
            yield generate_pb2.GenerateResponse(token_ids=[i], text="x")
        yield generate_pb2.GenerateResponse(token_ids=[0], text="x",
                                            finish_reason=generate_pb2.FINISH_REASON_LENGTH)


def _serve(messages: int, conn) -> None:
    """Server process: serve, and answer each line on `conn` with our CPU seconds so far."""
    async def main() -> None:
        server = grpc.aio.server()
        generate_pb2_grpc.add_GenerationServicer_to_server(_Canned(messages), server)
        conn.send(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, conn.recv) is not None:
            conn.send(time.process_time())
        await server.stop(0)
    asyncio.run(main())


async def _calls(port: int, n: int) -> float:
    """Client CPU seconds for n Generate calls, CONCURRENCY in flight at a time."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        request = generate_pb2.GenerateRequest()
        request.token_ids.ids.extend(range(PROMPT_LEN))

        async def one() -> None:
            async for _ in stub.Generate(request):
                pass

        await one()   # connect
        cpu = time.process_time()
        for start in range(0, n, CONCURRENCY):
            await asyncio.gather(*(one() for _ in range(min(CONCURRENCY, n - start))))
        return time.process_time() - cpu


def _measure(messages: int, n: int) -> tuple[float, float]:
    """(client, server) CPU seconds per call of `messages` streamed messages."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(messages, theirs), daemon=True)
    server.start()
    try:
        port = ours.recv()
        ours.send("mark")
        before = ours.recv()
        client = asyncio.run(_calls(port, n))
        ours.send("mark")
        return client / n, (ours.recv() - before) / n
    finally:
        ours.send(None)
        server.join(10)
        if server.is_alive():
            server.kill()


def measure(rpcs: int, messages: int) -> dict:
    """Per-RPC and per-extra-message CPU (microseconds), client and server."""
    c1, s1 = _measure(1, rpcs)
    cn, sn = _measure(messages, max(rpcs // messages, 1) * 4)
    per_msg = ((cn - c1) / (messages - 1), (sn - s1) / (messages - 1))
    return {"rpc_client_us": c1 * 1e6, "rpc_server_us": s1 * 1e6,
            "message_client_us": per_msg[0] * 1e6, "message_server_us": per_msg[1] * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[2:]))
    ap.add_argument("--rpcs", type=int, default=2560, help="calls timed for the per-RPC cost")
    ap.add_argument("--messages", type=int, default=100,
                    help="streamed messages per call for the per-message cost")
    ap.add_argument("--cores", type=float, default=2.0,
                    help="cores client and server share, for the tokens/s bound")
    ap.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = ap.parse_args(argv)
    if args.messages < 2:
        ap.error("--messages must be >= 2")
    r = measure(args.rpcs, args.messages)
    per_token = r["message_client_us"] + r["message_server_us"]
    r["max_tokens_per_s"] = args.cores / per_token * 1e6 if per_token > 0 else float("inf")
    print(f"one Generate call (one message):  client {r['rpc_client_us']:.0f} us CPU, "
          f"server {r['rpc_server_us']:.0f} us CPU")
    print(f"each further streamed message:    client {r['message_client_us']:.0f} us CPU, "
          f"server {r['message_server_us']:.0f} us CPU")
    print(f"one message per token on {args.cores:g} cores shared by client and server: at most "
          f"{r['max_tokens_per_s']:,.0f} output tok/s (gRPC alone)")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
