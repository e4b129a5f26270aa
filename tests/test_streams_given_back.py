"""A granted stream whose Triton was gone is given back, not ended (``Inbox.again``).

The shell's side of issue 30's "streams survive a lost Triton", without a core or a
Triton: a shell's link to remote cores (``RemoteLink``, never connected here, so what it
sends is recorded, not framed) is handed the core's records as the core would send
them. A stream given back stays the link's call: its inbox waits for the next grant or
the answer, the core hears of it as never sent (``Ended``), and a failover meanwhile
sends it to the next core as a call again; a stream that ended for good is forgotten.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from fair_frontend.errors import Unavailable
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.shell.link import Inbox
from fair_frontend.shell.remote import RemoteLink
from fair_frontend.wire.framing import to_core
from fair_frontend.wire.records import Answer, Call, Ended, Fault, Grant, Hello, Running


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
        super().__init__(["127.0.0.1:1"], b"secret", Hello(0, 0), _ignore, _none, _none)
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
    assert call.id not in link._held and link._streaming[call.id] == (call, 1)
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
