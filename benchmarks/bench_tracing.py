"""What request traces cost the frontend: CPU per request with tracing off, on but not
sampled, sampled 1 in 10, and every request traced.

Four frontends (``fair-frontend serve --workers 2``: the core and two shell processes) in
front of one real Triton, the same config but for ``tracing``; each load's client runs in
a process of its own, and the frontends are measured in alternating rounds of one run, so
the ratios are of one run: each round's figure over the same round's tracing-off figure,
the median of those (paired: the machine's speed drifts between rounds). CPU is each
frontend's own (user + system from /proc), the core's and its shells' apart: a traced
request's shell makes its request span, the core its admission, queue and batch spans and
the batch's call to Triton. The spans go to an
OTLP/HTTP sink of this process's (it decodes nothing, counts the exports' bytes), so the
exporter does its whole work.

- ``embed``: ``POST /v2/models/embed/infer`` (64 token ids), CPU per request;
- ``generate``: ``POST /v2/models/llm/generate_stream``, CPU per streamed token.

    .venv/bin/python -m benchmarks.bench_tracing [--rounds 3] [--count 1500] [--ref REF]

``--ref``: the frontend at an earlier git ref (the release before tracing) as a fifth,
``before``: what the code for tracing costs a frontend that does not trace.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from benchmarks.bench_api import measured
from benchmarks.harness import (
    baseline_checkout,
    frontend,
    load_example_config,
    process_tree_cpu_s,
    progress,
    triton,
    write_result,
)

VARIANTS = {
    "off": None,
    "unsampled": 0.0,
    "1-in-10": 0.1,
    "every": 1.0,
}


@contextlib.contextmanager
def sink() -> Iterator[tuple[str, dict[str, int]]]:
    """An OTLP/HTTP endpoint that takes every export and counts them."""
    seen = {"exports": 0, "bytes": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            size = int(self.headers.get("Content-Length", "0"))
            self.rfile.read(size)
            seen["exports"] += 1
            seen["bytes"] += size
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", seen
    finally:
        server.shutdown()
        server.server_close()


def unlimited(data: dict[str, Any]) -> dict[str, Any]:
    """The example config without rate limits (the loads would hit them)."""
    data.pop("tier_limits", None)
    for tenant in data["tenants"].values():
        tenant.pop("limits", None)
    return data


def run(rounds: int, count: int, ref: str | None) -> dict[str, Any]:
    base = unlimited(load_example_config())
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        url, seen = stack.enter_context(sink())
        server = stack.enter_context(triton())
        fronts = {}
        if ref is not None:  # the release before tracing, beside these
            source = stack.enter_context(baseline_checkout(ref))
            fronts["before"] = stack.enter_context(
                frontend(
                    unlimited(load_example_config(source)),
                    server.grpc_url,
                    http_url=server.http_url,
                    workers=2,
                    source=source,
                )
            )
        for name, ratio in VARIANTS.items():
            data = dict(base)
            if ratio is not None:
                data["tracing"] = {"otlp_endpoint": url, "sample_ratio": ratio}
            fe = stack.enter_context(
                frontend(data, server.grpc_url, http_url=server.http_url, workers=2)
            )
            fronts[name] = fe
        for load, route, n, conc in (
            ("embed", "kserve-embed", count, 8),
            ("generate", "kserve-generate", max(count // 20, 16), 16),
        ):
            progress(f"{load}: {route}, {rounds} rounds of {n} calls per frontend")
            per: dict[str, dict[str, list[float]]] = {
                v: {"core": [], "shells": [], "total": []} for v in fronts
            }
            for fe in fronts.values():  # warm every path
                measured(fe.process.pid, f"http://{fe.http_url}", route, max(n // 10, 4), conc)
            order = list(fronts)
            for r in range(rounds):
                for name in order if r % 2 == 0 else order[::-1]:
                    fe = fronts[name]
                    cpu, units = measured_split(
                        fe.process.pid, f"http://{fe.http_url}", route, n, conc
                    )
                    for part, seconds in cpu.items():
                        per[name][part].append(seconds / units * 1e6)
                    progress(
                        f"  {load} {name}: {per[name]['total'][-1]:.0f} µs per unit "
                        f"(core {per[name]['core'][-1]:.0f}, shells {per[name]['shells'][-1]:.0f})"
                    )
            median = {
                v: {p: statistics.median(xs) for p, xs in parts.items()} for v, parts in per.items()
            }
            # Paired: each round's figure over the same round's ``off`` (the machine's
            # speed drifts by tens of percent between rounds), the median of those.
            paired = {
                v: {
                    p: statistics.median(
                        x / o for x, o in zip(parts[p], per["off"][p], strict=True)
                    )
                    for p in parts
                }
                for v, parts in per.items()
            }
            results[load] = {"us_per_unit": per, "median_us": median, "ratio_to_off": paired}
        results["sink"] = dict(seen)
    return results


def measured_split(
    pid: int, url: str, route: str, count: int, conc: int
) -> tuple[dict[str, float], int]:
    """``benchmarks.bench_api.measured``, the core's CPU and its shells' apart."""
    before = process_tree_cpu_s(pid)
    _, units = measured(pid, url, route, count, conc)
    after = process_tree_cpu_s(pid)
    cpu = {part: after[part] - before[part] for part in before}
    cpu["total"] = sum(cpu.values())
    return cpu, units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=1500)
    parser.add_argument(
        "--ref", default=None, help="also measure this git ref (the release before tracing)"
    )
    args = parser.parse_args()
    results = run(args.rounds, args.count, args.ref)
    for load in ("embed", "generate"):
        for v, ratios in results[load]["ratio_to_off"].items():
            progress(
                f"{load} {v}: {ratios['total']:.2f}x off "
                f"(core {ratios['core']:.2f}x, shells {ratios['shells']:.2f}x)"
            )
    progress(f"sink: {results['sink']}")
    write_result("tracing", results)


if __name__ == "__main__":
    main()
