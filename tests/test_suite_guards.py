"""The suite's own guards, run on suites of their own (``pytester``, in a subprocess).

One crash is one failure: the session's Triton killed during a test fails that test
(its report carries the end of Triton's log), and the next test finds it started again
(before its module's fixtures too);
killed after a test's report (in a teardown), it fails the next test's set-up, once,
and the one after runs as usual. Before, every later test failed after its own timeout.
"""

from __future__ import annotations

import pytest

from tests.support import ROOT

# A light session Triton (one small model) standing in for the suite's, shared the same way.
INNER = """
import os
import signal

import pytest

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.kit.testing import eventually
from tests.conftest import TEST_MODEL_REPOSITORY, shared


@pytest.fixture(scope="session")
def triton(request):
    args = ["--model-control-mode=explicit", "--load-model=simple"]
    with EmbeddedTriton([TEST_MODEL_REPOSITORY], extra_args=args) as server:
        with shared(request.session, server):
            yield server


def kill(server):
    os.killpg(server.pid, signal.SIGKILL)
    eventually(lambda: not server.is_running(), 30, what="Triton gone")


@pytest.fixture
def killed_afterwards(triton):
    yield
    kill(triton)


def test_1_kills_it_and_passes_anyway(triton):
    print("first pid", triton.pid)
    kill(triton)


@pytest.fixture(scope="module")
def module_frontend(triton):
    # A module's fixture (one that starts a frontend, say) is set up before a test's own
    # fixtures: it too must find the session's Triton started again.
    assert triton.is_running(), "a module's fixture was set up against the dead Triton"
    return triton.pid


def test_2_finds_it_back(module_frontend, triton):
    assert triton.is_running() and module_frontend == triton.pid
    print("second pid", triton.pid)


def test_3_kills_it_in_its_teardown(killed_afterwards, triton):
    pass


def test_4_is_told_once(triton):
    pass


def test_5_runs_as_usual(triton):
    assert triton.is_running()
"""


def test_a_crash_of_the_shared_triton_is_one_failure(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "tests.conftest", "-rA", "-s", timeout=240)
    result.assert_outcomes(passed=3, failed=1, errors=1)
    out = result.stdout.str()
    assert "FAILED test_inner.py::test_1_kills_it_and_passes_anyway" in out
    assert "the session's Triton died during this test" in out
    assert "PASSED test_inner.py::test_2_finds_it_back" in out
    assert "PASSED test_inner.py::test_3_kills_it_in_its_teardown" in out
    assert "ERROR test_inner.py::test_4_is_told_once" in out
    assert "had died since the last test's report" in out
    assert "PASSED test_inner.py::test_5_runs_as_usual" in out
    # The log's tail is in the report: Triton's own lines, from this run.
    assert "Started GRPCInferenceService" in out


def test_property_examples_have_no_wall_clock_deadline() -> None:
    """Hypothesis's deadline (200 ms an example by default) is a sub-second ceiling on the
    machine's speed: a fresh clone beside CPU hogs failed a codec property whose example
    took 309 ms once and 94 ms on its replay. The suite's profiles set none."""
    from hypothesis import settings

    assert settings.default is not None
    assert settings.default.deadline is None
    for name in ("suite", "explore"):
        profile = settings.get_profile(name)
        assert profile is not None
        assert profile.deadline is None
