"""The core link over mutual TLS (``fair_frontend.wire.remote.Tls``): a core in this
process (``FrontendServer`` with no shells of its own, leading) and a shell's link
(``RemoteLink``) connecting to it with and without the certificates. The certificates are
made here by the real ``openssl``: a CA, the core's (for 127.0.0.1) and a shell's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from fair_frontend.config import parse_config
from fair_frontend.embedded import EmbeddedTriton
from fair_frontend.server import BackgroundServer, FrontendServer, Listen
from fair_frontend.shell.remote import RemoteLink
from fair_frontend.testing import free_port
from fair_frontend.wire.records import Hello
from fair_frontend.wire.remote import SecretError, Tls
from tests.support import config_dict, required_tool

SECRET = b"tls-test-secret-0123456789abcdef"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    required_tool("openssl")
    d = tmp_path_factory.mktemp("pki")
    days = ("-days", "2")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-subj", "/CN=fleet-ca", *days, cwd=d)  # fmt: skip
    for name, san in (("core", "IP:127.0.0.1"), ("shell", "DNS:shell")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                f"{name}.csr", "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-extfile", f"{name}.ext", *days,
                cwd=d)  # fmt: skip
    return d


async def connect(address: str, tls: Tls | None) -> RemoteLink:
    link = RemoteLink([address], SECRET, Hello(0, 0), lambda s: None, lambda: None, lambda: None,
                      tls=tls)  # fmt: skip
    await link._open(address)
    return link


async def test_mutual_tls_admits_only_a_shell_with_a_certificate_of_the_ca(
    triton: EmbeddedTriton, pki: Path
) -> None:
    data = config_dict()
    data["triton"] = {"backends": [{"grpc_url": triton.grpc_url}]}
    server = FrontendServer(parse_config(data), [], Listen(), workers=0)
    port = free_port()
    address = f"127.0.0.1:{port}"
    core_tls = Tls(str(pki / "core.pem"), str(pki / "core.key"), str(pki / "ca.pem"))
    background = BackgroundServer(server)
    with background:
        background.call(server.lead(address, SECRET, core_tls))
        shell = Tls(str(pki / "shell.pem"), str(pki / "shell.key"), str(pki / "ca.pem"))
        link = await connect(address, shell)  # the core's first record came: connected
        assert link.core == address and link.accepting
        await link.aclose()
        # No certificate of its own: the handshake fails, before any secret is read.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await connect(address, Tls(ca=str(pki / "ca.pem")))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # Plain text to a TLS core: no connection either.
        with pytest.raises(grpc.aio.AioRpcError):
            await connect(address, None)
        # A core it cannot verify (another CA): refused by the shell.
        with pytest.raises(grpc.aio.AioRpcError):
            await connect(address, Tls(str(pki / "shell.pem"), str(pki / "shell.key")))
        assert server.shells is not None and len(server.shells.server.connections) == 0


def test_incomplete_tls_files_are_a_clear_error(pki: Path) -> None:
    with pytest.raises(SecretError, match="--tls-cert and --tls-key"):
        Tls(cert=str(pki / "core.pem")).server_credentials()
    with pytest.raises(SecretError, match="cannot read"):
        Tls(str(pki / "missing.pem"), str(pki / "core.key")).server_credentials()
    with pytest.raises(SecretError, match="--tls-cert and --tls-key"):
        Tls(cert=str(pki / "shell.pem"), ca=str(pki / "ca.pem")).channel_credentials()
