"""A granted stream whose Triton was gone is given back, not ended (``Inbox.again``).

The shell's side of issue 30's "streams survive a lost Triton", without a core or a
Triton: a shell's link to remote cores (``RemoteLink``, never connected here, so what it
sends is recorded, not framed) is handed the core's records as the core would send
them. A stream given back stays the link's call: its inbox waits for the next grant or
the answer, the core hears of it as never sent (``Ended``), and a failover meanwhile
sends it to the next core as a call again; a stream that ended for good is forgotten.
Then the relay (``Gateway``, on fake Tritons and a link that grants at once): what is
given back (a stream that answered nothing), what is not (one that answered anything),
and how often (``STREAM_GRANTS``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import numpy as np
import pytest

from fair_frontend.auth import KeyRing
from fair_frontend.backends.protocol import BackendServer, StreamReply
from fair_frontend.errors import FrontendError, Unavailable
from fair_frontend.models import ModelInfo, TensorSpec
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.shell.gateway import STREAM_GRANTS, Gateway
from fair_frontend.shell.link import CoreLink, Inbox, gone_before_answered
from fair_frontend.shell.remote import RemoteLink
from fair_frontend.wire.framing import to_core
from fair_frontend.wire.records import (
    LINK_VERSION,
    Answer,
    Call,
    Ended,
    Fault,
    Grant,
    Hello,
    Produced,
    Running,
)
from tests.support import KEYS, make_config


class Wire:
    """A transport that keeps the bytes written to it."""

    def __init__(self) -> None:
        self.data = bytearray()

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.data += data


class Recorded(RemoteLink):
    """A ``RemoteLink`` on a ``Wire``: ``sent`` decodes the records it framed."""

    def __init__(self) -> None:
        super().__init__(
            ["127.0.0.1:1"], b"secret", Hello(0, 0, LINK_VERSION), _ignore, _none, _none
        )
        self.wire = Wire()
        self.reattach(self.wire)

    async def sent(self) -> list[Any]:
        await asyncio.sleep(0)  # the loop iteration's frames go out together
        records, data = [], bytes(self.wire.data)
        while data:
            size = int.from_bytes(data[:4], "big")
            records.append(to_core.decode(data[4 : 4 + size]))
            data = data[4 + size :]
        self.wire.data.clear()
        return records


def _ignore(settings: Any) -> None:
    pass


def _none() -> None:
    pass


def stream_call(call_id: int) -> Call:
    text = Tensor("text_input", "BYTES", (1,), np.array([b"hi"], dtype=object))
    request = InferRequest("llm", id=f"r{call_id}", inputs=[text])
    return Call(call_id, "acme", 1, time.monotonic(), time.time(), 1, 1, 2, None, request, True)


def gone() -> Unavailable:
    return Unavailable("Triton 127.0.0.1:2 is unavailable: not connected within 2 s")


@pytest.fixture
async def link() -> Any:
    made = Recorded()
    try:
        yield made
    finally:
        if made._hold_timer is not None:
            made._hold_timer.cancel()


async def granted(link: Recorded, call: Call, backend: int) -> Inbox:
    inbox = link._inboxes[call.id]
    link.received(Grant(call.id, backend=backend))
    answer = await inbox.get()
    assert isinstance(answer, Grant) and answer.backend == backend and inbox.granted
    return inbox


async def test_a_stream_given_back_waits_for_its_next_grant(link: Recorded) -> None:
    """Given back: the core is told never sent, the inbox stays the link's and waits; the
    next grant (another Triton) reaches it; a failover before that grant sends the call
    to the next core again (not as a running stream)."""
    call = stream_call(1)
    inbox = link.submit(call)
    await granted(link, call, 1)
    relayed = link._streaming[call.id]
    assert call.id not in link._held and (relayed.call, relayed.backend) == (call, 1)
    inbox.again(gone())
    inbox.end(fault=gone())  # the relay's finally: a no-op once given back
    sent = await link.sent()
    assert [type(r) for r in sent] == [Call, Ended]
    assert sent[1].fault is not None and sent[1].fault.never_sent
    assert not inbox.done and not inbox.granted and inbox.answered is None
    assert link._inboxes[call.id] is inbox and call.id in link._held

    link._resend()  # a failover now: a call again, not a running stream
    assert [(type(r), r.id) for r in await link.sent()] == [(Call, call.id)]

    await granted(link, call, 0)  # the next grant, to the Triton that is there
    inbox.end("1")
    assert inbox.done and call.id not in link._inboxes and call.id not in link._held
    (ended,) = await link.sent()
    assert isinstance(ended, Ended) and ended.fault is None


async def test_a_stream_given_back_takes_the_cores_answer(link: Recorded) -> None:
    """The core answers a stream given back (its deadline, an outage past max_outage_s):
    that answer is the call's, as for a call never granted."""
    call = stream_call(2)
    inbox = link.submit(call)
    await granted(link, call, 1)
    inbox.again(gone())
    link.received(Answer(call.id, fault=Fault.of(Unavailable("Triton has been unavailable"))))
    answer = await inbox.get()
    assert isinstance(answer, Answer) and answer.fault is not None and inbox.done
    assert call.id not in link._inboxes and call.id not in link._held


async def test_a_stream_that_failed_for_good_is_never_given_back(link: Recorded) -> None:
    """A stream that had answered its client ends with its error: the core is told it
    failed (not never sent, whatever the error says: it must not grant it again), and
    the link forgets it; on a failover it is neither a call nor a running stream."""
    call = stream_call(3)
    inbox = link.submit(call)
    await granted(link, call, 1)
    inbox.end("1", Unavailable("Socket closed", never_sent=True))
    ended = [r for r in await link.sent() if isinstance(r, Ended)]
    assert len(ended) == 1 and ended[0].fault is not None and not ended[0].fault.never_sent
    assert inbox.done and call.id not in link._inboxes
    link._resend()
    assert not [r for r in await link.sent() if isinstance(r, (Call, Running))]


async def test_a_running_stream_tells_the_next_core_its_limits_mark_and_its_tokens(
    link: Recorded,
) -> None:
    """On a failover the shell tells the next core of a stream it relays (``Running``)
    with what that core needs to correct its tenant's token limits when it ends: when
    they counted it (its grant's ``limits_at``) and the tokens relayed before, including
    a tally that went nowhere because the core was gone; the tokens not told yet follow
    as ``Produced``, not counted twice."""
    call = stream_call(4)
    inbox = link.submit(call)
    link.received(Grant(call.id, backend=1, limits_at=1.7e9))
    assert isinstance(await inbox.get(), Grant)
    inbox.produced(5, 0.1, -1.0)
    link.closed = True  # the core is lost before the tally's tick: it goes nowhere
    link._send_produced()
    link.closed = False
    inbox.produced(2, -1.0, 0.01)  # relayed meanwhile: told by the next tick
    link._resend()
    (running,) = [r for r in await link.sent() if isinstance(r, Running)]
    assert (running.call.id, running.backend, running.limits_at) == (call.id, 1, 1.7e9)
    assert running.produced == 5
    link._send_produced()
    (produced,) = [r for r in await link.sent() if isinstance(r, Produced)]
    assert [entry[:2] for entry in produced.entries] == [(call.id, 2)]


# ---- the relay: what is given back, and how often ------------------------------------------

REPEAT = ModelInfo(
    name="rep",
    max_batch_size=0,
    inputs={"IN": TensorSpec("IN", "INT32", (-1,))},
    outputs={"OUT": TensorSpec("OUT", "INT32", (1,))},
    decoupled=True,
)


def out(value: int, *, final: bool = False) -> StreamReply:
    data = np.array([value], dtype=np.int32)
    return StreamReply("1", [Tensor("OUT", "INT32", (1,), data)], final)


class FakeStream:
    """A stream from a fake Triton: its replies, as ``TritonStream`` yields them."""

    def __init__(self, replies: list[StreamReply]) -> None:
        self.replies = replies
        self.stopped: FrontendError | None = None
        self.on_stop: Any = None

    def stop(self, err: FrontendError) -> None:
        self.stopped = err

    def __aiter__(self) -> AsyncIterator[StreamReply]:
        return self._read()

    async def _read(self) -> AsyncIterator[StreamReply]:
        for reply in self.replies:
            yield reply

    async def aclose(self) -> None:
        pass


class FakeTriton:
    """A Triton of the pool as a shell sees it: each stream gets ``replies``."""

    def __init__(self, url: str, replies: list[StreamReply]) -> None:
        self.url = url
        self.replies = replies
        self.streams = 0

    def stream(self, *args: Any, **kwargs: Any) -> FakeStream:
        self.streams += 1
        return FakeStream(self.replies)


class GrantingCore:
    """A ``CoreLink`` that grants every call at once, to Triton 0, and a stream given back
    to the next Triton of the pool; it records how each grant ended."""

    accepting = True

    def __init__(self, tritons: int) -> None:
        self.tritons = tritons
        self.grants: list[int] = []
        self.ends: list[tuple[str, FrontendError | None, bool]] = []
        self._ids = 0

    def new_id(self) -> int:
        self._ids += 1
        return self._ids

    def submit(self, call: Call) -> Inbox:
        inbox = Inbox()

        def ended(version: str, fault: FrontendError | None, cancelled: bool) -> None:
            self.ends.append((version, fault, cancelled))
            if gone_before_answered(fault):
                self._grant(inbox, call.id)

        inbox._end = ended
        self._grant(inbox, call.id)
        return inbox

    def _grant(self, inbox: Inbox, call_id: int) -> None:
        backend = len(self.grants) % self.tritons
        self.grants.append(backend)
        asyncio.get_running_loop().call_soon(inbox.answer, Grant(call_id, backend=backend))

    async def model_info(self, model: str) -> ModelInfo:
        return REPEAT

    def queue_full(self, tenant: str, model: str, nbytes: int = 0) -> str | None:
        return None

    def overloaded(self, tier: str, model: str) -> Any:
        return None

    def tally(self, entry: Any) -> None:
        pass


async def relayed(tritons: list[FakeTriton]) -> tuple[GrantingCore, list[int], Any]:
    """One stream through a ``Gateway`` on ``tritons``: (its core, the values its client
    got, the error that ended it or None)."""
    config = make_config()
    core = GrantingCore(len(tritons))
    link, forwarders = cast(CoreLink, core), cast(list[BackendServer], tritons)  # stand-ins
    gateway = Gateway(config, KeyRing.from_config(config), link, forwarders)
    values = Tensor("IN", "INT32", (2,), np.array([1, 2], dtype=np.int32))
    request = InferRequest("rep", id="s1", inputs=[values])
    got: list[int] = []
    try:
        async for resp in gateway.stream_infer(request, {"x-api-key": KEYS["acme"]}):
            got.extend(int(v) for t in resp.outputs for v in t.data)
    except FrontendError as err:
        return core, got, err
    return core, got, None


async def test_a_stream_lost_before_its_first_response_is_relayed_from_the_next_grant() -> None:
    """Triton 0's connection drops before it answered anything: the shell gives the stream
    back (never sent) and relays it from Triton 1, the core's next grant; the client sees
    one stream, whole."""
    lost = FakeTriton("t0", [StreamReply(error=Unavailable("Socket closed"))])
    there = FakeTriton("t1", [out(1), out(2, final=True)])
    core, got, err = await relayed([lost, there])
    assert err is None and got == [1, 2]
    assert core.grants == [0, 1] and lost.streams == there.streams == 1
    faults = [fault for _, fault, _ in core.ends]
    assert isinstance(faults[0], Unavailable) and faults[0].never_sent and faults[1:] == [None]


async def test_a_stream_that_answered_anything_fails_with_its_triton() -> None:
    """A response reached the client: the stream cannot be replayed; it fails UNAVAILABLE,
    and the core is told it failed (not given back)."""
    lost = FakeTriton("t0", [out(1), StreamReply(error=Unavailable("Socket closed"))])
    core, got, err = await relayed([lost, FakeTriton("t1", [out(1, final=True)])])
    assert got == [1] and isinstance(err, Unavailable)
    assert core.grants == [0] and len(core.ends) == 1
    fault = core.ends[0][1]
    assert isinstance(fault, Unavailable) and not fault.never_sent


async def test_a_stream_is_given_back_a_bounded_number_of_times() -> None:
    """Every Triton drops every stream before its first response (each one's probe still
    says ready): the stream is granted ``STREAM_GRANTS`` times, then fails UNAVAILABLE."""
    tritons = [
        FakeTriton(f"t{i}", [StreamReply(error=Unavailable("Socket closed"))]) for i in (0, 1)
    ]
    core, got, err = await relayed(tritons)
    assert got == [] and isinstance(err, Unavailable)
    assert len(core.grants) == STREAM_GRANTS == len(core.ends)
    given_back = [isinstance(f, Unavailable) and f.never_sent for _, f, _ in core.ends]
    assert given_back == [True] * (STREAM_GRANTS - 1) + [False]
