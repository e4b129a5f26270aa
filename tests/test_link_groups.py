"""The parts of one call on a shell's links: framed as one ``Group`` record, and held and
sent again as one group (the parts still unanswered) by a remote shell's link when it
fails over to the next core. Unit tests of the links, with their records captured where
a socket or stream would take them."""

from __future__ import annotations

from typing import Any

import numpy as np

from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.shell.remote import RemoteLink
from fair_frontend.wire.framing import encode, to_core
from fair_frontend.wire.records import LINK_VERSION, Answer, Call, Group, Hello


def _call(i: int) -> Call:
    data = np.full((1, 3), i, dtype=np.int32)
    request = InferRequest(
        model="embed", id=f"r-{i}", inputs=[Tensor("INPUT_IDS", "INT32", (1, 3), data)]
    )
    return Call(i, "acme", 1, 0.0, 0.0, 1, 3, request.nbytes, [3], request, requests=int(i == 1))


def test_a_group_crosses_as_one_record_with_its_parts_whole() -> None:
    calls = [_call(i) for i in (1, 2, 3)]
    calls[0].precharged, calls[0].precharged_at = 7, 1.7e9
    frame = encode(Group(calls))
    decoded = to_core.decode(frame[4:])
    assert isinstance(decoded, Group)
    assert [c.id for c in decoded.calls] == [1, 2, 3]
    assert decoded.tenant == "acme"
    assert [c.requests for c in decoded.calls] == [1, 0, 0]
    assert (decoded.calls[0].precharged, decoded.calls[0].precharged_at) == (7, 1.7e9)
    np.testing.assert_array_equal(decoded.calls[2].request.inputs[0].data, [[3, 3, 3]])


class Captured(RemoteLink):
    """A remote link whose records are kept, not sent (no core to reach)."""

    def __init__(self) -> None:
        super().__init__(["127.0.0.1:1"], b"s", Hello(0, 0, LINK_VERSION), _none, _none, _none)
        self.sent: list[Any] = []

    def send(self, record: Any) -> None:
        self.sent.append(record)


def _none(*_: Any) -> None:
    pass


async def test_a_remote_link_sends_a_held_group_again_as_one_group_of_what_is_unanswered() -> None:
    link = Captured()
    try:
        group = [_call(i) for i in (1, 2, 3)]
        inboxes = link.submit_group(group)  # no core yet: held
        single = _call(4)
        link.submit(single)
        assert link.sent == []
        link._resend()  # a core is found: what is held goes to it, in order
        assert [type(r).__name__ for r in link.sent] == ["Group", "Call"]
        assert [c.id for c in link.sent[0].calls] == [1, 2, 3]
        link.sent.clear()
        link.closed = False
        link.received(Answer(2))  # part 2 answered by the lost core
        assert inboxes[1].answered is not None
        inboxes[0].cancel()  # and part 1's client gone
        link.sent.clear()
        link._resend()  # the next core gets the rest of the call, still as one group
        assert [type(r).__name__ for r in link.sent] == ["Group", "Call"]
        assert [c.id for c in link.sent[0].calls] == [3]
    finally:
        link.close()
