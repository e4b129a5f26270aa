"""Shared fixtures: one real Triton for the whole test session.

``triton`` starts ``tritonserver`` (the nvidia-pytriton wheel's, or one on ``PATH``) on
``model_repository/`` with free loopback ports, waits for readiness, and stops it (no
process left behind) when the session ends. Tests use ``triton.grpc_url``,
``triton.http_url`` and ``triton.metrics_url``; it is shared, so a test that reads
Triton's counters must look at differences, and label its own traffic (a unique tenant).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fair_frontend.embedded import EmbeddedTriton, default_model_repository


@pytest.fixture(scope="session")
def triton() -> Iterator[EmbeddedTriton]:
    server = EmbeddedTriton(default_model_repository())
    server.start()
    try:
        yield server
    finally:
        server.stop()
