"""Turns for the expensive part of a request: round robin per tenant under a burst."""

from __future__ import annotations

import asyncio

from fair_frontend.shell.turns import TURNS_PER_ITERATION, Turns


async def _burst(turns: Turns | None, a: int) -> list[tuple[str, int]]:
    """``a`` requests of tenant a, then one of b, all arriving in one loop iteration (as
    a transport hands a burst over); the order in which they reach their decode."""
    order: list[tuple[str, int]] = []

    async def one(tenant: str, i: int) -> None:
        if turns is not None:
            await turns.take(tenant)
        order.append((tenant, i))

    tasks = [asyncio.create_task(one("a", i)) for i in range(a)]
    tasks.append(asyncio.create_task(one("b", 0)))
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    return order


async def test_a_burst_of_one_tenant_lets_another_through_in_the_first_round() -> None:
    order = await _burst(Turns(), 500)
    assert len(order) == 501
    # The first turns of the iteration went at once, in arrival order (nobody waited);
    # then b had the second turn of the first round, not the 501st.
    assert order.index(("b", 0)) == TURNS_PER_ITERATION + 1
    assert [i for t, i in order if t == "a"] == list(range(500))  # a's own order kept


async def test_without_turns_the_burst_goes_first() -> None:
    """The negative control: in arrival order b's request is decoded last."""
    order = await _burst(None, 500)
    assert order.index(("b", 0)) == 500


async def test_a_request_alone_goes_at_once() -> None:
    turns = Turns()
    ran: list[str] = []
    asyncio.get_running_loop().call_soon(ran.append, "the next iteration")
    await turns.take("a")
    assert ran == []  # no loop iteration passed: no wait when nobody else waits


async def test_a_caller_gone_while_waiting_does_not_hold_the_others() -> None:
    turns = Turns()
    for _ in range(TURNS_PER_ITERATION):
        await turns.take("a")  # the iteration's turns, used up
    gone = asyncio.create_task(turns.take("a"))
    later = asyncio.create_task(turns.take("b"))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.wait_for(later, 10)
    assert len(turns) == 0
