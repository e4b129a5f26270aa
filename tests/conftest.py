"""Shared fixtures: one real Triton for the whole test session.

``triton`` starts ``tritonserver`` (the nvidia-pytriton wheel's, or one on ``PATH``) on
free loopback ports, serving ``model_repository/`` (``embed``, ``generate``) and, beside
it, ``tests/model_repository/`` (test-only models, when present); it waits for readiness
and stops it (no process left behind) when the session ends. Tests use
``triton.grpc_url``, ``triton.http_url`` and ``triton.metrics_url``. It is shared: a test
that reads Triton's counters must look at differences and label its own traffic (a unique
tenant).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from fair_frontend.embedded import EmbeddedTriton, default_model_repository
from tests.support import RunningFrontend, make_config, running_frontend

TEST_MODEL_REPOSITORY = Path(__file__).resolve().parent / "model_repository"

# Property tests: the same examples on every run of `make test` ("suite"), so that CI
# passes or fails on the code, not on the draw; HYPOTHESIS_PROFILE=explore draws new ones
# (run it when changing a decoder or the scheduler; keep what it finds as an @example).
settings.register_profile("suite", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


@pytest.fixture(scope="session")
def triton() -> Iterator[EmbeddedTriton]:
    repositories = [default_model_repository()]
    if TEST_MODEL_REPOSITORY.is_dir():
        repositories.append(TEST_MODEL_REPOSITORY)
    server = EmbeddedTriton(repositories)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session", params=[1, 2], ids=["one-process", "two-shells"])
def workers(request: pytest.FixtureRequest) -> int:
    """Shell processes of the frontends under test: the integration tests run twice, with
    the whole frontend in one process (``--workers 1``) and with two shell processes in
    front of the core (the transport split over processes)."""
    return int(request.param)


@pytest.fixture(scope="session")
def frontend(triton: EmbeddedTriton, workers: int) -> Iterator[RunningFrontend]:
    """The frontend (test tenants, no rate limits) in front of the session's Triton.

    Shared by the whole session: tests label their traffic with their own tenant where
    they read counters, and must leave no requests queued behind them.
    """
    with running_frontend(make_config(), triton, workers=workers) as running:
        yield running
