"""Engine mode on the real stack: the streaming ``llm`` model (continuous batching inside
one instance, vLLM-shaped) behind the frontend.

Every tenant's client is a process of its own (as on its own machine), with one gRPC
stream that carries all of its requests; tokens are timed at the client. One Triton,
one run, three scenarios:

- ``noisy``: tenant A holds the engine with long generations (``--hog`` streams x
  ``--hog-tokens`` output tokens), then tenant B sends 5 short ones (16 tokens) at once.
  B's time to first token (TTFT) at its client, against B alone on the same target, on
  Triton direct (the model's own FIFO), the frontend in ``fifo`` mode and in ``fair``
  mode (engine mode, ``max_inflight`` = the model's ``max_num_seqs``). Bound: B's worst
  TTFT <= its solo TTFT + the time for one slot to turn over (A's generation time,
  measured in the same run).
- ``shares``: two tenants kept backlogged, output lengths 1:8 (16 and 128 tokens), with
  token cost (virtual token counters) at weights 1:1 and 2:1, and with request cost
  (the negative control). Served tokens (input when a request gets its slot + output as
  it streams: the frontend's ``fair_served_tokens`` + ``fair_output_tokens``) over a
  window where both have queued work. Target: shares within 2 % of the weights.
- ``throughput``: ``--concurrency`` streams kept outstanding for ``--window-s``, Triton
  direct and through the frontend at the same concurrency (``--workers`` shell
  processes; with ``--ref REF`` also the frontend of that commit, in the same run): tokens/s
  at the client, and the frontend's CPU per streamed token, its core's and its shells'
  apart. Target: tokens/s ratio >= 0.95.

    .venv/bin/python -m benchmarks.bench_engine [--scenarios noisy shares throughput]
        [--hog 200] [--hog-tokens 256] [--workers 1] [--ref REF] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcaio

from benchmarks.harness import (
    RESULTS,
    baseline_checkout,
    frontend,
    load_example_config,
    process_tree_cpu_s,
    progress,
    triton,
    write_result,
)
from fair_frontend.backends.triton.embedded import process_group_members
from fair_frontend.kit import testing

MODEL = "llm"
PROMPT = "a tenant asks the engine for a story about"
KEYS = {"a": "tenant-a-bench-key", "b": "tenant-b-bench-key"}
SLOTS = 64  # the model's max_num_seqs: the frontend's max_inflight matches it
B_REQUESTS = 5
RESERVED = 8  # fair_reserved: A holds at most 56 of the 64 slots (B sends 5 at once)
B_TOKENS = 16


def bench_config(
    mode: str,
    *,
    cost: str = "tokens",
    weights: tuple[float, float] = (1, 1),
    slots: int = SLOTS,
    reserved: int = 0,
    source: Path | None = None,
) -> dict[str, Any]:
    cfg = load_example_config(source)
    cfg.pop("tier_limits", None)
    cfg["scheduling"] = mode
    cfg["endpoints"][MODEL].update(
        {"cost": cost, "max_inflight": slots, "reserved_slots": reserved, "throttle": False}
    )
    cfg["queues"] = {"max_queued": 100_000}
    cfg["tenants"] = {  # queues as deep as the load asks (an engine's default: 4 x slots)
        name: {"tier": "standard", "api_keys": [key], "weight": w, "max_queued": 100_000}
        for (name, key), w in zip(KEYS.items(), weights, strict=True)
    }
    return cfg


# ---- the client (a process per tenant) ---------------------------------------------------


def llm_inputs(prompt: str, max_tokens: int) -> list[Any]:
    text = grpcaio.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    flag = grpcaio.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([True]))
    sampling = grpcaio.InferInput("sampling_parameters", [1], "BYTES")
    params = {"max_tokens": max_tokens, "temperature": 0}
    sampling.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
    return [text, flag, sampling]


class Tenant:
    """One stream of a tenant's requests: send, and time every token at arrival."""

    def __init__(self, url: str, key: str | None) -> None:
        self.client = grpcaio.InferenceServerClient(url)
        self.headers = {"x-api-key": key} if key else None
        self.outbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.sent: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.want: dict[str, int] = {}
        self.done: asyncio.Queue[str] = asyncio.Queue()
        self.total = 0
        self._seq = 0
        self._reader = asyncio.ensure_future(self._read())

    def send(self, max_tokens: int) -> str:
        rid = str(self._seq)
        self._seq += 1
        self.want[rid] = max_tokens
        self.tokens[rid] = 0
        self.sent[rid] = time.monotonic()
        prompt = f"{PROMPT} {rid}"
        self.outbox.put_nowait(
            {"model_name": MODEL, "inputs": llm_inputs(prompt, max_tokens), "request_id": rid}
        )
        return rid

    async def _requests(self) -> AsyncIterator[dict[str, Any]]:
        while (item := await self.outbox.get()) is not None:
            yield item

    async def _read(self) -> None:
        async for result, error in self.client.stream_infer(self._requests(), headers=self.headers):
            if error is not None:
                raise RuntimeError(str(error))
            rid = result.get_response().id
            now = time.monotonic()
            self.first.setdefault(rid, now)
            self.last[rid] = now
            self.tokens[rid] += 1
            self.total += 1
            if self.tokens[rid] == self.want[rid]:
                self.done.put_nowait(rid)

    async def close(self) -> None:
        self.outbox.put_nowait(None)
        self._reader.cancel()
        await self.client.close()


async def client_main(url: str, key: str | None) -> None:
    """Commands on stdin, one JSON object per line; answers on stdout."""
    tenant = Tenant(url, key)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = json.loads(line)
        kind = cmd["do"]
        if kind == "burst":  # send n at once; answer when `started` have a first token
            rids = [tenant.send(cmd["tokens"]) for _ in range(cmd["n"])]
            while sum(1 for r in rids if r in tenant.first) < cmd["started"]:
                await asyncio.sleep(0.01)
            answer: Any = {"started": len(rids)}
        elif kind == "probe":  # send n at once; answer their TTFTs when all are done
            rids = [tenant.send(cmd["tokens"]) for _ in range(cmd["n"])]
            for _ in rids:
                await tenant.done.get()
            answer = {"ttft_s": [tenant.first[r] - tenant.sent[r] for r in rids]}
        elif kind == "generation":  # how long one of the burst's generations took
            done = [r for r, n in tenant.tokens.items() if n == tenant.want[r] and n > 1]
            while not done:
                await tenant.done.get()
                done = [r for r, n in tenant.tokens.items() if n == tenant.want[r] and n > 1]
            gen = [tenant.last[r] - tenant.first[r] for r in done]
            answer = {"generation_s": statistics.median(gen)}
        elif kind == "closed":  # keep `concurrency` outstanding for window_s; tokens/s
            stop = time.monotonic() + cmd["warmup_s"] + cmd["window_s"]
            for _ in range(cmd["concurrency"]):
                tenant.send(cmd["tokens"])
            counted_from = time.monotonic() + cmd["warmup_s"]
            base: int | None = None
            while (now := time.monotonic()) < stop:
                if base is None and now >= counted_from:
                    base = tenant.total
                try:
                    await asyncio.wait_for(tenant.done.get(), 0.05)
                    tenant.send(cmd["tokens"])
                except TimeoutError:
                    pass
            answer = {
                "tokens_per_s": (tenant.total - (base or 0)) / cmd["window_s"],
                "tokens": tenant.total,
            }
        else:
            raise ValueError(kind)
        print(json.dumps(answer), flush=True)
    await tenant.close()


class Client:
    """A tenant's client process, driven over its stdin."""

    def __init__(self, url: str, key: str | None) -> None:
        cmd = [sys.executable, "-m", "benchmarks.bench_engine", "--client", url]
        if key:
            cmd += ["--key", key]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    async def ask(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        line = await asyncio.get_running_loop().run_in_executor(None, self.proc.stdout.readline)
        if not line:
            raise RuntimeError(f"client exited with {self.proc.wait()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


# ---- scenarios ----------------------------------------------------------------------------


async def noisy_target(
    url: str, keyed: bool, hog: int, hog_tokens: int, reserved: int = 0
) -> dict[str, Any]:
    a = Client(url, KEYS["a"] if keyed else None)
    b = Client(url, KEYS["b"] if keyed else None)
    try:
        solo = (await b.ask(do="probe", n=B_REQUESTS, tokens=B_TOKENS))["ttft_s"]
        await a.ask(do="burst", n=hog, tokens=hog_tokens, started=min(hog, SLOTS - reserved))
        during = (await b.ask(do="probe", n=B_REQUESTS, tokens=B_TOKENS))["ttft_s"]
        generation = (await a.ask(do="generation"))["generation_s"]
    finally:
        a.close()
        b.close()
    return {
        "solo_ttft_s": solo,
        "ttft_s": during,
        "worst_ttft_s": max(during),
        "median_ttft_s": statistics.median(during),
        "generation_s": generation,
        "bound_s": max(solo) + generation,
    }


async def scenario_noisy(server: Any, hog: int, hog_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    progress(f"noisy: Triton direct, A {hog} x {hog_tokens} tokens, B {B_REQUESTS} x {B_TOKENS}")
    out["triton"] = await noisy_target(server.grpc_url, False, hog, hog_tokens)
    targets = (("fifo", "fifo", 0), ("fair", "fair", 0), ("fair_reserved", "fair", RESERVED))
    for name, mode, reserved in targets:
        cfg = bench_config(mode, reserved=reserved)
        with frontend(cfg, server.grpc_url, http_url=server.http_url) as fe:
            progress(f"noisy: frontend {name}")
            out[name] = await noisy_target(fe.grpc_url, True, hog, hog_tokens, reserved)
    for name, r in out.items():
        progress(
            f"  {name}: B worst TTFT {r['worst_ttft_s']:.3f} s (solo {max(r['solo_ttft_s']):.3f}"
            f", one generation {r['generation_s']:.2f} s)"
        )
    return out


def scrape(url: str) -> dict[tuple[str, str], float]:
    """(metric, tenant) -> value, for the served-token counters; ("backlogged", tenant) ->
    1 for a tenant with queued work (it has a VTC counter or a DRR deficit)."""
    page = testing.scrape(url)
    out: dict[tuple[str, str], float] = {}
    for name in ("fair_served_tokens_total", "fair_output_tokens_total"):
        for tenant, value in page.by_label(name, "tenant", endpoint=MODEL).items():
            out[(name, tenant)] = value
    for name in ("fair_vtc_counter", "fair_drr_deficit"):
        for tenant in page.label_values(name, "tenant", endpoint=MODEL):
            out[("backlogged", tenant)] = 1.0
    return out


def served(sample: dict[tuple[str, str], float], tenant: str) -> float:
    return sample.get(("fair_served_tokens_total", tenant), 0.0) + sample.get(
        ("fair_output_tokens_total", tenant), 0.0
    )


async def shares_config(
    server: Any,
    cost: str,
    weights: tuple[float, float],
    slots: int,
    warmup_s: float,
    window_s: float,
) -> dict[str, Any]:
    cfg = bench_config("fair", cost=cost, weights=weights, slots=slots)
    with frontend(cfg, server.grpc_url, http_url=server.http_url) as fe:
        metrics = f"http://127.0.0.1:{fe.metrics_port}/metrics"
        a, b = Client(fe.grpc_url, KEYS["a"]), Client(fe.grpc_url, KEYS["b"])
        try:
            work = [
                asyncio.ensure_future(
                    c.ask(
                        do="closed",
                        concurrency=4 * slots,
                        tokens=n,
                        warmup_s=warmup_s + window_s,
                        window_s=5.0,
                    )
                )
                for c, n in ((a, 16), (b, 128))
            ]
            await asyncio.sleep(warmup_s)
            start = scrape(metrics)
            backlogged = True
            t_end = time.monotonic() + window_s
            while time.monotonic() < t_end:
                await asyncio.sleep(0.5)
                now = scrape(metrics)
                backlogged &= all(("backlogged", t) in now for t in KEYS)
            end = scrape(metrics)
            for w in work:
                w.cancel()
        finally:
            a.close()
            b.close()
    got = {t: served(end, t) - served(start, t) for t in KEYS}
    share = got["a"] / sum(got.values())
    return {
        "cost": cost,
        "weights": list(weights),
        "served_tokens": got,
        "share_a": share,
        "target_share_a": weights[0] / sum(weights),
        "both_backlogged": backlogged,
    }


async def scenario_shares(
    server: Any, slots: int, warmup_s: float, window_s: float
) -> dict[str, Any]:
    out = {}
    for name, cost, weights in (
        ("tokens_1to1", "tokens", (1.0, 1.0)),
        ("tokens_2to1", "tokens", (2.0, 1.0)),
        ("requests_1to1", "requests", (1.0, 1.0)),
    ):
        progress(f"shares: {name} (outputs 16 : 128 tokens, {slots} slots)")
        out[name] = await shares_config(server, cost, weights, slots, warmup_s, window_s)
        r = out[name]
        progress(
            f"  A's share of served tokens {r['share_a']:.3f} (target "
            f"{r['target_share_a']:.3f}), both backlogged: {r['both_backlogged']}"
        )
    return out


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of a process onto ``cpus`` (affinity is per thread in Linux)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def pinned(server: Any) -> Iterator[None]:
    """Triton (the engine) on CPU 0, this process and what it starts next (frontend,
    clients) on the others: on a GPU host the engine computes on the GPU, not on the
    frontend's cores. Restored afterwards."""
    cpus = sorted(os.sched_getaffinity(0))
    engine, rest = {cpus[0]}, set(cpus[1:])
    triton_pids = process_group_members(server.pid)
    for pid in triton_pids:
        pin_threads(pid, engine)
    os.sched_setaffinity(0, rest)
    try:
        yield
    finally:
        os.sched_setaffinity(0, set(cpus))
        for pid in triton_pids:
            pin_threads(pid, set(cpus))


async def scenario_throughput(
    server: Any,
    concurrency: int,
    tokens: int,
    warmup_s: float,
    window_s: float,
    *,
    workers: int = 1,
    baseline: Path | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pair: dict[str, Any] = {
        "concurrency": concurrency,
        "tokens": tokens,
        "warmup_s": warmup_s,
        "window_s": window_s,
        "workers": workers,
        "baseline": baseline,
    }
    if len(os.sched_getaffinity(0)) >= 2:
        with pinned(server):
            progress("throughput, pinned: Triton on one CPU, frontend and clients on the rest")
            out["pinned"] = await throughput_pair(server, **pair)
    progress("throughput, unpinned: every process on every CPU")
    out["unpinned"] = await throughput_pair(server, **pair)
    return out


async def closed_loop(url: str, key: str | None, **load: Any) -> dict[str, Any]:
    """One client keeping ``concurrency`` streams outstanding; its tokens/s."""
    c = Client(url, key)
    try:
        return await c.ask(do="closed", **load)
    finally:
        c.close()


async def throughput_pair(
    server: Any,
    concurrency: int,
    tokens: int,
    warmup_s: float,
    window_s: float,
    workers: int,
    baseline: Path | None,
) -> dict[str, Any]:
    """Triton direct, then the frontend (and, with ``baseline``, the frontend of that
    earlier checkout), each at the same concurrency: tokens/s at the client and the
    frontend's CPU per streamed token, its core's and its shells' apart."""
    load = {
        "concurrency": concurrency,
        "tokens": tokens,
        "warmup_s": warmup_s,
        "window_s": window_s,
    }
    progress(f"throughput: Triton direct, {concurrency} streams x {tokens} tokens")
    direct = await closed_loop(server.grpc_url, None, **load)
    progress(f"  {direct['tokens_per_s']:.0f} tokens/s")
    out: dict[str, Any] = {"triton": direct["tokens_per_s"]}
    runs = [("frontend", None)] + ([("before", baseline)] if baseline is not None else [])
    for name, source in runs:
        progress(f"throughput: {name}, {workers} shell(s), {concurrency} streams x {tokens} tokens")
        config = bench_config("fair", source=source)
        with frontend(
            config, server.grpc_url, http_url=server.http_url, workers=workers, source=source
        ) as fe:
            cpu0 = process_tree_cpu_s(fe.process.pid)
            through = await closed_loop(fe.grpc_url, KEYS["a"], **load)
            cpu = process_tree_cpu_s(fe.process.pid)
        per_token = {k: (cpu[k] - cpu0[k]) / through["tokens"] * 1e6 for k in cpu}
        out[name] = {
            "tokens_per_s": through["tokens_per_s"],
            "ratio": through["tokens_per_s"] / direct["tokens_per_s"],
            "cpu_us_per_token": sum(per_token.values()),
            "core_cpu_us_per_token": per_token["core"],
            "shells_cpu_us_per_token": per_token["shells"],
        }
        r = out[name]
        progress(
            f"  {r['tokens_per_s']:.0f} tokens/s ({r['ratio']:.3f} of direct); frontend CPU "
            f"{r['cpu_us_per_token']:.0f} µs per token (core {r['core_cpu_us_per_token']:.0f}, "
            f"shells {r['shells_cpu_us_per_token']:.0f})"
        )
    # The names earlier results used, for the latest frontend.
    out["frontend_cpu_us_per_token"] = out["frontend"]["cpu_us_per_token"]
    out["ratio"] = out["frontend"]["ratio"]
    return out


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("noisy", "shares") if k in results]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    for ax, key in zip(axes[0], panels, strict=True):
        if key == "noisy":
            r = results["noisy"]
            names = list(r)
            ax.bar(names, [r[n]["worst_ttft_s"] for n in names], color="#c44e52")
            ax.scatter(
                names,
                [max(r[n]["solo_ttft_s"]) for n in names],
                color="k",
                zorder=3,
                label="B alone",
            )
            ax.axhline(
                r["fair"]["bound_s"],
                ls="--",
                color="gray",
                label="bound: solo + one slot's turnover",
            )
            ax.set_yscale("log")
            ax.set_ylabel("B's worst time to first token (s)")
            ax.set_title("quiet tenant B beside a hog holding the engine")
            ax.legend()
        else:
            r = results["shares"]
            names = list(r)
            ax.bar(names, [r[n]["share_a"] for n in names], color="#4c72b0", label="measured")
            ax.scatter(
                names,
                [r[n]["target_share_a"] for n in names],
                color="k",
                zorder=3,
                label="weights' share",
            )
            ax.set_ylim(0, 1)
            ax.set_ylabel("A's share of served tokens (A: 16-token, B: 128-token outputs)")
            ax.set_title("token shares, engine mode")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    progress(f"plot written to {path}")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with triton() as server:
        if "noisy" in args.scenarios:
            results["noisy"] = await scenario_noisy(server, args.hog, args.hog_tokens)
        if "shares" in args.scenarios:
            results["shares"] = await scenario_shares(
                server, args.share_slots, args.warmup_s, args.window_s
            )
        if "throughput" in args.scenarios:
            with contextlib.ExitStack() as stack:
                baseline = stack.enter_context(baseline_checkout(args.ref)) if args.ref else None
                results["throughput"] = await scenario_throughput(
                    server,
                    args.concurrency,
                    args.tokens,
                    args.warmup_s,
                    args.window_s,
                    workers=args.workers,
                    baseline=baseline,
                )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", nargs="+", default=["noisy", "shares", "throughput"])
    parser.add_argument("--hog", type=int, default=200, help="A's streams in noisy")
    parser.add_argument("--hog-tokens", type=int, default=256, help="A's output tokens each")
    parser.add_argument("--share-slots", type=int, default=8, help="max_inflight in shares")
    parser.add_argument("--concurrency", type=int, default=SLOTS, help="streams in throughput")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens in throughput")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--workers", type=int, default=1, help="shell processes in throughput")
    parser.add_argument("--ref", help="throughput: also the frontend of this git ref, same run")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # internal: a tenant's client
    parser.add_argument("--key", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        asyncio.run(client_main(args.client, args.key))
        return
    if args.quick:
        args.hog, args.hog_tokens, args.warmup_s, args.window_s = 80, 64, 2.0, 6.0
    results = asyncio.run(main_async(args))
    results["args"] = {k: v for k, v in vars(args).items() if k not in ("client", "key")}
    earlier = RESULTS / "engine.json"
    if set(args.scenarios) != {"noisy", "shares", "throughput"} and earlier.exists():
        # A partial run replaces its scenarios' results, keeps the others' (each
        # scenario's ratios come from one run).
        kept = json.loads(earlier.read_text())
        kept.pop("args", None)
        results = {**kept, **results}
    path = write_result("engine", results)
    plot(results, str(path.with_suffix(".png")))


if __name__ == "__main__":
    main()
