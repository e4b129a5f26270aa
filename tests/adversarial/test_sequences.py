"""A tenant's stateful sequences are its own (issue 11, item 3).

Triton keys a sequence-batched model's state by ``sequence_id`` alone. The frontend
passed the id on unchanged, so tenant B could add to tenant A's running sum, or restart
it, by sending A's id. Now the core maps (tenant, id) to ids of its own
(``fair_frontend.core.sequences``): on the real stack, with ``sequence_sum`` (OUTPUT is
the running sum of INPUT over the sequence), two tenants using the same id, integer or
string, each see their own sum, and a continuation of a sequence the tenant never
started gets Triton's own answer for an unknown sequence. The map's bounds (a cap per
tenant, idle expiry) are tested on the class itself, on explicit times.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.core.sequences import IDLE_MARGIN, OpenSequence, SequenceIds
from fair_frontend.errors import InvalidArgument, RateLimited
from fair_frontend.fleet.debt import FairnessState
from tests.support import KEYS, RunningFrontend, make_config, running_frontend

MODEL = "sequence_sum"
A = {"x-api-key": KEYS["acme"]}
B = {"x-api-key": KEYS["globex"]}


@pytest.fixture(scope="module")
def fe(triton: EmbeddedTriton) -> Iterator[RunningFrontend]:
    with running_frontend(make_config(), triton) as running:
        yield running


def add(
    url: str,
    seq: int | str,
    value: int,
    headers: Any = None,
    *,
    start: bool = False,
    end: bool = False,
) -> int:
    """One step of a sequence: the running sum after adding ``value``."""
    inp = grpcclient.InferInput("INPUT", [1], "INT32")
    inp.set_data_from_numpy(np.array([value], dtype=np.int32))
    result = grpcclient.InferenceServerClient(url).infer(
        MODEL, [inp], sequence_id=seq, sequence_start=start, sequence_end=end, headers=headers
    )
    return int(result.as_numpy("OUTPUT")[0])


def refused(url: str, seq: int | str, value: int, headers: Any = None) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        add(url, seq, value, headers)
    return info.value


@pytest.mark.parametrize("seq", [4242, "shared-sequence"], ids=["int-id", "string-id"])
def test_another_tenant_cannot_touch_a_sequence_by_its_id(fe: RunningFrontend, seq: Any) -> None:
    assert add(fe.grpc_url, seq, 5, A, start=True) == 5
    # B continues "A's" sequence: it is not B's, so B is told it never started one.
    refused(fe.grpc_url, seq, 100, B)
    # B starts its own under the same id: a sequence of its own, A's is not restarted.
    assert add(fe.grpc_url, seq, 1, B, start=True) == 1
    assert add(fe.grpc_url, seq, 2, A) == 7
    assert add(fe.grpc_url, seq, 1, B) == 2
    assert add(fe.grpc_url, seq, 3, A, end=True) == 10
    assert add(fe.grpc_url, seq, 4, B, end=True) == 6
    # Ended: a continuation is refused again, for both.
    refused(fe.grpc_url, seq, 1, A)
    refused(fe.grpc_url, seq, 1, B)


def test_a_sequence_never_started_gets_tritons_own_answer(
    fe: RunningFrontend, triton: EmbeddedTriton
) -> None:
    seq = 8_675_309  # no test starts it, directly or through the frontend
    direct = refused(triton.grpc_url, seq, 1)
    through = refused(fe.grpc_url, seq, 1, A)
    assert through.status() == direct.status()
    assert through.message() == direct.message()


def test_a_restart_keeps_the_tenants_own_sequence(fe: RunningFrontend) -> None:
    """A second START for an open sequence restarts it, as in Triton (same id again)."""
    assert add(fe.grpc_url, 77, 5, A, start=True) == 5
    assert add(fe.grpc_url, 77, 6, A, start=True) == 6
    assert add(fe.grpc_url, 77, 1, A, end=True) == 7


async def _export(fe: RunningFrontend) -> dict[str, list[OpenSequence]]:
    return fe.frontend.carried.export_sequences()


async def _resume(fe: RunningFrontend, saved: dict[str, list[OpenSequence]]) -> None:
    fe.frontend.carried.resume_sequences(saved)


def test_a_new_leader_goes_on_with_each_tenants_sequence(triton: EmbeddedTriton) -> None:
    """A failover (``fair_frontend.fleet.debt``): a second core in front of the same
    Triton, given the first's open sequences through the journal's own record, goes on
    with each tenant's sequence on the state Triton holds for it; before it resumed, it
    refused the continuation as a sequence never started (the control)."""
    seq = 5150
    with (
        running_frontend(make_config(), triton) as old,
        running_frontend(make_config(), triton) as new,
    ):
        assert add(old.grpc_url, seq, 5, A, start=True) == 5
        assert add(old.grpc_url, seq, 1, B, start=True) == 1  # B's: under an id of its own
        carried = old.call(_export(old))
        journal = msgspec.msgpack.encode(FairnessState("old", 0.0, {}, carried))
        state = msgspec.msgpack.decode(journal, type=FairnessState)
        refused(new.grpc_url, seq, 1, A)  # the control: a leader that forgot
        new.call(_resume(new, state.sequences))
        assert add(new.grpc_url, seq, 2, A) == 7
        assert add(new.grpc_url, seq, 2, B) == 3
        assert add(new.grpc_url, seq, 3, A, end=True) == 10
        assert add(new.grpc_url, seq, 3, B, end=True) == 6
        assert new.call(_export(new)) == {}


def test_resumed_sequences_keep_their_ids_and_idle_from_the_resume() -> None:
    old = SequenceIds()
    a = old.assign(MODEL, "a", start(7), idle_s=1.0, now=0.0)["sequence_id"]
    b = old.assign(MODEL, "b", start(7), idle_s=1.0, now=0.5)["sequence_id"]
    new = SequenceIds()
    new.resume(old.export(), now=10.0)  # before the new leader serves
    assert new.open_sequences(MODEL) == 2
    assert new.assign(MODEL, "a", {"sequence_id": 7}, idle_s=1.0, now=10.5)["sequence_id"] == a
    assert new.assign(MODEL, "b", {"sequence_id": 7}, idle_s=1.0, now=10.5)["sequence_id"] == b
    # Triton's ids stay taken: another tenant's 7 gets one of its own.
    c = new.assign(MODEL, "c", start(7), idle_s=1.0, now=10.5)["sequence_id"]
    assert c not in (a, b)
    # A carried entry idles from the resume, as if used then: kept for the margin, no more.
    new.resume({MODEL: [OpenSequence("d", 3, 3), OpenSequence("e", 4, 4)]}, now=11.0)
    new.assign(MODEL, "d", {"sequence_id": 3}, idle_s=1.0, now=11.0 + IDLE_MARGIN)
    with pytest.raises(InvalidArgument):
        new.assign(MODEL, "e", {"sequence_id": 4}, idle_s=1.0, now=11.0 + IDLE_MARGIN + 0.1)


# ---- the map's bounds, on explicit times ------------------------------------------------


def start(seq: int | str, *, end: bool = False) -> dict[str, Any]:
    return {"sequence_id": seq, "sequence_start": True, "sequence_end": end}


def test_ids_are_the_clients_while_free_else_the_frontends_own_of_their_type() -> None:
    ids = SequenceIds()
    a = ids.assign(MODEL, "a", start(7), idle_s=1.0, now=0.0)["sequence_id"]
    b = ids.assign(MODEL, "b", start(7), idle_s=1.0, now=0.0)["sequence_id"]
    s = ids.assign(MODEL, "a", start("7"), idle_s=1.0, now=0.0)["sequence_id"]
    t = ids.assign(MODEL, "b", start("7"), idle_s=1.0, now=0.0)["sequence_id"]
    assert a == 7 and s == "7"  # free: the model sees the client's own id
    assert isinstance(b, int) and b != 7 and 0 < b < 2**63  # taken by a: b's own
    assert isinstance(t, str) and t != "7"
    # An id the frontend gave b is taken too: a client naming it gets another.
    c = ids.assign(MODEL, "c", start(b), idle_s=1.0, now=0.0)["sequence_id"]
    assert c not in (7, b)
    assert ids.assign(MODEL, "a", {"sequence_id": 7}, idle_s=1.0, now=0.5)["sequence_id"] == a
    # Not a sequence to Triton (0, ""): passed on, for Triton's own error.
    assert ids.assign(MODEL, "a", start(0), idle_s=1.0, now=0.5) == start(0)


def test_end_frees_the_entry_and_the_request_still_goes_under_it() -> None:
    ids = SequenceIds()
    a = ids.assign(MODEL, "a", start(1), idle_s=1.0, now=0.0)["sequence_id"]
    last = ids.assign(MODEL, "a", {"sequence_id": 1, "sequence_end": True}, idle_s=1.0, now=0.1)
    assert last["sequence_id"] == a and last["sequence_end"] is True
    assert ids.open_sequences(MODEL) == 0
    with pytest.raises(InvalidArgument, match="must specify the START flag"):
        ids.assign(MODEL, "a", {"sequence_id": 1}, idle_s=1.0, now=0.2)


def test_idle_sequences_expire_after_the_models_timeout_with_a_margin() -> None:
    ids = SequenceIds()
    ids.assign(MODEL, "a", start(1), idle_s=1.0, now=0.0)
    ids.assign(MODEL, "a", start(2), idle_s=1.0, now=1.5)
    ids.assign(MODEL, "a", {"sequence_id": 1}, idle_s=1.0, now=IDLE_MARGIN * 1.0)  # still kept
    ids.assign(MODEL, "b", start(3), idle_s=1.0, now=1.5 + IDLE_MARGIN + 0.1)  # sweeps 2
    assert ids.open_sequences(MODEL, "a") == 1
    with pytest.raises(InvalidArgument):
        ids.assign(MODEL, "a", {"sequence_id": 2}, idle_s=1.0, now=1.5 + IDLE_MARGIN + 0.1)


def test_a_tenant_holds_at_most_its_cap_of_open_sequences() -> None:
    ids = SequenceIds(max_per_tenant=3)
    for seq in range(1, 4):
        ids.assign(MODEL, "a", start(seq), idle_s=1.0, now=0.0)
    with pytest.raises(RateLimited, match="3 open sequences") as info:
        ids.assign(MODEL, "a", start(4), idle_s=1.0, now=0.1)
    assert info.value.http_status == 429 and info.value.retry_after is not None
    # Another tenant is not held back by it; a restart of an open one is not a new one.
    ids.assign(MODEL, "b", start(4), idle_s=1.0, now=0.1)
    ids.assign(MODEL, "a", start(3), idle_s=1.0, now=0.1)
    # Once one ends, there is room again.
    ids.assign(MODEL, "a", {"sequence_id": 1, "sequence_end": True}, idle_s=1.0, now=0.2)
    ids.assign(MODEL, "a", start(4), idle_s=1.0, now=0.2)
    assert ids.open_sequences(MODEL, "a") == 3


def test_the_map_stays_bounded_under_a_flood_of_new_sequences() -> None:
    ids = SequenceIds(max_per_tenant=10)
    for n in range(10_000):
        with contextlib.suppress(RateLimited):
            ids.assign(MODEL, "a", start(n + 1), idle_s=1.0, now=n * 0.01)
    assert ids.open_sequences(MODEL) <= 10
