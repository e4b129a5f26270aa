"""The chaos run, short: every request sent gets exactly one answer, Triton kill included.

``benchmarks/bench_chaos.py`` runs it longer and reports the figures.
"""

from __future__ import annotations

from benchmarks.bench_chaos import run_chaos


def test_chaos_loses_nothing() -> None:
    r = run_chaos(requests=400, rate=80.0, tenants=12, seed=1)
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
