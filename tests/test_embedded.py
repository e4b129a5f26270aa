"""The embedded Triton launcher: lifecycle, failure reports, and where Triton comes from.

These start their own servers on tiny model repositories (a numpy-only echo model starts
in about a second, where the real models import torch), so the failure paths are cheap.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml

from fair_frontend.auth import hash_key
from fair_frontend.backends.triton.embedded import (
    STUB_NAME,
    EmbeddedTriton,
    TritonStartError,
    default_model_repository,
    find_tritonserver,
    free_ports,
    is_wheel_tritonserver,
    process_group_members,
)
from fair_frontend.cli import demo_banner
from fair_frontend.kit.testing import eventually
from tests.support import config_dict

ECHO_CONFIG = """
backend: "python"
max_batch_size: 4
input [ { name: "X", data_type: TYPE_INT32, dims: [ -1 ] } ]
output [ { name: "Y", data_type: TYPE_INT32, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""

ECHO_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        {init}

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]
            )
            for r in requests
        ]
"""


def add_model(repo: Path, name: str, init: str = "pass") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(ECHO_CONFIG)
    (repo / name / "1" / "model.py").write_text(ECHO_MODEL.format(init=init))


def stub_pids(pgid: int) -> list[int]:
    pids = []
    for pid in process_group_members(pgid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == STUB_NAME[:15]:
                pids.append(pid)
        except OSError:
            pass
    return pids


def alive(pid: int) -> bool:
    """Exists and is not a zombie (an exited orphan may wait for a reaper that never comes)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_start_serve_restart_stop_leaves_no_process(tmp_path: Path) -> None:
    add_model(tmp_path / "a", "echo")
    add_model(tmp_path / "b", "echo_too")  # several repositories, served side by side
    server = EmbeddedTriton([tmp_path / "a", tmp_path / "b"])
    with server:
        assert server.is_running()
        pid = server.pid
        assert pid is not None
        stubs = stub_pids(pid)
        assert stubs, "the Python backend stub runs in Triton's process group"
        ports = (server.http_port, server.grpc_port, server.metrics_port)
        client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
        x = httpclient.InferInput("X", [1, 3], "INT32")
        x.set_data_from_numpy(np.array([[1, 2, 3]], np.int32))
        assert client.infer("echo", [x]).as_numpy("Y").tolist() == [[1, 2, 3]]
        assert client.infer("echo_too", [x]).as_numpy("Y").tolist() == [[1, 2, 3]]
        client.close()  # else Triton waits (EXIT_TIMEOUT_S) for its keep-alive connection

        server.restart()
        assert (server.http_port, server.grpc_port, server.metrics_port) == ports
        assert server.pid != pid and not process_group_members(pid)
        client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
        assert client.infer("echo", [x]).as_numpy("Y").tolist() == [[1, 2, 3]]
        client.close()
        pid = server.pid
        assert pid is not None
        stubs = stub_pids(pid)
    assert not server.is_running() and server.pid is None
    assert not process_group_members(pid)
    assert not any(alive(s) for s in stubs)
    assert "Started GRPCInferenceService at 127.0.0.1:" in server.log_path.read_text()
    server.stop()  # idempotent


def test_a_model_failing_to_load_is_named_with_the_log_tail(tmp_path: Path) -> None:
    add_model(tmp_path, "fine")
    add_model(tmp_path, "broken", init='raise RuntimeError("weights are missing")')
    server = EmbeddedTriton(tmp_path)
    with pytest.raises(TritonStartError) as info:
        server.start()
    err = info.value
    assert set(err.failed_models) == {"broken"}
    assert "weights are missing" in err.failed_models["broken"]
    message = str(err)
    assert "'broken'" in message and "weights are missing" in message
    assert err.log_tail and err.log_tail in message
    assert "last 40 lines" in message
    assert not server.is_running()


@pytest.mark.parametrize("crashes", [1, 2])
def test_a_triton_that_crashes_while_starting_is_started_again_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crashes: int
) -> None:
    """Triton's Python backend can abort while Triton starts on a starved machine
    (``boost::interprocess::lock_exception``, triton-inference-server/server#8882; a fresh
    clone's suite saw it). A start-up ended by a signal is tried again, once; a second
    crash is the start's error, said as such. Here a wrapper aborts (SIGABRT) its first
    ``crashes`` launches, then runs Triton's own command."""
    add_model(tmp_path / "repo", "fine")
    count = tmp_path / "launches"
    command = EmbeddedTriton._command
    script = (
        'n=$(($(cat "$0" 2>/dev/null || echo 0) + 1)); echo $n > "$0"; '
        f'if [ $n -le {crashes} ]; then kill -ABRT $$; fi; exec "$@"'
    )

    def wrapped(self: EmbeddedTriton, binary: Path, backend_dir: Path | None) -> list[str]:
        return ["sh", "-c", script, str(count), *command(self, binary, backend_dir)]

    monkeypatch.setattr(EmbeddedTriton, "_command", wrapped)
    server = EmbeddedTriton(tmp_path / "repo")
    if crashes > 1:
        with pytest.raises(TritonStartError, match="exited with status -6") as info:
            server.start()
        assert info.value.crashed and not server.is_running()
        assert count.read_text().strip() == "2"
        return
    try:
        server.start()
        assert server.is_running() and count.read_text().strip() == "2"
    finally:
        server.stop()


def test_gpu_configs_are_selected_by_model_config_name() -> None:
    # No GPU here: Triton rejects every KIND_GPU config, which shows it read configs/gpu.pbtxt.
    server = EmbeddedTriton(default_model_repository(), model_config_name="gpu")
    with pytest.raises(TritonStartError) as info:
        server.start()
    assert set(info.value.failed_models) == {"embed", "generate", "llm", "rerank"}
    assert all("KIND_GPU" in reason for reason in info.value.failed_models.values())


def test_start_times_out_and_kills_a_server_that_never_gets_ready(tmp_path: Path) -> None:
    add_model(tmp_path, "slow", init="import time; time.sleep(60)")
    server = EmbeddedTriton(tmp_path, startup_timeout_s=3.0)
    with pytest.raises(TritonStartError, match="not ready after 3 s"):
        server.start()
    assert not server.is_running()


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_tritonserver_prefers_one_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _executable(tmp_path / "tritonserver")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    assert find_tritonserver() == fake
    assert not is_wheel_tritonserver(fake)


def test_find_tritonserver_falls_back_to_the_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    found = find_tritonserver()
    assert found.parts[-4:] == ("pytriton", "tritonserver", "bin", "tritonserver")
    assert is_wheel_tritonserver(found)


def test_default_model_repository_holds_both_models() -> None:
    repo = default_model_repository()
    assert (repo / "embed" / "config.pbtxt").is_file()
    assert (repo / "generate" / "config.pbtxt").is_file()


def test_a_taken_port_is_a_start_error_even_for_metrics(tmp_path: Path) -> None:
    # Triton exits when its HTTP or gRPC port is taken, but would run on without metrics.
    add_model(tmp_path, "echo")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = EmbeddedTriton(tmp_path, metrics_port=taken.getsockname()[1])
        with pytest.raises(TritonStartError, match="Metrics") as info:
            server.start()
    assert info.value.address_in_use
    assert not server.is_running()


def test_a_grpc_server_on_the_http_port_is_a_taken_port_not_a_parse_error(tmp_path: Path) -> None:
    """A gRPC server holds the port Triton's HTTP is to take (a fresh clone beside another
    saw one join a just-picked port): the health probe meets its HTTP/2 preface, which is no
    HTTP/1 status line. Before, that probe's ``BadStatusLine`` ended the start as an error of
    its own; now the start sees Triton exit for the taken port, as for any taken port."""
    add_model(tmp_path, "echo")
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        server = EmbeddedTriton(tmp_path, http_port=port)
        with pytest.raises(TritonStartError) as info:
            server.start()
        assert info.value.address_in_use, info.value
        assert not server.is_running()
    finally:
        grpc_server.stop(None)


# ---- `fair-frontend up`: demo mode, said loudly, and only there ----------------------------


class UpProcess:
    """``fair-frontend up ARGS`` as a process, its output read line by line."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fair_frontend.cli", "up", *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def until_serving(self, timeout_s: float = 120.0) -> str:
        """Its output up to "Ctrl-C stops it." (the announcement's last line)."""
        seen: list[str] = []
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("up did not serve in time:\n" + "".join(seen)) from None
            if line is None:
                raise AssertionError(f"up exited with {self.proc.wait()}:\n" + "".join(seen))
            seen.append(line)
            if line.startswith("Ctrl-C stops it."):
                return "".join(seen)

    def stop(self) -> None:
        """SIGTERM: the frontend drains, Triton stops, the process exits 0."""
        if self.proc.poll() is not None:
            return  # it ended already (until_serving said how)
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        rest = []
        while (line := self.lines.get(timeout=10)) is not None:
            rest.append(line)
        assert code == 0, "".join(rest)


UP_PORTS = ["--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--workers", "1"]


def test_up_runs_the_example_config_in_demo_mode_and_says_so(tmp_path: Path) -> None:
    """``make run``'s command (``up --config examples/config.yaml``): serves, on loopback,
    and says loudly that the published demo keys are in force (at start, in the log, and
    framed beside the example call); the answer to that call is real."""
    add_model(tmp_path / "repo", "echo")
    example = Path(__file__).resolve().parent.parent / "examples" / "config.yaml"
    up = UpProcess(
        ["--config", str(example), "--model-repository", str(tmp_path / "repo"), *UP_PORTS],
        tmp_path,
    )
    try:
        out = up.until_serving()
        assert out.count("DEMO MODE") >= 2, out  # the log line at start, the framed one
        assert "acme-demo-key, globex-demo-key, initech-demo-key, umbrella-demo-key" in out
        assert "beyond this machine" not in out  # the example listens on loopback
        http = re.search(r"HTTP +http://127\.0\.0\.1:(\d+)", out)
        assert http, out
        req = urllib.request.Request(
            f"http://127.0.0.1:{http.group(1)}/v2/health/ready", method="GET"
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(req, timeout=10) as response:
            assert response.status == 200
        assert "/v2/models/stats   (operator-only" in out
    finally:
        up.stop()


def own_group_children(parent: int) -> list[int]:
    """Live children of ``parent`` that lead a process group of their own (Triton, which
    ``EmbeddedTriton`` starts in a new session), from ``/proc``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        state, ppid, pgrp = fields[0], int(fields[1]), int(fields[2])  # after the command
        if state not in ("Z", "X") and ppid == parent and pgrp == int(entry):
            found.append(int(entry))
    return found


def test_a_killed_up_takes_its_triton_with_it(tmp_path: Path) -> None:
    """SIGKILL leaves ``up`` no moment to stop the Triton it started (from a worker thread
    of its event loop, as ``make run`` does); the kernel ends it (``parent_death``): the
    server and its Python stubs exit, nothing is left holding the ports."""
    add_model(tmp_path / "repo", "echo")
    example = Path(__file__).resolve().parent.parent / "examples" / "config.yaml"
    up = UpProcess(
        ["--config", str(example), "--model-repository", str(tmp_path / "repo"), *UP_PORTS],
        tmp_path,
    )
    triton: int | None = None
    try:
        up.until_serving()
        (triton,) = own_group_children(up.proc.pid)
        assert "tritonserver" in Path(f"/proc/{triton}/cmdline").read_bytes().decode()
        stubs = stub_pids(triton)
        assert stubs, "the Python backend stub runs in Triton's process group"
        up.proc.kill()
        up.proc.wait()
        eventually(
            lambda: not process_group_members(triton) and not any(alive(s) for s in stubs),
            60,
            what="Triton and its stubs to end with the process that started them",
        )
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
            up.proc.wait()
        if triton is not None:  # where the test failed: leave no server behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(triton, signal.SIGKILL)


def test_up_with_an_operators_config_is_not_demo_mode(tmp_path: Path) -> None:
    add_model(tmp_path / "repo", "echo")
    config = config_dict(
        tenants={"acme": {"tier": "enterprise", "api_keys": [hash_key("an-own-key")]}}
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    up = UpProcess(
        [
            *("--config", str(path), "--model-repository", str(tmp_path / "repo")),
            *("--host", "127.0.0.1", *UP_PORTS),
        ],
        tmp_path,
    )
    try:
        out = up.until_serving()
        assert "DEMO MODE" not in out and "demo-key" not in out, out
    finally:
        up.stop()


def test_the_demo_banner_says_when_the_ports_face_the_network() -> None:
    assert "beyond this machine" in demo_banner("0.0.0.0")
    assert "beyond this machine" not in demo_banner("127.0.0.1")


def test_listening_ports_are_drawn_where_no_outgoing_connection_takes_one() -> None:
    """Ports handed to servers come from outside the kernel's ephemeral range, so the
    connections a test's processes open cannot take one between the draw and the listen
    (a shell's "Address already in use" on a fresh clone); distinct, and free."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = free_ports(64)
    assert len(set(ports)) == 64
    assert not any(low <= p <= high for p in ports), (low, high, ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
