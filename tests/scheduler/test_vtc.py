"""Engine mode's selector 2: virtual token counters (``fair_frontend.scheduler.vtc``).

Driven by a simulated engine on a step clock: ``slots`` requests run at once, each emits
one output token per step (charged back as it streams), and a slot that frees goes to
the scheduler's next choice, as ``EngineDispatcher`` gives it. Negative
controls run the same workload with request cost (one request per DRR turn).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_support import TaggedRequest, make_policy

from fair_frontend.scheduler import (
    DEFAULT_DEBT_CARRIED,
    GlobalCaps,
    QueuedRequest,
    Scheduler,
    TenantSpec,
    VirtualTokenCounter,
)
from fair_frontend.scheduler.cost import CostUnit


@dataclass
class Running:
    req: TaggedRequest
    left: int  # output tokens still to come


@dataclass
class Engine:
    """A continuous-batching engine with ``slots`` slots in front of one scheduler."""

    scheduler: Scheduler
    slots: int
    output: Callable[[TaggedRequest], int]  # output tokens of a request
    output_weight: float = 1.0
    charge_output: bool = True  # VTC charges output as it streams; DRR(requests) does not
    running: list[Running] = field(default_factory=list)
    served: dict[str, float] = field(default_factory=dict)  # input + output tokens
    first_slot: dict[str, int] = field(default_factory=dict)  # tenant -> step of 1st slot
    step_no: int = 0

    def fill(self) -> None:
        while len(self.running) < self.slots:
            batch = self.scheduler.next_batch(float(self.step_no))
            if not batch:
                return
            (req,) = batch
            assert isinstance(req, TaggedRequest)
            self.first_slot.setdefault(req.tenant, self.step_no)
            self.served[req.tenant] = self.served.get(req.tenant, 0.0) + req.tokens
            self.running.append(Running(req, self.output(req)))

    def step(self) -> None:
        """One decode step: every running request emits a token; finished ones leave."""
        self.step_no += 1
        for r in self.running:
            r.left -= 1
            tenant = r.req.tenant
            self.served[tenant] = self.served.get(tenant, 0.0) + self.output_weight
            if self.charge_output:
                self.scheduler.charge_back(tenant, self.output_weight)
        self.running = [r for r in self.running if r.left > 0]
        self.fill()


def engine_scheduler(
    tenants: dict[str, TenantSpec],
    *,
    vtc: bool = True,
    tiers: tuple[str, ...] = ("paid",),
    carried: VirtualTokenCounter | None = None,
) -> Scheduler:
    """VTC's own (no debt carried) unless ``carried`` is the policy to use."""
    policy = make_policy(
        cost=CostUnit.TOKENS if vtc else CostUnit.REQUESTS,
        max_batch_size=0,
        quantum=1.0,
        tiers=tiers,
    )
    return Scheduler(
        policy,
        tenants,
        GlobalCaps(max_queued=10**6),
        fairness=(carried or VirtualTokenCounter()) if vtc else None,
    )


def backlog(s: Scheduler, tenant: str, n: int, *, prompt: int, out: int, at: float = 0.0) -> None:
    for i in range(n):
        s.enqueue(TaggedRequest(tenant, 1, prompt, 0, 1, None, None, tag=(tenant, i, out)), at)


def out_of(req: TaggedRequest) -> int:
    return int(req.tag[2])


def shares(served: dict[str, float]) -> dict[str, float]:
    total = sum(served.values())
    return {t: v / total for t, v in served.items()}


def run_two_tenants(
    *, vtc: bool, weights: tuple[float, float], steps: int = 3000
) -> dict[str, float]:
    """A asks 16 output tokens per request, B 128 (1:8); both stay backlogged."""
    tenants = {
        "a": TenantSpec("paid", weight=weights[0]),
        "b": TenantSpec("paid", weight=weights[1]),
    }
    s = engine_scheduler(tenants, vtc=vtc)
    backlog(s, "a", 5000, prompt=8, out=16)
    backlog(s, "b", 5000, prompt=8, out=128)
    engine = Engine(s, slots=16, output=out_of, charge_output=vtc)
    engine.fill()
    for _ in range(steps):
        engine.step()
    return shares(engine.served)


def test_backlogged_tenants_with_outputs_1_to_8_get_equal_tokens() -> None:
    got = run_two_tenants(vtc=True, weights=(1, 1))
    assert abs(got["a"] - 0.5) < 0.02, got


def test_weights_2_to_1_give_token_shares_2_to_1() -> None:
    got = run_two_tenants(vtc=True, weights=(2, 1))
    assert abs(got["a"] - 2 / 3) < 0.02, got


def test_negative_control_request_cost_gives_the_long_generations_8_times_the_tokens() -> None:
    got = run_two_tenants(vtc=False, weights=(1, 1))
    # Equal requests, so tokens follow the output lengths: (8+128) / (8+16) = 5.7x.
    assert got["b"] / got["a"] > 5, got


def test_a_newcomer_gets_the_next_free_slot() -> None:
    """A holds every slot with long generations and a deep queue; B's first request
    takes the very next slot that frees, not one after A's queue."""
    s = engine_scheduler({"a": TenantSpec("paid"), "b": TenantSpec("paid")})
    backlog(s, "a", 1000, prompt=8, out=200)
    engine = Engine(s, slots=8, output=out_of)
    engine.fill()
    for _ in range(50):  # A is well ahead: every slot is busy, its counter high
        engine.step()
    # Stagger: one of A's slots frees at step 60, the others later.
    engine.running[0].left = 10
    backlog(s, "b", 5, prompt=8, out=4, at=float(engine.step_no))
    joined = engine.step_no
    while "b" not in engine.first_slot:
        engine.step()
    assert engine.first_slot["b"] == joined + 10


def c_back_after_a_alone(
    vtc: VirtualTokenCounter | None = None, *, known: bool = False
) -> dict[str, float]:
    """A runs alone on 8 slots for 1,000 steps (C, if ``known``, served once before);
    then C queues as much as A: each one's service over the next 400 steps."""
    s = engine_scheduler({"a": TenantSpec("paid"), "c": TenantSpec("paid")}, carried=vtc)
    if known:
        backlog(s, "c", 1, prompt=8, out=16)  # known to the tier, then idle
    backlog(s, "a", 5000, prompt=8, out=16)
    engine = Engine(s, slots=8, output=out_of)
    engine.fill()
    for _ in range(1000):
        engine.step()
    before = dict(engine.served)
    backlog(s, "c", 5000, prompt=8, out=16, at=float(engine.step_no))
    for _ in range(400):
        engine.step()
    return {t: engine.served.get(t, 0.0) - before.get(t, 0.0) for t in ("a", "c")}


def test_returning_from_idle_banks_no_credit() -> None:
    """C was served nothing while A ran alone; when C comes back it shares from then on,
    it does not get the engine to itself until its counter catches up with A's."""
    since = c_back_after_a_alone()
    # Lifted to A's counter: equal shares from its return (a bank would give C ~100 %).
    assert abs(since["c"] / (since["a"] + since["c"]) - 0.5) < 0.1, since


def test_a_refund_lowers_the_counter() -> None:
    vtc = VirtualTokenCounter()
    s = engine_scheduler({"a": TenantSpec("paid"), "b": TenantSpec("paid")})
    backlog(s, "a", 2, prompt=10, out=1)
    backlog(s, "b", 2, prompt=10, out=1)
    s.next_batch(0.0)  # a (joined first) is charged 10
    s.next_batch(0.0)  # b is charged 10
    s.charge_back("a", -5)  # a's request cost 5 less than charged
    assert s.deficits() == {"a": 5.0, "b": 10.0}
    assert isinstance(s.fairness, type(vtc))


@settings(max_examples=60, deadline=None)
@given(
    slots=st.integers(1, 6),
    outs=st.lists(st.integers(1, 20), min_size=2, max_size=2),
    prompts=st.lists(st.integers(1, 20), min_size=2, max_size=2),
    weights=st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=2, max_size=2),
    steps=st.integers(1, 300),
)
def test_bound_b_holds_for_backlogged_tenants(
    slots: int, outs: list[int], prompts: list[int], weights: list[float], steps: int
) -> None:
    """|S_a/w_a - S_b/w_b| <= U_a + U_b with U_f = (I + O * S) / w_f (module docstring)."""
    tenants = {
        "a": TenantSpec("paid", weight=weights[0]),
        "b": TenantSpec("paid", weight=weights[1]),
    }
    s = engine_scheduler(tenants)
    for t, prompt, out in zip("ab", prompts, outs, strict=True):
        backlog(s, t, 2000, prompt=prompt, out=out)
    engine = Engine(s, slots=slots, output=out_of)
    engine.fill()
    for _ in range(steps):
        engine.step()
    i_max, o_max = max(prompts), max(outs)
    bound = sum((i_max + o_max * slots) / w for w in weights)
    diff = engine.served["a"] / weights[0] - engine.served.get("b", 0.0) / weights[1]
    assert abs(diff) <= bound + 1e-9


def run_agents(debt_carried: float, seed: int, steps: int = 3000) -> dict[str, float]:
    """Four agents at weights 2:1:1:1 on 32 slots: each sends a step of 16-32 calls of 8
    output tokens at once and the next step only when all of them have ended (its queue
    is empty while the step's last calls run). Token shares after a warm-up."""
    rng = random.Random(seed)
    weights = {"a": 2.0, "b": 1.0, "c": 1.0, "d": 1.0}
    tenants = {t: TenantSpec("paid", weight=w) for t, w in weights.items()}
    s = engine_scheduler(tenants, carried=VirtualTokenCounter(debt_carried, slots=32))
    engine = Engine(s, slots=32, output=out_of)
    for _ in range(steps):
        busy = {r.req.tenant for r in engine.running}
        for t in weights:
            if t not in busy and not s.depth(t):
                backlog(s, t, rng.randint(16, 32), prompt=2, out=8, at=float(engine.step_no))
        engine.fill()
        if engine.step_no == steps // 5:
            engine.served.clear()
        engine.step()
    return shares(engine.served)


def worst_share_error(got: dict[str, float]) -> float:
    weights = {"a": 0.4, "b": 0.2, "c": 0.2, "d": 0.2}
    return max(abs(got[t] - w) / w for t, w in weights.items())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_agents_between_steps_keep_their_debt_and_their_weights(seed: int) -> None:
    """With the default debt carried (two turnovers) the agents' token shares follow
    their weights to within 4-5.4 % here (what is left is the agents' own demand: a step
    ends with its last call); VTC's own lift (the negative control) drops what the
    heavier agent was owed at every step: 14-19 % off (the issue's 'shares follow the
    agents' demand, not the weights')."""
    carried = worst_share_error(run_agents(DEFAULT_DEBT_CARRIED, seed))
    lifted = worst_share_error(run_agents(0.0, seed))
    assert carried < 0.06, carried
    assert lifted > 0.12, lifted
    assert carried < 0.4 * lifted, (carried, lifted)


def holds_no_slot(running: list[Running]) -> Callable[[QueuedRequest], bool]:
    """A light slot's test: the request's program holds none."""
    busy = {(r.req.tenant, r.req.program) for r in running}
    return lambda r: (r.tenant, r.program) not in busy


def run_agents_and_chats(
    debt_carried: float, light: int, seed: int, steps: int = 4000
) -> dict[str, float]:
    """The agents benchmark on the fake clock (``benchmarks/bench_agents.py``): four
    tenants at weights 2:1:1:1 on 64 slots, 8 reserved (no tenant holds more than 56),
    ``light`` light slots, each slot given as ``EngineDispatcher`` gives it. Each tenant
    runs an agent program (steps of 32-64 calls of 32 output tokens, the next when all
    have ended) and a chat program (one call of 32 tokens at a time, 5-15 steps of think
    time). Token shares after a warm-up (the first fifth of the ``steps``)."""
    slots, reserved, out = 64, 8, 32
    rng = random.Random(seed)
    weights = {"a": 2.0, "b": 1.0, "c": 1.0, "d": 1.0}
    tenants = {t: TenantSpec("paid", weight=w) for t, w in weights.items()}
    s = engine_scheduler(tenants, carried=VirtualTokenCounter(debt_carried, slots=slots))
    running: list[Running] = []
    served = dict.fromkeys(weights, 0.0)
    step_left = dict.fromkeys(weights, 0)  # calls of the agent's step not ended yet
    chat_at: dict[str, int | None] = {t: rng.randint(1, 10) for t in weights}  # None: one is out
    calls = 0

    def send(tenant: str, program: str, now: int) -> None:
        nonlocal calls
        calls += 1
        req = TaggedRequest(tenant, 1, 2, 0, 1, None, None, program=program, tag=calls)
        s.enqueue(req, float(now))

    for now in range(steps):
        for t in weights:
            if not step_left[t]:
                step_left[t] = rng.randint(32, 64)
                for _ in range(step_left[t]):
                    send(t, "agent", now)
            at = chat_at[t]
            if at is not None and now >= at:
                chat_at[t] = None
                send(t, "chat", now)
        while len(running) < slots:
            # ``_may_send``: nothing goes while the next in line holds its cap.
            head = s.peek(float(now))
            if head is None or sum(r.req.tenant == head.tenant for r in running) >= (
                slots - reserved
            ):
                break
            if light and slots - len(running) <= light:  # ``_next``: light slots
                got = s.next_where(float(now), holds_no_slot(running))
            else:
                got = s.next_batch(float(now))
            if not got:
                break
            (req,) = got
            assert isinstance(req, TaggedRequest)
            served[req.tenant] += req.tokens if now >= steps // 5 else 0.0
            running.append(Running(req, out))
        for r in running:
            r.left -= 1
            tenant = r.req.tenant
            s.charge_back(tenant, 1.0, r.req.program)
            served[tenant] += 1.0 if now >= steps // 5 else 0.0
            if not r.left and r.req.program == "agent":
                step_left[tenant] -= 1
            elif not r.left:
                chat_at[tenant] = now + rng.randint(5, 15)
        running = [r for r in running if r.left]
    return shares(served)


@pytest.mark.parametrize("light", [0, 4])
@pytest.mark.parametrize("seed", [1, 2])
def test_agents_beside_chats_with_reserved_and_light_slots_keep_their_weights(
    light: int, seed: int
) -> None:
    """The agents benchmark's workload on the fake clock, slots given as the engine
    dispatcher gives them: with the default debt carried the token shares are within
    4 % of the weights (1.5-2.2 % with these seeds, 0.4-2.7 % over six), with VTC's own
    lift 16-17 % off (13-20 % over six), as the benchmark measures its lifted
    configurations (16-22 %)."""
    carried = worst_share_error(run_agents_and_chats(DEFAULT_DEBT_CARRIED, light, seed))
    lifted = worst_share_error(run_agents_and_chats(0.0, light, seed))
    assert carried < 0.04, carried
    assert lifted > 0.10, lifted


def test_the_debt_carried_is_at_most_one_turnover() -> None:
    """C, served once, comes back after a long idle: it gets back at most L (one
    turnover of 8 slots of the mean cost, over its weight) more than A from then on,
    plus the bound's U terms; and it does get back debt (VTC's own lift gives it
    none)."""
    gained = {}
    for debt in (0.0, 1.0):
        vtc = VirtualTokenCounter(debt, slots=8)
        since = c_back_after_a_alone(vtc, known=True)
        bank = vtc.carried(1.0)  # as told at C's join (nothing joined since)
        gained[debt] = since["c"] - since["a"]
        u = 2 * (8 + 16 * 8)  # U_a + U_c
        assert gained[debt] <= bank + u, (debt, gained, bank)
    # 8 slots of 8 + 16 tokens (a little less: the running requests' output is to come)
    assert vtc.carried(1.0) == pytest.approx(8 * 24, rel=0.05)
    assert gained[1.0] - gained[0.0] > 0.5 * vtc.carried(1.0), gained


def test_joiners_carry_debt_from_the_floor_not_from_each_other() -> None:
    """Tenants joining one after another each start at most L below the tier's floor V
    (the most the least active counter has been): the second joiner is not lifted to
    the first one's lowered counter less L again."""
    vtc = VirtualTokenCounter(1.0, slots=4)
    tenants = {t: TenantSpec("paid") for t in "abcd"}
    s = engine_scheduler(tenants, carried=vtc)
    for t in "bcd":  # known to the tier (a new tenant starts at V: it was owed nothing)
        backlog(s, t, 1, prompt=8, out=1)
    backlog(s, "a", 1000, prompt=8, out=16)
    engine = Engine(s, slots=4, output=out_of)
    engine.fill()
    for _ in range(500):
        engine.step()
    v = s.deficits()["a"]
    for t in "bcd":
        backlog(s, t, 3, prompt=8, out=16, at=float(engine.step_no))
    bank = vtc.carried(1.0)  # the mean request cost is told at each join
    assert 0 < bank < v
    counters = s.deficits()
    assert counters["b"] == counters["c"] == counters["d"] == pytest.approx(v - bank)


def test_a_new_tenant_of_a_debt_carrying_tier_still_gets_the_next_free_slot() -> None:
    """(N) with debt carried: B's first request takes the very next slot that frees, and
    B starts at the floor (A's counter), not below it: it was owed nothing."""
    vtc = VirtualTokenCounter(1.0, slots=8)
    s = engine_scheduler({"a": TenantSpec("paid"), "b": TenantSpec("paid")}, carried=vtc)
    backlog(s, "a", 1000, prompt=8, out=200)
    engine = Engine(s, slots=8, output=out_of)
    engine.fill()
    for _ in range(50):
        engine.step()
    engine.running[0].left = 10
    backlog(s, "b", 5, prompt=8, out=4, at=float(engine.step_no))
    counters = s.deficits()
    assert counters["b"] == counters["a"]
    joined = engine.step_no
    while "b" not in engine.first_slot:
        engine.step()
    assert engine.first_slot["b"] == joined + 10


@pytest.mark.parametrize("debt", [-1.0, float("nan"), float("inf")])
def test_debt_carried_must_be_a_number_at_least_0(debt: float) -> None:
    with pytest.raises(ValueError, match="debt_carried"):
        VirtualTokenCounter(debt, slots=8)


@settings(max_examples=60, deadline=None)
@given(
    slots=st.integers(1, 6),
    outs=st.lists(st.integers(1, 20), min_size=2, max_size=2),
    prompts=st.lists(st.integers(1, 20), min_size=2, max_size=2),
    debt=st.sampled_from([0.5, 1.0, 2.0]),
    bursts=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=8),
)
def test_a_tenant_back_with_debt_gains_at_most_its_carried_debt_and_the_bound(
    slots: int, outs: list[int], prompts: list[int], debt: float, bursts: list[tuple[int, int]]
) -> None:
    """A stays backlogged; B comes and goes in bursts (an idle gap, then a few requests).
    (V): every backlogged counter stays >= V - L_f. (B) over each of B's busy periods,
    from its join: B's service less A's is at most U_a + U_b + L_b."""
    vtc = VirtualTokenCounter(debt, slots=slots)
    s = engine_scheduler({"a": TenantSpec("paid"), "b": TenantSpec("paid")}, carried=vtc)
    backlog(s, "b", 1, prompt=prompts[1], out=outs[1])  # known to the tier
    backlog(s, "a", 5000, prompt=prompts[0], out=outs[0])
    engine = Engine(s, slots=slots, output=out_of)
    engine.fill()
    u = 2 * (max(prompts) + max(outs) * slots)
    for gap, count in bursts:
        for _ in range(gap):
            engine.step()
        while s.depth("b"):  # B's last burst has not all had slots yet
            engine.step()
        backlog(s, "b", count, prompt=prompts[1], out=outs[1], at=float(engine.step_no))
        bank = vtc.carried(1.0)  # as told at B's join
        floor = s.export_fairness().tiers["paid"].floor  # max(V, the least backlogged)
        for tenant, counter in s.deficits().items():
            assert counter >= floor - bank - 1e-9, (tenant, counter, floor, bank)
        start = dict(engine.served)
        while s.depth("b"):
            engine.step()
        for _ in range(max(outs)):  # B's last requests run out
            engine.step()
        gained = {t: engine.served.get(t, 0.0) - start.get(t, 0.0) for t in "ab"}
        assert gained["b"] - gained["a"] <= u + bank + 1e-9, (gained, u, bank)


def test_requests_taken_out_of_turn_count_in_the_mean_request_cost() -> None:
    """The debt carried is measured in requests of the mean cost: requests a light slot
    takes out of turn (``next_where``, charged as a charge-back) count as requests, as
    those the policy picks do. Counted as cost alone they made the mean (and so the debt)
    grow without bound on a busy engine, where most grants go out of turn, and a
    returning tenant then held every slot (seen: two of four tenants got 4 % of the
    tokens for 40 s)."""
    vtc = VirtualTokenCounter(1.0, slots=8)
    s = engine_scheduler({t: TenantSpec("paid") for t in "abc"}, carried=vtc)
    backlog(s, "c", 1, prompt=10, out=0)  # known to the tier
    s.next_batch(0.0)
    backlog(s, "a", 100, prompt=10, out=0)
    backlog(s, "b", 100, prompt=10, out=0)
    for i in range(150):
        taken = s.next_where(0.0, lambda r: True) if i % 10 else s.next_batch(0.0)
        assert len(taken) == 1
        s.charge_back(taken[0].tenant, 20.0)  # its output, as it streams
    backlog(s, "c", 1, prompt=10, out=0)
    assert vtc.carried(1.0) == pytest.approx(8 * 30, rel=0.01)
