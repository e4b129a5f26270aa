"""The chaos run, short: every request sent gets exactly one answer, Triton kill included.

``benchmarks/bench_chaos.py`` runs it longer and reports the figures; this test runs that
same scenario, small, as a process of its own (the tests do not import the benchmarks)
and checks the result it writes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support import ROOT

# Triton starts, is killed and restarted, and 400 requests go at 80/s: under a minute
# here; the deadline leaves room for a loaded machine (pytest's own is 300 s).
RUN_TIMEOUT_S = 240


def run_chaos(tmp_path: Path, *, requests: int, rate: float, tenants: int, seed: int) -> Any:
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_chaos", "--requests", str(requests),
           "--rate", str(rate), "--tenants", str(tenants), "--seed", str(seed),
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


def test_chaos_loses_nothing(tmp_path: Path) -> None:
    r = run_chaos(tmp_path, requests=400, rate=80.0, tenants=12, seed=1)
    assert r["lost"] == 0, r
    assert sum(r["answers"].values()) == r["sent"] == 400
    # Every kind of trouble happened, and was answered.
    for outcome in ("ok", "rate limited (429)", "invalid (400)", "cancelled by client"):
        assert r["answers"].get(outcome, 0) > 0, (outcome, r["answers"])
    assert r["answers"].get("expired (503)", 0) + r["answers"].get("unavailable (503)", 0) > 0
    # Service resumed once Triton was back.
    assert r["first_success_after_return_s"] is not None, r
    # The frontend's books balance: nothing left queued, every admitted request accounted.
    for model, c in r["frontend"]["schedulers"].items():
        assert c["queued"] == 0, (model, c)
        assert c["admitted"] == c["dispatched"] + c["expired"] + c["cancelled"], (model, c)
    # It saw at most what was sent (a client may cancel before its request arrives).
    cancelled = r["answers"].get("cancelled by client", 0)
    assert r["sent"] - cancelled <= r["frontend_total"] <= r["sent"], r
