"""Run a real Triton Inference Server as a child process: for ``fair-frontend up`` and tests.

Where Triton comes from (``find_tritonserver``):
- a ``tritonserver`` on ``PATH`` (the NGC image ``nvcr.io/nvidia/tritonserver:<yy.mm>-py3``):
  used as is, with its own backend directory and GPU backends;
- else the server inside the ``nvidia-pytriton`` wheel (Triton 2.51 + Python backend). That
  one needs three things the wheel does not arrange (``prepare_backend_directory`` and
  ``EmbeddedTriton._environment`` arrange them; every test that starts a Triton from
  the wheel, ``tests/test_embedded.py`` first, runs this set-up): a backend
  directory ``B/python/`` holding the wheel's ``backends/python/`` files plus the
  ``triton_python_backend_stub`` built for the running Python; the wheel's bundled
  libraries (``nvidia_pytriton.libs``, with ``libcudart``) on ``LD_LIBRARY_PATH``; and this
  interpreter's ``bin/`` first on ``PATH``, so the stub runs model code with this virtual
  environment's interpreter and packages (``python_backend``, torch).

Lifecycle invariants of ``EmbeddedTriton``:
- every port is bound to 127.0.0.1; ports left ``None`` are picked free at the first
  ``start()`` and then kept, so ``restart()`` serves on the same addresses;
- ``start()`` returns only once ``GET /v2/health/ready`` answers 200 (Triton's strict
  readiness: every model loaded) and the metrics endpoint answers, polled at a short
  interval. It raises ``TritonStartError`` as soon as the process exits, at the timeout,
  or when Triton runs without a service (it carries on without metrics if that port is
  taken), naming the models that failed to load and quoting the tail of Triton's log. A
  port found taken is retried with fresh ports when the ports were picked here;
- Triton runs in its own process group (its Python-backend stubs inherit it), and
  ``stop()`` leaves no process of that group behind: SIGTERM (Triton unloads models and
  ends its stubs), then SIGKILL to the whole group after the grace period or if anything
  outlived the server.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import importlib.util
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from fair_frontend.parent_death import popen

LOOPBACK = "127.0.0.1"
log = logging.getLogger(__name__)

TRITON_BINARY = "tritonserver"
STUB_NAME = "triton_python_backend_stub"
LOG_TAIL_LINES = 40
POLL_INTERVAL_S = 0.05
_HEALTH_TIMEOUT_S = 1.0
_PORT_RETRIES = 3  # a freshly picked port can be taken before Triton binds it
_CRASH_RETRIES = 1  # a Triton killed by a signal while it starts is started again once
# Triton's own shutdown bound (its default is 30 s). On SIGTERM it waits for in-flight
# requests but also for every open HTTP keep-alive connection, which clients hold for as
# long as they live: without a bound, stop() would sit out its whole grace period whenever
# a client is still around. Passing --exit-timeout-secs in extra_args overrides this.
EXIT_TIMEOUT_S = 5
_LOAD_FAILED_RE = re.compile(r"failed to load '([^']+)' version (\d+): (.*)")
# Triton exits when it cannot start HTTP or gRPC, but carries on without its metrics
# endpoint ("failed to start Metrics service: ... already in use"): checked at readiness.
_SERVICE_FAILED_RE = re.compile(r"failed to start (\w+) service: ([^\"]*)")
_IN_USE = "already in use"
# Health checks must reach 127.0.0.1 directly, whatever http_proxy says.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class TritonStartError(RuntimeError):
    """Triton exited during start-up or did not become ready in time.

    ``failed_models`` maps each model that failed to load to Triton's reason; the message
    names them and ends with the last lines of Triton's log. ``address_in_use``: Triton
    found one of its ports taken. ``crashed``: a signal ended it (an abort, a segfault).
    """

    def __init__(
        self,
        message: str,
        *,
        failed_models: dict[str, str],
        log_tail: str,
        address_in_use: bool = False,
        crashed: bool = False,
    ) -> None:
        super().__init__(message)
        self.failed_models = failed_models
        self.log_tail = log_tail
        self.address_in_use = address_in_use
        self.crashed = crashed


_DRAW = random.SystemRandom()  # its own source: a test's seeded ``random`` draws alike


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct TCP ports free on ``host`` now, drawn from outside the kernel's
    ephemeral range (``listen_range``): a port the OS hands out for ``bind(0)`` is one it
    may give the next outgoing connection as its own before the server listens on it
    (seen: a shell's "Address already in use" with many processes connecting). Any may
    still be taken by another listener before it is used, which ``EmbeddedTriton.start``
    retries."""
    low, high = listen_range()
    draws = count * 64 if high > low else 0
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count and draws:  # all held bound at once: none drawn twice
            draws -= 1
            port = _DRAW.randrange(low, high)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            stack.enter_context(s)
            ports.append(port)
        while len(ports) < count:  # no room outside the ephemeral range: the OS picks
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def listen_range() -> tuple[int, int]:
    """Ports to draw listening ports from: below the kernel's ephemeral range (Linux's
    ``ip_local_port_range``, 32768-60999 by default) from 10000, else above it; (0, 0)
    where neither leaves 2,000 ports."""
    low, high = 32768, 60999
    with contextlib.suppress(OSError, ValueError):
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    if low - 10000 >= 2000:
        return 10000, low
    if 65535 - high >= 2000:
        return high + 1, 65536
    return 0, 0


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` now."""
    return free_ports(1, host)[0]


def _wheel_tritonserver_dir() -> Path | None:
    """``<site-packages>/pytriton/tritonserver`` of the nvidia-pytriton wheel, if installed.

    Found without importing ``pytriton`` (its import pulls in much more than a path).
    """
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    return root if (root / "bin" / TRITON_BINARY).is_file() else None


def find_tritonserver() -> Path:
    """The server to run: ``tritonserver`` on ``PATH`` if any, else the nvidia-pytriton one."""
    on_path = shutil.which(TRITON_BINARY)
    if on_path:
        return Path(on_path)
    wheel = _wheel_tritonserver_dir()
    if wheel is None:
        raise FileNotFoundError(
            "no tritonserver: none on PATH and nvidia-pytriton is not installed "
            "(pip install nvidia-pytriton==0.7.0, or run in an NGC Triton image)"
        )
    return wheel / "bin" / TRITON_BINARY


def is_wheel_tritonserver(binary: Path) -> bool:
    """Whether ``binary`` is the nvidia-pytriton one (then it needs a prepared backend dir)."""
    wheel = _wheel_tritonserver_dir()
    return wheel is not None and binary.resolve() == (wheel / "bin" / TRITON_BINARY).resolve()


def prepare_backend_directory(dest: Path) -> Path:
    """Fill ``dest/python/`` with the wheel's Python backend plus this Python's stub.

    The stub must sit next to ``libtriton_python.so``: the backend looks for it there.
    Copied (about 3 MB): the module's docstring says what else the wheel's Triton needs.
    """
    wheel = _wheel_tritonserver_dir()
    if wheel is None:
        raise FileNotFoundError("nvidia-pytriton is not installed")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = wheel / "python_backend_stubs" / version / STUB_NAME
    if not stub.is_file():
        raise FileNotFoundError(f"nvidia-pytriton has no Python backend stub for Python {version}")
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for item in (wheel / "backends" / "python").iterdir():
        if item.is_file():
            shutil.copy2(item, python_dir / item.name)
    shutil.copy2(stub, python_dir / STUB_NAME)
    return dest


def _wheel_library_dir() -> Path | None:
    """``<site-packages>/nvidia_pytriton.libs``: the wheel's bundled shared libraries."""
    wheel = _wheel_tritonserver_dir()
    if wheel is None:
        return None
    libs = wheel.parent.parent / "nvidia_pytriton.libs"
    return libs if libs.is_dir() else None


def default_model_repository() -> Path:
    """The project's ``model_repository/`` (next to the package in a source checkout).

    Raises ``FileNotFoundError`` saying to pass ``--model-repository`` when the package is
    installed without its source tree (a non-editable install has no such directory).
    """
    repo = (
        Path(__file__).resolve().parents[3] / "model_repository"
    )  # fair_frontend/backends/triton/
    if not repo.is_dir():
        raise FileNotFoundError(
            f"no model repository at {repo}: fair_frontend seems installed without its source "
            "tree; pass --model-repository pointing at the project's model_repository/"
        )
    return repo


def llm_with_stream_interval(dest: Path, interval: int) -> Path:
    """A model repository in ``dest`` holding a copy of the shipped ``llm`` that sends up to
    ``interval`` tokens per streamed response (its ``stream_interval``, vLLM's); ``dest``."""
    shutil.copytree(default_model_repository() / "llm", dest / "llm")
    config = dest / "llm" / "config.pbtxt"
    text, n = re.subn(
        r'(key: "stream_interval", value: \{ string_value: )"1"',
        rf'\1"{interval}"',
        config.read_text(),
    )
    if n != 1:
        raise RuntimeError(f"{config}: no stream_interval parameter to set")
    config.write_text(text)
    return dest


def process_group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is ``pgid``, from ``/proc``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        # After the command: state, ppid, pgrp, ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def _failed_models(log_text: str) -> dict[str, str]:
    """``{model: reason}`` from Triton's "failed to load 'NAME' version N: ..." lines."""
    failed: dict[str, str] = {}
    for line in log_text.splitlines():
        m = _LOAD_FAILED_RE.search(line)
        if m:
            # Triton's log escapes newlines inside the quoted message (Python tracebacks).
            reason = m.group(3).rstrip('"').replace("\\n", "\n").strip()
            failed.setdefault(m.group(1), reason)
    return failed


# Strong references: a running server must not be garbage-collected out of reach of atexit.
_RUNNING: set[EmbeddedTriton] = set()


@atexit.register
def _stop_all() -> None:
    """Do not leave servers behind when the interpreter exits without stopping them."""
    for server in list(_RUNNING):
        server.stop(grace_s=5.0)


class EmbeddedTriton:
    """One ``tritonserver`` child process serving ``model_repository`` on loopback ports.

    ``model_repository`` may also be a sequence of directories: Triton serves the models of
    all of them (one ``--model-repository`` each; a model name must be unique across them).
    Usable as a context manager (``with EmbeddedTriton(repo) as triton: ...``).
    """

    def __init__(
        self,
        model_repository: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        model_config_name: str | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 120.0,
    ) -> None:
        if isinstance(model_repository, (str, os.PathLike)):
            model_repository = [model_repository]
        self.model_repositories = tuple(Path(r).resolve() for r in model_repository)
        if not self.model_repositories:
            raise ValueError("at least one model repository is needed")
        self.model_repository = self.model_repositories[0]
        self._ports: dict[str, int | None] = {
            "http": http_port,
            "grpc": grpc_port,
            "metrics": metrics_port,
        }
        self._auto_ports = {name for name, port in self._ports.items() if port is None}
        self._workdir = Path(tempfile.mkdtemp(prefix="fair-triton-"))
        self._log_path = Path(log_path) if log_path is not None else self._workdir / "triton.log"
        self.model_config_name = model_config_name
        self.extra_args = tuple(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    # -- addresses -----------------------------------------------------------------------

    def _port(self, name: str) -> int:
        port = self._ports[name]
        if port is None:
            raise RuntimeError("ports are picked at start(); start the server first")
        return port

    @property
    def http_port(self) -> int:
        return self._port("http")

    @property
    def grpc_port(self) -> int:
        return self._port("grpc")

    @property
    def metrics_port(self) -> int:
        return self._port("metrics")

    @property
    def grpc_url(self) -> str:
        return f"{LOOPBACK}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.metrics_port}/metrics"

    @property
    def log_path(self) -> Path:
        """Triton's stdout and stderr (with the stubs' output), appended across restarts.

        By default in a temporary directory that is kept after ``stop()``, to be read.
        """
        return self._log_path

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> EmbeddedTriton:
        """Launch Triton and return once it is ready; ``TritonStartError`` otherwise."""
        if self.is_running():
            raise RuntimeError(f"Triton is already running (pid {self.pid})")
        crashes = 0
        for attempt in range(_PORT_RETRIES + _CRASH_RETRIES):
            pick = [n for n in self._auto_ports if attempt > 0 or self._ports[n] is None]
            for name, port in zip(pick, free_ports(len(pick)), strict=True):
                self._ports[name] = port
            try:
                self._launch_and_wait()
                return self
            except TritonStartError as err:
                # Only ports that we picked ourselves may have been taken meanwhile.
                retry = (
                    self._auto_ports
                    and err.address_in_use
                    and not err.failed_models
                    and attempt - crashes + 1 < _PORT_RETRIES
                )
                # A crash while it starts (its Python backend aborts under CPU starvation:
                # triton-inference-server/server#8882) is tried again, once; a model that
                # failed to load is not a crash to retry.
                if err.crashed and not err.failed_models and crashes < _CRASH_RETRIES:
                    crashes += 1
                    log.warning("tritonserver crashed while starting; starting it again")
                    continue
                if not retry:
                    raise
        raise AssertionError("unreachable")

    def _command(self, binary: Path, backend_dir: Path | None) -> list[str]:
        cmd = [str(binary)]
        cmd += [f"--model-repository={repo}" for repo in self.model_repositories]
        cmd += [
            f"--http-address={LOOPBACK}",
            f"--http-port={self.http_port}",
            f"--grpc-address={LOOPBACK}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={LOOPBACK}",
            f"--metrics-port={self.metrics_port}",
        ]
        if backend_dir is not None:
            cmd.append(f"--backend-directory={backend_dir}")
        if self.model_config_name:
            cmd.append(f"--model-config-name={self.model_config_name}")
        if not any(a.startswith("--exit-timeout-secs") for a in self.extra_args):
            cmd.append(f"--exit-timeout-secs={EXIT_TIMEOUT_S}")
        cmd.extend(self.extra_args)
        return cmd

    def _environment(self, wheel: bool) -> dict[str, str]:
        env = dict(os.environ)
        # The stub runs the first python3 on PATH: make it this environment's interpreter.
        bin_dir = os.path.dirname(sys.executable)
        env["PATH"] = os.pathsep.join(p for p in (bin_dir, env.get("PATH", "")) if p)
        libs = _wheel_library_dir() if wheel else None
        if libs is not None:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (str(libs), env.get("LD_LIBRARY_PATH", "")) if p
            )
        return env

    def _launch_and_wait(self) -> None:
        binary = find_tritonserver()
        wheel = is_wheel_tritonserver(binary)
        backend_dir = None
        if wheel:
            backend_dir = self._workdir / "backends"
            shutil.rmtree(backend_dir, ignore_errors=True)
            prepare_backend_directory(backend_dir)
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "ab") as log:
            log_start = log.tell()
            # stdout and stderr both: the stubs inherit them, so model tracebacks land here.
            # Triton ends with this process, however it ends (``parent_death``): no
            # server left holding the ports and a GPU's memory after a SIGKILL.
            self._proc = popen(
                self._command(binary, backend_dir),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._environment(wheel),
                start_new_session=True,
            )
        _RUNNING.add(self)
        try:
            self._wait_ready(log_start)
        except TritonStartError:
            raise
        except BaseException:  # interrupted while waiting: leave no server behind
            self.stop(grace_s=2.0)
            raise

    def _wait_ready(self, log_start: int) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        ready_url = f"{self.http_url}/v2/health/ready"
        while True:
            code = self._proc.poll()
            if code is not None:
                what = f"tritonserver exited with status {code} during start-up"
                self._fail(what, log_start, crashed=code < 0)
            if self._answers(ready_url):
                service = _SERVICE_FAILED_RE.search(self._log_since(log_start))
                if service:
                    what = f"Triton runs without its {service.group(1)} service"
                    self._fail(f"{what}: {service.group(2).strip()}", log_start)
                # The metrics endpoint comes up after HTTP: wait for it as well.
                if self._answers(self.metrics_url, b"nv_"):
                    return
            if time.monotonic() >= deadline:
                self._fail(
                    f"tritonserver not ready after {self.startup_timeout_s:.0f} s", log_start
                )
            time.sleep(POLL_INTERVAL_S)

    @staticmethod
    def _answers(url: str, marker: bytes = b"") -> bool:
        """Whether ``url`` answers 200 (with ``marker`` in the body, if given)."""
        try:
            with _HTTP.open(url, timeout=_HEALTH_TIMEOUT_S) as response:
                return bool(response.status == 200) and marker in response.read()
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            # Not listening yet (refused), or 400 (HTTPError) until every model is loaded;
            # or not HTTP/1 at all: another server on the port Triton was to take (a gRPC
            # server joins a port through SO_REUSEPORT), whose HTTP/2 preface is no status
            # line. Triton then exits for the taken port, which the next look sees.
            return False

    def _log_since(self, offset: int) -> str:
        try:
            with open(self._log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _fail(self, what: str, log_start: int, *, crashed: bool = False) -> None:
        self.stop(grace_s=2.0)
        full = self._log_since(log_start)
        tail = "\n".join(full.splitlines()[-LOG_TAIL_LINES:])
        failed = _failed_models(full)
        parts = [what]
        if failed:
            parts.append(
                "models that failed to load: "
                + "; ".join(
                    f"'{name}': {(reason.splitlines() or [''])[0]}"
                    for name, reason in failed.items()
                )
            )
        parts.append(f"last {LOG_TAIL_LINES} lines of {self._log_path}:\n{tail}")
        raise TritonStartError(
            "\n".join(parts),
            failed_models=failed,
            log_tail=tail,
            address_in_use=_IN_USE in full,
            crashed=crashed,
        )

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop Triton and everything it started; a no-op when not running."""
        proc = self._proc
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the server leads its own group
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
        # Whatever is left of the group (the server past its grace, orphaned stubs) dies now.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 5.0
        while process_group_members(pgid) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)
        self._proc = None
        _RUNNING.discard(self)
        shutil.rmtree(self._workdir / "backends", ignore_errors=True)

    def restart(self) -> EmbeddedTriton:
        """Stop, then start again on the same ports."""
        self.stop()
        return self.start()

    def __enter__(self) -> EmbeddedTriton:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
