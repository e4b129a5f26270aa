"""The frontend across hosts: ``fair-frontend core`` (the one scheduler, leader-elected
among two or more) and ``fair-frontend shell`` (tenant-facing shells on any host), joined
by gRPC streams authenticated with a shared secret (``fair_frontend.wire.remote``)."""

from __future__ import annotations

DEFAULT_CORE_PORT = 8010  # where a core accepts its shells
# A leader that cannot renew its lease for this long is replaced (``fleet.election``):
# within 0.9 s of a leader's death with the Redis election's default, whose renewals are
# round trips of a millisecond; a Kubernetes Lease holds whole seconds and is renewed
# through the API server, whose writes take longer: 2 s there.
DEFAULT_LEASE_S = 0.8
DEFAULT_KUBERNETES_LEASE_S = 2.0
