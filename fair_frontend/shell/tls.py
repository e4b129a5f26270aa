"""TLS on the tenant ports (``server.tls_cert_file``, ``server.tls_key_file``): the HTTP
listener's ``ssl.SSLContext`` and the gRPC listener's credentials, from the same PEM
files, loaded as each listening process starts (the in-process shell, each shell
process). Unset, both listeners are plain, for a terminator in front."""

from __future__ import annotations

import ssl

import grpc

from fair_frontend.config import ConfigError, Server

SOURCE = "(server)"


def _files(server: Server) -> tuple[str, str] | None:
    if server.tls_cert_file is None or server.tls_key_file is None:
        return None
    return server.tls_cert_file, server.tls_key_file


def http_context(server: Server) -> ssl.SSLContext | None:
    """The HTTPS context of the tenant HTTP port, or None (plain). ``ConfigError`` naming
    the files where they cannot be read or do not hold a certificate and its key."""
    files = _files(server)
    if files is None:
        return None
    cert, key = files
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise ConfigError(
            SOURCE,
            [f"server.tls_cert_file {cert} / tls_key_file {key}: cannot load: {reason}"],
        ) from None
    context.set_alpn_protocols(["http/1.1"])
    return context


def grpc_credentials(server: Server) -> grpc.ServerCredentials | None:
    """The gRPC port's TLS credentials, or None (plain); loaded through ``http_context``
    first, so a bad pair is said the same way for both ports."""
    files = _files(server)
    if files is None or http_context(server) is None:
        return None
    cert, key = files
    with open(cert, "rb") as c, open(key, "rb") as k:
        return grpc.ssl_server_credentials([(k.read(), c.read())])
