"""What the OpenAI (and rerank) routes cost beside the KServe routes they translate to.

The frontend runs as its own process (``fair-frontend serve``, one shell in the core's
process) in front of a real Triton; each load runs in a client process of its own. CPU is
the frontend's process tree (user + system, from /proc) over a fixed amount of work, the
two routes measured in alternating rounds of the same run, so the ratio is of one run.

- ``embeddings``: CPU per request, ``POST /v1/embeddings`` (64 token ids) against
  ``POST /v2/models/embed/infer`` (the same ids as a JSON tensor);
- ``chat``: CPU per streamed token, ``POST /v1/chat/completions`` with ``stream`` against
  ``POST /v2/models/llm/generate_stream`` (the same prompt, Triton's generate extension);
- ``rerank`` (where the model is in the repository): a quiet tenant's 3-document rerank
  latency while another floods 1,000-document reranks, through the frontend and straight
  to Triton (one KServe request per document, as the frontend sends them).

    .venv/bin/python -m benchmarks.bench_api [--scenarios embeddings,chat,rerank] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.harness import (
    RESULTS,
    frontend,
    load_example_config,
    load_generators,
    process_tree_cpu_s,
    progress,
    triton,
    write_result,
)
from fair_frontend.kit.testing import perf_analyzer_binary

KEY = "acme-demo-key"
QUIET_KEY = "globex-demo-key"  # the same tier as acme: the fair share decides
IDS = list(range(1, 65))
PROMPT = "Tell me about the rivers of Europe and the towns along them."
CHAT_TOKENS = 64


async def _drive(url: str, route: str, count: int, concurrency: int) -> int:
    """``count`` calls of ``route`` at ``concurrency``; returns the tokens streamed
    (chat/generate) or the calls answered (the others)."""
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    bodies = {
        "openai-embed": ("/v1/embeddings", {"model": "embed", "input": IDS}),
        "kserve-embed": (
            "/v2/models/embed/infer",
            {
                "inputs": [
                    {"name": "INPUT_IDS", "datatype": "INT32", "shape": [1, len(IDS)], "data": IDS}
                ]
            },
        ),
        "openai-chat": (
            "/v1/chat/completions",
            {
                "model": "llm",
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": CHAT_TOKENS,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
        "kserve-generate": (
            "/v2/models/llm/generate_stream",
            {
                "text_input": PROMPT,
                "stream": True,
                "sampling_parameters": json.dumps({"max_tokens": CHAT_TOKENS}),
            },
        ),
    }
    path, body = bodies[route]
    data = json.dumps(body).encode()
    left = count
    units = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal left, units
        while left > 0:
            left -= 1
            async with session.post(url + path, data=data, headers=headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{route}: {resp.status} {await resp.text()}")
                if route in ("openai-chat", "kserve-generate"):
                    # Every generation is CHAT_TOKENS long (the model has no EOS): the
                    # usage chunk says so, which is checked; a token whose text is empty
                    # (part of a UTF-8 character) has no chunk of its own.
                    async for line in resp.content:
                        if (
                            b'"usage":{' in line
                            and b'"completion_tokens":%d' % CHAT_TOKENS not in line
                        ):
                            raise RuntimeError(f"{route}: not {CHAT_TOKENS} tokens: {line!r}")
                    units += CHAT_TOKENS
                else:
                    await resp.read()
                    units += 1

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return units


def _client(url: str, route: str, count: int, concurrency: int, out: Any) -> None:
    out.put(asyncio.run(_drive(url, route, count, concurrency)))


def measured(pid: int, url: str, route: str, count: int, concurrency: int) -> tuple[float, int]:
    """(frontend CPU seconds, units) of one load, its client in a process of its own."""
    queue: Any = multiprocessing.get_context("spawn").Queue()
    proc = multiprocessing.get_context("spawn").Process(
        target=_client, args=(url, route, count, concurrency, queue)
    )
    before = sum(process_tree_cpu_s(pid).values())
    proc.start()
    units = queue.get(timeout=600)
    proc.join()
    after = sum(process_tree_cpu_s(pid).values())
    return after - before, units


def compare(
    pid: int, url: str, pair: tuple[str, str], count: int, conc: int, rounds: int
) -> dict[str, Any]:
    per: dict[str, list[float]] = {pair[0]: [], pair[1]: []}
    measured(pid, url, pair[0], max(count // 10, 4), conc)  # warm both paths
    measured(pid, url, pair[1], max(count // 10, 4), conc)
    for r in range(rounds):
        for route in pair if r % 2 == 0 else pair[::-1]:
            cpu, units = measured(pid, url, route, count, conc)
            per[route].append(cpu / units * 1e6)
            progress(
                f"  {route}: {cpu / units * 1e6:.0f} µs of frontend CPU per unit ({units} units)"
            )
    a, b = (statistics.median(per[p]) for p in pair)
    return {"us_per_unit": per, "median_us": {pair[0]: a, pair[1]: b}, "ratio": a / b}


DOC = " about the Danube and the Rhine" * 24  # ~200 tokens: Triton is the bottleneck


def _documents(n: int) -> list[str]:
    return [f"document {i}{DOC}" for i in range(n)]


async def _rerank_calls(
    url: str, key: str, docs: int, count: int, direct: bool, out: list[float], queue: Any
) -> None:
    """``count`` rerank calls of ``docs`` documents, one after another, each timed: through
    the frontend's ``/v2/rerank``, or (``direct``) as the frontend sends them to Triton,
    one KServe infer per document (256 at a time), straight to Triton."""
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    documents = _documents(docs)
    rows: list[list[int]] = []
    if direct:
        from fair_frontend.shell.api.rerank import pair_rows

        data = load_example_config()
        tokenizer = data["endpoints"]["rerank"]["tokenizer"]
        rows = [r.tolist() for r in pair_rows(tokenizer, "rivers of Europe", documents, None, 512)]
    body = json.dumps({"model": "rerank", "query": "rivers of Europe", "documents": documents})
    # Straight to Triton a client keeps 256 rows in flight (its connection pool; more open
    # connections than Triton's HTTP threads serve only stall), as the frontend keeps
    # at most 256 of a call's rows in its own queues.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:

        async def row(ids: list[int]) -> None:
            tensor = {"name": "INPUT_IDS", "datatype": "INT32", "shape": [1, len(ids)], "data": ids}
            async with session.post(
                url + "/v2/models/rerank/infer", json={"inputs": [tensor]}
            ) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"rerank row: {resp.status}")

        queue.put("started")  # its rows are made: the load starts now
        for _ in range(count):
            t0 = time.monotonic()
            if direct:
                await asyncio.gather(*(row(ids) for ids in rows))
            else:
                async with session.post(url + "/v2/rerank", data=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"rerank: {resp.status}")
            out.append(time.monotonic() - t0)


def _rerank_client(url: str, key: str, docs: int, count: int, direct: bool, queue: Any) -> None:
    out: list[float] = []
    asyncio.run(_rerank_calls(url, key, docs, count, direct, out, queue))
    queue.put(out)


def _result(queue: Any, proc: Any) -> Any:
    """What a client process put on ``queue``; raises if it died without."""
    while True:
        try:
            return queue.get(timeout=1.0)
        except Exception:  # queue.Empty
            if not proc.is_alive():
                raise RuntimeError(f"client process exited with {proc.exitcode}") from None


def rerank(url: str, triton_url: str, triton_grpc: str, count: int) -> dict[str, Any]:
    """The quiet tenant's 3-document rerank latency, alone and beside another tenant's
    flood, each in its own process. Through the frontend the flood is 1,000-document
    calls one after another (the frontend keeps 256 of a call's rows in its queues at
    once); straight to Triton it is the same rows as a client sends them, 256 in flight
    at all times: perf_analyzer's plain command (``--shape INPUT_IDS:ROW_TOKENS``, rows
    as long as the documents' pairs), which keeps Triton's queue as full as the
    frontend's flood keeps the frontend's."""
    ctx = multiprocessing.get_context("spawn")
    result: dict[str, Any] = {}
    for target, base, direct in (("frontend", url, False), ("triton", triton_url, True)):
        for label, flood in (("alone", False), ("flooded", True)):
            with contextlib.ExitStack() as stack:
                if flood and not direct:
                    hog_queue: Any = ctx.Queue()  # held here: a queue collected breaks its user
                    hog = ctx.Process(
                        target=_rerank_client, args=(base, KEY, 1000, 1000, False, hog_queue)
                    )
                    hog.start()
                    stack.callback(_stop, hog)
                    _result(hog_queue, hog)  # "started": its first call is going out
                elif flood:
                    logs = Path(tempfile.mkdtemp(prefix="fair-bench-api-"))
                    stack.enter_context(load_generators({"flood": _perf_flood(triton_grpc)}, logs))
                time.sleep(2.0 if flood else 0.0)  # the flood is queued (a load, not a server)
                q: Any = ctx.Queue()
                quiet = ctx.Process(
                    target=_rerank_client, args=(base, QUIET_KEY, 3, count, direct, q)
                )
                quiet.start()
                _result(q, quiet)  # "started"
                lat = sorted(_result(q, quiet))
                quiet.join()
            entry = {
                "p50_ms": statistics.median(lat) * 1e3,
                "p90_ms": lat[int(len(lat) * 0.9)] * 1e3,
                "max_ms": lat[-1] * 1e3,
                "latencies_ms": [x * 1e3 for x in lat],
            }
            result.setdefault(target, {})[label] = entry
            progress(
                f"  rerank via {target}, {label}: p50 {entry['p50_ms']:.0f} ms, "
                f"p90 {entry['p90_ms']:.0f} ms"
            )
    f, t = result["frontend"]["flooded"], result["triton"]["flooded"]
    result["flooded_p50_triton_over_frontend"] = t["p50_ms"] / f["p50_ms"]
    result["flooded_p90_triton_over_frontend"] = t["p90_ms"] / f["p90_ms"]
    return result


ROW_TOKENS = 220  # a document's pair: [CLS] query [SEP] ~210 tokens [SEP]


def _perf_flood(triton_grpc: str) -> list[str]:
    return [
        perf_analyzer_binary(), "-m", "rerank", "-u", triton_grpc, "-i", "grpc",
        "--shape", f"INPUT_IDS:{ROW_TOKENS}", "--concurrency-range", "256",
        "--measurement-interval", "600000",
    ]  # fmt: skip


def _stop(proc: Any) -> None:
    if not proc.is_alive():
        raise RuntimeError(f"the flood's client exited with {proc.exitcode}")
    proc.terminate()
    proc.join()


def plot_rerank(result: dict[str, Any]) -> None:
    """The quiet tenant's latencies, each call a dot, alone and under the flood."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    groups = [(t, label) for t in ("frontend", "triton") for label in ("alone", "flooded")]
    for x, (target, label) in enumerate(groups):
        lat = result[target][label]["latencies_ms"]
        ax.scatter([x] * len(lat), lat, s=12, alpha=0.6)
        ax.hlines(statistics.median(lat), x - 0.25, x + 0.25, color="k", lw=1.5)
    names = {"frontend": "through the frontend", "triton": "Triton direct"}
    ax.set_xticks(range(4), [f"{names[t]}\n{label}" for t, label in groups], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("3-document rerank latency (ms)")
    ax.set_title("Quiet tenant beside a 1,000-document rerank flood", fontsize=10)
    fig.tight_layout()
    path = RESULTS / "api_rerank.png"
    fig.savefig(path, dpi=120)
    progress(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="embeddings,chat,rerank")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    data = load_example_config()
    data.pop("tier_limits", None)
    for tenant in data["tenants"].values():
        tenant.pop("limits", None)
    # The throttle would refuse most of a 1,000-document flood at once (its rows' predicted
    # wait is over the latency target): off, so that the flood queues and the fair share
    # alone keeps the quiet tenant's latency.
    data["endpoints"]["rerank"]["throttle"] = False
    results: dict[str, Any] = {}
    with triton() as server, frontend(data, server.grpc_url, http_url=server.http_url) as fe:
        url = f"http://{fe.http_url}"
        pid = fe.process.pid
        if "embeddings" in scenarios:
            progress("embeddings: CPU per request, /v1/embeddings vs KServe infer")
            results["embeddings"] = compare(
                pid, url, ("openai-embed", "kserve-embed"), 2000, 8, args.rounds
            )
        if "chat" in scenarios:
            progress("chat: CPU per streamed token, /v1/chat/completions vs generate_stream")
            results["chat"] = compare(
                pid, url, ("openai-chat", "kserve-generate"), 120, 16, args.rounds
            )
        if "rerank" in scenarios:
            progress("rerank: a 3-document rerank beside a 1,000-document flood")
            triton_url = server.http_url
            if not triton_url.startswith("http"):
                triton_url = f"http://{triton_url}"
            results["rerank"] = rerank(url, triton_url, server.grpc_url, 20)
            plot_rerank(results["rerank"])
    for name, r in results.items():
        if "ratio" in r:
            progress(f"{name}: OpenAI / KServe = {r['ratio']:.2f} ({r['median_us']})")
    write_result("api", results)


if __name__ == "__main__":
    main()
