"""TLS on the tenant ports (``server.tls_cert_file`` / ``tls_key_file``): tritonclient over
gRPC with TLS and HTTPS reach the frontend, in one process and through shell processes;
a plain client gets nothing from those ports; a pair that does not load refuses the start
as check-config says. The certificate is made here by the real ``openssl`` (a CA and a
server certificate for 127.0.0.1), against the session's Triton."""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.cli import StartRefused, check_start
from fair_frontend.config import ConfigError
from tests.support import KEYS, RunningFrontend, config_dict, make_config, required_tool
from tests.support import running_frontend as start_frontend

KEY = KEYS["hooli"]


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    required_tool("openssl")
    d = tmp_path_factory.mktemp("tenant-pki")
    days = ("-days", "2")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-subj", "/CN=tenant-ca", *days, cwd=d)  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
            "server.csr", "-subj", "/CN=frontend", cwd=d)  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-extfile", "server.ext", *days,
            cwd=d)  # fmt: skip
    return d


def tls_server(pki: Path) -> dict[str, Any]:
    return {"tls_cert_file": str(pki / "server.pem"), "tls_key_file": str(pki / "server.key")}


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "two-shells"])
def secured(
    triton: EmbeddedTriton, pki: Path, request: pytest.FixtureRequest
) -> Iterator[RunningFrontend]:
    config = make_config(server=tls_server(pki))
    with start_frontend(config, triton, workers=int(request.param)) as running:
        yield running


def test_grpc_with_tls_infers_and_plain_grpc_gets_nothing(
    secured: RunningFrontend, pki: Path
) -> None:
    root = str(pki / "ca.pem")
    client = grpcclient.InferenceServerClient(secured.grpc_url, ssl=True, root_certificates=root)
    try:
        assert client.is_server_ready()
        ids = grpcclient.InferInput("INPUT_IDS", [1, 8], "INT32")
        ids.set_data_from_numpy(np.arange(1, 9, dtype=np.int32).reshape(1, 8))
        answer = client.infer("embed", [ids], headers={"x-api-key": KEY})
        assert answer.as_numpy("EMBEDDING") is not None
    finally:
        client.close()
    plain = grpcclient.InferenceServerClient(secured.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match=r"(?i)unavailable|socket closed"):
            plain.is_server_ready(client_timeout=10)
    finally:
        plain.close()


def test_https_infers_and_plain_http_gets_nothing(secured: RunningFrontend, pki: Path) -> None:
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    body = {
        "inputs": [
            {"name": "INPUT_IDS", "shape": [1, 4], "datatype": "INT32", "data": [1, 2, 3, 4]}
        ]
    }
    request = urllib.request.Request(
        f"https://{secured.http_url}/v2/models/embed/infer",
        data=json.dumps(body).encode(),
        headers={"x-api-key": KEY, "content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60, context=context) as answer:
        assert answer.status == 200
        assert json.load(answer)["outputs"][0]["name"] == "EMBEDDING"
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://{secured.http_url}/v2/health/ready", timeout=10)


def test_a_pair_that_does_not_load_refuses_the_start(pki: Path, tmp_path: Path) -> None:
    """check-config's check (serve's, up's, core's) names the files; one of the two alone
    is a config error."""
    wrong = {**tls_server(pki), "tls_key_file": str(pki / "ca.key")}  # not the cert's key
    with pytest.raises(StartRefused, match=r"server\.tls_cert_file .* cannot load"):
        check_start(make_config(server=wrong))
    missing = {**tls_server(pki), "tls_cert_file": str(tmp_path / "absent.pem")}
    with pytest.raises(StartRefused, match=r"absent\.pem"):
        check_start(make_config(server=missing))
    with pytest.raises(ConfigError, match="both or neither"):
        make_config(server={"tls_cert_file": str(pki / "server.pem")})
    check_start(make_config(server=tls_server(pki)))  # the good pair: no refusal
    assert "server" not in config_dict()  # the other tests' frontends stay plain
