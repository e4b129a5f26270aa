"""The frontend across hosts: ``fair-frontend core`` (the one scheduler, leader-elected
among two or more) and ``fair-frontend shell`` (tenant-facing shells on any host), joined
by gRPC streams authenticated with a shared secret (``fair_frontend.wire.remote``)."""

from __future__ import annotations

DEFAULT_CORE_PORT = 8010  # where a core accepts its shells
DEFAULT_LEASE_S = 2.0  # a leader that cannot renew its lease for this long is replaced
SECRET_ENV = "FAIR_FRONTEND_CORE_SECRET"  # the shared secret, where no --secret-file is given
