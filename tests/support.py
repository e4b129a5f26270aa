"""Helpers shared by the tests that run the frontend against a real Triton."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import urllib.request
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fair_frontend.config import Config, parse_config, resolve_relative_paths
from fair_frontend.embedded import EmbeddedTriton
from fair_frontend.server import BackgroundServer, FrontendServer, Listen

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_CONFIG = ROOT / "examples" / "config.yaml"
TEST_MODEL_REPOSITORY = Path(__file__).resolve().parent / "model_repository"

# Test tenants and their keys (plain: these are test fixtures, not secrets).
KEYS = {
    "acme": "acme-test-key",
    "globex": "globex-test-key",
    "initech": "initech-test-key",
    "umbrella": "umbrella-test-key",
    "hooli": "hooli-test-key",
}
TIERS = {
    "acme": "enterprise",
    "globex": "enterprise",
    "initech": "standard",
    "umbrella": "trial",
    "hooli": "standard",
}


def config_dict(**overrides: Any) -> dict[str, Any]:
    """The example config's endpoints and tiers, test tenants, no rate limits, no throttle,
    every model open to every tenant ("*").

    Tests of admission set their own limits and targets; the others test scheduling and
    must not depend on how fast these machines serve today.
    """
    data: dict[str, Any] = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    resolve_relative_paths(data, EXAMPLE_CONFIG.parent)
    data.pop("tier_limits", None)
    # The listeners are the tests' own (``Listen``), and statistics stay where Triton
    # keeps them (keyed, on the tenant ports) unless a test says otherwise.
    data.pop("server", None)
    # Every model open to every tier: the tests of model access close them themselves.
    data["tier_models"] = {tier: ["*"] for tier in data["tiers"]}
    for endpoint in data["endpoints"].values():
        endpoint["throttle"] = False
    data["default_endpoint"] = {"throttle": False}
    data["tenants"] = {name: {"tier": TIERS[name], "api_keys": [key]} for name, key in KEYS.items()}
    data.update(overrides)
    return data


def make_config(**overrides: Any) -> Config:
    return parse_config(config_dict(**overrides))


def ids_input(mod: Any, ids: np.ndarray, *, binary: bool = True, name: str = "INPUT_IDS") -> Any:
    """An INT32 token-id input for tritonclient's grpc, grpc.aio or http module."""
    inp = mod.InferInput(name, list(ids.shape), "INT32")
    if mod.__name__.endswith("http"):
        inp.set_data_from_numpy(ids, binary_data=binary)
    else:
        inp.set_data_from_numpy(ids)
    return inp


@dataclass
class RunningFrontend:
    """A frontend on its own event loop in a thread, in front of a real Triton."""

    server: FrontendServer
    background: BackgroundServer

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.server.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.server.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.server.metrics_port}/metrics"

    @property
    def frontend(self) -> Any:
        """The core (in this process whatever the number of shells)."""
        return self.server.frontend

    @property
    def gateway(self) -> Any:
        """The in-process shell's gateway (``workers=1`` only)."""
        return self.server.gateway

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        """Run a coroutine on the frontend's loop (to read its state safely)."""
        return self.background.call(coro, timeout)

    async def acall(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """``call`` for async tests: awaits without blocking the test's own event loop."""
        future = asyncio.run_coroutine_threadsafe(coro, self.background.loop)
        return await asyncio.wrap_future(future)

    async def batch_count(self, model: str) -> int:
        runtime = self.frontend.runtimes.get(model)
        return 0 if runtime is None else runtime.batches_sent

    async def counters(self, model: str) -> Any:
        return self.frontend.runtimes[model].scheduler.counters


@contextlib.contextmanager
def running_frontend(
    config: Config,
    triton: EmbeddedTriton | str,
    *,
    workers: int = 1,
    listen: Listen | None = None,
) -> Iterator[RunningFrontend]:
    """The frontend, its core on a thread of this process (its state readable here), with
    ``workers`` shells: 1 in this process too, more as processes of their own.

    ``triton``: a running ``EmbeddedTriton`` (batches go over its HTTP endpoint, as in
    ``up`` mode, unless the config names one), or a gRPC address (batches over gRPC).
    ``listen``: addresses and ports (default: every listener on a free loopback port)."""
    url = triton if isinstance(triton, str) else triton.grpc_url
    if not isinstance(triton, str) and config.triton.http_url is None:
        http = config.triton.model_copy(update={"http_url": triton.http_url})
        config = config.model_copy(update={"triton": http})
    server = FrontendServer(config, url, listen or Listen(), workers=workers)
    background = BackgroundServer(server)
    with background:
        yield RunningFrontend(server, background)


async def gather_settled(*aws: Any) -> list[Any]:
    """asyncio.gather that returns exceptions as values."""
    return list(await asyncio.gather(*aws, return_exceptions=True))


def identity_request(payload: bytes) -> bytes:
    """A serialized ``ModelInferRequest`` to ``simple_identity``: one BYTES element,
    ``payload`` (its size is the request's size, for tests of message bounds)."""
    from tritonclient.grpc import service_pb2

    msg = service_pb2.ModelInferRequest(model_name="simple_identity")
    msg.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, 1])
    msg.raw_input_contents.append(struct.pack("<I", len(payload)) + payload)
    return msg.SerializeToString()


def metric_sum(running: RunningFrontend, name: str, **labels: str) -> float:
    """The sum of the frontend's ``name`` samples whose labels include ``labels``, from
    one scrape of its /metrics (which counts what the shells answered themselves first)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(running.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )
