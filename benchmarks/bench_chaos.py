"""The chaos run: nothing is lost, whatever happens.

Many tenants in three tiers send a random mix to `embed` and `generate` over gRPC and
HTTP: random sizes, priorities and deadlines (some too short to be met), some requests
cancelled by their client after a random delay, some bad requests, some tenants over
tight rate limits; in the middle, Triton is killed (SIGKILL) and restarted. Every request
sent must get exactly one answer; the answers by outcome must add up to the requests sent;
the frontend's own accounting must agree.

Reported: requests sent, answered by outcome, lost (must be 0), and the time from
Triton's return (ready again) to the first successful answer after it.

    .venv/bin/python -m benchmarks.bench_chaos [--requests 3000] [--seed 0]

``--json PATH`` writes the result there instead of ``benchmarks/results/chaos.json``
(``tests/test_chaos.py`` runs a short one so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcaio
import tritonclient.http.aio as httpaio
from tritonclient.utils import InferenceServerException

from benchmarks.harness import progress, write_result
from fair_frontend.backends.triton.embedded import EmbeddedTriton, default_model_repository
from fair_frontend.config import Config, parse_config
from fair_frontend.server import BackgroundServer, FrontendServer, Listen

TIERS = ["enterprise", "standard", "trial"]


def chaos_config(tenants: int) -> tuple[Config, dict[str, str]]:
    """Tenants spread over three tiers; every fifth one on a tight rate limit."""
    from benchmarks.harness import load_example_config

    data = load_example_config()
    data.pop("tier_limits", None)
    keys = {f"t{i:02d}": f"chaos-key-{i:02d}" for i in range(tenants)}
    data["tenants"] = {}
    for i, (name, key) in enumerate(keys.items()):
        tenant: dict[str, Any] = {"tier": TIERS[i % 3], "api_keys": [key], "weight": 1 + i % 2}
        if i % 5 == 0:
            tenant["limits"] = {
                "embed": {"requests_per_second": 5},
                "generate": {"requests_per_second": 2},
            }
        data["tenants"][name] = tenant
    for ep in data["endpoints"].values():
        ep["throttle"] = False  # deadlines, caps and limits make the chaos; not the throttle
    data["triton"] = {"max_outage_s": 120.0}
    return parse_config(data), keys


@dataclass
class Tally:
    sent: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    success_times: list[float] = field(default_factory=list)

    @property
    def answered(self) -> int:
        return sum(self.answers.values())


def _classify(err: BaseException) -> str:
    if isinstance(err, asyncio.CancelledError):
        return "cancelled by client"
    if isinstance(err, InferenceServerException):
        status, message = str(err.status()), err.message() or ""
        if "Request timeout expired" in message:
            return "expired (503)"
        if status in ("StatusCode.RESOURCE_EXHAUSTED", "429"):
            return "rate limited (429)"
        if status in ("StatusCode.INVALID_ARGUMENT", "400"):
            return "invalid (400)"
        if status in ("StatusCode.UNAVAILABLE", "503"):
            return "unavailable (503)"
        return f"other {status}"
    return f"client error {type(err).__name__}"


async def one_request(
    rng: random.Random,
    tally: Tally,
    grpc_client: Any,
    http_client: Any,
    keys: dict[str, str],
) -> None:
    tenant = rng.choice(list(keys))
    headers = {"x-api-key": keys[tenant]}
    model = rng.choice(["embed", "embed", "generate"])
    use_http = rng.random() < 0.25
    mod: Any = httpaio if use_http else grpcaio
    tokens = rng.choice([8, 32, 128, 512]) if model == "embed" else rng.choice([8, 32])
    ids = np.full((1, tokens), rng.randrange(4096), dtype=np.int32)
    inp = mod.InferInput("INPUT_IDS", [1, tokens], "INT32")
    if rng.random() < 0.03:  # a bad request: the wrong datatype
        inp = mod.InferInput("INPUT_IDS", [1, tokens], "FP32")
        ids = ids.astype(np.float32)
    inp.set_data_from_numpy(ids)
    kwargs: dict[str, Any] = {"priority": rng.choice([0, 0, 1, 5, 10])}
    if rng.random() < 0.3:
        kwargs["timeout"] = rng.choice([2_000, 50_000, 500_000, 5_000_000])  # microseconds
    client = http_client if use_http else grpc_client
    call = asyncio.ensure_future(client.infer(model, [inp], headers=dict(headers), **kwargs))
    tally.sent += 1
    cancel_after = rng.uniform(0.005, 1.0) if rng.random() < 0.08 else None
    try:
        if cancel_after is not None:
            done, _ = await asyncio.wait({call}, timeout=cancel_after)
            if not done:
                call.cancel()
        await call
    except BaseException as err:  # every way a call can end is an answer, counted once
        tally.answers[_classify(err)] += 1
    else:
        tally.answers["ok"] += 1
        tally.success_times.append(time.monotonic())


async def drive(
    fe: FrontendServer,
    triton: EmbeddedTriton,
    keys: dict[str, str],
    requests: int,
    rate: float,
    seed: int,
) -> dict[str, Any]:
    rng = random.Random(seed)
    grpc_client = grpcaio.InferenceServerClient(f"127.0.0.1:{fe.grpc_port}")
    http_client = httpaio.InferenceServerClient(f"127.0.0.1:{fe.http_port}", conn_limit=256)
    tally = Tally()
    tasks: list[asyncio.Task[None]] = []
    killed_at = back_at = None
    kill_after = requests // 3
    restart: asyncio.Task[Any] | None = None
    started = time.monotonic()
    try:
        for i in range(requests):
            tasks.append(
                asyncio.ensure_future(one_request(rng, tally, grpc_client, http_client, keys))
            )
            if i == kill_after:
                assert triton.pid is not None
                os.killpg(triton.pid, signal.SIGKILL)
                killed_at = time.monotonic()
                progress(f"Triton killed after {i} requests")
                restart = asyncio.ensure_future(_restart_later(triton, 1.0))
            if i % 500 == 0:
                progress(f"{i} sent, {tally.answered} answered")
            await asyncio.sleep(rng.expovariate(rate))
        if restart is not None:
            back_at = await restart
            progress(f"Triton ready again after {back_at - (killed_at or 0):.1f} s down")
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
    finally:
        await grpc_client.close()
        await http_client.close()
    first_after = min((t for t in tally.success_times if back_at and t >= back_at), default=None)
    return {
        "sent": tally.sent,
        "answered": tally.answered,
        "lost": tally.sent - tally.answered,
        "answers": dict(tally.answers),
        "seconds": time.monotonic() - started,
        "triton_down_s": (back_at - killed_at) if back_at and killed_at else None,
        "first_success_after_return_s": (first_after - back_at)
        if first_after and back_at
        else None,
    }


async def _restart_later(triton: EmbeddedTriton, delay: float) -> float:
    await asyncio.sleep(delay)
    await asyncio.to_thread(triton.restart)
    return time.monotonic()


def frontend_accounting(bg: BackgroundServer) -> dict[str, Any]:
    async def read() -> dict[str, Any]:
        fe = bg.server.frontend
        assert fe is not None
        out: dict[str, Any] = {"by_outcome": {}, "schedulers": {}}
        for metric in fe.registry.collect():
            if metric.name == "fair_requests":
                for s in metric.samples:
                    if s.name.endswith("_total"):
                        o = s.labels["outcome"]
                        out["by_outcome"][o] = out["by_outcome"].get(o, 0) + int(s.value)
        for model, rt in fe.runtimes.items():
            c = rt.scheduler.counters
            out["schedulers"][model] = {
                "admitted": c.admitted,
                "dispatched": c.dispatched,
                "expired": c.expired,
                "cancelled": c.cancelled,
                "queued": rt.scheduler.queued_requests,
            }
        return out

    return bg.call(read())


def run_chaos(requests: int, rate: float, tenants: int, seed: int) -> dict[str, Any]:
    config, keys = chaos_config(tenants)
    triton = EmbeddedTriton(
        default_model_repository(),
        extra_args=["--model-control-mode=explicit", "--load-model=embed", "--load-model=generate"],
    )
    progress("starting Triton")
    triton.start()
    try:
        bg = BackgroundServer(FrontendServer(config, triton.grpc_url, Listen()))
        with bg as fe:
            progress(f"chaos: {requests} requests at ~{rate:.0f}/s from {tenants} tenants")
            result = asyncio.run(drive(fe, triton, keys, requests, rate, seed))
            result["frontend"] = frontend_accounting(bg)
    finally:
        triton.stop()
    result["frontend_total"] = sum(result["frontend"]["by_outcome"].values())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=150.0, help="requests per second")
    parser.add_argument("--tenants", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json", type=Path, help="write the result here, not to benchmarks/results/chaos.json"
    )
    args = parser.parse_args()
    r = run_chaos(args.requests, args.rate, args.tenants, args.seed)
    print()
    print(f"sent {r['sent']}, answered {r['answered']}, lost {r['lost']} (must be 0)")
    for outcome, n in sorted(r["answers"].items(), key=lambda kv: -kv[1]):
        print(f"  {outcome:<24} {n}")
    print(f"frontend counted {r['frontend_total']} requests: {r['frontend']['by_outcome']}")
    for model, c in r["frontend"]["schedulers"].items():
        print(f"  {model}: {c}")
    print(
        f"Triton down {r['triton_down_s']:.1f} s; first success "
        f"{r['first_success_after_return_s']:.3f} s after it was ready again"
        if r["triton_down_s"] and r["first_success_after_return_s"] is not None
        else "no success after Triton's return (see answers)"
    )
    if args.json is None:
        write_result("chaos", r)
    else:
        args.json.write_text(json.dumps(r, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
