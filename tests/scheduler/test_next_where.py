"""``Scheduler.next_where``: the next request a condition takes, out of turn where the
selectors' own next fails it (an engine's light slots: ``core.engine``).

The fairest request the condition takes goes: the tier's tenants in the order its policy
ranks them (VTC: least counter first; DRR: round order), each tenant's own head; the
tenant taken out of turn is charged as if it had been picked (its VTC counter, its DRR
budget owing it), so out-of-turn service is fairness's, not extra. Nothing is taken
where no head qualifies, and the policy's own next stays what it was.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from sched_support import make_request, make_scheduler, tags

from fair_frontend.scheduler import QueuedRequest
from fair_frontend.scheduler.cost import CostUnit


def light(req: QueuedRequest) -> bool:
    return req.program == "chat"


def test_vtc_takes_the_least_served_light_head_and_charges_it() -> None:
    s = make_scheduler({t: "paid" for t in "abc"}, cost=CostUnit.TOKENS, fairness="vtc",
                       max_batch_size=0, quantum=None)  # fmt: skip
    s.enqueue(make_request("a", tokens=5, program="agent", tag="a-agent"), 0.0)
    for t in "bc":  # each tenant's chat queued first: its head
        s.enqueue(make_request(t, tokens=5, program="chat", tag=f"{t}-chat"), 0.0)
        s.enqueue(make_request(t, tokens=5, program="agent", tag=f"{t}-agent"), 0.0)
    s.charge_back("b", 3.0, "agent")  # a 0, b 3, c 0: a (first in) is the policy's next
    before = s.deficits()
    assert tags(s.next_where(0.0, light)) == ["c-chat"]  # of the light heads, c's is least
    after = s.deficits()
    assert after == {**before, "c": before["c"] + 5}  # charged as a pick is; a, b untouched
    assert tags(s.next_where(0.0, light)) == ["b-chat"]
    assert s.next_where(0.0, light) == []  # only agents' heads left: nothing taken
    assert s.queued_requests == 3
    assert tags(s.next_batch(0.0)) == ["a-agent"]  # the policy's next, as it was


def test_the_selectors_next_goes_first_when_it_qualifies() -> None:
    s = make_scheduler({"a": "paid", "b": "trial"}, max_batch_size=0)
    s.enqueue(make_request("b", program="chat", tag="b-chat"), 0.0)
    s.enqueue(make_request("a", program="chat", tag="a-chat"), 0.0)
    assert tags(s.next_where(0.0, light)) == ["a-chat"]  # the paid tier first


def test_a_higher_tier_light_head_goes_before_a_lower_tiers() -> None:
    s = make_scheduler({"a": "paid", "b": "paid", "c": "trial"}, max_batch_size=0)
    s.enqueue(make_request("a", program="agent", tag="a-agent"), 0.0)
    s.enqueue(make_request("c", program="chat", tag="c-chat"), 0.0)
    s.enqueue(make_request("b", program="chat", tag="b-chat"), 0.0)
    assert tags(s.next_where(0.0, light)) == ["b-chat"]
    assert tags(s.next_where(0.0, light)) == ["c-chat"]


def test_drr_takes_in_round_order_and_the_budget_owes_it() -> None:
    s = make_scheduler({t: "paid" for t in "abc"}, max_batch_size=0, quantum=1.0)
    s.enqueue(make_request("a", program="agent", tag="a-agent"), 0.0)
    for t in "bc":
        s.enqueue(make_request(t, program="chat", tag=f"{t}-chat"), 0.0)
        s.enqueue(make_request(t, program="agent", tag=f"{t}-agent"), 0.0)
    s.enqueue(make_request("a", program="agent", tag="a-agent2"), 0.0)
    # a's turn (its head an agent's): the round's next light heads, b's then c's, go out
    # of turn, each owed by its tenant's budget.
    assert tags(s.next_where(0.0, light)) == ["b-chat"]
    assert tags(s.next_where(0.0, light)) == ["c-chat"]
    assert s.next_where(0.0, light) == []
    assert s.deficits() == {"a": 1.0, "b": -1.0, "c": -1.0}
    # b and c pay it back with their next turn's grant: a's two agent calls go first.
    assert [tags(b) for b in iter(lambda: s.next_batch(0.0), [])] == [
        ["a-agent"],
        ["a-agent2"],
        ["b-agent"],
        ["c-agent"],
    ]


def test_fifo_scheduling_takes_the_first_arrival_or_nothing() -> None:
    s = make_scheduler({"a": "paid", "b": "paid"}, mode="fifo", max_batch_size=0)
    s.enqueue(make_request("a", program="agent", tag="a-agent"), 0.0)
    s.enqueue(make_request("b", program="chat", tag="b-chat"), 0.0)
    assert s.next_where(0.0, light) == []
    assert tags(s.next_batch(0.0)) == ["a-agent"]
    assert tags(s.next_where(0.0, light)) == ["b-chat"]


@given(
    st.lists(
        st.tuples(st.sampled_from("abcd"), st.sampled_from(["chat", "agent"]),
                  st.integers(1, 50)),
        min_size=1, max_size=40,
    ),
    st.sampled_from(["vtc", "drr"]),
)  # fmt: skip
def test_it_takes_a_request_the_condition_takes_or_none_is_queued(
    queued: list[tuple[str, str, int]], fairness: str
) -> None:
    """Whatever is queued: a qualifying request where one is queued (and none
    otherwise), each one queued, none twice; the rest stays for next_batch."""
    s = make_scheduler({t: "paid" for t in "abcd"}, cost=CostUnit.TOKENS, fairness=fairness,
                       max_batch_size=0, quantum=16.0)  # fmt: skip
    reqs = [make_request(t, tokens=n, program=p, tag=i) for i, (t, p, n) in enumerate(queued)]
    for r in reqs:
        s.enqueue(r, 0.0)
    taken: list[int] = []
    while got := s.next_where(0.0, light):
        assert len(got) == 1 and light(got[0])
        taken.extend(tags(got))
    # What is left: heads of every tenant are not light (or the tenant has none left).
    rest = [t for batch in iter(lambda: s.next_batch(0.0), []) for t in tags(batch)]
    assert sorted(taken + rest) == list(range(len(reqs)))
    lights = {i for i, r in enumerate(reqs) if light(r)}
    assert set(taken) <= lights
