"""Parts by name (``fair_frontend.parts``): the registries of fairness policies, dispatch
modes and backends, each filled by the modules that define the parts."""

from __future__ import annotations

import pytest

from fair_frontend.backends import BACKENDS, DEFAULT_BACKEND, backend
from fair_frontend.backends.triton.forwarder import TritonForwarder
from fair_frontend.core import DISPATCH_MODES, BatchDispatcher, EngineDispatcher
from fair_frontend.core.granted import GrantedDispatcher
from fair_frontend.parts import Registry, UnknownPart
from fair_frontend.scheduler import (
    FAIRNESS_POLICIES,
    DeficitRoundRobin,
    EndpointPolicy,
    FirstComeFirstServed,
    VirtualTokenCounter,
)
from fair_frontend.scheduler.cost import CostUnit


def test_each_part_is_registered_by_its_module_under_its_name() -> None:
    # Importing the packages fills them: a part whose module nobody imports is missing.
    assert dict(DISPATCH_MODES) == {
        "batches": BatchDispatcher,
        "engine": EngineDispatcher,
        "granted": GrantedDispatcher,
    }
    assert sorted(FAIRNESS_POLICIES) == ["drr", "fifo", "vtc"]
    policy = EndpointPolicy(CostUnit.REQUESTS, 8, None, 3.0, ("paid",))
    built = {name: FAIRNESS_POLICIES[name](policy) for name in FAIRNESS_POLICIES}
    assert isinstance(built["drr"], DeficitRoundRobin) and built["drr"].quantum == 3.0
    assert isinstance(built["vtc"], VirtualTokenCounter)
    assert isinstance(built["fifo"], FirstComeFirstServed)


def test_a_registry_refuses_a_second_part_of_a_name_and_lists_the_known_for_an_unknown() -> None:
    parts: Registry[int] = Registry("widget")
    parts.add("b", 2)
    parts.add("a", 1)
    with pytest.raises(ValueError, match="widget 'a' is registered already"):
        parts.add("a", 3)
    assert parts["a"] == 1 and "b" in parts and "c" not in parts and len(parts) == 2
    with pytest.raises(UnknownPart) as info:
        parts["c"]
    assert str(info.value) == "unknown widget 'c' (known: a, b)"
    assert isinstance(info.value, KeyError)  # a mapping's miss


async def test_a_backend_is_built_by_its_kinds_name() -> None:
    assert dict(BACKENDS) == {"triton": TritonForwarder} and DEFAULT_BACKEND == "triton"
    made = backend("127.0.0.1:1", request_timeout_s=7.0, http_url="http://127.0.0.1:2")
    try:
        assert isinstance(made, TritonForwarder)
        assert made.url == "127.0.0.1:1" and made.request_timeout_s == 7.0
        assert made.http is not None  # its HTTP address taken: batches may go there
    finally:
        await made.close()
    with pytest.raises(UnknownPart, match=r"unknown backend 'vllm' \(known: triton\)"):
        backend("127.0.0.1:1", request_timeout_s=1.0, http_url=None, kind="vllm")
