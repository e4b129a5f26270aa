"""Shared pieces of the benchmarks: the real stack, load generators, results.

Everything here runs real processes on free loopback ports: an embedded Triton, the
frontend as its own process (``fair-frontend serve``), perf_analyzer 2.46. Results go
to ``benchmarks/results/<name>.json``; figures people would rather see go next to them
as PNG plots. What the tests use too (perf_analyzer, the metrics scraper, waits with a
deadline) is in ``fair_frontend.kit.testing``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fair_frontend.backends.triton.embedded import (
    EmbeddedTriton,
    default_model_repository,
    free_port,
)
from fair_frontend.config import resolve_relative_paths

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
EXAMPLE_CONFIG = ROOT / "examples" / "config.yaml"


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    progress(f"results written to {path.relative_to(ROOT)}")
    return path


@contextlib.contextmanager
def triton(repo: Path | Sequence[Path] | None = None, **kwargs: Any) -> Iterator[EmbeddedTriton]:
    server = EmbeddedTriton(repo or default_model_repository(), **kwargs)
    progress(f"starting Triton on {server.model_repository}")
    server.start()
    progress(f"Triton ready on {server.grpc_url} (log: {server.log_path})")
    try:
        yield server
    finally:
        server.stop()


@dataclass
class FrontendProcess:
    http_port: int
    grpc_port: int
    metrics_port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"


def wait_http_ready(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float = 60) -> None:
    """Poll a readiness URL until 200; fail early if the process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before becoming ready")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout_s}s")


def write_config(data: dict[str, Any], directory: Path) -> Path:
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def load_example_config(root: Path | None = None) -> dict[str, Any]:
    """The example config as data, its relative paths (tokenizers) made absolute: the
    benchmarks write it to a folder of their own. ``root``: the checkout whose example it
    is (an earlier version run beside this one takes its own, which its config parser
    knows; default: this one)."""
    example = EXAMPLE_CONFIG if root is None else root / "examples" / "config.yaml"
    data: dict[str, Any] = yaml.safe_load(example.read_text())
    resolve_relative_paths(data, example.parent)
    if "tier_models" in data:  # model access (issue 17); an earlier checkout has none
        # The benchmarks' own tenants call test models too (simple, sleeper): every model
        # open to every tier (the example's lists are for its demo tenants).
        data["tier_models"] = {tier: ["*"] for tier in data["tiers"]}
    return data


@contextlib.contextmanager
def frontend(
    config: dict[str, Any] | Path,
    triton_url: str | list[str],
    *,
    workers: int | None = 1,
    source: Path | None = None,
    http_url: str | None = None,
    cpus: set[int] | None = None,
    log_level: str | None = None,
) -> Iterator[FrontendProcess]:
    """``fair-frontend serve`` as its own process, as a user runs it (``workers`` shell
    processes; None: its default, and no ``--workers`` flag). ``source``: run the package
    of another checkout (``baseline_checkout``) instead of this one. ``http_url``: Triton's
    HTTP address, where batches then go (``triton.http_url``, as ``up`` mode sets it).
    ``cpus``: the CPUs it runs on, its shells too (``pinned``). ``log_level``: its
    ``--log-level`` (None: ``FAIR_BENCH_LOG_LEVEL``, else WARNING; INFO writes the request
    log, a line per finished request, to ``FrontendProcess.log_path``)."""
    if http_url is not None and not isinstance(config, Path):
        config = {**config, "triton": {**config.get("triton", {}), "http_url": http_url}}
    tmp = Path(tempfile.mkdtemp(prefix="fair-bench-"))
    path = config if isinstance(config, Path) else write_config(config, tmp)
    ports = [free_port() for _ in range(3)]
    log_path = tmp / "frontend.log"
    cmd = [
        sys.executable,
        "-m",
        "fair_frontend.cli",
        "serve",
        "--config",
        str(path),
        "--host",
        "127.0.0.1",
        "--http-port",
        str(ports[0]),
        "--grpc-port",
        str(ports[1]),
        "--metrics-port",
        str(ports[2]),
        "--log-level",
        log_level or os.environ.get("FAIR_BENCH_LOG_LEVEL", "WARNING"),
    ]
    for url in [triton_url] if isinstance(triton_url, str) else triton_url:
        cmd += ["--triton-url", url]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    env = None
    if source is not None:
        env = {**os.environ, "PYTHONPATH": str(source)}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=source or None,
            env=env,
            preexec_fn=pinned(cpus),
        )
    try:
        wait_http_ready(f"http://127.0.0.1:{ports[0]}/v2/health/ready", proc)
        yield FrontendProcess(ports[0], ports[1], ports[2], proc, log_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def pinned(cpus: set[int] | None) -> Callable[[], None] | None:
    """A child's ``preexec_fn`` that runs it (and what it starts) on ``cpus`` only."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


@contextlib.contextmanager
def load_generators(
    commands: dict[str, list[str]], logs: Path
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Load generators (perf_analyzer) running until stopped, one per name, each logging to
    ``logs/<name>.log``; stopped with SIGINT (perf_analyzer prints its summary), then
    killed if they do not exit."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, cmd in commands.items():
            log = (logs / f"{name}.log").open("wb")
            procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def process_tree_cpu_s(pid: int) -> dict[str, float]:
    """User + system CPU seconds of a process (``core``: the frontend's) and of its live
    children together (``shells``), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu(p: int) -> float:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tick
        return 0.0

    children: list[int] = []
    with contextlib.suppress(OSError):
        children = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return {"core": cpu(pid), "shells": sum(cpu(c) for c in children)}


def child_pids(pid: int) -> list[int]:
    """The live children of a process (the frontend's shells), from /proc; none if it is
    gone."""
    with contextlib.suppress(OSError):
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def rss_bytes(pid: int) -> int:
    """Resident memory of one process (``VmRSS``), 0 if it is gone: what the machine
    actually holds for it, which is what a memory attack has to grow."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def process_tree_rss_bytes(pid: int) -> dict[str, int]:
    """Resident memory of a process (``core``: the frontend's) and of its live children
    together (``shells``), as ``process_tree_cpu_s`` splits CPU."""
    return {"core": rss_bytes(pid), "shells": sum(rss_bytes(c) for c in child_pids(pid))}


@contextlib.contextmanager
def baseline_checkout(ref: str) -> Iterator[Path]:
    """The project at git ``ref`` in a temporary worktree (to run an earlier version
    beside this one in the same benchmark run)."""
    path = Path(tempfile.mkdtemp(prefix="fair-baseline-"))
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(path), ref],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True
        )
        shutil.rmtree(path, ignore_errors=True)
