"""A gate a test model holds its answers at until the test opens it.

In place of a model that sleeps for a time sized to the machine's speed: the test decides
when the answer goes. ``Gate`` is the test's side, ``hold_at_gate`` the model's (in its
``execute``); both are re-exported by ``fair_frontend.kit.testing``. This module needs only the
standard library: Triton's Python-backend stub imports it, and that interpreter cannot
load every extension module of the virtual environment's (``ssl`` among them).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

# The request parameter (a string: a file's path) that names a request's gate.
GATE_PARAMETER = "test_gate"
# The same, for a decoupled test model to hold at before its first response (the other
# after it): a stream that is in Triton and has answered nothing yet.
GATE_FIRST_PARAMETER = "test_gate_first"
# How long a model holds at a gate nobody opens: a test that forgot it fails, Triton goes on.
GATE_LIMIT_S = 300.0
_GATE_POLL_S = 0.002


class Gate:
    """A gate a test model holds its answers at until the test opens it.

    The test sends ``parameter`` as the request parameter ``GATE_PARAMETER`` (what a
    client's custom parameter is, over either protocol); the model's ``execute`` calls
    ``hold_at_gate`` and answers only once ``open()`` has been called. Triton runs on the
    test's machine, so the gate is a file: opened is created. One gate holds every request
    that names it, before and after it opens (those after pass at once); each one it
    holds leaves a file beside it as it arrives (``held`` counts them)."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / f"gate-{uuid.uuid4().hex}"

    @property
    def parameter(self) -> str:
        return str(self.path)

    @property
    def is_open(self) -> bool:
        return self.path.exists()

    @property
    def held(self) -> int:
        """How many requests arrived at the gate while it was closed (each held there)."""
        return len(list(self.path.parent.glob(f"{self.path.name}.held.*")))

    def open(self) -> None:
        self.path.touch()


def hold_at_gate(
    parameters: str, limit_s: float = GATE_LIMIT_S, *, name: str = GATE_PARAMETER
) -> bool:
    """For a test model's ``execute``: wait until the gate named in a request's parameters
    (``request.parameters()``, a JSON object; ``name``: the parameter) is open, at most
    ``limit_s``. Returns whether it was open; a request that names no gate passes at once
    (True)."""
    path = json.loads(parameters or "{}").get(name)
    if not path:
        return True
    if not os.path.exists(path):
        Path(f"{path}.held.{uuid.uuid4().hex}").touch()  # arrived: ``Gate.held``
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_GATE_POLL_S)
    return True
