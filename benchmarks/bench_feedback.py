"""The feedback loop on the real stack: how fast the learned cost follows a change, and how
well the throttle predicts the wait.

Two scenarios, one Triton (``embed`` and the test model ``sleeper``), one frontend per
scenario in this process (``BackgroundServer``) reading Triton's metrics every second,
a load generator in a child process keeping ``--concurrency`` requests outstanding:

- ``embed`` (token cost, the real encoder): 32-token requests, then 512-token requests.
  Attention makes a token of a 512-token row dearer than one of a 32-token row, so the
  seconds per token (the EMA, ``unit_seconds``) and the batch-time model's per-token cost
  both move.
- ``sleeper`` (request cost, a known cost: 2 ms + 20 us per token per execution): 32-token
  rows, then 512-token rows. Seconds per row (the EMA) grows about 15-fold; the true
  per-token cost does not change (20 us), which the fit must keep.

Learned cost: the endpoint's ``ServiceModel.status()`` sampled every 0.25 s. Settling
time: seconds from the switch until the value stays within 10 % of its new steady value
(the median over the last 30 % of the second phase) for the rest of the run.

Predicted against measured wait: an extra observer on the frontend records, per request,
the throttle's predicted wait at admission (``ThrottleDecision.predicted_wait_s``: until
the request's batch has run, the batches in flight and the backlog ahead included) and,
when it finishes, its latency (arrival to answer) and its queue wait. The throttle is on
with a latency target nobody reaches, so it predicts for every request and rejects none.
Requests are matched by the asyncio task that handles them (admission and the finish run
in the same task).

    .venv/bin/python -m benchmarks.bench_feedback [--before-s 30] [--after-s S] [--concurrency 48]
                                                    [--scenarios embed sleeper] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from benchmarks.harness import RESULTS, ROOT, load_example_config, progress, write_result
from fair_frontend.backends.triton.embedded import EmbeddedTriton, default_model_repository
from fair_frontend.config import parse_config
from fair_frontend.core import Core
from fair_frontend.observability.observe import Observer
from fair_frontend.outcomes import Outcome
from fair_frontend.server import BackgroundServer, FrontendServer, Listen

TEST_MODELS = ROOT / "tests" / "model_repository"
KEY = "feedback-bench-key"
TENANT = "bench"
SAMPLE_S = 0.25
SETTLE_BAND = 0.10
STEADY_TAIL = 0.30  # the new steady value: median over this last fraction of phase 2
MAX_SAVED_REQUESTS = 500
SAVED_SAMPLE_EVERY = 2  # the JSON keeps every 2nd sample of the learned cost (0.5 s)
SLEEPER_FIXED_S = 0.002  # tests/model_repository/sleeper/config.pbtxt
SLEEPER_PER_TOKEN_S = 20e-6


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    tokens: tuple[int, int]  # row width before and after the switch
    unit: str  # the endpoint's cost unit: what unit_seconds is per
    after_s: float  # long enough for the estimates to settle and stay (see README)


SCENARIOS = {
    "embed": Scenario("embed", "embed", (32, 512), "token", 60.0),
    # 512-token rows make 330 ms batches: the memory floor of 100 batches is then 33 s.
    "sleeper": Scenario("sleeper", "sleeper", (32, 512), "row", 90.0),
}


# ---- the load generator (a child process) --------------------------------------------------


def _generate(
    url: str,
    model: str,
    widths: tuple[int, int],
    switch_at: float,
    end_at: float,
    concurrency: int,
    out: Any,
) -> None:
    asyncio.run(_generate_async(url, model, widths, switch_at, end_at, concurrency, out))


async def _generate_async(
    url: str,
    model: str,
    widths: tuple[int, int],
    switch_at: float,
    end_at: float,
    concurrency: int,
    out: Any,
) -> None:
    """Keep ``concurrency`` requests outstanding; rows of ``widths[0]`` tokens until the
    wall-clock ``switch_at``, then ``widths[1]``, until ``end_at``."""
    import tritonclient.grpc.aio as grpcaio
    from tritonclient.utils import InferenceServerException

    rng = np.random.default_rng(0)
    inputs = {}
    for width in widths:
        inp = grpcaio.InferInput("INPUT_IDS", [1, width], "INT32")
        inp.set_data_from_numpy(rng.integers(1, 4096, size=(1, width), dtype=np.int32))
        inputs[width] = inp
    headers = {"authorization": f"Bearer {KEY}"}
    counts = {"sent": 0, "errors": 0}
    client = grpcaio.InferenceServerClient(url)

    async def worker() -> None:
        while (now := time.time()) < end_at:
            width = widths[0] if now < switch_at else widths[1]
            counts["sent"] += 1
            try:
                await client.infer(model, [inputs[width]], headers=headers)
            except InferenceServerException:
                counts["errors"] += 1

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    out.put(counts)


# ---- what the frontend saw ------------------------------------------------------------------


@dataclass
class Request:
    at: float  # wall clock at admission
    predicted_s: float
    latency_s: float
    queued_s: float


@dataclass
class Recorder:
    """An extra observer: the throttle's prediction and the outcome, per request."""

    model: str
    pending: dict[int, tuple[float, float]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    unpredicted: int = 0  # admitted with no service data yet (the defaults' guess)

    def _task(self) -> int:
        return id(asyncio.current_task())

    def throttle_decision(self, *, model: str, decision: Any, count: int = 1) -> None:
        if model != self.model:
            return
        if decision.reason == "no service data":
            self.unpredicted += 1
            return
        self.pending[self._task()] = (time.time(), decision.predicted_wait_s)

    def request_finished(
        self,
        *,
        model: str,
        outcome: Outcome,
        queued_s: float | None,
        latency_s: float | None = None,
        **_: Any,
    ) -> None:
        entry = self.pending.pop(self._task(), None)
        if entry is None or outcome is not Outcome.DISPATCHED or latency_s is None:
            return
        self.requests.append(Request(entry[0], entry[1], latency_s, queued_s or 0.0))

    def batch_finished(self, report: Any) -> None:
        pass

    def rate_limit_hit(self, **_: Any) -> None:
        pass

    def rate_limit_degraded(self, **_: Any) -> None:
        pass


def bench_config(metrics_url: str) -> dict[str, Any]:
    cfg = load_example_config()
    cfg.pop("tier_limits", None)
    never = 3_600_000  # ms: the throttle predicts for every request and rejects none
    for endpoint in cfg["endpoints"].values():
        endpoint["latency_target_ms"] = never
        endpoint["throttle"] = True
    cfg["default_endpoint"] = {"latency_target_ms": never, "throttle": True}
    cfg["tenants"] = {TENANT: {"tier": "standard", "api_keys": [KEY], "max_queued": 100_000}}
    cfg["triton"] = {"metrics_url": metrics_url, "metrics_interval_s": 1.0}
    return cfg


async def _status(fe: Core, model: str) -> Any:
    runtime = fe.runtimes.get(model)
    return None if runtime is None or runtime.service is None else runtime.service.status()


def run_scenario(
    sc: Scenario, triton: EmbeddedTriton, before_s: float, after_s: float, concurrency: int
) -> dict[str, Any]:
    recorder = Recorder(sc.model)
    config = parse_config(bench_config(triton.metrics_url))
    server = FrontendServer(
        config,
        triton.grpc_url,
        Listen(),
        core_factory=lambda c, f: Core(c, f, observers=[cast(Observer, recorder)]),  # duck-typed
    )
    background = BackgroundServer(server)
    samples: list[dict[str, Any]] = []
    with background:
        assert server.frontend is not None
        url = f"127.0.0.1:{server.grpc_port}"
        start = time.time() + 1.0
        switch_at, end_at = start + before_s, start + before_s + after_s
        spawn = mp.get_context("spawn")
        out: Any = spawn.Queue()
        proc = spawn.Process(
            target=_generate,
            args=(url, sc.model, sc.tokens, switch_at, end_at, concurrency, out),
        )
        proc.start()
        progress(
            f"{sc.name}: {concurrency} outstanding, {sc.tokens[0]}-token rows for "
            f"{before_s:.0f} s, then {sc.tokens[1]}-token rows for {after_s:.0f} s"
        )
        next_print = start + 5.0
        while (now := time.time()) < end_at:
            status = background.call(_status(server.frontend, sc.model))
            if status is not None:
                samples.append(_sample(now - switch_at, status))
            if now >= next_print and samples:
                s = samples[-1]
                progress(
                    f"  t={s['t']:+6.1f} s  source={s['source']:8s} "
                    f"unit={s['unit_seconds'] * 1e6:9.2f} us/{sc.unit}  "
                    f"per_token={s['per_token_s'] * 1e6:6.2f} us  "
                    f"fixed={s['fixed_s'] * 1e3:6.2f} ms"
                    f"  batch={s['typical_rows']:.1f} rows  requests={len(recorder.requests)}"
                )
                next_print += 5.0
            time.sleep(SAMPLE_S)
        proc.join(60)
        counts = out.get(timeout=10)
    requests = [
        {
            "t": r.at - switch_at,
            "predicted_s": r.predicted_s,
            "latency_s": r.latency_s,
            "queued_s": r.queued_s,
        }
        for r in recorder.requests
    ]
    result = {
        "model": sc.model,
        "unit": sc.unit,
        "tokens_before_after": list(sc.tokens),
        "before_s": before_s,
        "after_s": after_s,
        "concurrency": concurrency,
        "sent": counts["sent"],
        "errors": counts["errors"],
        "unpredicted": recorder.unpredicted,
        "samples": samples,
        "requests": requests,
    }
    result["settle"] = {
        key: settle(samples, key, before_s, after_s) for key in ("unit_seconds", "per_token_s")
    }
    result["prediction"] = prediction_errors(requests, before_s, after_s)
    return result


def compact(res: dict[str, Any]) -> dict[str, Any]:
    """The scenario's result for the JSON file: time series as rows of 4 significant
    digits, and an even subsample of the requests (the statistics used them all)."""

    def rows(items: list[dict[str, Any]], columns: list[str]) -> dict[str, Any]:
        return {
            "columns": columns,
            "rows": [
                [float(f"{x[c]:.4g}") if isinstance(x[c], float) else x[c] for c in columns]
                for x in items
            ],
        }

    step = max(1, len(res["requests"]) // MAX_SAVED_REQUESTS)
    return {
        **res,
        "samples": rows(
            res["samples"][::SAVED_SAMPLE_EVERY], list(res["samples"][0]) if res["samples"] else []
        ),
        "requests": rows(res["requests"][::step], ["t", "predicted_s", "latency_s", "queued_s"]),
        "requests_saved_every": step,
    }


def _sample(t: float, status: Any) -> dict[str, Any]:
    bt = status.batch_time
    return {
        "t": t,
        "source": status.source.value,
        "unit_seconds": status.unit_seconds,
        "fixed_s": bt.fixed_s,
        "per_row_s": bt.per_row_s,
        "per_token_s": bt.per_token_s,
        "typical_rows": status.typical_rows,
        "typical_tokens": status.typical_tokens,
        "stale": status.triton_stale,
    }


def settle(
    samples: list[dict[str, Any]], key: str, before_s: float, after_s: float
) -> dict[str, Any]:
    """How long ``key`` takes after the switch to come within 10 % of its new steady value.

    ``first_within_s``: the first sample inside the band; ``seconds``: from when on it
    stays inside for the rest of the run (None: it never does, e.g. when the machine's
    load moves the true cost by more than 10 %); ``inside_after_first``: the fraction of
    samples inside the band from the first entry on.
    """
    before = [s[key] for s in samples if -before_s * STEADY_TAIL <= s["t"] < 0]
    after = [s for s in samples if s["t"] >= 0]
    tail = [s[key] for s in after if s["t"] >= after_s * (1 - STEADY_TAIL)]
    if not before or not tail:
        return {"seconds": None, "first_within_s": None}
    old, new = statistics.median(before), statistics.median(tail)
    inside = [abs(s[key] - new) <= SETTLE_BAND * abs(new) for s in after]
    first = next((i for i, ok in enumerate(inside) if ok), None)
    stays = None
    for i in range(len(inside) - 1, -1, -1):
        if not inside[i]:
            break
        stays = i
    return {
        "before": old,
        "after": new,
        "ratio": new / old if old else None,
        "first_within_s": None if first is None else after[first]["t"],
        "seconds": None if stays is None else after[stays]["t"],
        "inside_after_first": None if first is None else sum(inside[first:]) / len(inside[first:]),
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values)
    return {"p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90))}


def prediction_errors(
    requests: list[dict[str, Any]], before_s: float, after_s: float
) -> dict[str, Any]:
    """Error of the predicted wait against the measured latency, by stretch of the run.

    ``steady``: the second half of each phase (the estimates had time to settle);
    ``after_switch``: the first 10 s of phase 2, where the estimates are still the old ones.
    """
    stretches = {
        "steady_before": lambda t: -before_s / 2 <= t < 0,
        "after_switch": lambda t: 0 <= t < min(10.0, after_s / 2),
        "steady_after": lambda t: t >= after_s / 2,
        "all": lambda t: True,
    }
    out: dict[str, Any] = {}
    for name, inside in stretches.items():
        chosen = [r for r in requests if inside(r["t"])]
        out[name] = {
            "requests": len(chosen),
            "abs_error_s": _percentiles([abs(r["predicted_s"] - r["latency_s"]) for r in chosen]),
            "rel_error": _percentiles(
                [abs(r["predicted_s"] - r["latency_s"]) / r["latency_s"] for r in chosen]
            ),
            "signed_error_s": _percentiles([r["predicted_s"] - r["latency_s"] for r in chosen]),
            "measured_latency_s": _percentiles([r["latency_s"] for r in chosen]),
            "measured_queue_s": _percentiles([r["queued_s"] for r in chosen]),
            "predicted_s": _percentiles([r["predicted_s"] for r in chosen]),
        }
    return out


# ---- output -----------------------------------------------------------------------------------


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["scenarios"])
    fig, axes = plt.subplots(len(names), 4, figsize=(21, 4.2 * len(names)), squeeze=False)
    for row, name in zip(axes, names, strict=True):
        res = results["scenarios"][name]
        t = np.array([s["t"] for s in res["samples"]])
        for ax, key, scale, label in (
            (row[0], "unit_seconds", 1e6, f"seconds per {res['unit']} (EMA), us"),
            (row[1], "per_token_s", 1e6, "batch-time model: per-token cost, us"),
        ):
            y = np.array([s[key] for s in res["samples"]]) * scale
            ax.plot(t, y, lw=1.2, label="learned")
            st = res["settle"][key]
            if st.get("after") is not None:
                new = st["after"] * scale
                ax.axhspan(
                    new * (1 - SETTLE_BAND),
                    new * (1 + SETTLE_BAND),
                    color="C2",
                    alpha=0.15,
                    label="new steady value +-10%",
                )
                if st["seconds"] is not None:
                    ax.axvline(
                        st["seconds"],
                        color="C2",
                        ls=":",
                        label=f"settled after {st['seconds']:.1f} s",
                    )
            if name == "sleeper" and key == "unit_seconds":
                truth = [
                    (SLEEPER_FIXED_S + SLEEPER_PER_TOKEN_S * smp["typical_tokens"])
                    / max(1.0, smp["typical_rows"])
                    * scale
                    for smp in res["samples"]
                ]
                ax.plot(t, truth, "k--", lw=0.8, label="known cost at the typical batch")
            if name == "sleeper" and key == "per_token_s":
                ax.axhline(
                    SLEEPER_PER_TOKEN_S * 1e6, color="k", ls="--", lw=0.8, label="configured 20 us"
                )
            ax.axvline(0, color="C3", ls="--", lw=1, label="switch")
            ax.set_title(
                f"{name} ({res['tokens_before_after'][0]} -> "
                f"{res['tokens_before_after'][1]} tokens): {label}",
                fontsize=9,
            )
            ax.set_xlabel("seconds from the switch")
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        ax = row[2]
        reqs = res["requests"]
        for stretch, color, inside in (
            ("before the switch", "C0", lambda r: r["t"] < 0),
            ("first 10 s after", "C3", lambda r: 0 <= r["t"] < 10),
            ("later", "C1", lambda r: r["t"] >= 10),
        ):
            chosen = [r for r in reqs if inside(r)]
            if chosen:
                ax.scatter(
                    [r["latency_s"] for r in chosen],
                    [r["predicted_s"] for r in chosen],
                    s=3,
                    alpha=0.35,
                    color=color,
                    label=stretch,
                )
        if reqs:
            lo = min(min(r["latency_s"] for r in reqs), min(r["predicted_s"] for r in reqs))
            hi = max(max(r["latency_s"] for r in reqs), max(r["predicted_s"] for r in reqs))
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured latency (admission to answer), s")
        ax.set_ylabel("throttle's predicted wait at admission, s")
        ax.set_title(f"{name}: predicted vs measured wait", fontsize=9)
        ax.legend(fontsize=7, markerscale=3)
        ax.grid(alpha=0.3, which="both")
        ax = row[3]
        bins: dict[int, list[dict[str, Any]]] = {}
        for r in reqs:
            bins.setdefault(int(np.floor(r["t"])), []).append(r)
        xs = sorted(bins)
        for key, label, color in (
            ("latency_s", "measured latency", "C0"),
            ("predicted_s", "predicted wait at admission", "C1"),
        ):
            ax.plot(
                xs,
                [statistics.median(r[key] for r in bins[x]) for x in xs],
                color=color,
                label=f"{label} (median per second)",
            )
        ax.axvline(0, color="C3", ls="--", lw=1, label="switch")
        ax.set_yscale("log")
        ax.set_xlabel("seconds from the switch")
        ax.set_ylabel("s")
        ax.set_title(f"{name}: predicted and measured wait over time", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    progress(f"plot written to {path.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before-s", type=float, default=30.0, help="seconds before the switch")
    parser.add_argument(
        "--after-s", type=float, default=None, help="seconds after it (default: per scenario)"
    )
    parser.add_argument("--concurrency", type=int, default=48, help="requests outstanding")
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--quick", action="store_true", help="10 s, then 20 s")
    args = parser.parse_args()
    before_s = 10.0 if args.quick else args.before_s
    triton = EmbeddedTriton(
        TEST_MODELS,
        extra_args=[
            f"--model-repository={default_model_repository()}",
            "--model-control-mode=explicit",
            *(f"--load-model={SCENARIOS[n].model}" for n in args.scenarios),
        ],
    )
    progress("starting Triton (embed, sleeper)")
    with triton:
        progress(f"Triton ready on {triton.grpc_url}")
        results: dict[str, Any] = {
            "before_s": before_s,
            "concurrency": args.concurrency,
            "scenarios": {},
        }
        for name in args.scenarios:
            sc = SCENARIOS[name]
            after_s = 20.0 if args.quick else (args.after_s or sc.after_s)
            res = run_scenario(sc, triton, before_s, after_s, args.concurrency)
            results["scenarios"][name] = res
            report(name, res)
    summary = {
        name: {
            "settle": res["settle"],
            "prediction": res["prediction"],
            "sent": res["sent"],
            "errors": res["errors"],
        }
        for name, res in results["scenarios"].items()
    }
    plot(results, RESULTS / "feedback.png")
    scenarios = {name: compact(res) for name, res in results["scenarios"].items()}
    write_result("feedback", {**results, "scenarios": scenarios, "summary": summary})


def report(name: str, res: dict[str, Any]) -> None:
    for key, st in res["settle"].items():
        if st.get("after") is None:
            progress(f"{name}: {key}: not enough samples")
            continue
        first, stays = st["first_within_s"], st["seconds"]
        progress(
            f"{name}: {key}: {st['before']:.3g} -> {st['after']:.3g}"
            + (f" (x{st['ratio']:.2f})" if st["ratio"] is not None else "")
            + "; within 10 % first after "
            + ("never" if first is None else f"{first:.1f} s")
            + ", for good after "
            + ("never" if stays is None else f"{stays:.1f} s")
            + (
                ""
                if st["inside_after_first"] is None
                else f" ({st['inside_after_first']:.0%} of samples inside from then on)"
            )
        )
    for stretch, p in res["prediction"].items():
        if p["requests"]:
            progress(
                f"{name}: predicted vs measured, {stretch} ({p['requests']} requests): "
                f"|error| p50 {p['abs_error_s']['p50'] * 1e3:.1f} ms, "
                f"p90 {p['abs_error_s']['p90'] * 1e3:.1f} ms; relative p50 "
                f"{p['rel_error']['p50']:.0%}, p90 {p['rel_error']['p90']:.0%}; signed p50 "
                f"{p['signed_error_s']['p50'] * 1e3:+.1f} ms; measured p50 "
                f"{p['measured_latency_s']['p50'] * 1e3:.1f} ms"
            )


if __name__ == "__main__":
    main()
