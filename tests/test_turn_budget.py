"""TurnBudget: at most N grants per event-loop turn, first come first served, nobody lost."""
import asyncio

import pytest

from scheduler_service.turn_budget import TurnBudget


class TurnCounter:
    """Counts event-loop turns: a callback that re-schedules itself runs once per turn."""

    def __init__(self):
        self.turn = 0
        self.running = True
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self):
        self.turn += 1
        if self.running:
            asyncio.get_running_loop().call_soon(self._tick)


async def _grants(per_turn: int, takers: int, rounds: int = 1):
    """(taker, turn) per grant, in grant order, for `takers` tasks taking `rounds` times."""
    budget = TurnBudget(per_turn)
    turns = TurnCounter()
    got: list[tuple[int, int]] = []

    async def taker(i):
        for _ in range(rounds):
            await budget.take()
            got.append((i, turns.turn))
            await asyncio.sleep(0)   # a stream writes its delta before it asks again

    await asyncio.gather(*(taker(i) for i in range(takers)))
    turns.running = False
    return got


def _per_turn(got):
    counts = {}
    for _, turn in got:
        counts[turn] = counts.get(turn, 0) + 1
    return counts


@pytest.mark.parametrize("per_turn", [1, 3, 8])
def test_at_most_per_turn_grants_in_a_turn_and_first_come_first_served(per_turn):
    got = asyncio.run(_grants(per_turn, takers=20))
    assert sorted(i for i, _ in got) == list(range(20))       # everyone got through
    assert [i for i, _ in got] == list(range(20))             # in the order they asked
    counts = _per_turn(got)
    assert max(counts.values()) <= per_turn
    assert len(counts) >= 20 // per_turn                      # spread over several turns


def test_repeated_takers_all_progress():
    """Streams that take once per delta: each gets its share, none is starved."""
    got = asyncio.run(_grants(4, takers=10, rounds=5))
    assert len(got) == 50
    assert max(_per_turn(got).values()) <= 4
    for i in range(10):
        assert sum(1 for t, _ in got if t == i) == 5
    first_round = [i for i, _ in got[:10]]
    assert first_round == list(range(10))


def test_zero_means_no_limit():
    got = asyncio.run(_grants(0, takers=50))
    assert len(_per_turn(got)) == 1                           # all in one turn


def test_a_cancelled_waiter_does_not_hold_up_the_rest():
    async def main():
        budget = TurnBudget(1)
        await budget.take()                 # uses this turn's only grant
        waiters = [asyncio.ensure_future(budget.take()) for _ in range(4)]
        await asyncio.sleep(0)              # all four are queued now
        waiters[1].cancel()
        await asyncio.wait_for(asyncio.gather(waiters[0], waiters[2], waiters[3]), 1.0)
        assert waiters[1].cancelled()
        for _ in range(5):                  # the budget disarms once idle
            await asyncio.sleep(0)
        assert not budget.armed and not budget.waiting
    asyncio.run(main())


def test_the_flag_reaches_every_frontend_and_rejects_negatives(tmp_path):
    import shutil

    from scheduler_service.__main__ import ControlPlane, parse_args
    base = ["--model", str(tmp_path), "--workers", "127.0.0.1:1"]
    assert parse_args(base).stream_deltas_per_turn == 8          # the default
    plane = ControlPlane(parse_args(base + ["--stream-deltas-per-turn", "0", "--frontends", "2"]))
    try:
        assert [c.deltas_per_turn for c in plane.frontend_configs] == [0, 0]
    finally:
        shutil.rmtree(plane.ipc_dir, ignore_errors=True)
    with pytest.raises(SystemExit):
        parse_args(base + ["--stream-deltas-per-turn", "-1"])


def test_a_turn_after_a_call_arrived_grants_nothing():
    """Calls arriving get the next turn to themselves (acceptance waits for no writes);
    the takers are served after it, in order, still at most per_turn a turn."""
    async def run(arrival: bool):
        budget = TurnBudget(4)
        turns = TurnCounter()
        got = []

        async def taker(i):
            await budget.take()
            got.append((i, turns.turn))

        if arrival:
            budget.arrived()
        await asyncio.gather(*(taker(i) for i in range(6)))
        turns.running = False
        return got

    plain, held = asyncio.run(run(False)), asyncio.run(run(True))
    assert [i for i, _ in held] == [i for i, _ in plain] == list(range(6))
    assert held[0][1] >= plain[0][1] + 2          # the held turn, and the grant's own turn
    assert max(_per_turn(held).values()) <= 4


def test_a_flood_of_calls_cannot_hold_writes_for_more_than_hold_turns():
    """A call in every turn: writes still get a turn after HOLD_TURNS held ones."""
    from scheduler_service.turn_budget import HOLD_TURNS

    async def main():
        budget = TurnBudget(2)
        turns = TurnCounter()
        got = []
        flooding = True

        def flood():   # one new call per turn, for as long as the takers need
            budget.arrived()
            if flooding:
                asyncio.get_running_loop().call_soon(flood)

        await budget.take()                  # this turn's grants are spent ...
        await budget.take()
        flood()
        async def taker(i):
            await budget.take()
            got.append((i, turns.turn))
        first = turns.turn
        await asyncio.wait_for(asyncio.gather(*(taker(i) for i in range(6))), 5.0)
        flooding = False
        turns.running = False
        return first, got

    first, got = asyncio.run(main())
    assert [i for i, _ in got] == list(range(6))          # nobody lost, in order
    granted_turns = sorted(_per_turn(got))
    # a grant resumes its taker one turn after the grant's own turn
    assert 2 <= granted_turns[0] - first <= HOLD_TURNS + 2   # held, at most HOLD_TURNS turns
    gaps = [b - a for a, b in zip(granted_turns, granted_turns[1:])]
    assert all(g <= HOLD_TURNS + 1 for g in gaps)           # never starved


def test_no_holds_without_a_budget():
    async def main():
        budget = TurnBudget(0)
        turns = TurnCounter()
        budget.arrived()
        start = turns.turn
        await budget.take()
        turns.running = False
        return turns.turn - start, budget.armed
    delay, armed = asyncio.run(main())
    assert delay == 0 and not armed


def test_a_first_delta_goes_ahead_of_the_queue_but_not_into_a_held_turn():
    """A new request's first token (its TTFT) does not wait behind the running streams'
    writes: granted in the turn it asks, over the budget. A turn held for arrivals holds
    it too."""
    async def main():
        budget = TurnBudget(1)
        turns = TurnCounter()
        await budget.take()                       # this turn's one grant is spent
        queued = [asyncio.ensure_future(budget.take()) for _ in range(5)]
        await asyncio.sleep(0)                    # all five wait in the queue now
        asked = turns.turn
        await budget.take(first=True)             # ... and the first delta does not
        at_once = turns.turn == asked and sum(q.done() for q in queued) <= 1
        budget.arrived()
        await asyncio.sleep(0)                    # the next turn is held for the arrival
        assert budget.held
        held_turn = turns.turn
        await budget.take(first=True)             # asked in the held turn: granted later
        held_back = turns.turn > held_turn
        await asyncio.wait_for(asyncio.gather(*queued), 2.0)
        turns.running = False
        return at_once, held_back

    at_once, held_back = asyncio.run(main())
    assert at_once and held_back
