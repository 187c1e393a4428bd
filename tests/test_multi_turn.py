"""client.bench --multi-turn's turn order: --concurrency C keeps at most C turns in flight,
conversations take turns round-robin, and every prompt resends exactly the conversation
so far (checked against a fake server that records what it was sent)."""
from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from client import multi_turn
from client.client import GenerationChunk, Usage


class FakeServer:
    def __init__(self) -> None:
        self.in_flight = self.peak = 0
        self.sent: list[list[int]] = []

    async def generate(self, prompt, params):
        self.sent.append(list(prompt))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(0.001 * random.random())
        out = [len(prompt) + i for i in range(params.max_tokens)]
        self.in_flight -= 1
        yield GenerationChunk("r", out, "", [], "length", Usage(len(prompt), len(out)))


def _args(**kw):
    base = dict(multi_turn=3, num_seqs=6, concurrency=0, seed=0, min_input_len=2,
                max_input_len=4, min_output_len=1, max_output_len=3, temperature=0.0)
    return SimpleNamespace(**{**base, **kw})


async def _drive(args, server):
    ready: asyncio.Queue = asyncio.Queue()
    for i in range(args.num_seqs):
        ready.put_nowait(multi_turn.Conversation(i, random.Random(i), [7, 7]))
    turns: list = []
    await asyncio.gather(*(multi_turn._client(server, ready, args, 100, 10_000, turns)
                           for _ in range(multi_turn.clients(args))))
    return turns


@pytest.mark.parametrize("concurrency,peak", [(0, 6), (2, 2), (1, 1)])
def test_concurrency_bounds_turns_in_flight(concurrency, peak):
    server = FakeServer()
    turns = asyncio.run(_drive(_args(concurrency=concurrency), server))
    assert len(turns) == 18 and server.peak == peak
    for c in range(6):   # every conversation ran its 3 turns in order
        assert [t.turn for t in turns if t.conversation == c] == [0, 1, 2]


def test_one_client_goes_round_robin_and_resends_history():
    server = FakeServer()
    turns = asyncio.run(_drive(_args(concurrency=1), server))
    # all first turns, then all second turns: each history idles while 5 others run
    assert [(t.conversation, t.turn) for t in turns] == [(c, t) for t in range(3)
                                                         for c in range(6)]
    by_conv: dict[int, list[list[int]]] = {}
    for t, prompt in zip(turns, server.sent):
        by_conv.setdefault(t.conversation, []).append(prompt)
    for prompts in by_conv.values():
        for earlier, later in zip(prompts, prompts[1:]):
            assert later[:len(earlier)] == earlier         # the history is resent ...
            assert later[len(earlier)] == len(earlier)     # ... with the fake's answer after it
