"""Issue 12: Triton's own client examples and QA tests pass through the frontend.

Each vendored item (``runner.py``) runs against the session's Triton and through a frontend
in front of it with the tenant's key, once per session, in parallel subprocesses. Then:

- every item that passes against Triton passes through the frontend, except the named
  exceptions (``runner.EXCEPTIONS``), where the client must get the documented answer;
- items still failing through the frontend because a fix of issue 12 is not in yet are
  ``xfail(strict=True)`` (``KNOWN``): they turn into errors the moment the fix lands, so
  the mark is removed then;
- an item that fails against Triton is a broken stand-in or harness, not a frontend
  difference: it fails here too (except the named exceptions, which do on this machine).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from tests.support import KEYS, make_config, running_frontend
from tests.triton_suites.runner import (
    DIRECT,
    EXCEPTIONS,
    FRONTEND,
    KNOWN,
    Results,
    Target,
    all_items,
    run_all,
)

pytestmark = pytest.mark.slow

# Against Triton these fail on this machine whatever the frontend does (see EXCEPTIONS).
FAIL_DIRECT = {
    "client_examples::simple_http_cudashm_client.py",
    "client_examples::simple_grpc_cudashm_client.py",
    "client_examples::simple_http_model_control.py",
    "client_examples::simple_grpc_model_control.py",
}


@pytest.fixture(scope="module")
def results(triton: EmbeddedTriton) -> Iterator[Results]:
    with running_frontend(make_config(), triton) as front:
        targets = {
            DIRECT: Target(triton.http_url.removeprefix("http://"), triton.grpc_url),
            FRONTEND: Target(front.http_url, front.grpc_url, KEYS["acme"]),
        }
        yield run_all(targets, progress=lambda line: print(line, flush=True))


def _params() -> list[object]:
    params: list[object] = []
    for item in all_items():
        marks = []
        if item.id in KNOWN:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN[item.id]))
        params.append(pytest.param(item.id, id=item.id, marks=marks))
    return params


@pytest.mark.parametrize("item_id", _params())
def test_item_passes_through_the_frontend_as_against_triton(results: Results, item_id: str) -> None:
    direct = results.outcomes[DIRECT][item_id]
    through = results.outcomes[FRONTEND][item_id]
    if item_id in FAIL_DIRECT:
        assert not direct.passed, f"{item_id} now passes against Triton: move it out of FAIL_DIRECT"
    else:
        assert direct.passed, f"fails against Triton itself (stand-in or harness):\n{direct.output}"
    exception = EXCEPTIONS.get(item_id)
    if exception is not None:
        assert not through.passed
        assert exception.answer in through.output, through.output
        return
    assert through.passed, f"passes against Triton, fails through the frontend:\n{through.output}"
