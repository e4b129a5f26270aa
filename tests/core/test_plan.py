"""An endpoint's plan (``fair_frontend.endpoint.plan``): the facts every room used to
derive from the config and the model's description, resolved once, equal to what those
derivations gave."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, cast

import pytest
from dispatch_support import embed_info, plan_of
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from fair_frontend.auth import KeyRing
from fair_frontend.backends.protocol import BackendServer
from fair_frontend.backends.triton.model_config import model_info
from fair_frontend.config import Config, CostUnit, Endpoint, parse_config
from fair_frontend.core.dispatch import DISPATCH_MODES
from fair_frontend.endpoint import EndpointPlan, plan
from fair_frontend.models import ModelInfo
from fair_frontend.shell.gateway import Gateway
from fair_frontend.shell.link import CoreLink
from fair_frontend.wire.framing import encode, to_shell
from fair_frontend.wire.records import InfoAnswer, ModelDescribed
from tests.support import config_dict

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
SHIPPED = ("embed", "rerank", "generate", "llm")


def shipped_info(model: str, *, instances: int | None = None) -> ModelInfo:
    """The shipped model's description, from its config.pbtxt as Triton gives it."""
    cfg = text_format.Parse(
        (REPOSITORY / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
    )
    if instances is not None:
        cfg.instance_group[0].count = instances
    return model_info(cfg)


def derived(endpoint: Endpoint, info: ModelInfo) -> dict[str, Any]:
    """What the rooms derived before the plan, each as it did (``core/plan.py``'s
    ``endpoint_policy`` and ``dispatch_mode``, ``batching.one_hop``, the dispatchers'
    ``_slots``, ``Core._runtime``, the shells' ``info.bounds(config.endpoint(model))``,
    ``batching.batch_key``'s parts)."""
    engine = endpoint.max_inflight is not None
    one_hop = endpoint.unary == "one_hop" and not info.passthrough and endpoint.max_inflight is None
    configured = info.max_batch_size if endpoint.max_batch_size is None else endpoint.max_batch_size
    if not info.batching or info.passthrough or configured == 0 or engine:
        rows = 0
    else:
        rows = min(configured, info.max_batch_size)
    if endpoint.max_inflight is not None:
        slots = endpoint.max_inflight
    else:
        batches = endpoint.max_inflight_batches
        slots = batches if batches is not None else info.instances
    return {
        "mode": "engine" if engine else "granted" if one_hop else "batches",
        "engine": engine,
        "one_hop": one_hop,
        "max_batch_size": rows,
        "slots": slots,
        "quantum": endpoint.effective_quantum(rows),
        "cost": endpoint.cost,
        "fairness": endpoint.fairness_policy(),
        "bounds": info.bounds(endpoint),
        "token_input": endpoint.token_input,
        "token_output": endpoint.token_output,
        "tokenizer": endpoint.tokenizer,
        # batching.batch_key's, per request: mergeable_padding, _max_rows, the per-row one
        "padded": frozenset(
            name
            for name, pad in endpoint.padding.inputs.items()
            if info.takes_rows or pad.lengths_field is None
        ),
        "key_rows": (
            max(1, info.max_batch_size)
            if not endpoint.max_batch_size
            else max(
                1, min(endpoint.max_batch_size, info.max_batch_size or endpoint.max_batch_size)
            )
        ),
        "per_row_parameter": (
            endpoint.max_tokens_parameter if info.batching and info.takes_rows else None
        ),
    }


def facts(p: EndpointPlan) -> dict[str, Any]:
    return {name: getattr(p, name) for name in derived(p.endpoint, p.info)}


@pytest.fixture(scope="module")
def example() -> Config:
    return parse_config(config_dict())


@pytest.mark.parametrize("model", SHIPPED)
def test_each_example_endpoint_plans_what_the_old_derivations_gave(
    example: Config, model: str
) -> None:
    info = shipped_info(model)
    p = plan(example, model, info)
    assert (p.model, p.info) == (model, info)
    assert p.endpoint is example.endpoint(model)
    assert facts(p) == derived(p.endpoint, info)
    assert p.mode in DISPATCH_MODES
    policy = p.policy  # the scheduler's parameters, of the same facts
    assert (policy.max_batch_size, policy.quantum, policy.cost, policy.fairness) == (
        p.max_batch_size,
        p.quantum,
        p.cost,
        p.fairness,
    )
    assert policy.slots == p.endpoint.max_inflight
    assert policy.tiers == tuple(example.tiers)


def test_the_example_plans_llm_as_an_engine_and_embed_in_one_hop(example: Config) -> None:
    llm = plan(example, "llm", shipped_info("llm"))
    assert (llm.mode, llm.engine, llm.one_hop, llm.max_batch_size, llm.slots) == (
        "engine",
        True,
        False,
        0,
        64,
    )
    assert (llm.cost, llm.fairness, llm.token_output) == (CostUnit.TOKENS, "vtc", "text_output")
    assert llm.policy.slots == 64
    embed = plan(example, "embed", shipped_info("embed", instances=3))
    assert (embed.mode, embed.engine, embed.one_hop, embed.max_batch_size, embed.slots) == (
        "granted",
        False,
        True,
        32,
        3,  # one batch per model instance
    )
    assert (embed.quantum, embed.fairness, embed.token_input) == (4096.0, "drr", "INPUT_IDS")
    assert embed.bounds.max_model_len == 4096
    generate = plan(example, "generate", shipped_info("generate"))
    assert (generate.max_batch_size, generate.quantum, generate.cost) == (8, 1.0, CostUnit.REQUESTS)


def test_models_that_keep_tritons_semantics_or_are_not_in_the_config_plan_as_before() -> None:
    # A stateful model under the default endpoint: one request per batch, relayed.
    stateful = embed_info(sequence_batching=True)
    p = plan_of(Endpoint(), stateful, "other")
    assert facts(p) == derived(Endpoint(), stateful)
    assert (p.mode, p.max_batch_size, p.one_hop) == ("batches", 0, False)
    # Relayed by config, with its own batches in flight and rows below the model's.
    relayed = Endpoint(unary="relay", max_inflight_batches=2, max_batch_size=4)
    p = plan_of(relayed, embed_info(instances=3))
    assert facts(p) == derived(relayed, embed_info(instances=3))
    assert (p.mode, p.slots, p.max_batch_size) == ("batches", 2, 4)
    # A model the config does not name takes the default endpoint.
    config = parse_config({"tiers": ["paid"], "default_endpoint": {"max_batch_size": 5}})
    p = plan(config, "unnamed", embed_info())
    assert p.endpoint is config.default_endpoint and p.max_batch_size == 5


def test_a_reload_with_a_changed_endpoint_gives_a_new_plan(example: Config) -> None:
    info = shipped_info("embed")
    before = plan(example, "embed", info)
    data = config_dict()
    data["endpoints"]["embed"]["max_batch_size"] = 16
    data["endpoints"]["embed"]["unary"] = "relay"
    after = plan(parse_config(data), "embed", info)
    assert after is not before and after.endpoint is not before.endpoint
    assert (before.max_batch_size, before.mode) == (32, "granted")
    assert (after.max_batch_size, after.mode, after.one_hop) == (16, "batches", False)
    assert facts(after) == derived(after.endpoint, info)
    # The same config and description plan the same facts again (a plan holds no state).
    assert facts(plan(example, "embed", info)) == facts(before)


class Lookups:
    """A shell's link as far as ``Gateway.plan`` reads it: the model's description, one
    lookup counted each."""

    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self.asked = 0

    async def model_info(self, model: str) -> ModelInfo:
        self.asked += 1
        return self.info


async def test_a_shell_keeps_one_plan_per_model_until_its_config_or_the_description_changes() -> (
    None
):
    config = parse_config(config_dict())
    info = shipped_info("embed")
    link = Lookups(info)
    gateway = Gateway(
        config, KeyRing.from_config(config), cast(CoreLink, link), cast(BackendServer, None)
    )
    assert gateway.kept_wire_bound("embed") == config.endpoint("embed").max_wire_bytes
    assert gateway.precheck("embed") is None  # no description yet
    first = await gateway.plan("embed")
    assert link.asked == 1 and first.info is info and first.endpoint is config.endpoint("embed")
    assert facts(first) == derived(first.endpoint, info)
    assert await gateway.plan("embed") is first and link.asked == 1  # kept
    assert gateway.kept_wire_bound("embed") == first.bounds.wire_bytes
    assert await gateway.wire_bound("embed") == info.bounds(first.endpoint).wire_bytes
    # A reload: the plan is made again from the new config (the description is kept).
    data = config_dict()
    data["endpoints"]["embed"]["unary"] = "relay"
    reloaded = parse_config(data)
    gateway.configure(reloaded, KeyRing.from_config(reloaded))
    second = await gateway.plan("embed")
    assert second is not first and second.endpoint is reloaded.endpoint("embed")
    assert (first.one_hop, second.one_hop, link.asked) == (True, False, 1)
    assert await gateway.plan("embed") is second
    # Another description of the model: planned again from it.
    gateway._infos["embed"] = changed = shipped_info("embed", instances=2)
    third = await gateway.plan("embed")
    assert third.info is changed and third.slots == 2 and second.slots == 1


def test_the_link_record_names_every_field_of_a_models_description() -> None:
    """``ModelDescribed`` is the one list of what crosses (``ModelInfo.described`` and
    ``of`` copy its fields by name): a field added to ``ModelInfo`` and not to the record
    would reach the shells as its default."""
    fields = {f.name for f in dataclasses.fields(ModelInfo) if f.init}
    assert set(ModelDescribed.__struct_fields__) == fields


@pytest.mark.parametrize("model", SHIPPED)
def test_a_models_description_crosses_the_link_in_the_frontends_words(
    model: str, example: Config
) -> None:
    """The core answers a shell's ``InfoQuery`` with the ``ModelInfo`` it read from
    Triton's config, its fields and not Triton's bytes: the shell's copy is equal, and so
    is the plan made of it."""
    info = dataclasses.replace(shipped_info(model, instances=3), versions=("1", "3"))
    frame = encode(InfoAnswer(7, info.described()))
    answer = to_shell.decode(frame[4:])
    assert isinstance(answer, InfoAnswer) and answer.model is not None
    received = ModelInfo.of(answer.model)
    assert received == info
    assert list(received.inputs) == list(info.inputs)
    assert list(received.outputs) == list(info.outputs)
    endpoint = example.endpoint(model)
    assert facts(plan(example, model, received)) == facts(plan(example, model, info))
    assert received.bounds(endpoint) == info.bounds(endpoint)
