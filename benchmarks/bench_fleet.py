"""The fleet (issue 19): a pool of Tritons, shells on many hosts, leader-elected cores.

Scenarios (``--scenarios``, all by default):

* ``pool``: throughput of one frontend (``serve``) with 1 and then 2 Tritons, each serving
  ``sleeper`` set to *sleep* 40 ms a batch of up to 8 (a model whose time is its own, as
  a GPU's is: two Tritons on these 2 cores can take it at once). perf_analyzer, plain
  ``--shape``, concurrency 32. Target: 2 Tritons >= 1.9x one. Then two Tritons of
  different speeds (40 and 80 ms a batch): what each served, by its own statistics.
* ``shares``: tenant A (weight 2) only through one entry point, B (weight 1) only through
  another, both backlogged, each client its own process. The fleet (one ``core``, two
  ``shell`` processes) against today's independent replicas (two ``serve``), on ``llm``
  (engine mode, 8 slots; tokens received in a window) and on ``embed`` (token cost;
  perf_analyzer's infer/s, equal shapes). Target: within 5 % of 2:1 for the fleet.
* ``failover``: two Tritons, Redis, two cores (``--election redis``, default lease), one
  shell, two closed-loop clients (acme, weight 2, and globex, 1; each its own process)
  through the shell. The leader SIGKILLed three times (the killed one restarted as the
  standby): the gap from each kill to the first answer after it, the calls that failed
  (target: gap <= 1.5 s, none failed), and the service difference over the throughput
  (by weight) in the 10 s after each kill against the 10 s before (target: <= 1.1x);
  then one Triton SIGKILLed: the calls that failed (only what ran on it: at most a
  batch), the rest served by the other.
* ``capacity``: one ``core`` process (``--election none``) with shells on the other CPU:
  the core's CPU per request (embed, 16 tokens, perf_analyzer through two shells) and
  per stream slot (``repeat_int32``, one response each: grant, report, end), from the
  process's own CPU time; one core's capacity is the inverse. Over the gRPC link, with
  embed's unary requests relayed through the core and taking one hop (issue 30), and the
  bytes on the core's TCP sockets per request (``ss``). Triton is real (embed is
  cheap at 16 tokens): the core's CPU does not depend on Triton's speed.

    .venv/bin/python -m benchmarks.bench_fleet [--scenarios pool,shares,failover,capacity]

Results in ``benchmarks/results/fleet.json``; the shares as a plot
(``benchmarks/results/fleet_shares.png``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (
    RESULTS,
    ROOT,
    frontend,
    load_example_config,
    load_generators,
    process_tree_cpu_s,
    progress,
    wait_http_ready,
    write_config,
    write_result,
)
from fair_frontend.backends.triton.embedded import (
    EmbeddedTriton,
    default_model_repository,
    free_port,
)
from fair_frontend.kit.testing import perf_analyzer, perf_analyzer_binary, scrape

TEST_MODELS = ROOT / "tests" / "model_repository"
KEYS = {"acme": "acme-demo-key", "globex": "globex-demo-key"}
SECRET = "bench-fleet-secret-0123456789abcdef"
PROMPT = "a tenant asks the shared model a question"


# ---- processes -------------------------------------------------------------------------


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    log: Path

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def cli(args: list[str], log: Path) -> Proc:
    out = log.open("wb")
    popen = subprocess.Popen(
        [sys.executable, "-m", "fair_frontend.cli", *args], stdout=out, stderr=subprocess.STDOUT
    )
    return Proc(popen, log)


@dataclass
class CoreProc:
    proc: Proc
    port: int
    metrics: int

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics}/metrics"

    def ready(self) -> bool:
        try:
            wait_http_ready(f"http://127.0.0.1:{self.metrics}/v2/health/ready", None, 0.2)
            return True
        except TimeoutError:
            return False


def start_core(
    config: Path, tmp: Path, name: str, election: str = "none", port: int = 0
) -> CoreProc:
    """A core; ``port``: where shells find it (a restarted core takes its old address, as
    a pod behind a Service does)."""
    port, metrics = port or free_port(), free_port()
    secret = tmp / "secret"
    secret.write_text(SECRET)
    args = [
        "core",
        "--config",
        str(config),
        "--listen",
        f"127.0.0.1:{port}",
        "--secret-file",
        str(secret),
        "--election",
        election,
        "--lease-name",
        f"bench-{os.getpid()}",
        "--metrics-port",
        str(metrics),
        "--metrics-host",
        "127.0.0.1",
        "--log-level",
        "WARNING",
    ]
    return CoreProc(cli(args, tmp / f"{name}.log"), port, metrics)


@dataclass
class ShellProc:
    proc: Proc
    http: int
    grpc: int

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc}"


def start_shell(cores: list[CoreProc], tmp: Path, name: str) -> ShellProc:
    http, grpc = free_port(), free_port()
    args = [
        "shell",
        "--secret-file",
        str(tmp / "secret"),
        "--host",
        "127.0.0.1",
        "--http-port",
        str(http),
        "--grpc-port",
        str(grpc),
        "--log-level",
        "WARNING",
    ]
    for core in cores:
        args += ["--core", f"127.0.0.1:{core.port}"]
    shell = ShellProc(cli(args, tmp / f"{name}.log"), http, grpc)
    wait_http_ready(f"http://127.0.0.1:{http}/v2/health/ready", shell.proc.popen)
    return shell


@contextlib.contextmanager
def tritons(repos: list[Path], n: int, **kw: Any) -> Iterator[list[EmbeddedTriton]]:
    servers = [EmbeddedTriton(repos, **kw) for _ in range(n)]
    try:
        for server in servers:
            server.start()
        progress(f"{n} Triton(s) ready: {', '.join(s.grpc_url for s in servers)}")
        yield servers
    finally:
        for server in servers:
            server.stop()


def napper_repo(tmp: Path, ms: int = 40) -> Path:
    """``sleeper``, set to sleep ``ms`` a call of up to 8 rows."""
    repo = tmp / f"napper-{ms}"
    shutil.copytree(TEST_MODELS / "sleeper", repo / "sleeper")
    config = repo / "sleeper" / "config.pbtxt"
    text = config.read_text()
    text = text.replace("max_batch_size: 32", "max_batch_size: 8")
    text = text.replace(
        '"fixed_ms", value: { string_value: "2" }', f'"fixed_ms", value: {{ string_value: "{ms}" }}'
    )
    text = text.replace(
        '"per_token_us", value: { string_value: "20" }',
        '"per_token_us", value: { string_value: "0" }',
    )
    text += 'parameters: { key: "wait", value: { string_value: "sleep" } }\n'
    config.write_text(text)
    return repo


def base_config(**endpoints: dict[str, Any]) -> dict[str, Any]:
    data = load_example_config()
    data.pop("tier_limits", None)
    for endpoint in data["endpoints"].values():
        endpoint["throttle"] = False
    data["default_endpoint"] = {"throttle": False}
    data["endpoints"].update(endpoints)
    data["tenants"]["acme"].update(weight=2.0, max_queued=100000)
    data["tenants"]["globex"].update(weight=1.0, max_queued=100000, tier="enterprise")
    data["tenants"]["globex"].pop("limits", None)  # shares by weight, not by a rate limit
    return data


def backend(triton: EmbeddedTriton) -> dict[str, str]:
    """A pool's entry for ``triton``: batches over its HTTP, as ``up`` sends them."""
    return {"grpc_url": triton.grpc_url, "http_url": triton.http_url}


def pa_headers(tenant: str) -> list[str]:
    return [f"x-api-key:{KEYS[tenant]}"]


# ---- pool: 1 and 2 Tritons ---------------------------------------------------------------


def run_pool(tmp: Path, seconds: int) -> dict[str, Any]:
    repo = napper_repo(tmp)
    config = base_config(sleeper={"throttle": False})
    out: dict[str, Any] = {}
    with tritons([repo], 2) as servers:
        direct = perf_analyzer(
            "sleeper",
            servers[0].grpc_url,
            concurrency=32,
            shapes=["INPUT_IDS:16"],
            interval_ms=seconds * 1000,
        )
        out["triton_direct_one"] = direct["throughput"]
        progress(f"Triton direct, one: {direct['throughput']:.0f} infer/s")
        for n in (1, 2):
            urls = [s.grpc_url for s in servers[:n]]
            with frontend(config, urls, workers=None) as fe:
                result = load_sleeper(fe.grpc_url, seconds)
            out[f"frontend_{n}_tritons"] = result["throughput"]
            progress(f"frontend, {n} Triton(s): {result['throughput']:.0f} infer/s")
    out["ratio_2_to_1"] = out["frontend_2_tritons"] / out["frontend_1_tritons"]
    progress(f"2 Tritons / 1: {out['ratio_2_to_1']:.2f}x (target >= 1.9)")
    # Two Tritons of different speeds (40 and 80 ms a batch): work in proportion.
    slow = napper_repo(tmp, 80)
    with tritons([repo], 1) as (fast,), tritons([slow], 1) as (late,):
        with frontend(config, [fast.grpc_url, late.grpc_url], workers=None) as fe:
            result = load_sleeper(fe.grpc_url, seconds)
        served = [triton_served(t, "sleeper") for t in (fast, late)]
    out["speeds_40_80_ms"] = {
        "throughput": result["throughput"],
        "served": served,
        "ratio_fast_to_slow": served[0] / served[1],
        "ideal_throughput": 8 / 0.040 + 8 / 0.080,
    }
    progress(
        f"Tritons of 40 and 80 ms a batch: served {served[0]} / {served[1]} "
        f"({served[0] / served[1]:.2f}:1, their speeds 2:1), {result['throughput']:.0f} infer/s "
        f"of {8 / 0.040 + 8 / 0.080:.0f}"
    )
    return out


def load_sleeper(url: str, seconds: int) -> dict[str, float]:
    """perf_analyzer's plain command on ``sleeper`` through a frontend, as acme."""
    return perf_analyzer(
        "sleeper",
        url,
        concurrency=32,
        shapes=["INPUT_IDS:16"],
        headers=pa_headers("acme"),
        interval_ms=seconds * 1000,
    )


def triton_served(triton: EmbeddedTriton, model: str) -> int:
    """Requests ``triton`` itself says it served of ``model`` (its statistics)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        stats = client.get_inference_statistics(model)
    finally:
        client.close()
    return sum(int(s.inference_stats.success.count) for s in stats.model_stats)


# ---- shares across entry points -----------------------------------------------------------


def llm_client(url: str, tenant: str, concurrency: int, seconds: float, out: str) -> None:
    """A tenant's streaming client (its own process): ``concurrency`` generations at a
    time, each of 32 tokens, for ``seconds``; writes the arrival time of every token."""
    import tritonclient.grpc.aio as grpcaio
    import uvloop

    async def main() -> None:
        times: list[float] = []
        stop_at = time.monotonic() + seconds

        async def one_after_another() -> None:
            client = grpcaio.InferenceServerClient(url)
            try:
                while time.monotonic() < stop_at:
                    text = grpcaio.InferInput("text_input", [1], "BYTES")
                    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
                    flag = grpcaio.InferInput("stream", [1], "BOOL")
                    flag.set_data_from_numpy(np.array([True]))
                    params = grpcaio.InferInput("sampling_parameters", [1], "BYTES")
                    params.set_data_from_numpy(
                        np.array([json.dumps({"max_tokens": 32}).encode()], dtype=object)
                    )

                    async def request(inputs: list[Any]) -> Any:
                        yield {"model_name": "llm", "inputs": inputs}

                    got = 0
                    async for result, error in client.stream_infer(
                        request([text, flag, params]), headers={"x-api-key": KEYS[tenant]}
                    ):
                        if error is not None:
                            raise RuntimeError(str(error))
                        if result.as_numpy("text_output") is not None:
                            times.append(time.time())
                            got += 1
                            if got == 32:
                                break
            finally:
                await client.close()

        await asyncio.gather(*(one_after_another() for _ in range(concurrency)))
        Path(out).write_text(json.dumps(times))

    uvloop.run(main())


def share_in_window(files: dict[str, Path], warmup_s: float) -> dict[str, int]:
    times = {t: json.loads(f.read_text()) for t, f in files.items()}
    start = max(min(ts) for ts in times.values()) + warmup_s
    end = min(max(ts) for ts in times.values())  # both still backlogged
    return {t: sum(1 for x in ts if start <= x <= end) for t, ts in times.items()}


def served_tokens(metrics: list[str], endpoint: str) -> dict[str, float]:
    pages = [scrape(url) for url in metrics]
    return {t: sum(p.sum("fair_served_tokens_total", tenant=t, endpoint=endpoint) for p in pages)
            for t in KEYS}  # fmt: skip


def measure_shares(
    urls: dict[str, str], metrics: list[str], tmp: Path, seconds: int, label: str
) -> dict[str, Any]:
    """llm tokens received by acme's client (through ``urls['acme']``) and globex's, and
    embed tokens served to each (``metrics``: the frontends' pages)."""
    files = {t: tmp / f"{label}-{t}.json" for t in urls}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.bench_fleet",
                "llm-client",
                urls[t],
                t,
                "24",
                str(seconds),
                str(files[t]),
            ]
        )
        for t in urls
    ]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"an llm client failed ({p.returncode})")
    llm = share_in_window(files, warmup_s=3.0)
    # embed: perf_analyzer per tenant, running until stopped; the tokens each was served
    # in a window while both ran, from the frontends' own counters.
    embed: dict[str, float] = {}
    commands = {
        t: [perf_analyzer_binary(), "-m", "embed", "-u", urls[t], "-i", "grpc",
            "--concurrency-range", "128:128", "--shape", "INPUT_IDS:128",
            "-H", f"x-api-key:{KEYS[t]}", "--measurement-interval", "600000"]
        for t in urls
    }  # fmt: skip
    with load_generators(commands, tmp):
        time.sleep(5)
        before = served_tokens(metrics, "embed")
        time.sleep(seconds)
        after = served_tokens(metrics, "embed")
    embed = {t: after[t] - before[t] for t in urls}
    return {
        "llm_tokens": llm,
        "llm_share_acme": llm["acme"] / sum(llm.values()),
        "embed_tokens": embed,
        "embed_share_acme": embed["acme"] / sum(embed.values()),
    }


def run_shares(tmp: Path, seconds: int) -> dict[str, Any]:
    config = base_config()
    config["endpoints"]["llm"].update(max_inflight=8, reserved_slots=0)
    path = write_config(config, tmp)
    out: dict[str, Any] = {}
    with tritons([default_model_repository()], 1) as (triton,):
        data = {**config, "triton": {"backends": [backend(triton)]}}
        (tmp / "fleet").mkdir(exist_ok=True)
        fleet_config = write_config(data, tmp / "fleet")
        core = start_core(fleet_config, tmp, "shares-core")
        try:
            wait_http_ready(f"http://127.0.0.1:{core.metrics}/v2/health/ready", core.proc.popen)
            shells = [start_shell([core], tmp, f"shares-shell{i}") for i in range(2)]
            progress("fleet: one core, two shells; acme (w2) via shell 0, globex (w1) via 1")
            out["fleet"] = measure_shares(
                {"acme": shells[0].url, "globex": shells[1].url},
                [core.metrics_url],
                tmp,
                seconds,
                "fleet",
            )
        finally:
            for s in locals().get("shells", []):
                s.proc.stop()
            core.proc.stop()
        progress("replicas: two serve processes, each its own scheduler")
        with (
            frontend(path, triton.grpc_url, workers=1, http_url=triton.http_url) as one,
            frontend(path, triton.grpc_url, workers=1, http_url=triton.http_url) as two,
        ):
            out["replicas"] = measure_shares(
                {"acme": one.grpc_url, "globex": two.grpc_url},
                [f"http://127.0.0.1:{fe.metrics_port}/metrics" for fe in (one, two)],
                tmp,
                seconds,
                "replicas",
            )
    for kind in ("fleet", "replicas"):
        r = out[kind]
        progress(
            f"{kind}: acme's share llm {r['llm_share_acme']:.3f}, embed "
            f"{r['embed_share_acme']:.3f} (weights: 0.667)"
        )
    plot_shares(out)
    return out


def plot_shares(out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    kinds = ["fleet", "replicas"]
    x = np.arange(2)
    for i, key in enumerate(("llm_share_acme", "embed_share_acme")):
        ax.bar(x + (i - 0.5) * 0.35, [out[k][key] for k in kinds], 0.35, label=key.split("_")[0])
    ax.axhline(2 / 3, color="k", ls="--", lw=1, label="weight 2:1")
    ax.axhline(1 / 2, color="grey", ls=":", lw=1)
    ax.set_xticks(x, ["one core, two shells", "two independent replicas"])
    ax.set_ylabel("tenant A's share (weight 2 of 3)")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(RESULTS / "fleet_shares.png", dpi=120)
    progress(f"plot written to {RESULTS / 'fleet_shares.png'}")


# ---- failover ----------------------------------------------------------------------------


# Calls each failover client keeps in flight: the two together keep a queue in the core
# beside what the two Tritons run (2 x 8 rows a batch, batches pipelined), so both are
# backlogged and their shares follow their weights.
CALLS = 48


def load_client(url: str, seconds: float, out: str, tenant: str = "acme") -> None:
    """A closed-loop client (its own process) of ``tenant``: ``CALLS`` at a time to
    ``sleeper``; writes (time, ok) per answer."""
    import tritonclient.grpc.aio as grpcaio
    import uvloop
    from tritonclient.utils import InferenceServerException

    async def main() -> None:
        answers: list[tuple[float, bool, str]] = []
        stop_at = time.monotonic() + seconds
        ids = np.full((1, 16), 3, dtype=np.int32)

        async def loop() -> None:
            client = grpcaio.InferenceServerClient(url)
            try:
                while time.monotonic() < stop_at:
                    inp = grpcaio.InferInput("INPUT_IDS", [1, 16], "INT32")
                    inp.set_data_from_numpy(ids)
                    try:
                        await client.infer(
                            "sleeper", [inp], headers={"x-api-key": KEYS[tenant]}, client_timeout=60
                        )
                        answers.append((time.time(), True, ""))
                    except InferenceServerException as err:
                        answers.append((time.time(), False, str(err)[:200]))
            finally:
                await client.close()

        await asyncio.gather(*(loop() for _ in range(CALLS)))
        Path(out).write_text(json.dumps(answers))

    uvloop.run(main())


def run_failover(tmp: Path, seconds: int) -> dict[str, Any]:
    repo = napper_repo(tmp)
    out: dict[str, Any] = {"core_gaps_s": [], "kills": []}
    redis_port = free_port()
    redis = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(redis_port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        with tritons([repo], 2) as servers:
            data = base_config(sleeper={"throttle": False})
            data["triton"] = {
                "backends": [{"grpc_url": s.grpc_url} for s in servers],
                "max_outage_s": 120.0,
            }
            data["rate_limiting"] = {"storage": f"redis://127.0.0.1:{redis_port}/0"}
            config = write_config(data, tmp)
            cores = [start_core(config, tmp, f"core{i}", "redis") for i in range(2)]
            wait_until(lambda: any(c.ready() for c in cores), 60)
            shell = start_shell(cores, tmp, "shell")
            answers = tmp / "answers.json"
            duration = (WINDOW_S + 2) * 4 + seconds
            clients = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.bench_fleet",
                        "load-client",
                        shell.url,
                        str(duration),
                        str(tmp / f"answers-{tenant}.json" if tenant != "acme" else answers),
                        tenant,
                    ]
                )
                for tenant in ("acme", "globex")
            ]
            started = time.time()
            time.sleep(WINDOW_S + 1)
            for n in range(3):  # the leader killed; the killed one back as the standby
                leader = next(c for c in cores if c.ready())
                killed_at = time.time()
                leader.proc.popen.kill()
                leader.proc.popen.wait()
                out["kills"].append(killed_at)
                progress(f"core kill {n + 1}: leader on port {leader.port} SIGKILLed")
                cores.remove(leader)
                wait_until(lambda: any(c.ready() for c in cores), 30)
                name = f"core{len(out['kills']) + 1}"
                cores.append(start_core(config, tmp, name, "redis", port=leader.port))
                time.sleep(WINDOW_S + 1)
            progress("Triton 1 SIGKILLed")
            triton_killed_at = time.time()
            assert servers[1].pid is not None
            os.killpg(servers[1].pid, signal.SIGKILL)
            for client in clients:
                client.wait()
            for c in cores:
                c.proc.stop()
            shell.proc.stop()
    finally:
        redis.terminate()
        redis.wait()
    acme = json.loads(answers.read_text())
    others = json.loads((tmp / "answers-globex.json").read_text())
    results = acme + others
    errors = sorted({e for _, ok, e in results if not ok})
    progress(f"{len(results)} answers, {sum(1 for r in results if r[1])} ok; errors: {errors[:3]}")
    for killed_at in out["kills"]:
        after = sorted(t for t, ok, _ in results if ok and t > killed_at)
        out["core_gaps_s"].append(first_after_outage(after, killed_at) - killed_at)
    # Acme (weight 2) and globex (1), both backlogged: the service difference over the
    # throughput, |S_a/2 - S_g| / (S_a/2 + S_g), in the WINDOW_S before each kill and after.
    out["imbalance_before_after"] = [
        [
            imbalance(acme, others, killed_at - WINDOW_S, killed_at),
            imbalance(acme, others, killed_at, killed_at + WINDOW_S),
        ]
        for killed_at in out["kills"]
    ]
    out["failed_core_phase"] = sum(1 for t, ok, _ in results if not ok and t < triton_killed_at)
    failed_triton = [(t, e) for t, ok, e in results if not ok and t >= triton_killed_at]
    out["failed_after_triton_kill"] = len(failed_triton)
    out["failed_errors"] = sorted({e for _, e in failed_triton})[:3]
    out["served_after_triton_kill"] = sum(
        1 for t, ok, _ in results if ok and t >= triton_killed_at + 1
    )
    out["answers"] = len(results)
    out["seconds"] = time.time() - started
    progress(
        f"core failover gaps: {', '.join(f'{g:.2f}' for g in out['core_gaps_s'])} s; "
        f"failed meanwhile: {out['failed_core_phase']} of {len(results)}"
    )
    progress(
        "service difference over throughput, before -> after each kill: "
        + ", ".join(f"{b:.3f} -> {a:.3f}" for b, a in out["imbalance_before_after"])
    )
    progress(
        f"Triton killed: {len(failed_triton)} failed (a batch holds at most 8), "
        f"{out['served_after_triton_kill']} served after it"
    )
    return out


WINDOW_S = 10.0  # the windows before and after a kill whose service is compared
OUTAGE_S = 0.2  # a pause between answers this long, after a kill: the leader is gone


def first_after_outage(times: list[float], killed_at: float) -> float:
    """The first answer by the new leader: the first after the outage that follows the
    kill (answers the old leader had sent before it died still arrive in its first
    milliseconds); the first after the kill where no pause shows."""
    previous = killed_at
    for t in times:
        if t - previous >= OUTAGE_S:
            return t
        previous = t
    return times[0]


def imbalance(acme: list[list[Any]], globex: list[list[Any]], since: float, until: float) -> float:
    """|S_a/2 - S_g| / (S_a/2 + S_g): answers OK in [since, until), by weight."""
    a = sum(1 for t, ok, _ in acme if ok and since <= t < until) / 2
    g = sum(1 for t, ok, _ in globex if ok and since <= t < until)
    return abs(a - g) / (a + g) if a + g else 0.0


def wait_until(condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("not within the time")
        time.sleep(0.02)


# ---- capacity ------------------------------------------------------------------------------


def run_capacity(tmp: Path, seconds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tritons(
        [default_model_repository(), TEST_MODELS],
        1,
        extra_args=[
            "--model-control-mode=explicit",
            "--load-model=embed",
            "--load-model=repeat_int32",
        ],
    ) as (triton,):
        for unary in ("relay", "one_hop"):  # embed's tensors through the core, or not
            data = base_config()
            data["triton"] = {"backends": [backend(triton)]}
            data["endpoints"]["repeat_int32"] = {"max_inflight_batches": 64, "throttle": False}
            data["endpoints"]["embed"]["unary"] = unary
            (tmp / f"capacity-{unary}").mkdir(exist_ok=True)
            config = write_config(data, tmp / f"capacity-{unary}")
            # The fleet's core, its two shells elsewhere (over gRPC).
            core = start_core(config, tmp, f"capacity-core-{unary}")
            try:
                wait_http_ready(f"http://127.0.0.1:{core.metrics}/v2/health/ready", core.proc.popen)
                shells = [start_shell([core], tmp, f"cap-shell{i}-{unary}") for i in range(2)]
                out[f"grpc link, unary {unary}"] = core_cost(
                    core.proc.popen.pid,
                    [s.proc.popen.pid for s in shells],
                    [s.url for s in shells],
                    core.metrics_url,
                    tmp,
                    seconds,
                )
            finally:
                for s in locals().get("shells", []):
                    s.proc.stop()
                core.proc.stop()
            # The same core with its two shells on this host (serve --workers 2, Unix
            # socket).
            with frontend(config, [], workers=2) as fe:
                out[f"unix socket, unary {unary}"] = core_cost(
                    fe.process.pid,
                    [],
                    [fe.grpc_url],
                    f"http://127.0.0.1:{fe.metrics_port}/metrics",
                    tmp,
                    seconds,
                )
    return out


def core_cost(
    core: int, shells: list[int], urls: list[str], metrics: str, tmp: Path, seconds: int
) -> dict[str, Any]:
    """The core process's CPU per request and per stream slot under load through
    ``urls``: the core pinned to CPU 0, everything else to CPU 1."""
    pin(core, "0")
    for pid in shells:
        pin(pid, "1", tree=True)
    for child in subprocess.run(["pgrep", "-P", str(core)], capture_output=True,
                                text=True).stdout.split():  # fmt: skip
        pin(int(child), "1", tree=True)  # serve's own shells
    out: dict[str, Any] = {}
    link = "grpc link" if shells else "unix socket"
    for name, model, extra in (
        ("request", "embed", ["--shape", "INPUT_IDS:16"]),
        (
            "stream slot",
            "repeat_int32",
            [
                "--streaming",
                "--input-data",
                str(repeat_input(tmp)),
                "--shape",
                "IN:1",
                "--shape",
                "DELAY:1",
                "--shape",
                "WAIT:1",
            ],
        ),
    ):
        commands = {
            f"{model}-{i}": ["taskset", "-c", "1", perf_analyzer_binary(), "-m", model, "-u", url,
                             "-i", "grpc", "--concurrency-range", "16:16",
                             "-H", f"x-api-key:{KEYS['acme']}",
                             "--measurement-interval", "600000", *extra]
            for i, url in enumerate(urls * (2 // len(urls)))
        }  # fmt: skip
        with load_generators(commands, tmp):
            time.sleep(4)
            cpu0 = process_tree_cpu_s(core)["core"]
            bytes0 = tcp_bytes(core)
            count0 = scrape(metrics).sum("fair_requests_total", endpoint=model)
            t0 = time.monotonic()
            time.sleep(seconds)
            cpu = process_tree_cpu_s(core)["core"] - cpu0
            moved = tcp_bytes(core) - bytes0
            count = scrape(metrics).sum("fair_requests_total", endpoint=model) - count0
            wall = time.monotonic() - t0
        if not count:
            tails = [(tmp / f"{n}.log").read_text()[-500:] for n in commands]
            raise RuntimeError(f"nothing served of {model}: {tails}")
        per_us = cpu / count * 1e6
        out[name] = {
            "core_cpu_us": per_us,
            "per_core_second": 1e6 / per_us,
            "served_per_s": count / wall,
            "core_busy": cpu / wall,
        }
        if shells:  # TCP all of it (a Unix socket keeps no byte counts)
            out[name]["core_socket_bytes"] = moved / count
        progress(
            f"{link}, {name}: core CPU {per_us:.0f} µs each -> one core "
            f"{1e6 / per_us:,.0f}/s (served {count / wall:,.0f}/s here, core "
            f"{cpu / wall:.0%} busy)"
            + (f", {moved / count:,.0f} bytes on the core's sockets each" if shells else "")
        )
    return out


def tcp_bytes(pid: int) -> int:
    """Bytes process ``pid``'s open TCP sockets have sent (acknowledged) and received, as
    the kernel counts them (``ss -ti``): its links to shells, Triton and the scrapers."""
    listing = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True).stdout
    total = 0
    mine = False
    for line in listing.splitlines():
        if not line[:1].isspace():  # a socket's line; its counters follow on the next
            mine = f"pid={pid}," in line
            continue
        if mine:
            for field in line.split():
                name, _, value = field.partition(":")
                if name in ("bytes_acked", "bytes_received"):
                    total += int(value)
    return total


def pin(pid: int, cpus: str, tree: bool = False) -> None:
    args = ["taskset", "-a", "-p", "-c", cpus, str(pid)]
    subprocess.run(args, check=True, capture_output=True)
    if tree:
        for child in subprocess.run(
            ["pgrep", "-P", str(pid)], capture_output=True, text=True
        ).stdout.split():
            pin(int(child), cpus, tree=True)


def repeat_input(tmp: Path) -> Path:
    path = tmp / "repeat.json"
    path.write_text(json.dumps({"data": [{"IN": [1], "DELAY": [0], "WAIT": [0]}]}))
    return path


# ---- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "llm-client":
        llm_client(argv[1], argv[2], int(argv[3]), float(argv[4]), argv[5])
        return 0
    if argv and argv[0] == "load-client":
        load_client(argv[1], float(argv[2]), argv[3], *argv[4:5])
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_fleet")
    parser.add_argument("--scenarios", default="pool,shares,failover,capacity")
    parser.add_argument("--seconds", type=int, default=15, help="each measurement's window")
    args = parser.parse_args(argv)
    previous = RESULTS / "fleet.json"
    results: dict[str, Any] = json.loads(previous.read_text()) if previous.exists() else {}
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    runs = {
        "pool": run_pool,
        "shares": run_shares,
        "failover": run_failover,
        "capacity": run_capacity,
    }
    try:
        for name in args.scenarios.split(","):
            progress(f"scenario {name}")
            results[name] = runs[name](tmp, args.seconds)
            write_result("fleet", results)
    finally:
        if os.environ.get("FAIR_BENCH_KEEP"):
            progress(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
