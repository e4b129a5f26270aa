"""The one adaptation Triton's vendored examples and QA tests get: where the server is, and
the tenant's key on every call. Imported by Python at start (``sitecustomize``) when this
folder is on ``PYTHONPATH``; the vendored files stay as Triton ships them.

- ``TRITON_SUITES_HTTP`` / ``TRITON_SUITES_GRPC``: ``host:port`` that replaces the QA tests'
  hard-coded ``localhost:8000`` / ``localhost:8001`` (examples get ``-u`` on their command
  line instead; this machine's servers use free ports, never the fixed ones).
- ``TRITON_SUITES_KEY``: when set, ``authorization: Bearer <key>`` is added to every request
  of every tritonclient client (HTTP, gRPC, both asyncio flavours) through tritonclient's
  own plugin hook (``register_plugin``, what its ``BasicAuth`` uses), to ``requests``
  calls (the raw HTTP requests of qa/L0_http) and to calls on raw ``grpc.insecure_channel``
  stubs (the grpc_explicit_* examples) where the metadata has none yet. Unset for Triton
  direct.
"""

from __future__ import annotations

import os
from typing import Any

_URLS = {
    "localhost:8000": os.environ.get("TRITON_SUITES_HTTP"),
    "localhost:8001": os.environ.get("TRITON_SUITES_GRPC"),
}
_KEY = os.environ.get("TRITON_SUITES_KEY")


def _url(url: str) -> str:
    return _URLS.get(url) or url


class _TenantKey:
    """A tritonclient client plugin: adds the tenant's key to the request's headers."""

    def __call__(self, request: Any) -> None:
        request.headers = dict(request.headers or {})
        request.headers["authorization"] = f"Bearer {_KEY}"


def _patch_client(cls: Any) -> None:
    original = cls.__init__

    def __init__(self: Any, url: str, *args: Any, **kwargs: Any) -> None:
        original(self, _url(url), *args, **kwargs)
        if _KEY:
            self.register_plugin(_TenantKey())

    cls.__init__ = __init__


def _patch_requests() -> None:
    import requests

    original = requests.Session.request

    def request(self: Any, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        for fixed, target in _URLS.items():
            if target and url.startswith(f"http://{fixed}/"):
                url = f"http://{target}/" + url[len(f"http://{fixed}/") :]
        if _KEY:
            kwargs["headers"] = {**(kwargs.get("headers") or {}), "authorization": f"Bearer {_KEY}"}
        return original(self, method, url, *args, **kwargs)

    # The shim's one patch of requests: a method replaced on its class (its signature kept).
    requests.Session.request = request  # type: ignore[method-assign,assignment]


def _patch_grpc_channels() -> None:
    import grpc

    key = ("authorization", f"Bearer {_KEY}")

    class _AddKey(
        grpc.UnaryUnaryClientInterceptor,
        grpc.UnaryStreamClientInterceptor,
        grpc.StreamUnaryClientInterceptor,
        grpc.StreamStreamClientInterceptor,
    ):
        def _details(self, details: Any) -> Any:
            metadata = list(details.metadata or ())
            if not any(name.lower() == "authorization" for name, _ in metadata):
                metadata.append(key)
            return details._replace(metadata=metadata)

        def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            return continuation(self._details(details), request)

        def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
            return continuation(self._details(details), request)

        def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
            return continuation(self._details(details), requests)

        def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
            return continuation(self._details(details), requests)

    original = grpc.insecure_channel

    def insecure_channel(target: str, *args: Any, **kwargs: Any) -> Any:
        return grpc.intercept_channel(original(target, *args, **kwargs), _AddKey())

    grpc.insecure_channel = insecure_channel


def _install() -> None:
    import tritonclient.grpc
    import tritonclient.grpc.aio
    import tritonclient.http
    import tritonclient.http.aio

    for module in (
        tritonclient.http,
        tritonclient.http.aio,
        tritonclient.grpc,
        tritonclient.grpc.aio,
    ):
        _patch_client(module.InferenceServerClient)
    _patch_requests()
    if _KEY:
        _patch_grpc_channels()


if os.environ.get("TRITON_SUITES_HTTP") or os.environ.get("TRITON_SUITES_GRPC") or _KEY:
    _install()
