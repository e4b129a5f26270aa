"""Shared fixtures: one real Triton for the whole test session.

``triton`` starts ``tritonserver`` (the nvidia-pytriton wheel's, or one on ``PATH``) on
free loopback ports, serving ``model_repository/`` (``embed``, ``generate``) and, beside
it, ``tests/model_repository/`` (test-only models, when present); it waits for readiness
and stops it (no process left behind) when the session ends. Tests use
``triton.grpc_url``, ``triton.http_url`` and ``triton.metrics_url``. It is shared: a test
that reads Triton's counters must look at differences and label its own traffic (a unique
tenant).

One crash is one failure: the shared Triton is looked at before each test that uses it,
and started again (on the same ports) if it died; the test that was running when it died
carries the tail of its log in its report (``pytest_runtest_makereport``).
"""

from __future__ import annotations

import contextlib
import os
import urllib.request
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from fair_frontend.backends.triton.embedded import EmbeddedTriton, default_model_repository
from fair_frontend.kit.testing import eventually
from tests.support import RunningFrontend, make_config, running_frontend

TEST_MODEL_REPOSITORY = Path(__file__).resolve().parent / "model_repository"
pytest_plugins = ["pytester"]  # tests/test_suite_guards.py runs suites of its own

# Property tests: the same examples on every run of `make test` ("suite"), so that CI
# passes or fails on the code, not on the draw; HYPOTHESIS_PROFILE=explore draws new ones
# (run it when changing a decoder or the scheduler; keep what it finds as an @example).
# No deadline on an example's wall time in either: a deadline is a sub-second ceiling
# on this shared machine's speed (a fresh clone beside CPU hogs: a 94 ms example took
# 309 ms once, and Hypothesis failed it as flaky); a property is judged on its values.
settings.register_profile("suite", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


# The session's Triton, once started: what the report hook and the liveness check read.
SHARED_TRITON = pytest.StashKey[EmbeddedTriton]()
# The pids of the session's Tritons whose death a test's report has already shown.
DEATHS_SHOWN = pytest.StashKey[set[int]]()
# A test before which the session's Triton was started again: (the dead pid, its log's
# tail where not shown yet, whether it is to be shown).
RESTARTED = pytest.StashKey[tuple[int | None, str, bool]]()
CRASH_LOG_LINES = 60
# A frontend in front of a restarted Triton: ready once its probe has seen Triton back.
FRONTEND_BACK_S = 60.0


@contextlib.contextmanager
def shared(session: pytest.Session, server: EmbeddedTriton) -> Iterator[EmbeddedTriton]:
    """``server`` (started) as the session's Triton, for the liveness check and the reports."""
    session.stash[SHARED_TRITON] = server
    try:
        yield server
    finally:
        del session.stash[SHARED_TRITON]


@pytest.fixture(scope="session")
def triton(request: pytest.FixtureRequest) -> Iterator[EmbeddedTriton]:
    repositories = [default_model_repository()]
    if TEST_MODEL_REPOSITORY.is_dir():
        repositories.append(TEST_MODEL_REPOSITORY)
    with EmbeddedTriton(repositories) as server, shared(request.session, server):
        yield server


def _log_tail(server: EmbeddedTriton) -> str:
    """The last lines of Triton's log (appended across restarts: the dead one's last)."""
    try:
        text = server.log_path.read_text(errors="replace")
    except OSError as err:
        return f"(its log {server.log_path} could not be read: {err})"
    lines = text.splitlines()[-CRASH_LOG_LINES:]
    return f"the last {len(lines)} lines of {server.log_path}:\n" + "\n".join(lines)


def _ready(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{url}/v2/health/ready", timeout=5) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a test that uses the session's Triton, and before any of its fixtures (a
    module's fixture that starts a frontend in front of it among them): if it died (in an
    earlier test, whose report says so), start it again on its ports. Without this one
    crash failed every later test; done in ``_shared_triton_alive`` alone, it came after
    the module's fixtures, which failed against the dead one (a fresh clone: 3 errors)."""
    server = item.session.stash.get(SHARED_TRITON, None)
    if server is None or "triton" not in getattr(item, "fixturenames", ()):
        return
    if server.is_running():
        return
    dead = server.pid
    unseen = dead not in item.session.stash.setdefault(DEATHS_SHOWN, set())
    item.stash[RESTARTED] = (dead, _log_tail(server) if unseen else "", unseen)
    server.stop()  # reaps it and whatever of its group is left
    server.start()


@pytest.fixture(autouse=True)
def _shared_triton_alive(request: pytest.FixtureRequest) -> None:
    """After ``pytest_runtest_setup`` started the session's Triton again for this test:
    wait for the session's frontend, if the test uses it, to see it back, and fail this
    test, once per crash not reported yet."""
    restarted = request.node.stash.get(RESTARTED, None)
    if restarted is None:
        return
    dead, tail, unseen = restarted
    if "frontend" in request.fixturenames:
        running: RunningFrontend = request.getfixturevalue("frontend")
        eventually(
            lambda: _ready(running.http_url),
            FRONTEND_BACK_S,
            what="the session's frontend to see the restarted Triton",
        )
    if unseen:  # it died after the last test's report: this one says so, once
        request.session.stash[DEATHS_SHOWN].add(dead or 0)
        pytest.fail(
            f"the session's Triton (pid {dead}) had died since the last test's report; "
            f"started again for this test. {tail}",
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test during which the session's Triton died carries the tail of Triton's log."""
    report = yield
    server = item.session.stash.get(SHARED_TRITON, None)
    if server is None or report.when != "call":
        return report
    if not server.is_running():
        item.session.stash.setdefault(DEATHS_SHOWN, set()).add(server.pid or 0)
        report.sections.append(
            (
                f"the session's Triton died during this test (pid {server.pid}; "
                f"started again before the next test)",
                _log_tail(server),
            )
        )
        if report.passed:  # a crash is a failure, even of a test that did not notice
            report.outcome = "failed"
            report.longrepr = f"the session's Triton died during this test; {_log_tail(server)}"
    return report


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
