"""Engine mode's selector 2: virtual token counters (``fair_frontend.scheduler.vtc``).

Driven by a simulated engine on a step clock: ``slots`` requests run at once, each emits
one output token per step (charged back as it streams), and a slot that frees goes to
the scheduler's next choice, as ``EngineDispatcher`` gives it. Negative
controls run the same workload with request cost (one request per DRR turn).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st
from sched_support import TaggedRequest, make_policy

from fair_frontend.scheduler import (
    GlobalCaps,
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
    tenants: dict[str, TenantSpec], *, vtc: bool = True, tiers: tuple[str, ...] = ("paid",)
) -> Scheduler:
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
        fairness=VirtualTokenCounter() if vtc else None,
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


def test_returning_from_idle_banks_no_credit() -> None:
    """C was served nothing while A ran alone; when C comes back it shares from then on,
    it does not get the engine to itself until its counter catches up with A's."""
    s = engine_scheduler({"a": TenantSpec("paid"), "c": TenantSpec("paid")})
    backlog(s, "a", 5000, prompt=8, out=16)
    engine = Engine(s, slots=8, output=out_of)
    engine.fill()
    for _ in range(1000):
        engine.step()
    before = dict(engine.served)
    backlog(s, "c", 5000, prompt=8, out=16, at=float(engine.step_no))
    for _ in range(400):
        engine.step()
    since = {t: engine.served.get(t, 0.0) - before.get(t, 0.0) for t in ("a", "c")}
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
