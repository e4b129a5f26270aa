"""The fleet over the raw TCP link (``--link tcp``, ``fair_frontend.wire.tcp``), with real
processes on loopback: two ``fair-frontend core --link tcp`` (``--election none``: both
lead, as a leader and a standby that already leads would) on the session's Triton, and one
``fair-frontend shell --link tcp`` given both. A request through the shell is served; the
core it is connected to is stopped (SIGSTOP: its host's kernel still answers, its process
does not) and the shell notices the silence by the link's heartbeats, within seconds, and
serves through the other; that one is SIGKILLed and the shell goes back to the first
(resumed). The wrong secret, TLS and the core's bounds are tested in-process
(``test_core_link``, ``test_fleet_tls``); the gRPC link's failover under a flood in
``test_fleet``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import yaml
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.kit.testing import aeventually, eventually, free_port
from tests.support import config_dict, start
from tests.test_fleet import SECRET, Core, Shell, _embed


async def test_a_shell_over_tcp_serves_and_follows_a_stopped_or_killed_core(
    triton: EmbeddedTriton, tmp_path: Path
) -> None:
    data = config_dict()
    data["triton"] = {"backends": [{"grpc_url": triton.grpc_url}]}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    cores: list[Core] = []
    shell: Shell | None = None
    try:
        for i in range(2):
            port, metrics = free_port(), free_port()
            args = ["core", "--config", str(config), "--listen", f"127.0.0.1:{port}",
                    "--link", "tcp", "--secret-file", str(secret), "--election", "none",
                    "--metrics-port", str(metrics), "--metrics-host", "127.0.0.1"]  # fmt: skip
            cores.append(Core(start(args, tmp_path / f"core{i}.log"), port, metrics))
        for core in cores:

            def leads(c: Core = core) -> bool:
                return c.ready

            eventually(leads, 60, what="the cores to lead")
        http, grpc = free_port(), free_port()
        args = ["shell", "--link", "tcp", "--secret-file", str(secret), "--host",
                "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc),
                "--log-format", "text"]  # fmt: skip
        for core in cores:
            args += ["--core", f"127.0.0.1:{core.port}"]
        shell = Shell(start(args, tmp_path / "shell.log"), http, grpc)
        eventually(lambda: shell.ready, 60, what="the shell to be ready")

        async def served() -> None:
            result = await _embed(shell.url)
            assert not isinstance(result, InferenceServerException), result

        await served()
        assert f"connected to the core at 127.0.0.1:{cores[0].port}" in shell.proc.output()

        stopped_at = time.monotonic()
        os.kill(cores[0].proc.popen.pid, signal.SIGSTOP)
        await aeventually(
            lambda: f"at 127.0.0.1:{cores[1].port} (failover 1)" in shell.proc.output(),
            60,
            what="the shell to connect to the other core",
        )
        noticed = time.monotonic() - stopped_at
        print(f"the stopped core: the shell connected to the other {noticed:.2f} s later")
        # The heartbeats noticed it (TCP's keepalive cannot: the stopped core's kernel
        # answers its probes).
        assert f"the core at 127.0.0.1:{cores[0].port} sent nothing for" in shell.proc.output()
        await served()

        os.kill(cores[0].proc.popen.pid, signal.SIGCONT)
        cores[1].proc.popen.kill()
        await aeventually(
            lambda: f"at 127.0.0.1:{cores[0].port} (failover 2)" in shell.proc.output(),
            60,
            what="the shell to go back to the first core",
        )
        await served()
    finally:
        if cores:
            os.kill(cores[0].proc.popen.pid, signal.SIGCONT)
        for proc in ([shell.proc] if shell else []) + [c.proc for c in cores]:
            proc.stop()
