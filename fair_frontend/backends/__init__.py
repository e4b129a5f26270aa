"""The servers the frontend sends work to, one package each, chosen by name.

A backend kind is a package here (``triton``) whose forwarder's factory is registered in
``BACKENDS`` by one line below: given a server's address, the request timeout and its
HTTP address where it has one, the object that sends a ``protocol.Batch``, opens a
stream and describes a model (``backends.protocol.BackendServer``). The core and the
shells build their forwarders by the kind's name (``DEFAULT_BACKEND`` until a config
names another) and hold them by that protocol, not by importing a class. A kind's reader
of its servers' own metrics (``backends.protocol.MetricsReader``) is registered the same
way, in ``METRICS``, and built by ``metrics_reader``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from fair_frontend.backends.protocol import BackendServer, MetricsReader
from fair_frontend.backends.triton.forwarder import TritonForwarder
from fair_frontend.backends.triton.metrics import TritonMetrics
from fair_frontend.feedback.delta import TritonDelta
from fair_frontend.parts import Registry


class BackendFactory(Protocol):
    """Builds the forwarder for one server of a backend kind."""

    def __call__(
        self, url: str, *, request_timeout_s: float, http_url: str | None
    ) -> BackendServer: ...


class MetricsFactory(Protocol):
    """Builds the reader of one server's metrics, at ``url``, for a backend kind."""

    def __call__(
        self,
        url: str,
        *,
        interval_s: float,
        on_delta: Callable[[TritonDelta], None],
        on_scrape: Callable[[float, bool], None],
    ) -> MetricsReader: ...


BACKENDS: Registry[BackendFactory] = Registry("backend")
BACKENDS.add("triton", TritonForwarder)
METRICS: Registry[MetricsFactory] = Registry("backend metrics reader")
METRICS.add("triton", TritonMetrics)
DEFAULT_BACKEND = "triton"


def backend(
    url: str, *, request_timeout_s: float, http_url: str | None, kind: str = ""
) -> BackendServer:
    """The forwarder for the server at ``url``, of backend ``kind`` (the default one)."""
    return BACKENDS[kind or DEFAULT_BACKEND](
        url, request_timeout_s=request_timeout_s, http_url=http_url
    )


def metrics_reader(
    url: str,
    *,
    interval_s: float,
    on_delta: Callable[[TritonDelta], None],
    on_scrape: Callable[[float, bool], None],
    kind: str = "",
) -> MetricsReader:
    """The reader of the metrics at ``url``, of a server of backend ``kind`` (the default
    one); not started."""
    return METRICS[kind or DEFAULT_BACKEND](
        url, interval_s=interval_s, on_delta=on_delta, on_scrape=on_scrape
    )
