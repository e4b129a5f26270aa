"""What crosses between the shells and the core: one record per request, one per answer.

Shells (``fair_frontend.shell``) do protocol: decode, identify the tenant, validate against
the model, encode the answer. The core (``fair_frontend.core``) does policy: admission,
scheduling, batching, dispatch to Triton. Between them travel only the records below,
``msgspec`` structs:

* a shell sends a ``Call`` per inference request (decoded, identified, validated), or a
  ``Group`` of them for an API call made of several (admitted or refused whole), a
  ``Cancel`` when its client goes away, a ``Precharge`` before it tokenises a request's
  text (what that text costs at least, counted against its tenant's limits first), a
  ``Tally`` of what it answered itself (requests refused before the core saw them), and
  queries (``InfoQuery``, ``StatsQuery``);
* the core answers each ``Call`` with exactly one ``Answer`` (its outputs, or the error it
  is answered with), each query with its answer (a ``Precharge`` with ``Precharged``),
  and pushes ``Settings`` (the config a shell needs, at start and on reload),
  ``Draining`` and ``Stop`` (shutdown).

Streams take one hop. A decoupled model's request is not relayed through the core: when
its turn comes the core answers the call with a ``Grant`` (a slot in the engine), and the
shell that holds the client sends the request to Triton itself and writes Triton's
responses straight to its client. It tells the core the output tokens they carried
(``Produced``, one record per shell process every ``PRODUCED_TICK_S``, for every stream it
relays, with the tick's inter-token times binned per tenant and model: no datum per token)
and, once, that the stream ended (``Ended``: how); the core
then frees the slot and records the outcome. A call granted a slot is answered no further
by the core, except to take the slot back (a shutdown that stopped waiting for it): an
``Answer`` with the error, which ends the stream in the shell.

Unary requests take one hop too, on an endpoint the plan puts in granted mode
(``batching.one_hop``; ``fair_frontend.core.granted``): the shell keeps the tensors and
sends the ``Call`` with its facts alone (its request without inputs, outputs or
parameters, and ``key``: the batch key it computed, ``batching.wire_key``). The core
forms each batch from the queued facts as it forms a relayed one and grants each shell
its rows of it, one ``Rows`` per shell per batch; the shell packs them into one Triton
request, sends it to the Triton the grant names, answers its clients when it succeeds,
and reports the outcome in one ``RowsDone``. A part that failed is not answered by the
shell: the core decides (another grant: a bisection's half, or another Triton for a part
that never reached one; or an ``Answer`` with the error). Only a shell process's link
takes grants (``SocketLink``, and so the remote shells'); a shell in the core's process
(``--workers 1``) sends its calls whole, and the core relays them as before.

With ``--workers 1`` the shell lives in the core's process and the records are passed as
objects; with several shell processes ``fair_frontend.wire.framing`` frames them as msgpack over a
Unix socket, tensors as Triton's raw bytes (row-major, little-endian; BYTES elements
each a 4-byte length and the bytes), decoded on arrival as numpy views of the frame.

Times are ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process of a host)
and ``time.time()`` where a deadline goes to the model as a wall-clock instant.

Records are msgpack arrays (``array_like``): a field is its position. New fields go at the
end, with a default, so that a peer of the release before still reads them (it ignores
elements past its last field; a record from it lacks them and takes the default): that
is how ``quota`` (``fair_frontend.quota``: the rate-limit state the answer's headers
show) was added to ``Fault``, ``Answer`` and ``Grant``, and a trace's context to ``Call``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from typing import Any, Union

import grpc
import msgspec

from fair_frontend import errors
from fair_frontend.outcomes import Outcome
from fair_frontend.protocol import InferRequest, ParamValue, Tensor
from fair_frontend.quota import Quota


class Call(msgspec.Struct, tag=1, array_like=True):
    """One inference request, decoded, identified and validated by a shell."""

    id: int  # the shell's number for it: answers and cancels carry it
    tenant: str
    priority: int  # effective level, 1 = highest (the shell resolved the default)
    arrived: float  # time.monotonic() when the shell received it
    arrived_wall: float  # time.time() at the same moment (deadline_us for the model)
    rows: int  # batch rows it occupies (>= 1)
    tokens: int  # its token count, for cost and limits
    nbytes: int  # its tensor bytes, for byte caps
    lengths: list[int] | None  # per-row token lengths of its token input, if any
    request: InferRequest  # as decoded (the model's defaults filled in)
    stream: bool = False  # ModelStreamInfer: answers may come in parts (decoupled)
    max_tokens: int = 0  # of ``tokens``, the output tokens it asks for (charged back later)
    # What it counts against its tenant's request limits: 1, or 0 for each part of an API
    # call made of several but its first (a rerank's documents, an embeddings' inputs).
    requests: int = 1
    # Its trace (``fair_frontend.observability.tracing``): the W3C traceparent and tracestate of its
    # shell's span, where it is sampled; "" otherwise (tracing off: nothing to carry).
    traceparent: str = ""
    tracestate: str = ""
    # Of its tenant's token limits, what a ``Precharge`` counted for it already (the
    # tokens its text has at least, counted before it was tokenised) and the wall time
    # it was counted at: its admission counts only the rest, and gives back what the
    # precharge counted beyond its tokens. 0: no precharge (``requests`` then counts
    # the request; with one, the precharge counted it).
    precharged: int = 0
    precharged_at: float = 0.0
    # Granted mode (the module docstring): the batch key its shell computed
    # (``batching.wire_key``), where the shell keeps the tensors and ``request`` carries
    # none; b"": the request whole, relayed by the core.
    key: bytes = b""
    # Its shell writes its request-log line (it answers the call itself: a unary call
    # that takes one hop), so the core does not: a line per request off the core's hot
    # path, written where the request's bytes are. False: the core writes it.
    logged: bool = False
    # Its program inside its tenant (the ``program`` parameter, ``x-program-id``, an
    # OpenAI call's ``user``; "": none named): its tenant's programs share its turns by
    # least attained service (``scheduler.queues.TenantQueue``). Last: older frames
    # decode without it.
    program: str = ""
    # The SLO class it named (the ``slo_class`` parameter, ``x-slo-class``; "": none, its
    # tenant's or tier's holds: ``admission.slo``), checked by its shell against the
    # configured ones. Last: older frames decode without it.
    slo_class: str = ""

    @property
    def deadline(self) -> float | None:
        """Triton's timeout is relative to arrival: the deadline on the monotonic clock."""
        timeout_us = self.request.timeout_us
        return self.arrived + timeout_us / 1e6 if timeout_us else None

    @property
    def deadline_us(self) -> int:
        """The deadline as unix microseconds, for the model (0: none)."""
        timeout_us = self.request.timeout_us
        return int(self.arrived_wall * 1e6) + timeout_us if timeout_us else 0


class Group(msgspec.Struct, tag=22, array_like=True):
    """The parts of one API call (an embeddings' inputs, a rerank's documents), each a
    ``Call`` of its own (one row), admitted or refused as a whole before any of them
    queues (``Core.submit_group``): the throttle, the tenant's rate limits (the call's
    request once, every part's tokens) and the queue caps judge the call, and a refusal
    answers every part with it. Once admitted each part is scheduled, answered and
    cancelled as a ``Call``. All of one tenant, model and shell; never streamed."""

    calls: list[Call]

    @property
    def tenant(self) -> str:
        return self.calls[0].tenant


class Precharge(msgspec.Struct, tag=23, array_like=True):
    """Count ``requests`` and ``tokens`` against ``tenant``'s limits on ``model`` now: a
    shell asks before it tokenises a request's text, with the tokens that text has at
    least (``tokens.max_token_bytes``), so that a request refused after its tokenising
    has paid for it. Answered with ``Precharged``; the request's ``Call`` then carries
    what was counted (``Call.precharged``)."""

    id: int
    tenant: str
    model: str
    requests: int
    tokens: int


class Precharged(msgspec.Struct, tag=24, array_like=True):
    """The answer to ``Precharge`` ``id``: the wall time its cost was counted at (None:
    not counted: no limits, or a storage that did not answer let it through), or the
    refusal (a ``RateLimited`` with the tenant's quota)."""

    id: int
    at: float | None = None
    fault: Fault | None = None


class Cancel(msgspec.Struct, tag=2, array_like=True):
    """The client of call ``id`` went away: drop it if still queued."""

    id: int


class Fault(msgspec.Struct, array_like=True, frozen=True):
    """A ``FrontendError``, as it crosses to the shell that answers the client."""

    kind: str  # the error class's name (``Unavailable``, ``RateLimited``...)
    message: str
    grpc_code: int  # grpc.StatusCode's number
    http_status: int
    outcome: str
    retry_after: float | None = None
    never_sent: bool = False  # an ``Unavailable`` that provably never reached Triton
    quota: Quota | None = None  # the tenant's rate-limit state (``FrontendError.quota``)

    @classmethod
    def of(cls, err: errors.FrontendError, quota: Quota | None = None) -> Fault:
        """``err`` as it crosses; ``quota``: the rate-limit state of the request it
        answers, where the error itself has none (one error may answer a whole batch,
        of several tenants)."""
        return cls(
            type(err).__name__,
            err.message,
            err.grpc_code.value[0],
            err.http_status,
            err.outcome.value,
            err.retry_after,
            bool(getattr(err, "never_sent", False)),
            err.quota if err.quota is not None else quota,
        )

    def error(self) -> errors.FrontendError:
        """The same error again: its class (where the receiving process knows it, else the
        nearest it does, ``FrontendError`` at worst), status, message, retry hint and
        quota; so a fault keeps its class across the socket as it does in one process."""
        cls = errors.error_class(self.kind)
        err = Exception.__new__(cls)
        errors.FrontendError.__init__(err, self.message, retry_after=self.retry_after)
        err.grpc_code = _GRPC_CODES.get(self.grpc_code, grpc.StatusCode.INTERNAL)
        err.http_status = self.http_status
        err.outcome = Outcome(self.outcome)
        if isinstance(err, errors.Unavailable):
            err.never_sent = self.never_sent
        if self.quota is not None:
            err.quota = self.quota
        return err


_GRPC_CODES = {code.value[0]: code for code in grpc.StatusCode}


class Answer(msgspec.Struct, tag=3, array_like=True):
    """The core's answer to call ``id``: outputs, or the error it is answered with. One
    per call; for a call granted a slot (``Grant``), only to take the slot back."""

    id: int
    version: str = ""
    outputs: list[Tensor] = []
    fault: Fault | None = None
    queued_s: float = -1.0  # time from admission to dispatch; < 0: never queued
    quota: Quota | None = None  # its tenant's rate-limit state (with a fault: on the fault)


class Grant(msgspec.Struct, tag=18, array_like=True):
    """Call ``id`` (a decoupled model's request) has its slot: its shell sends it to
    Triton now and relays the responses to its client (the module docstring)."""

    id: int
    sequence: dict[str, ParamValue] = {}  # a stateful model's ids, as the core mapped them
    queued_s: float = -1.0
    backend: int = 0  # the Triton to send it to: an index into ``Settings.triton_urls``
    quota: Quota | None = None  # its tenant's rate-limit state after its admission
    # The wall time its token limits counted it (-1: they did not): a new leader that
    # adopts the stream (``Running``) corrects that count when it ends, as this core would.
    limits_at: float = -1.0


class Rows(msgspec.Struct, tag=25, array_like=True):
    """Batch ``batch`` of ``model`` takes these of a shell's calls (granted mode, the
    module docstring): its shell packs them, in this order, into one Triton request to
    backend ``backend`` (an index into ``Settings.triton_urls``), answers each client
    when it succeeds, and reports in one ``RowsDone``. Per call, in the order of
    ``calls``: its time queued and its tenant's rate-limit state (its answer's)."""

    model: str
    batch: int
    backend: int
    calls: list[int]
    queued_s: list[float]
    quotas: list[Quota | None]


class RowsDone(msgspec.Struct, tag=26, array_like=True):
    """How a shell's part of batch ``batch`` (a ``Rows``) went: ``served``, the calls it
    sent, each with the output tokens of its answer; ``gone``, those whose client had gone
    away (not sent); ``fault``: None where Triton answered the part (the shell answered
    its clients), else its error, and those calls wait for the core's word (a new
    ``Rows`` or an ``Answer``). ``exec_s``: the part's time in Triton, as its shell timed
    the call; ``traceparent``: that call's span, where traced, which the batch span of
    each of its requests links to."""

    model: str
    batch: int
    served: list[tuple[int, int]]
    gone: list[int] = []
    fault: Fault | None = None
    version: str = ""
    exec_s: float = 0.0
    traceparent: str = ""  # the part's call to Triton, where traced (``tracing``)


INTER_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5
)  # fmt: skip
"""The upper bounds (seconds) a shell bins its streams' inter-token times at, +Inf after
the last: the buckets of the core's histograms of them (``fair_inter_token_seconds``,
GenAI's per-output-token time), which take the counts as they come."""

Gaps = tuple[float, list[int]]
"""Inter-token times binned at ``INTER_TOKEN_BUCKETS``: (their sum in seconds, [bucket,
count, bucket, count, ...]), the bucket an index into the bounds (their length: +Inf).
What a stream's tokens of one tick cost on the link and in the core is then its buckets,
not a time per token."""

NO_GAPS: Gaps = (0.0, [])


def bin_gaps(bins: dict[int, int], tokens: int, gap_s: float) -> float:
    """Bin the inter-token times of ``tokens`` tokens that came together ``gap_s`` after
    the response before (-1: none before) into ``bins`` (bucket -> count): the gap shared
    evenly, one time per token (a stream interval of N is N tokens per response, not one
    token N times slower), so ``tokens`` times in one bucket. Returns their sum (0.0:
    none)."""
    if gap_s < 0 or tokens <= 0:
        return 0.0
    bucket = bisect_left(INTER_TOKEN_BUCKETS, gap_s / tokens)  # as a histogram's observe
    bins[bucket] = bins.get(bucket, 0) + tokens
    return gap_s


def gaps_of(total_s: float, bins: dict[int, int]) -> Gaps:
    """``bin_gaps``' bins and sum as a record carries them."""
    return (total_s, [n for pair in bins.items() for n in pair])


def gaps_from(times: Iterable[float]) -> Gaps:
    """``times`` (each one token's inter-token time) binned as a record carries them."""
    bins: dict[int, int] = {}
    total = 0.0
    for t in times:
        total += bin_gaps(bins, 1, t)
    return gaps_of(total, bins)


def gap_count(gaps: Gaps) -> int:
    """How many inter-token times ``gaps`` holds."""
    return sum(gaps[1][1::2])


class Produced(msgspec.Struct, tag=19, array_like=True):
    """Output tokens of granted calls relayed since the last of these, one entry per call:
    (call id, tokens, seconds from its arrival to its first token if that is among them
    else -1); and the times between consecutive tokens of them all, binned per tenant and
    model (tenant, model, and their ``Gaps``: sum, [bucket, count, ...]), timed by the
    shell where it wrote them to the client. No time per token crosses the link, nor one
    per stream: a tick's inter-token times are a few buckets per tenant and model."""

    entries: list[tuple[int, int, float]]
    gaps: list[tuple[str, str, float, list[int]]] = []


PRODUCED_TICK_S = 0.005
"""How long a shell process gathers its streams' token reports into one ``Produced``: a
tenant's tokens reach its fair share this much (and one socket hop) after they reach its
shell, and the core wakes for a record per shell per tick, not per token."""


class Ended(msgspec.Struct, tag=20, array_like=True):
    """Granted call ``id``'s stream ended: its slot is free (its tokens were all told in
    ``Produced`` records before this one); ``fault``: the error its client was answered
    with (None: served, or ``cancelled``: its client went away). A fault ``never_sent``
    is the exception: its Triton was gone before anything reached the client, which was
    answered nothing; the call is the core's again (granted once more, or answered)."""

    id: int
    version: str = ""
    fault: Fault | None = None
    cancelled: bool = False


# A side-door tally entry's outcome for a call that asked Triton (a cache miss).
SIDE_DOOR_LOOKUP = "lookup"
# A tally entry with this ``door`` counts connections a shell closed itself (over a cap,
# or too slow with a request's headers): ``model`` is the transport, ``outcome`` why.
CONNECTION_DOOR = "connection"


class TallyEntry(msgspec.Struct, array_like=True, frozen=True):
    """Requests a shell answered itself, of one kind, since its last tally; or, with
    ``door`` set, its side-door calls (metadata, config, readiness, statistics, health):
    ``outcome`` is then "ok", the error's gRPC code in lower case, or ``SIDE_DOOR_LOOKUP``."""

    tenant: str | None  # None: refused before the tenant was known
    model: str
    outcome: str
    count: int
    failed_version: str | None = None  # Triton's statistics count a failure (a tenant)
    failed_s: float = 0.0  # their total duration, for the statistics
    door: str = ""  # a side door's name: counted in fair_side_door_*, not fair_requests


class Tally(msgspec.Struct, tag=4, array_like=True):
    """What a shell answered without the core: counted in the one ``/metrics``."""

    entries: list[TallyEntry]


class InfoQuery(msgspec.Struct, tag=5, array_like=True):
    """What is model ``model``? (the core asks Triton once and keeps the answer)."""

    id: int
    model: str


class TensorDescribed(msgspec.Struct, array_like=True, frozen=True):
    """One input or output of a model (``models.TensorSpec``)."""

    name: str
    datatype: str
    dims: tuple[int, ...]  # without the batch dimension
    optional: bool = False


class ModelDescribed(msgspec.Struct, array_like=True, frozen=True):
    """A model as the frontend describes it (``models.ModelInfo``, its fields), whatever
    the backend that serves it: what a shell validates and batches by. The backend's own
    description of the model (Triton's model config) does not cross; a client that asks
    for it is answered by the backend."""

    name: str
    max_batch_size: int
    inputs: tuple[TensorDescribed, ...]
    outputs: tuple[TensorDescribed, ...]
    decoupled: bool
    sequence_batching: bool
    platform: str
    instances: int
    versions: tuple[str, ...]
    takes_rows: bool
    max_model_len: int | None
    sequence_idle_s: float


class InfoAnswer(msgspec.Struct, tag=6, array_like=True):
    id: int
    model: ModelDescribed | None = None  # None with a fault
    fault: Fault | None = None


class StatsQuery(msgspec.Struct, tag=7, array_like=True):
    """Triton's statistics extension, for what went through the frontend."""

    id: int
    model: str
    version: str


class StatsAnswer(msgspec.Struct, tag=8, array_like=True):
    id: int
    message: bytes = b""  # the serialized ModelStatisticsResponse
    fault: Fault | None = None


LINK_VERSION = 2
"""The version of these records on the link, raised whenever a record changes so that a
core and a shell of different versions would misread each other (2: ``Produced``
carries binned inter-token times). A shell says its own in ``Hello``; a core closes the
connection of a shell of another version, saying so, instead of failing on the first
record it cannot read."""


class Hello(msgspec.Struct, tag=9, array_like=True):
    """A shell process has connected (the first record on its connection); ``link``: its
    ``LINK_VERSION`` (0: a shell from before it was said)."""

    index: int
    pid: int
    link: int = 0


class Settings(msgspec.Struct, tag=10, array_like=True):
    """What a shell needs of the config: sent when it connects and on every reload.

    ``config`` is the validated config as JSON-able data; ``keys`` the API keys' SHA-256
    digests (hex) by tenant, read once by the core from inline entries, key files and
    environment variables; ``triton_urls`` the pool of Tritons the shell streams from.
    """

    config: dict[str, Any]
    keys: dict[str, str]
    triton_url: str  # the first Triton's gRPC address (the only one, without a pool)
    # Every Triton of the pool, in order (a ``Grant`` names one by its index); empty:
    # ``triton_url`` alone.
    triton_urls: list[str] = []
    # Each one's HTTP address, in the same order ("" where it has none): generate_stream's
    # clients read Triton's own events there (``triton.sse``).
    triton_http_urls: list[str] = []


class Ready(msgspec.Struct, tag=11, array_like=True):
    """The shell listens: sent once, after its first ``Settings``."""

    http_port: int
    grpc_port: int


class Draining(msgspec.Struct, tag=12, array_like=True):
    """The core stops admitting (shutdown): readiness turns false; answers still come."""


class Stop(msgspec.Struct, tag=13, array_like=True):
    """Close the listeners and exit (the core has drained)."""


class FlushTally(msgspec.Struct, tag=14, array_like=True):
    """Send your tally now (the metrics port is being scraped); answer ``Flushed``."""

    id: int


class Flushed(msgspec.Struct, tag=15, array_like=True):
    """The tally up to now has been sent (it precedes this on the connection)."""

    id: int


class QueueView(msgspec.Struct, tag=16, array_like=True):
    """Which queues are full now: (tenant, model, the cap) for each, tenant "*" and model
    "*" for the process-wide cap. A shell sheds a request for a full queue at once (before
    it reads an HTTP body, or validates), as the core would refuse it. Sent when it
    changes, checked every ``QUEUE_VIEW_INTERVAL_S``.

    ``room``: the byte caps close to full, (tenant, model, bytes left, the cap), model "*"
    for a tenant's default share over every model and ("*", "*", ...) for the global byte
    cap: a shell sheds a request whose tensor bytes exceed what is left, once decoded
    (before it crosses to the core). Only caps with less room than the largest request
    any model accepts are listed.

    ``overloaded``: the tiers the throttle closed, (model, tier, message, retry-after
    seconds) for each model and tier where even the most favourable request of the tier
    would be refused now (``Shedding.refresh``): a shell refuses a request of a
    tenant of that tier for that model at once, with that message (503, Retry-After), as
    the core would."""

    full: list[tuple[str, str, str]]
    room: list[tuple[str, str, int, str]] = []
    overloaded: list[tuple[str, str, str, float]] = []


class Running(msgspec.Struct, tag=21, array_like=True):
    """A stream another core granted, still relayed by this shell (told to the core it
    connects to next, which holds its slot on Triton ``backend`` until it ends). With
    its grant's ``limits_at`` and the tokens it relayed before this record (``produced``;
    those after come as ``Produced``): the new core corrects its tenant's token limits
    by what it produced when it ends, as the core that admitted it would have."""

    call: Call
    backend: int
    limits_at: float = -1.0
    produced: int = 0


ToCore = Union[  # noqa: UP007
    Call,
    Group,
    Cancel,
    Precharge,
    Tally,
    InfoQuery,
    StatsQuery,
    Hello,
    Ready,
    Flushed,
    Produced,
    Ended,
    Running,
    RowsDone,
]
ToShell = Union[  # noqa: UP007
    Answer,
    Grant,
    Precharged,
    InfoAnswer,
    StatsAnswer,
    Settings,
    Draining,
    Stop,
    FlushTally,
    QueueView,
    Rows,
]
