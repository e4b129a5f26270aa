"""The core's admission and accounting on fake clocks: one outcome per request, and the
tokens charged to rate limits and fair shares as the streams report them.

A real ``Core`` over two models, without Triton: ``embed`` (batched; a ``FakeTriton``
whose every batch waits for the test to answer it) and ``llm`` (decoupled, in engine
mode, token cost: each request's slot is granted to its shell, ``records.Grant``, and the
test plays the shell, reporting tokens and the stream's end). Both clocks are fake: the
loop clock (a ``StepClock``: deadlines, dispatch, latencies) and the wall clock the rate
limits count on (the same fake time, shifted to the epoch); the limiter keeps its windows
in memory, where the test reads them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc
import numpy as np
import pytest
from dispatch_support import (
    LLM,
    LLM_INFO,
    SETTLE_ROUNDS,
    WIDTH,
    FakeTriton,
    Shell,
    StepClock,
    embed_info,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fair_frontend.admission import RateLimiter
from fair_frontend.admission.storage import MemoryStorage
from fair_frontend.backends.protocol import BackendServer
from fair_frontend.config import Config, parse_config
from fair_frontend.core.dispatch import CoreRequest
from fair_frontend.core.service import Core
from fair_frontend.errors import FrontendError, Unavailable, UpstreamError
from fair_frontend.models import ModelInfo
from fair_frontend.observability.observe import Observer
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.scheduler import Scheduler
from fair_frontend.usage import Usage
from fair_frontend.wire.records import Answer, Call, Gaps, gaps_from

EMBED = "embed"
EPOCH = 1.7e9  # the fake wall clock: the fake monotonic time, shifted by this
SLOTS = 2
TOKENS_PER_MINUTE = {"a": 2_000, "b": 150}  # b: its own, tighter limit (tenant limits)
EMBED_PER_MINUTE = 2  # requests of embed per tenant per minute (the tier's limit)
TENANTS = tuple(TOKENS_PER_MINUTE)


def core_config() -> Config:
    return parse_config(
        {
            "tiers": ["paid"],
            "tier_models": {"paid": ["*"]},
            "tenants": {
                "a": {"tier": "paid", "api_keys": ["a-test-key"]},
                "b": {
                    "tier": "paid",
                    "api_keys": ["b-test-key"],
                    "limits": {LLM: {"tokens_per_minute": TOKENS_PER_MINUTE["b"]}},
                },
            },
            "default_endpoint": {"throttle": False},
            "endpoints": {
                EMBED: {"throttle": False},
                LLM: {
                    "cost": "tokens",
                    "max_inflight": SLOTS,
                    "token_output": "text_output",
                    "throttle": False,
                },
            },
            "tier_limits": {
                "paid": {
                    LLM: {"tokens_per_minute": TOKENS_PER_MINUTE["a"]},
                    EMBED: {"requests_per_minute": EMBED_PER_MINUTE},
                }
            },
        }
    )


# ---- the fakes around the core -----------------------------------------------------------


class Triton(FakeTriton):
    """The fake Triton of ``embed``; ready whenever asked (an outage ends at the probe)."""

    async def server_ready(self) -> bool:
        return True


@dataclass(frozen=True)
class Finished:
    """One ``request_finished``, with the fake time it was told at."""

    request_id: str
    outcome: Outcome
    latency_s: float | None
    at: float


class Recorder(Observer):
    """Every request's end, and every token count, as the core tells its observers."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self.finished: list[Finished] = []
        self.first_token_s: list[float] = []

    def request_finished(
        self,
        *,
        tenant: str | None,
        model: str,
        outcome: Outcome,
        queued_s: float | None,
        request_id: str = "",
        latency_s: float | None = None,
        error: str | None = None,
        usage: Usage | None = None,
        service_s: float | None = None,
    ) -> None:
        self.finished.append(Finished(request_id, outcome, latency_s, self.clock.now()))

    def tokens_produced(
        self,
        *,
        tenant: str,
        model: str,
        tokens: int,
        first_token_s: float | None,
        inter_token: Gaps | None = None,
    ) -> None:
        if first_token_s is not None:
            self.first_token_s.append(first_token_s)


@dataclass(eq=False)
class Sent:
    """One call the test made, and what became of it on the test's side."""

    call: Call
    shell: Shell
    req: CoreRequest | None  # None: refused at once
    ended: bool = False  # granted: its shell said the stream ended (or the shell is gone)

    @property
    def id(self) -> str:
        return self.call.request.id

    @property
    def granted(self) -> bool:
        return any(g.id == self.call.id for g in self.shell.grants)

    def answers(self) -> list[Answer]:
        return [a for a in self.shell.answers if a.id == self.call.id]


class Rig:
    """A ``Core`` on fake clocks, both models' runtimes ready (no lookup in Triton)."""

    def __init__(self, of: Rig | None = None, ready: Sequence[str] = (EMBED, LLM)) -> None:
        """``of``: another rig whose clock and limits' storage this one shares (a
        standby of the same fleet, with Redis); ``ready``: the models whose runtimes are
        made at once (another is looked up as a call for it comes)."""
        self.clock: StepClock = of.clock if of is not None else StepClock()
        self.start = self.clock.now()
        self.triton = Triton(self.clock)
        self.storage: MemoryStorage = of.storage if of is not None else MemoryStorage()
        self.recorder = Recorder(self.clock)
        self.core = Core(
            core_config(),
            cast(BackendServer, self.triton),
            observers=[self.recorder],
            limiter=RateLimiter(self.storage),
            clock=self.clock,
            wall=lambda: EPOCH + self.clock.now(),
        )
        infos = {EMBED: embed_info(), LLM: LLM_INFO}
        for model in ready:
            self.core._runtime(model, infos[model])
        self.sent: list[Sent] = []
        self._ids = itertools.count(1)

    # ---- calls --------------------------------------------------------------------------

    def _call(self, model: str, tenant: str, request: InferRequest, **kw: Any) -> Call:
        return Call(
            id=int(request.id.rpartition(":")[2]),
            tenant=tenant,
            priority=1,
            arrived=self.clock.now(),
            arrived_wall=EPOCH + self.clock.now(),
            lengths=None,
            request=request,
            **kw,
        )

    def submit_embed(
        self, shell: Shell, tenant: str, *, rows: int = 1, timeout_s: float | None = None
    ) -> Sent:
        n = next(self._ids)
        data = np.full((rows, WIDTH), n, dtype=np.int32)
        request = InferRequest(
            model=EMBED,
            id=f"{tenant}:{n}",
            inputs=[Tensor("INPUT_IDS", "INT32", (rows, WIDTH), data)],
            priority=1,
            timeout_us=round(timeout_s * 1e6) if timeout_s is not None else None,
        )
        call = self._call(
            EMBED, tenant, request, rows=rows, tokens=rows * WIDTH, nbytes=request.nbytes
        )
        return self._submit(call, shell)

    def submit_llm(
        self,
        shell: Shell,
        tenant: str,
        *,
        prompt: int,
        max_tokens: int,
        timeout_s: float | None = None,
    ) -> Sent:
        n = next(self._ids)
        text = Tensor("text_input", "BYTES", (1,), np.array([b"hi"], dtype=object))
        request = InferRequest(
            model=LLM,
            id=f"{tenant}:{n}",
            inputs=[text],
            timeout_us=round(timeout_s * 1e6) if timeout_s is not None else None,
        )
        call = self._call(
            LLM,
            tenant,
            request,
            rows=1,
            tokens=prompt + max_tokens,
            nbytes=request.nbytes,
            stream=True,
            max_tokens=max_tokens,
        )
        return self._submit(call, shell)

    def _submit(self, call: Call, shell: Shell) -> Sent:
        sent = Sent(call, shell, self.core.submit(call, shell))
        self.sent.append(sent)
        return sent

    # ---- what happened ------------------------------------------------------------------

    def outcomes(self, sent: Sent) -> list[Outcome]:
        return [f.outcome for f in self.recorder.finished if f.request_id == sent.id]

    def streams(self) -> list[Sent]:
        """The granted requests whose shell has not said their stream ended."""
        return [s for s in self.sent if s.granted and not s.ended]

    def limit_tokens(self, tenant: str) -> int:
        """The tokens counted against ``tenant``'s tokens_per_minute on llm, now."""
        window = self.storage._windows.get((f"{tenant}:{LLM}", "tokens", 60.0))
        if window is None:
            return 0
        window.prune(round((EPOCH + self.clock.now()) * 1e6))
        return window.total

    def vtc(self, tenant: str) -> float:
        """``tenant``'s virtual token counter on llm (queued or not)."""
        scheduler: Scheduler = self.core.runtimes[LLM].scheduler
        return sum(t.fair_state.counters.get(tenant, 0.0) for t in scheduler._tiers)

    # ---- time and the event loop --------------------------------------------------------

    async def settle(self) -> None:
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(0)

    async def advance(self, seconds: float) -> None:
        """Move the fake time on, timer by timer, letting the tasks run after each."""
        until = self.clock.now() + seconds
        await self.settle()
        while (due := self.clock.next_timer) is not None and due <= until:
            self.clock.advance_to(due)
            await self.settle()
        self.clock.advance_to(until)
        await self.settle()


def end_stream(rig: Rig, sent: Sent, tokens: int, how: str) -> None:
    """The shell of granted ``sent`` tells its last ``tokens``, then that its stream ended:
    ``ok``, ``failed`` (the model's error), ``unreachable`` (Triton could not be reached)
    or ``cancelled``."""
    assert sent.req is not None
    if tokens:
        rig.core.produced(sent.req, tokens)
    err: FrontendError | None = None
    if how == "failed":
        err = UpstreamError("llm: cannot sample", grpc.StatusCode.INTERNAL, 500)
    elif how == "unreachable":
        err = Unavailable("connection reset")
    sent.ended = True
    rig.core.stream_ended(sent.req, "1" if err is None else "", err, how == "cancelled")


# ---- one outcome per request ---------------------------------------------------------------

# How often each comes (the flushes, a shell gone and a shutdown's answer, rarely).
KINDS = [*["llm", "advance"] * 4, *["embed", "produce", "end", "answer"] * 2, "cancel"]
KINDS += ["drop", "fail_queued"]
# Every op draws the same fields and reads those it needs: (kind, tenant, shell, n, m,
# timeout, time step, how a stream ends, a batch answered ok).
Op = tuple[str, str, int, int, int, float | None, float, str, bool]
OPS = st.tuples(
    st.sampled_from(KINDS),
    st.sampled_from(TENANTS),
    st.integers(0, 1),
    st.integers(1, 40),
    st.integers(1, 40),
    st.sampled_from([0.4, None, 2.0]),
    st.sampled_from([0.3, 1.0, 0.05]),
    st.sampled_from(["ok", "failed", "cancelled", "unreachable"]),
    st.booleans(),
)


def pick(items: list[Sent], k: int) -> Sent | None:
    return items[k % len(items)] if items else None


async def play(rig: Rig, ops: list[Op], shells: list[Shell]) -> None:
    """Run ``ops`` against the core, checking the fair-share charge at every report."""
    core = rig.core
    for what, tenant, j, n, m, timeout_s, step, how, ok in ops:
        if what == "embed":
            rig.submit_embed(shells[j], tenant, rows=1 + n % 3, timeout_s=timeout_s)
        elif what == "llm":
            rig.submit_llm(shells[j], tenant, prompt=n, max_tokens=m, timeout_s=timeout_s)
        elif what == "cancel":
            sent = pick([s for s in rig.sent if s.req is not None], n + m)
            if sent is not None:
                assert sent.req is not None
                core.cancel(sent.req)
        elif what == "advance":
            await rig.advance(step)
        elif what == "answer":
            pending = rig.triton.pending
            if pending:
                if ok:
                    pending[n % len(pending)].ok()
                else:
                    err = UpstreamError("bad row", grpc.StatusCode.INVALID_ARGUMENT, 400)
                    pending[n % len(pending)].fail(err)
        elif what in ("produce", "end"):
            sent = pick(rig.streams(), n)
            if sent is None:
                continue
            assert sent.req is not None
            tokens = m % 9
            before, live = rig.vtc(sent.call.tenant), not sent.req.answered
            if what == "produce":
                core.produced(sent.req, tokens)
            else:
                end_stream(rig, sent, tokens, how)
            # The fair share is charged exactly the tokens reported, at once (output
            # weight 1), and nothing for a stream the core no longer counts.
            assert rig.vtc(sent.call.tenant) - before == (tokens if live else 0)
        elif what == "drop":
            shell = shells[j]
            core.drop_route(shell)
            for s in rig.sent:
                if s.shell is shell:
                    s.ended = True  # a shell gone says nothing more
            shells[j] = Shell(f"{shell.name}'")  # its successor
        elif what == "fail_queued":
            for runtime in core.runtimes.values():
                runtime.fail_queued(Unavailable("the frontend is shutting down"))
        await rig.settle()


async def finish(rig: Rig) -> None:
    """Let every request end: answer every batch, end every stream, move time on."""
    for _ in range(40):
        for batch in rig.triton.pending:
            batch.ok()
        for sent in rig.streams():
            end_stream(rig, sent, 1, "ok")
        await rig.advance(0.5)
        if all(rt.idle for rt in rig.core.runtimes.values()) and not rig.triton.pending:
            return
    raise AssertionError("requests still queued or in flight after 20 s")


def check_one_outcome_each(rig: Rig, *, taken_back: bool) -> None:
    """Every call ended once; its route had at most one answer, and only where its
    client still waits for one from the core."""
    ids = [s.id for s in rig.sent]
    assert len(set(ids)) == len(ids)
    assert sorted(f.request_id for f in rig.recorder.finished) == sorted(ids)
    for sent in rig.sent:
        (outcome,) = rig.outcomes(sent)
        answers = sent.answers()
        assert len(answers) <= 1
        if sent.granted:
            assert len([g for g in sent.shell.grants if g.id == sent.call.id]) == 1
            # The shell answers its stream's client; the core only when it takes the
            # slot back (shutdown's drain).
            if answers:
                assert taken_back and answers[0].fault is not None
                assert answers[0].fault.kind == "Unavailable"
        elif outcome is Outcome.CANCELLED:
            assert not answers  # its client went away
        else:
            assert len(answers) == 1
        if answers and answers[0].fault is not None:
            assert answers[0].fault.outcome == outcome.value
        elif answers:
            assert outcome is Outcome.DISPATCHED


def check_latencies(rig: Rig) -> None:
    """Latencies are the fake clock's: from the call's arrival to its end, exactly."""
    arrived = {s.id: s.call.arrived for s in rig.sent}
    for f in rig.recorder.finished:
        assert f.latency_s == f.at - arrived[f.request_id]
    assert all(0 <= s <= rig.clock.now() - rig.start for s in rig.recorder.first_token_s)


def check_charge_back(rig: Rig) -> None:
    """Token limits count, for every request they admitted, its input and what it
    produced: the max_tokens counted at admission is corrected when it ends."""
    assert rig.clock.now() - rig.start < 55.0  # every admission still in the minute
    for tenant in TENANTS:
        counted = [
            s
            for s in rig.sent
            if s.call.request.model == LLM
            and s.call.tenant == tenant
            and rig.outcomes(s) != [Outcome.REJECTED_RATE]
        ]
        expected = sum(
            s.call.tokens - s.call.max_tokens + (s.req.produced if s.req else 0) for s in counted
        )
        assert rig.limit_tokens(tenant) == expected, tenant


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=10, max_size=30), shutdown=st.booleans())
def test_every_call_ends_once_and_token_limits_count_what_was_produced(
    ops: list[Op], shutdown: bool
) -> None:
    """A random mix of submits (some refused by their rate limits), cancels (queued or
    granted), deadlines that expire, batches answered or failed, streams granted,
    reporting tokens and ending (done, failed, cancelled, Triton unreachable), a shell
    gone and a shutdown's answer to what is queued; then either every stream ends, or a
    shutdown takes back the slots still held."""

    async def scenario() -> None:
        rig = Rig()
        shells = [Shell("s0"), Shell("s1")]
        await play(rig, ops, shells)
        if shutdown:
            rig.storage.close = _kept  # type: ignore[method-assign]  # a patch: read after
            await rig.core.shutdown(grace_s=0.0)
            await rig.settle()
        else:
            await finish(rig)
        check_one_outcome_each(rig, taken_back=shutdown)
        check_latencies(rig)
        check_charge_back(rig)
        for f in rig.recorder.finished:  # what the draw covered (--hypothesis-show-statistics)
            event(f"outcome: {f.outcome.value}")
        if any(s.granted and s.answers() for s in rig.sent):
            event("a slot taken back by the shutdown")

    run(scenario)


async def _kept() -> None:
    """``MemoryStorage.close`` that keeps the windows (the test reads them after)."""


# ---- the charge-back, step by step ---------------------------------------------------------


async def test_a_stream_is_counted_in_its_limit_as_its_input_and_what_it_produced() -> None:
    rig = Rig()
    shell = Shell("s")
    first = rig.submit_llm(shell, "a", prompt=10, max_tokens=50)
    second = rig.submit_llm(shell, "a", prompt=5, max_tokens=20)
    assert rig.limit_tokens("a") == 60 + 25  # admission counts the output asked for
    await rig.settle()
    assert first.granted and second.granted
    assert first.req is not None and second.req is not None
    await rig.advance(2.0)
    rig.core.produced(first.req, 7, 2.0, gaps_from([0.1] * 6))  # as its shell timed them
    end_stream(rig, first, 3, "ok")  # 10 produced of 50
    assert rig.limit_tokens("a") == 10 + 10 + 25
    rig.core.produced(second.req, 30, 2.0)  # more than it asked for (the model's choice)
    end_stream(rig, second, 0, "cancelled")
    assert rig.limit_tokens("a") == 10 + 10 + 5 + 30
    await rig.settle()
    assert rig.outcomes(first) == [Outcome.DISPATCHED]
    assert rig.outcomes(second) == [Outcome.CANCELLED]
    # The first tokens as the shell timed them; the ends on the fake clock, from arrival.
    assert rig.recorder.first_token_s == [2.0, 2.0]
    assert [f.latency_s for f in rig.recorder.finished] == [2.0, 2.0]


async def test_a_new_leader_corrects_the_limits_of_a_stream_it_adopted() -> None:
    """A failover mid-stream: the shell tells the new leader of the stream it relays
    (``Running``: when its limits counted it, the tokens relayed so far), and when it ends
    the new leader corrects its tenant's count by what it produced in all, as the old
    leader would have. Adopted with no mark (the control), the 50 asked for stay counted."""
    for carried in (True, False):
        old = Rig()
        shell = Shell("s")
        sent = old.submit_llm(shell, "a", prompt=10, max_tokens=50)
        await old.settle()
        assert sent.granted and sent.req is not None
        (grant,) = shell.grants
        assert grant.limits_at == EPOCH + old.clock.now()  # its admission, on the wall
        old.core.produced(sent.req, 7, 1.0)  # then the old leader is gone
        await old.advance(1.0)
        new = Rig(of=old)  # the standby: the same limits' storage (Redis)
        running = (grant.limits_at, 7) if carried else (-1.0, 0)
        req = new.core.adopt(sent.call, shell, 0, *running)
        assert req is not None
        await new.settle()
        new.core.produced(req, 3)
        new.core.stream_ended(req, "1", None, False)
        assert new.limit_tokens("a") == (10 + 10 if carried else 10 + 50)


async def test_a_limit_refuses_what_asks_for_more_than_is_left_and_counts_nothing() -> None:
    rig = Rig()
    shell = Shell("s")
    kept = rig.submit_llm(shell, "b", prompt=50, max_tokens=80)  # b: 150 a minute
    refused = rig.submit_llm(shell, "b", prompt=10, max_tokens=50)
    assert refused.req is None and rig.outcomes(refused) == [Outcome.REJECTED_RATE]
    (answer,) = refused.answers()
    assert answer.fault is not None and answer.fault.kind == "RateLimited"
    assert rig.limit_tokens("b") == 130
    await rig.settle()
    assert kept.req is not None
    end_stream(rig, kept, 20, "ok")  # the 60 it did not produce are free again
    assert rig.limit_tokens("b") == 70
    again = rig.submit_llm(shell, "b", prompt=10, max_tokens=50)
    assert again.req is not None and rig.limit_tokens("b") == 130


async def test_the_fair_share_is_charged_the_tokens_reported_as_they_come() -> None:
    rig = Rig()
    shell = Shell("s")
    a = rig.submit_llm(shell, "a", prompt=10, max_tokens=50)
    b = rig.submit_llm(shell, "b", prompt=4, max_tokens=50)
    await rig.settle()
    assert a.req is not None and b.req is not None
    # The input, at the grant; b joined lifted to a's counter (idle time banks nothing).
    assert (rig.vtc("a"), rig.vtc("b")) == (10.0, 14.0)
    for n in (1, 1, 5, 0, 2):
        rig.core.produced(a.req, n)
    assert (rig.vtc("a"), rig.vtc("b")) == (19.0, 14.0)
    end_stream(rig, a, 3, "ok")
    end_stream(rig, a, 3, "ok")  # a duplicate end: charged nothing
    rig.core.produced(a.req, 4)  # late: charged nothing
    assert rig.vtc("a") == 22.0
    rig.core.produced(b.req, 6)
    rig.core.cancel(b.req)  # its client went away: the stream is the core's no more
    await rig.settle()
    rig.core.produced(b.req, 6)
    assert rig.vtc("b") == 20.0 and rig.outcomes(b) == [Outcome.CANCELLED]


async def test_the_fairness_gauges_read_the_window_at_the_cores_time() -> None:
    """``Core.state_samples`` on the fake clock: a and b (weights 1) each have one stream
    granted at 1000 s (both slots) and two queued from then on. At 1012.5 s, the window
    [1002 s, 1012 s] saw no grant: both backlogged, neither served, gap 0 and Jain 1,
    no goodput. Then a's stream ends at 1012.5 s with 5 tokens, charged back to a then
    (in that second, not in its grant's at 1000 s), and the queued request of the tenant
    with the lower counter (b: 4 against a's 15) is granted: at 1013.2 s the window
    [1003 s, 1013 s] has a's 5 output tokens and b's prompt of 4: gap 1, Jain
    9^2 / (2 (5^2 + 4^2)) = 81/82, goodput 0.5 and 0.4."""
    rig = Rig()
    shell = Shell("s")
    prompts = {"a": 10, "b": 4}
    sent: dict[str, list[Sent]] = {"a": [], "b": []}
    for _ in range(3):
        for tenant, p in prompts.items():
            sent[tenant].append(rig.submit_llm(shell, tenant, prompt=p, max_tokens=10))
    await rig.settle()
    assert [x.granted for x in sent["a"] + sent["b"]] == [True, False, False] * 2

    def gauges() -> dict[tuple[str, str], float]:
        return {
            (name, labels.get("tier") or labels["tenant"]): value
            for name, labels, value in rig.core.state_samples()
            if name in ("fair_service_gap", "fair_jain_index", "fair_goodput")
            and labels["endpoint"] == LLM
        }

    await rig.advance(12.5)
    assert gauges() == {("fair_service_gap", "paid"): 0.0, ("fair_jain_index", "paid"): 1.0}
    end_stream(rig, sent["a"][0], 5, "ok")
    await rig.settle()
    assert [t for t in prompts if sent[t][1].granted] == ["b"]
    await rig.advance(0.7)
    assert gauges() == {
        ("fair_service_gap", "paid"): 1.0,
        ("fair_jain_index", "paid"): pytest.approx(81 / 82, rel=1e-12),
        ("fair_goodput", "a"): 0.5,
        ("fair_goodput", "b"): 0.4,
    }
    await finish(rig)


async def test_a_request_admitted_once_its_model_is_looked_up_holds_its_dispatcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call for a model not set up yet waits for the lookup (``Core._admit_later``);
    then its request holds the dispatcher made for it, as one admitted at once does: the
    engine charges its input alone at its grant, the tokens its shell reports are charged
    to its tenant, and its cancellation reaches its slot (none looks its model up again)."""
    rig = Rig(ready=(EMBED,))
    looked_up: list[str] = []

    async def lookup(model: str) -> ModelInfo:
        looked_up.append(model)
        return LLM_INFO

    monkeypatch.setattr(rig.core.models, "_lookup", lookup)
    shell = Shell("s")
    a = rig.submit_llm(shell, "a", prompt=10, max_tokens=50)
    await rig.settle()
    assert looked_up == [LLM] and a.req is not None and a.granted
    assert a.req.runtime is rig.core.runtimes[LLM]
    assert rig.vtc("a") == 10.0  # the input only: its output is charged as it streams
    rig.core.produced(a.req, 5)
    assert rig.vtc("a") == 15.0
    rig.core.cancel(a.req)
    await rig.settle()
    assert rig.outcomes(a) == [Outcome.CANCELLED]


async def test_a_request_whose_model_another_lookup_set_up_is_charged_as_one_admitted_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call that came before its model was set up, whose dispatcher another call's
    lookup made before this one's admission went on (``Core._admit_later`` finds it
    there): its scheduled tokens and batch key are taken again with the dispatcher, as
    for one admitted at once. Taken without it, they were its input and its output asked
    for, and the engine charged that output at the grant as well as when it streamed."""
    rig = Rig(ready=(EMBED,))

    async def lookup(model: str) -> ModelInfo:
        await asyncio.Event().wait()  # never answers: the dispatcher comes from elsewhere
        raise AssertionError("unreachable")

    monkeypatch.setattr(rig.core.models, "_lookup", lookup)
    shell = Shell("s")
    b = rig.submit_llm(shell, "b", prompt=20, max_tokens=50)
    assert b.req is not None and b.req.runtime is None  # waits for its model's lookup
    rig.core._runtime(LLM, LLM_INFO)  # another call's lookup ended first, and set it up
    await rig.settle()
    assert b.granted and b.req.runtime is rig.core.runtimes[LLM]
    assert b.req.tokens == 20  # the input only, as the engine charges it at the grant
    assert rig.vtc("b") == 20.0


async def test_a_request_that_never_ran_is_counted_in_its_limit_as_its_input_alone() -> None:
    """Cancelled while queued, past its deadline in the queue, answered by a shutdown
    before its turn: it produced nothing, and the max_tokens admission counted for it is
    taken back as for a stream that produced nothing."""
    rig = Rig()
    shell = Shell("s")
    running = [rig.submit_llm(shell, "a", prompt=1, max_tokens=1) for _ in range(SLOTS)]
    await rig.settle()
    assert all(s.granted for s in running)
    cancelled = rig.submit_llm(shell, "a", prompt=10, max_tokens=100)
    expired = rig.submit_llm(shell, "a", prompt=20, max_tokens=200, timeout_s=0.5)
    failed = rig.submit_llm(shell, "a", prompt=30, max_tokens=300)
    assert rig.limit_tokens("a") == 2 * 2 + 110 + 220 + 330
    assert cancelled.req is not None
    rig.core.cancel(cancelled.req)
    await rig.advance(1.0)
    for runtime in rig.core.runtimes.values():
        runtime.fail_queued(Unavailable("the frontend is shutting down"))
    assert rig.outcomes(cancelled) == [Outcome.CANCELLED]
    assert rig.outcomes(expired) == [Outcome.EXPIRED]
    assert rig.outcomes(failed) == [Outcome.FAILED]
    assert rig.limit_tokens("a") == 2 * 2 + 10 + 20 + 30
