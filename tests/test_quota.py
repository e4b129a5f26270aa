"""The quota's headers (``fair_frontend.quota``), the 429 split (``QuotaExhausted``) and the
records that carry both between the core and a shell.

Headers: reset times as OpenAI writes them (Go's ``time.Duration`` at millisecond
precision: ``120ms``, ``1s``, ``6m0s``, ``1h2m3s``), read back by a parser written here
from that grammar, not from the code under test. Records: the quota and the error's class
survive the framing a shell process reads (``wire.framing``), and a record of the layout
before ``quota`` was added still decodes (and the new one decodes in the old layout).
"""

from __future__ import annotations

import re

import grpc
import msgspec
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from fair_frontend.admission import RateLimitItem
from fair_frontend.admission.limits import WINDOWS_S, Unit
from fair_frontend.admission.ratelimit import Decision, binding_quota, rate_limited_error
from fair_frontend.errors import QuotaExhausted, RateLimited, error_class
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import ParamValue, Tensor
from fair_frontend.quota import HEADERS, Quota, QuotaWindow, format_reset, quota_headers
from fair_frontend.wire.framing import encode, to_shell
from fair_frontend.wire.records import Answer, Fault, Grant

# Go's Duration.String for whole milliseconds: [Hh][Mm]S[.fff]s with h, m only when a larger
# unit is there (or they are not zero), or Nms below a second, or 0s.
DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)(?:\.(\d{1,3}))?s)?|(\d+)ms")
UNIT_MS = {"h": 3_600_000, "m": 60_000}


def parse_duration(text: str) -> int:
    """Milliseconds from a duration as OpenAI's headers write it."""
    match = DURATION.fullmatch(text)
    assert match is not None and text, text
    hours, minutes, seconds, fraction, ms = match.groups()
    if ms is not None:
        return int(ms)
    total = int(hours or 0) * UNIT_MS["h"] + int(minutes or 0) * UNIT_MS["m"]
    total += int(seconds or 0) * 1000 + int((fraction or "").ljust(3, "0") or 0)
    return total


@given(st.integers(0, 10 * 366 * 86_400_000))
@example(0)
@example(120)
@example(999)
@example(1000)
@example(7660)
@example(60_000)
@example(360_000)
@example(179_560)
@example(3_723_000)
@example(30 * 86_400_000)
def test_a_reset_reads_back_as_the_milliseconds_it_was(ms: int) -> None:
    text = format_reset(ms)
    assert parse_duration(text) == ms
    # Canonical as Go writes it: ms only below a second; no trailing zeros in a fraction;
    # minutes (and seconds) written once a larger unit is.
    if ms < 1000:
        assert text == ("0s" if ms == 0 else f"{ms}ms")
    else:
        assert text.endswith("s") and not text.endswith("ms")
        assert not re.search(r"\.\d*0s$", text), text
        if ms >= 3_600_000:
            assert re.fullmatch(r"\d+h\d+m\d+(\.\d+)?s", text), text
        elif ms >= 60_000:
            assert re.fullmatch(r"\d+m\d+(\.\d+)?s", text), text


def test_resets_as_openai_documents_them() -> None:
    # The samples of OpenAI's rate-limit guide, and values its API has been seen sending.
    assert format_reset(1000) == "1s"
    assert format_reset(360_000) == "6m0s"
    assert format_reset(120) == "120ms"
    assert format_reset(3_723_000) == "1h2m3s"
    assert format_reset(7660) == "7.66s"
    assert format_reset(179_560) == "2m59.56s"
    assert format_reset(3_600_000) == "1h0m0s"
    assert format_reset(30 * 86_400_000) == "720h0m0s"  # no days, as in Go
    assert format_reset(0) == "0s"


windows_st = st.builds(
    QuotaWindow,
    st.integers(0, 10**12),
    st.integers(0, 10**12),
    st.integers(0, 40 * 86_400_000),
    st.sampled_from(list(WINDOWS_S)),
)


@given(st.one_of(st.none(), windows_st), st.one_of(st.none(), windows_st))
def test_headers_name_each_unit_that_has_a_window(
    requests: QuotaWindow | None, tokens: QuotaWindow | None
) -> None:
    headers = quota_headers(Quota(requests, tokens))
    assert list(headers) == [h for h in HEADERS if h in headers]  # OpenAI's order
    for unit, window in (("requests", requests), ("tokens", tokens)):
        names = [f"x-ratelimit-{part}-{unit}" for part in ("limit", "remaining", "reset")]
        if window is None:
            assert not any(name in headers for name in names)
            continue
        assert headers[names[0]] == str(window.limit)
        assert headers[names[1]] == str(window.remaining)
        assert parse_duration(headers[names[2]]) == window.reset_ms
    assert quota_headers(None) == {}


# ---- which window binds -------------------------------------------------------------------


def item(unit: Unit, window: str, amount: int) -> RateLimitItem:
    return RateLimitItem(unit, window, amount, WINDOWS_S[window])


def test_the_binding_window_is_the_least_remaining_per_unit() -> None:
    items = [
        item("requests", "second", 10),
        item("requests", "day", 1000),
        item("tokens", "minute", 5000),
        item("tokens", "month", 10**6),
    ]
    states = [(4, 900_000), (2, 86_000_000_000), (100, 59_000_000), (100, 2_000_000_000_000)]
    quota = binding_quota(items, states)
    # Requests: the day's 2 left bind, not the second's 4. Tokens: a tie at 100, the
    # longer window (the month) binds: it stays the limit for longer.
    assert quota.requests == QuotaWindow(1000, 2, 86_000_000, "day")
    assert quota.tokens == QuotaWindow(10**6, 100, 2_000_000_000, "month")
    only_tokens = binding_quota(items[2:3], states[2:3])
    assert only_tokens.requests is None
    assert only_tokens.tokens == QuotaWindow(5000, 100, 59_000, "minute")


def test_a_reset_is_rounded_up_to_the_millisecond() -> None:
    quota = binding_quota([item("requests", "second", 3)], [(1, 1_000_001)])
    assert quota.requests is not None and quota.requests.reset_ms == 1001
    assert quota_headers(quota)["x-ratelimit-reset-requests"] == "1.001s"


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["requests", "tokens"]),
            st.sampled_from(list(WINDOWS_S)),
            st.integers(0, 50),
            st.integers(0, 10**9),
        ),
        unique_by=lambda t: (t[0], t[1]),
        max_size=10,
    )
)
def test_the_binding_window_against_a_sort(rows: list[tuple[Unit, str, int, int]]) -> None:
    items = [item(unit, window, 60) for unit, window, _, _ in rows]
    states = [(left, reset) for _, _, left, reset in rows]
    quota = binding_quota(items, states)
    for unit, got in (("requests", quota.requests), ("tokens", quota.tokens)):
        mine = [(left, -WINDOWS_S[window], window) for u, window, left, _ in rows if u == unit]
        if not mine:
            assert got is None
            continue
        left, _, window = min(mine)
        assert got is not None and (got.remaining, got.window) == (left, window)


# ---- the 429 split: an allowance used up ---------------------------------------------------


@pytest.mark.parametrize("window", list(WINDOWS_S))
@pytest.mark.parametrize("retry_after", [12.5, None])
def test_a_day_or_month_limit_refuses_with_quota_exhausted(
    window: str, retry_after: float | None
) -> None:
    limit = item("tokens", window, 100)
    quota = Quota(None, QuotaWindow(100, 0, 5000, window))
    err = rate_limited_error(
        Decision(False, retry_after=retry_after, violated=limit, quota=quota),
        tenant="acme",
        endpoint="embed",
    )
    allowance = window in ("day", "month")
    assert isinstance(err, RateLimited)
    assert isinstance(err, QuotaExhausted) is allowance
    # The same answer on the wire either way, the retry hint included (still true).
    assert (err.http_status, err.grpc_code, err.outcome) == (
        429,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        Outcome.REJECTED_RATE,
    )
    assert err.retry_after == retry_after
    assert err.quota == quota
    assert f"limit: {limit}" in err.message


def _crossed(record: Answer | Grant) -> Answer | Grant:
    """``record`` as a shell process reads it: framed, then decoded."""
    decoded = to_shell.decode(encode(record)[4:])
    assert isinstance(decoded, type(record))
    return decoded


def test_quota_exhausted_and_its_quota_cross_to_a_shell_process() -> None:
    quota = Quota(QuotaWindow(2, 0, 86_400_020, "day"), QuotaWindow(10**6, 5, 1234, "minute"))
    err = rate_limited_error(
        Decision(False, retry_after=3600.0, violated=item("requests", "day", 2), quota=quota),
        tenant="acme",
        endpoint="embed",
    )
    crossed = _crossed(Answer(7, fault=Fault.of(err)))
    assert isinstance(crossed, Answer) and crossed.fault is not None
    again = crossed.fault.error()
    assert type(again) is QuotaExhausted and error_class("QuotaExhausted") is QuotaExhausted
    assert (again.message, again.retry_after, again.quota) == (err.message, 3600.0, quota)
    assert again.retry_after_header == "3600"
    assert (again.http_status, again.grpc_code) == (429, grpc.StatusCode.RESOURCE_EXHAUSTED)


def test_answers_and_grants_carry_their_quota() -> None:
    quota = Quota(QuotaWindow(5, 4, 1020, "second"), None)
    out = Tensor("OUT", "INT32", (1,), np.array([3], dtype=np.int32))
    answer = _crossed(Answer(1, "1", [out], queued_s=0.5, quota=quota))
    assert isinstance(answer, Answer) and answer.quota == quota
    grant = _crossed(Grant(2, {"sequence_id": 9}, 0.1, backend=1, quota=quota))
    assert isinstance(grant, Grant) and (grant.quota, grant.backend) == (quota, 1)
    # An error after admission takes its request's quota where the error has none.
    unavailable = Fault.of(RateLimited("x"), quota)
    assert unavailable.quota == quota and unavailable.error().quota == quota
    assert Fault.of(RateLimited("x")).error().quota is None


# The layouts before ``quota`` (a field is its position in the msgpack array).
class OldFault(msgspec.Struct, array_like=True, frozen=True):
    kind: str
    message: str
    grpc_code: int
    http_status: int
    outcome: str
    retry_after: float | None = None
    never_sent: bool = False


class OldAnswer(msgspec.Struct, tag=3, array_like=True):
    id: int
    version: str = ""
    outputs: list[Tensor] = []
    fault: OldFault | None = None
    queued_s: float = -1.0


class OldGrant(msgspec.Struct, tag=18, array_like=True):
    id: int
    sequence: dict[str, ParamValue] = {}
    queued_s: float = -1.0
    backend: int = 0


def test_records_stay_readable_across_the_quota_field() -> None:
    old_answer = OldAnswer(3, fault=OldFault("RateLimited", "m", 8, 429, "rejected_rate", 2.0))
    new = to_shell.decode(encode(old_answer)[4:])  # from a core of the release before
    assert isinstance(new, Answer) and new.quota is None and new.fault is not None
    assert type(new.fault.error()) is RateLimited and new.fault.quota is None
    grant = to_shell.decode(encode(OldGrant(4, {}, 0.2, 1))[4:])
    assert isinstance(grant, Grant) and (grant.backend, grant.quota) == (1, None)
    # A shell of the release before reads the new records (it ignores the extra field).
    quota = Quota(QuotaWindow(5, 4, 1020, "second"), None)
    fault = Fault.of(QuotaExhausted("m", retry_after=2.0), quota)
    old_shell: msgspec.msgpack.Decoder[OldAnswer | OldGrant] = msgspec.msgpack.Decoder(
        OldAnswer | OldGrant
    )
    old_read = old_shell.decode(encode(Answer(5, fault=fault, quota=quota))[4:])
    assert isinstance(old_read, OldAnswer) and old_read.fault is not None
    assert old_read.fault.retry_after == 2.0 and old_read.fault.kind == "QuotaExhausted"
    old_grant = old_shell.decode(encode(Grant(6, {}, 0.3, 2, quota))[4:])
    assert isinstance(old_grant, OldGrant) and old_grant.backend == 2
