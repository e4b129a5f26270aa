"""SLO classes under an overload mix (issue 33, "Targets": "Overload mix"): interactive and
batch tenants at 1x, 2x and 3x the engine's capacity, on the engine-mode ``llm`` endpoint
behind the frontend.

Four tenants, each client a process of its own sending Poisson arrivals (open loop) of
streamed ``generate_stream`` calls of ``--tokens`` output tokens (``llm`` alone in the
model repository, with ``--stream-interval`` tokens a response: its first at once):
``i1`` and ``i2`` in tier ``online`` (SLO class ``chat``: interactive, TTFT target
``--ttft-ms``), ``b1`` and ``b2`` in tier ``offline`` (class ``bulk``: batch, deadline
``--deadline-s``). The classes come from the tiers (``tier_slo_classes``); the shipped
``llm`` endpoint otherwise (64 slots, 8 reserved, token cost, the throttle on). Batch
work takes the slack: its tier is below the interactive one, and the scheduler is
work-conserving.

First the engine's capacity is measured in the same run: the batch tenants flood it for
``--capacity-s`` (requests completed per second while it is backlogged). Then, for each
load L (1, 2, 3), every tenant sends at L x capacity x its share (the interactive tenants
``--interactive-share`` of it together, the batch ones the rest) for a warm-up and a
window. Measured in the window, at the clients:

- interactive SLO attainment: the admitted interactive calls whose first token came
  within the TTFT target (refused calls, 503, are counted apart; also shown: attainment
  over every call sent, a refusal counting as a miss);
- goodput: calls completed in the window that met their class (interactive: TTFT within
  target; batch: completed within the deadline), per second, over the capacity;
- TTFT prediction error: the frontend's ``fair_ttft_prediction_error`` histogram over the
  window, (predicted - actual) / actual for each admitted interactive call: the fraction
  within 20 % either way, and the 90th percentile of its size (interpolated between
  buckets);
- the attainment gauges (``fair_slo_class_attainment``), scraped every second, plotted.

Targets (issue 33): interactive attainment >= 99 % at 3x, goodput >= 0.95x capacity,
TTFT prediction error p90 <= 20 %.

    .venv/bin/python -m benchmarks.bench_slo [--loads 1 2 3] [--window-s 30] [--quick]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.harness import frontend, load_example_config, progress, triton, write_result
from fair_frontend.backends.triton.embedded import llm_with_stream_interval
from fair_frontend.kit import testing

MODEL = "llm"
TENANTS = {  # name: (API key, tier)
    "i1": ("tenant-i1-slo-key", "online"),
    "i2": ("tenant-i2-slo-key", "online"),
    "b1": ("tenant-b1-slo-key", "offline"),
    "b2": ("tenant-b2-slo-key", "offline"),
}
INTERACTIVE = ("i1", "i2")
BATCH = ("b1", "b2")
PROMPT = "request {n} of tenant {tenant}: summarise the state of the queue"
# Buckets of fair_ttft_prediction_error: (predicted - actual) / actual (core.metrics).
ERROR_BOUNDS = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
MAX_OPEN = 2000  # a client's calls open at once at most (beyond, an arrival is dropped)


def bench_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = load_example_config()
    cfg.pop("tier_limits", None)
    cfg["scheduling"] = "fair"
    cfg["tiers"] = ["online", "offline"]
    cfg["tier_models"] = {"online": ["*"], "offline": ["*"]}
    cfg.pop("tier_top_priority", None)
    if args.no_classes:  # the control: the endpoint's throttle alone, as before classes
        cfg["tenants"] = {
            name: {"tier": tier, "api_keys": [key]} for name, (key, tier) in TENANTS.items()
        }
        cfg["queues"] = {"max_queued": 100_000}
        return cfg
    cfg["slo_classes"] = {
        "chat": {"kind": "interactive", "ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms},
        "bulk": {"kind": "batch", "deadline_s": args.deadline_s},
    }
    cfg["tier_slo_classes"] = {"online": "chat", "offline": "bulk"}
    cfg["queues"] = {"max_queued": 100_000}
    # Every client connects from 127.0.0.1, an open call a connection: no per-address cap.
    cfg["server"] = {
        **cfg.get("server", {}),
        "http_max_connections": 20_000,
        "http_max_connections_per_peer": None,
    }
    cfg["tenants"] = {
        name: {"tier": tier, "api_keys": [key]} for name, (key, tier) in TENANTS.items()
    }
    return cfg


# ---- the client (a process per tenant) ---------------------------------------------------


async def _drive(cmd: dict[str, Any]) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` per second from ``start`` to ``stop``; each call's
    [sent, first event, end, HTTP status, events] (monotonic seconds: one clock for every
    process of the machine), then waits for the open calls up to ``drain_s``."""
    url, tenant = cmd["url"], cmd["tenant"]
    headers = {"authorization": f"Bearer {TENANTS[tenant][0]}"}
    rng = random.Random(cmd["seed"])
    calls: list[list[float]] = []
    errors: list[str] = []
    body_of = {"stream": True, "sampling_parameters": json.dumps(
        {"max_tokens": cmd["tokens"], "temperature": 0, "ignore_eos": True}
    )}  # fmt: skip

    async def one(session: aiohttp.ClientSession, n: int) -> None:
        sent = time.monotonic()
        first = end = 0.0
        events = 0
        status = 0
        try:
            body = {"text_input": PROMPT.format(n=n, tenant=tenant), **body_of}
            async with session.post(
                f"{url}/v2/models/{MODEL}/generate_stream", json=body, headers=headers
            ) as resp:
                status = resp.status
                if status == 200:
                    async for line in resp.content:
                        if not line.startswith(b"data:"):
                            continue
                        if b'"error"' in line:
                            status = -1
                            errors.append(line.decode(errors="replace")[:300])
                            break
                        if not events:
                            first = time.monotonic()
                        events += 1
                else:
                    await resp.read()
        except Exception as e:  # counted and reported, not fatal
            status = -2
            errors.append(f"{type(e).__name__}: {e}"[:300])
        end = time.monotonic()
        calls.append([sent, first, end, float(status), float(events)])

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    tasks: set[asyncio.Task[None]] = set()
    dropped = 0
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.sleep(max(0.0, cmd["start"] - time.monotonic()))
        at = time.monotonic()
        n = 0
        while True:
            at += rng.expovariate(cmd["rate"])
            if at >= cmd["stop"]:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            if len(tasks) >= MAX_OPEN:
                dropped += 1
                continue
            task = asyncio.ensure_future(one(session, n))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            n += 1
        if tasks:
            await asyncio.wait(tasks, timeout=cmd["drain_s"])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"calls": calls, "errors": errors, "dropped": dropped}


def _client(cmd: dict[str, Any], go: Any, out: Any) -> None:
    out.put((cmd["tenant"], None))  # ready: imported and started
    cmd["start"], cmd["stop"] = go.get()
    out.put((cmd["tenant"], asyncio.run(_drive(cmd))))


class Clients:
    """A client process per tenant, started and ready before any is told when to send
    (a process takes seconds to start on a loaded machine)."""

    def __init__(self, url: str, rates: dict[str, float], args: argparse.Namespace, seed: int):
        ctx = multiprocessing.get_context("spawn")
        self.queue: Any = ctx.Queue()
        self.procs = []
        self.go = []
        for i, (tenant, rate) in enumerate(rates.items()):
            cmd = {
                "url": url,
                "tenant": tenant,
                "rate": rate,
                "seed": seed * 100 + i,
                "tokens": args.tokens,
                "drain_s": args.drain_s,
            }
            go = ctx.Queue()
            p = ctx.Process(target=_client, args=(cmd, go, self.queue))
            p.start()
            self.procs.append(p)
            self.go.append(go)

    async def ready(self) -> None:
        for _ in self.procs:
            await asyncio.to_thread(self.queue.get, True, 120)

    def start(self, start: float, stop: float) -> None:
        for go in self.go:
            go.put((start, stop))

    async def results(self, stop: float) -> dict[str, dict[str, Any]]:
        got: dict[str, dict[str, Any]] = {}
        for _ in self.procs:
            timeout = stop - time.monotonic() + 300
            tenant, answer = await asyncio.to_thread(self.queue.get, True, timeout)
            got[tenant] = answer
        for p in self.procs:
            p.join(10)
        return got


# ---- the measures --------------------------------------------------------------------------


def error_buckets(page: testing.Samples) -> dict[float, float]:
    """The prediction-error histogram's cumulative buckets (le -> count), every class."""
    out: dict[float, float] = {}
    for s in page:
        if s.name == "fair_ttft_prediction_error_bucket" and s.labels.get("endpoint") == MODEL:
            le = float(s.labels["le"])
            out[le] = out.get(le, 0.0) + s.value
    return out


def error_summary(before: dict[float, float], after: dict[float, float]) -> dict[str, Any]:
    """Of the predictions made in between: how many, the fraction whose error is within
    each bound either way, and the 90th percentile of the error's size (linear between
    the bounds; None if beyond the last)."""
    cum = {le: after.get(le, 0.0) - before.get(le, 0.0) for le in after}
    total = cum.get(float("inf"), 0.0)
    if total <= 0:
        return {"count": 0, "within": {}, "p90_abs": None}

    def at(le: float) -> float:
        return cum.get(le, 0.0)

    within = {}
    for bound in ERROR_BOUNDS:
        below = at(-bound) if -bound in cum else 0.0  # an error is never below -1
        within[bound] = (at(bound) - below) / total
    p90 = None
    prev_bound, prev = 0.0, 0.0
    for bound in ERROR_BOUNDS:
        if within[bound] >= 0.9:
            span = within[bound] - prev
            p90 = prev_bound + (bound - prev_bound) * ((0.9 - prev) / span if span else 1.0)
            break
        prev_bound, prev = bound, within[bound]
    signed = {str(le): n / total for le, n in sorted(cum.items())}  # its bias: P(error <= le)
    return {
        "count": int(total),
        "within": {str(b): w for b, w in within.items()},
        "p90_abs": p90,
        "cumulative": signed,
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


async def measure_capacity(fe: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The batch tenants flood the engine (far above what it serves); completions per
    second over a window once it is backlogged."""
    url = f"http://127.0.0.1:{fe.http_port}"
    rates = {t: args.flood_rps / len(BATCH) for t in BATCH}
    clients = Clients(url, rates, args, seed=7)
    await clients.ready()
    begin = time.monotonic() + 0.5
    t0 = begin + args.warmup_s
    t1 = t0 + args.capacity_s
    clients.start(begin, t1)
    got = await clients.results(t1)
    done = [c for t in BATCH for c in got[t]["calls"] if c[3] == 200 and t0 <= c[2] <= t1]
    tokens = len(done) * args.tokens  # llm generates exactly max_tokens
    return {
        "requests_per_s": len(done) / args.capacity_s,
        "tokens_per_s": tokens / args.capacity_s,
        "refused": sum(1 for t in BATCH for c in got[t]["calls"] if c[3] == 503),
        "sent": sum(len(got[t]["calls"]) for t in BATCH),
        "hold_s_median": pct([c[2] - c[1] for c in done if c[1]], 50),
    }


async def run_load(
    fe: Any, load: float, capacity: float, args: argparse.Namespace
) -> dict[str, Any]:
    url = f"http://127.0.0.1:{fe.http_port}"
    metrics = f"http://127.0.0.1:{fe.metrics_port}/metrics"
    offered = load * capacity
    rates = {t: offered * args.interactive_share / len(INTERACTIVE) for t in INTERACTIVE}
    rates.update({t: offered * (1 - args.interactive_share) / len(BATCH) for t in BATCH})
    clients = Clients(url, rates, args, seed=int(load * 10))
    await clients.ready()
    begin = time.monotonic() + 0.5
    t0 = begin + args.warmup_s
    t1 = t0 + args.window_s
    clients.start(begin, t1)
    await asyncio.sleep(max(0.0, t0 - time.monotonic()))
    first = await testing.ascrape(metrics)
    before = error_buckets(first)
    decisions0 = first.by_label("fair_throttle_decisions_total", "decision", endpoint=MODEL)
    # [seconds into the window, chat, bulk attainment, requests in the engine]
    timeline: list[list[float]] = []
    while time.monotonic() < t1:
        await asyncio.sleep(1.0)
        page = await testing.ascrape(metrics)
        att = page.by_label("fair_slo_class_attainment", "slo_class", endpoint=MODEL)
        inflight = page.sum("fair_inflight_batches", endpoint=MODEL)
        chat, bulk = att.get("chat", float("nan")), att.get("bulk", float("nan"))
        timeline.append([time.monotonic() - t0, chat, bulk, inflight])
    last = await testing.ascrape(metrics)
    after = error_buckets(last)
    decisions = {
        k: v - decisions0.get(k, 0.0)
        for k, v in last.by_label(
            "fair_throttle_decisions_total", "decision", endpoint=MODEL
        ).items()
    }
    got = await clients.results(t1)
    target_s = args.ttft_ms / 1000.0

    def sent_in(t: str) -> list[list[float]]:
        return [c for c in got[t]["calls"] if t0 <= c[0] <= t1]

    inter = [c for t in INTERACTIVE for c in sent_in(t)]
    admitted = [c for c in inter if c[3] == 200 and c[4] > 0]
    met = [c for c in admitted if c[1] - c[0] <= target_s]
    refused = [c for c in inter if c[3] == 503]
    batch = [c for t in BATCH for c in sent_in(t)]
    batch_ok = [c for c in batch if c[3] == 200 and c[4] > 0]
    # Goodput: completions in the window that met their class, per second.
    good = sum(
        1
        for t in TENANTS
        for c in got[t]["calls"]
        if c[3] == 200
        and c[4] > 0
        and t0 <= c[2] <= t1
        and (c[1] - c[0] <= target_s if t in INTERACTIVE else c[2] - c[0] <= args.deadline_s)
    )
    ttft = [c[1] - c[0] for c in admitted]
    out = {
        "load": load,
        "offered_rps": offered,
        "rates": rates,
        "interactive_sent": len(inter),
        "interactive_admitted": len(admitted),
        "interactive_refused": len(refused),
        "interactive_attainment": len(met) / len(admitted) if admitted else float("nan"),
        "interactive_attainment_of_sent": len(met) / len(inter) if inter else float("nan"),
        "interactive_ttft_p50_s": pct(ttft, 50),
        "interactive_ttft_p99_s": pct(ttft, 99),
        "batch_sent": len(batch),
        "batch_served": len(batch_ok),
        "batch_refused": sum(1 for c in batch if c[3] == 503),
        "batch_late": sum(1 for c in batch_ok if c[2] - c[0] > args.deadline_s),
        "goodput_rps": good / args.window_s,
        "goodput_over_capacity": good / args.window_s / capacity,
        "prediction_error": error_summary(before, after),
        "throttle_decisions": decisions,
        "attainment_timeline": timeline,
        # The frontend's own attainment gauge (first tokens as its shell wrote them), the
        # mean of the window's scrapes: the clients' figure less their own lag.
        "gauge_chat_attainment_mean": _mean([p[1] for p in timeline if p[1] == p[1]]),
        "errors": {t: len(got[t]["errors"]) for t in TENANTS},
        "error_samples": [e for t in TENANTS for e in got[t]["errors"][:2]],
        "dropped": {t: got[t]["dropped"] for t in TENANTS},
    }
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summary(r: dict[str, Any]) -> str:
    e = r["prediction_error"]
    p90 = e["p90_abs"]
    return (
        f"  {r['load']:g}x: interactive attainment {r['interactive_attainment'] * 100:.2f} % of "
        f"{r['interactive_admitted']} admitted ({r['interactive_refused']} refused of "
        f"{r['interactive_sent']}; of all sent {r['interactive_attainment_of_sent'] * 100:.1f} %; "
        f"the frontend's gauge {r['gauge_chat_attainment_mean'] * 100:.1f} %), "
        f"TTFT p50 {r['interactive_ttft_p50_s'] * 1000:.0f} ms p99 "
        f"{r['interactive_ttft_p99_s'] * 1000:.0f} ms; batch {r['batch_served']} served, "
        f"{r['batch_refused']} refused, {r['batch_late']} late; goodput "
        f"{r['goodput_over_capacity']:.3f}x capacity; prediction error within 20 % "
        f"{e['within'].get('0.2', float('nan')) * 100:.1f} % of {e['count']}, p90 "
        f"{'beyond 5' if p90 is None else f'{p90 * 100:.0f} %'}"
    )


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["loads"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    loads = [r["load"] for r in runs]
    xs = range(len(runs))
    width = 0.27
    left.bar([x - width for x in xs], [r["interactive_attainment"] for r in runs], width,
             label="interactive attainment (admitted)", color="#4c72b0")  # fmt: skip
    left.bar(list(xs), [r["interactive_attainment_of_sent"] for r in runs], width,
             label="interactive attainment (all sent)", color="#8da0cb")  # fmt: skip
    left.bar([x + width for x in xs], [r["goodput_over_capacity"] for r in runs], width,
             label="goodput / capacity", color="#55a868")  # fmt: skip
    left.axhline(0.99, ls=":", color="gray")
    left.axhline(0.95, ls="--", color="gray")
    left.set_xticks(list(xs))
    left.set_xticklabels([f"{load:g}x" for load in loads])
    left.set_ylim(0, 1.1)
    left.set_title("overload mix: interactive and batch tenants")
    left.legend(loc="lower left", fontsize=8)
    for r in runs:
        tl = r["attainment_timeline"]
        right.plot([p[0] for p in tl], [p[1] for p in tl], label=f"chat, {r['load']:g}x")
    right.set_xlabel("seconds into the window")
    right.set_ylabel("fair_slo_class_attainment{slo_class=chat}")
    right.set_title("the attainment gauge over time (10 s window)")
    right.set_ylim(0, 1.05)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    progress(f"plot written to {path}")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    cfg = bench_config(args)
    tmp = tempfile.TemporaryDirectory(prefix="fair-slo-")
    repo = llm_with_stream_interval(Path(tmp.name), args.stream_interval)
    with (
        tmp,
        triton(repo) as server,
        frontend(cfg, server.grpc_url, http_url=server.http_url, source=args.source) as fe,
    ):
        if args.capacity_rps:
            cap = {"requests_per_s": args.capacity_rps, "tokens_per_s": None, "given": True}
        else:
            progress(f"capacity: the batch tenants flood the engine, {args.capacity_s:g} s window")
            cap = await measure_capacity(fe, args)
        progress(
            f"  capacity {cap['requests_per_s']:.1f} requests/s "
            f"({cap['tokens_per_s'] or 0:.0f} tokens/s)"
        )
        runs = []
        for load in args.loads:
            await asyncio.sleep(args.pause_s)  # the flood's queues drain
            progress(f"load {load:g}x: {args.warmup_s:g} s warm-up + {args.window_s:g} s window")
            r = await run_load(fe, load, cap["requests_per_s"], args)
            runs.append(r)
            progress(summary(r))
            progress(f"  throttle decisions in the window: {r['throttle_decisions']}")
    return {"capacity": cap, "loads": runs, "verdict": verdict(runs)}


def verdict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    top = max(runs, key=lambda r: r["load"])
    overloaded = [r for r in runs if r["load"] > 1] or runs
    worst_goodput = min(r["goodput_over_capacity"] for r in overloaded)
    p90s = [r["prediction_error"]["p90_abs"] for r in runs]
    worst_p90 = None if any(p is None for p in p90s) else max(p90s)
    out = {
        "attainment_at_top_load": top["interactive_attainment"],
        "top_load": top["load"],
        "worst_goodput_over_capacity_overloaded": worst_goodput,
        "worst_prediction_error_p90": worst_p90,
    }
    out["met"] = {
        "attainment_ge_99pct_at_3x": top["interactive_attainment"] >= 0.99,
        "goodput_ge_0.95_capacity": worst_goodput >= 0.95,
        "prediction_error_p90_le_20pct": worst_p90 is not None and worst_p90 <= 0.2,
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loads", type=float, nargs="+", default=[1.0, 2.0, 3.0])
    parser.add_argument("--warmup-s", type=float, default=8.0)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--capacity-s", type=float, default=20.0)
    parser.add_argument("--pause-s", type=float, default=8.0)
    parser.add_argument("--drain-s", type=float, default=30.0)
    parser.add_argument("--flood-rps", type=float, default=300.0, help="capacity run's rate")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per call")
    parser.add_argument("--interactive-share", type=float, default=1 / 3)
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=8,
        help="llm's tokens per streamed response (a copy of the model so set): fewer events "
        "for the clients and the relay to carry on a small machine; the first token still "
        "goes at once",
    )
    parser.add_argument("--ttft-ms", type=float, default=1000.0)
    parser.add_argument("--itl-ms", type=float, default=100.0)
    # Short for a batch class, so that the throttle, not the batch tenants' queue caps
    # (256 each), bounds their backlog under the flood: with 60 s the caps were reached
    # and the engine's 64 slots then stayed held by streams that never ended (not
    # diagnosed; benchmarks/README.md, "SLO classes").
    parser.add_argument("--deadline-s", type=float, default=6.0)
    parser.add_argument(
        "--capacity-rps", type=float, default=None, help="skip measuring it (not a result)"
    )
    parser.add_argument("--no-classes", action="store_true", help="control: no SLO classes")
    parser.add_argument(
        "--source", type=Path, default=None, help="run the frontend of another checkout"
    )
    parser.add_argument("--quick", action="store_true", help="short windows")
    parser.add_argument("--json", default=None, help="where the results go")
    if parser.parse_args().quick:
        parser.set_defaults(warmup_s=4.0, window_s=10.0, capacity_s=8.0, pause_s=4.0)
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    results["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    v = results["verdict"]
    p90 = v["worst_prediction_error_p90"]
    progress(
        f"interactive attainment at {v['top_load']:g}x {v['attainment_at_top_load'] * 100:.2f} % "
        f"(target >= 99 %); goodput at overload >= "
        f"{v['worst_goodput_over_capacity_overloaded']:.3f}x capacity (target >= 0.95); "
        f"TTFT prediction error p90 {'beyond 500 %' if p90 is None else f'{p90 * 100:.0f} %'} "
        "(target <= 20 %)"
    )
    if args.json:
        path = Path(args.json)
        path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    else:
        path = write_result("slo", results)
    plot(results, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
