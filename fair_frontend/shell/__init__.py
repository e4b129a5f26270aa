"""Shells: the transport processes. They do protocol; the core does policy.

A shell serves KServe v2 over HTTP (``http_server``, aiohttp) and gRPC (``grpc_server``,
grpc.aio): it decodes each request, identifies its tenant, validates it against the
model and hands it to the core as one ``Call`` (``fair_frontend.wire.records``); it
encodes the core's ``Answer`` for the client, or, granted a slot, relays the request's
stream from Triton itself. ``gateway.Gateway`` is that protocol-independent part, which
both transports call; ``link`` is how it reaches the core: in the core's own process
(``--workers 1``), or from a shell process (``process``, through ``socket_link`` over
``fair_frontend.wire``). Several shell processes serve the same ports, so the transport
scales over cores while admission and scheduling stay exact in the one core.
"""
