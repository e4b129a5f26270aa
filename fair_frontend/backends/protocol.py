"""What the core and the shells need of one server of a backend, whatever its kind.

A backend kind's forwarder (``backends.triton.forwarder.TritonForwarder``) is built by its
name (``backends.BACKENDS``) and used through these protocols only: the dispatch loop
sends batches (``Forwarder``); the core also looks models up and probes readiness, and a
shell also opens streams and answers the side doors (``BackendServer``).

The side doors speak KServe's v2 protocol, which the frontend serves to its clients as
it is: ``side_door`` takes a door by the frontend's name for it (``SideDoor``) and
answers KServe's message for it (a kind other than Triton makes that message). ``events``
is a server's own event stream (Triton's ``generate_stream``), passed to a client as it
came where the shell has nothing to add to it; a kind that has none leaves it None.

A server's own metrics feed the core's service estimates (``MetricsReader``, built by the
kind's name too: ``backends.metrics_reader``): each model's counters between two reads,
as the feedback loop's own ``TritonDelta``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from fair_frontend.errors import FrontendError
from fair_frontend.models import ModelInfo
from fair_frontend.protocol import Batch, Tensor


class Forwarder(Protocol):
    """What the dispatch loop needs of a server: one batch sent, its outputs back."""

    async def infer(self, batch: Batch) -> tuple[str, list[Tensor]]:
        """One request (``batch``); returns (the model version that ran, its outputs)."""
        ...


@dataclass(slots=True)
class StreamReply:
    """One response of a decoupled model (or the error that ended its stream)."""

    version: str = ""
    outputs: list[Tensor] = field(default_factory=list)
    final: bool = False
    error: FrontendError | None = None
    # A stream read raw (``BackendServer.stream(raw=True)``): the server's serialized
    # response, and that message parsed (``outputs`` stays empty: nothing is decoded
    # into tensors).
    raw: bytes = b""
    message: Any = None


class Stream(Protocol):
    """One request to a decoupled model: its responses, the last one an error where one
    ended it. ``stop(err)`` cancels it from outside (the core took its slot back): the
    consumer's next reply is ``err``; ``on_stop`` hears of every stop at once."""

    stopped: FrontendError | None
    on_stop: Callable[[FrontendError], None]

    def stop(self, err: FrontendError) -> None: ...

    def __aiter__(self) -> AsyncIterator[StreamReply]: ...

    async def aclose(self) -> None: ...


@dataclass(slots=True)
class Events:
    """Whole events of a server's own event stream, as it wrote them (Triton's
    generate_stream: ``data: {...}\\n\\n``, one or more); or the error that ended it:
    ``error``, the stream's (not reached, lost, stopped), or ``model_error``, what the
    model answered in the stream's last event (its server's own error event, left out of
    ``data``, which holds the events before it)."""

    data: bytes = b""
    error: FrontendError | None = None
    model_error: FrontendError | None = None


class EventStream(Protocol):
    """One request's events (``EventSource.stream``), as ``Stream`` its responses: the
    last item an error where one ended it; ``stop`` and ``on_stop`` as ``Stream``'s."""

    stopped: FrontendError | None
    on_stop: Callable[[FrontendError], None]

    def stop(self, err: FrontendError) -> None: ...

    def __aiter__(self) -> AsyncIterator[Events]: ...

    async def aclose(self) -> None: ...


class EventSource(Protocol):
    """A server's own event stream (``BackendServer.events``): one request (``body``, the
    generate extension's JSON object) and its events; a consumer that holds them for
    ``stalled_s`` has the request cancelled."""

    def stream(
        self,
        model: str,
        version: str,
        body: bytes,
        *,
        stalled_s: float | None = None,
        traceparent: str = "",
    ) -> EventStream: ...


SideDoor = Literal["server_metadata", "model_metadata", "model_config", "model_ready"]
"""The side doors a server answers itself (health's liveness is the frontend's own, its
readiness ``server_ready``; statistics are the frontend's, from the core)."""


class BackendServer(Forwarder, Protocol):
    """One server of a backend kind, as the core and the shells use it."""

    url: str  # its address (log lines, traces, metrics)
    request_timeout_s: float

    @property
    def events(self) -> EventSource | None: ...

    async def describe(self, model: str) -> ModelInfo:
        """``model`` in the frontend's words: its inputs, outputs, batching, ready
        versions (the core asks once per model and sends it to the shells)."""
        ...

    def stream(self, batch: Batch, *, stalled_s: float | None = None, raw: bool = False) -> Stream:
        """One request to a decoupled model, its responses as they come; a consumer that
        holds one for ``stalled_s`` has it cancelled."""
        ...

    async def side_door(self, door: SideDoor, model: str = "", version: str = "") -> Any:
        """KServe's answer to a side door (its v2 message: ``model_ready`` a bool), about
        ``model`` and ``version`` where the door is about a model; errors mapped."""
        ...

    async def server_ready(self) -> bool: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ScrapeStatus:
    """How a ``MetricsReader``'s reads went, for the core's metrics."""

    url: str
    scrapes: int  # successful
    failures: int
    consecutive_failures: int
    last_success_at: float | None
    last_error: str | None


class MetricsReader(Protocol):
    """Reads one server's metrics every interval while started, and tells its owner of
    each model's counters between two reads (``on_delta``) and of every read
    (``on_scrape``: the loop's time, whether it succeeded)."""

    def start(self) -> Any: ...

    async def stop(self) -> None: ...

    def status(self) -> ScrapeStatus: ...
