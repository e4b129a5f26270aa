"""The core link over mutual TLS (``fair_frontend.wire.remote.Tls``): a core in this
process (``FrontendServer`` with no shells of its own, leading) and a shell's link
(``RemoteLink``) connecting to it with and without the certificates. The certificates are
made here by the real ``openssl``: a CA, the core's (for 127.0.0.1) and a shell's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import parse_config
from fair_frontend.kit.testing import aeventually, free_port
from fair_frontend.server import BackgroundServer, FrontendServer, Listen
from fair_frontend.shell.remote import RemoteLink
from fair_frontend.wire.records import LINK_VERSION, Hello
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


async def connect(address: str, tls: Tls | None, link: str = "grpc") -> RemoteLink:
    remote = RemoteLink([address], SECRET, Hello(0, 0, LINK_VERSION), lambda s: None, lambda: None,
                        lambda: None, tls=tls, link=link)  # fmt: skip
    await remote._open(address)
    return remote


@pytest.mark.parametrize("link", ["grpc", "tcp"])
async def test_mutual_tls_admits_only_a_shell_with_a_certificate_of_the_ca(
    triton: EmbeddedTriton, pki: Path, link: str
) -> None:
    """On either link (gRPC, raw TCP): gRPC names a failed connection UNAVAILABLE, the
    TCP link's is an OSError (the TLS handshake's, or the connection closed)."""
    data = config_dict()
    data["triton"] = {"backends": [{"grpc_url": triton.grpc_url}]}
    server = FrontendServer(parse_config(data), [], Listen(), workers=0)
    port = free_port()
    address = f"127.0.0.1:{port}"
    core_tls = Tls(str(pki / "core.pem"), str(pki / "core.key"), str(pki / "ca.pem"))
    failed = grpc.aio.AioRpcError if link == "grpc" else OSError
    background = BackgroundServer(server)
    with background:
        background.call(server.lead(address, SECRET, core_tls, link))
        shell = Tls(str(pki / "shell.pem"), str(pki / "shell.key"), str(pki / "ca.pem"))
        remote = await connect(address, shell, link)  # the core's first record came
        assert remote.core == address and remote.accepting
        await remote.aclose()
        # No certificate of its own: the handshake fails, before any secret is read.
        with pytest.raises(failed) as refused:
            await connect(address, Tls(ca=str(pki / "ca.pem")), link)
        if link == "grpc":
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # Plain text to a TLS core: no connection either.
        with pytest.raises(failed):
            await connect(address, None, link)
        # A core it cannot verify (another CA): refused by the shell.
        with pytest.raises(failed):
            await connect(address, Tls(str(pki / "shell.pem"), str(pki / "shell.key")), link)
        assert server.shells is not None
        assert server.shells.server.refused == 0  # no secret was ever read from them

        def gone() -> bool:
            assert server.shells is not None
            return len(server.shells.server.connections) == 0

        await aeventually(gone, 10, what="the shells gone")


def test_incomplete_tls_files_are_a_clear_error(pki: Path) -> None:
    with pytest.raises(SecretError, match="--tls-cert and --tls-key"):
        Tls(cert=str(pki / "core.pem")).server_credentials()
    with pytest.raises(SecretError, match="cannot read"):
        Tls(str(pki / "missing.pem"), str(pki / "core.key")).server_credentials()
    with pytest.raises(SecretError, match="--tls-cert and --tls-key"):
        Tls(cert=str(pki / "shell.pem"), ca=str(pki / "ca.pem")).channel_credentials()
