"""Sampling parameters at the door (``fair_frontend.sampling``, called from ``validate``).

Unit tests, no Triton: the door's rules are vLLM's, in its words, naming the key and the
rule; the door and the model (``python_backend.llm``) answer every generated value alike,
so a direct client and a client of the frontend are refused the same requests; the
shipped configs turn the rules on for ``llm``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2

from fair_frontend.backends.triton.model_config import model_info
from fair_frontend.config import ConfigError, load_config, parse_config
from fair_frontend.errors import InvalidArgument
from fair_frontend.models import ModelInfo, validate
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.sampling import SamplingRules, check_sampling
from python_backend.llm import decode_sampling_parameters
from python_backend.rows import RequestError
from tests.sampling_strategies import LLM_KEYS, PARAMS, SAMPLING
from tests.support import ROOT, config_dict, planned

LLM_CONFIG = ROOT / "model_repository" / "llm" / "config.pbtxt"
SHIPPED = [ROOT / "examples" / "config.yaml", ROOT / "docker" / "config.yaml"]


def llm_info() -> ModelInfo:
    """The shipped llm's description, read from its config.pbtxt (as from Triton)."""
    cfg = text_format.Parse(LLM_CONFIG.read_text(), model_config_pb2.ModelConfig())
    return model_info(cfg)


LLM = llm_info()
ENDPOINT = load_config(SHIPPED[0]).endpoints["llm"]
LLM_PLAN = planned(LLM, ENDPOINT)


def llm_request(sampling: dict[str, Any] | str | None = None, **parameters: Any) -> InferRequest:
    inputs = [Tensor("text_input", "BYTES", (1,), np.array([b"Once upon a time"], dtype=object))]
    if sampling is not None:
        text = sampling if isinstance(sampling, str) else json.dumps(sampling)
        value = np.array([text.encode()], dtype=object)
        inputs.append(Tensor("sampling_parameters", "BYTES", (1,), value))
    return InferRequest(model="llm", inputs=inputs, parameters=dict(parameters))


def refused(req: InferRequest) -> str:
    with pytest.raises(InvalidArgument) as info:
        validate(req, LLM_PLAN)
    return info.value.message


def test_the_shipped_llm_declares_its_context_and_the_configs_turn_the_rules_on() -> None:
    assert LLM.max_model_len == 512
    for path in SHIPPED:
        llm = load_config(path).endpoints["llm"]
        assert llm.sampling_rules is SamplingRules.VLLM
        assert llm.sampling_keys == list(LLM_KEYS)
        assert llm.sampling_parameters_input == "sampling_parameters"


@pytest.mark.parametrize(
    ("req", "says"),
    [
        # Issue 17: this seed stopped the llm engine for every tenant.
        (
            llm_request(parameters=None, seed=18446744073709551616),
            "parameter 'seed': seed must be an integer in [-9223372036854775808, "
            "9223372036854775807] (64 bits), got 18446744073709551616.",
        ),
        (llm_request({"seed": 2**64}), "input 'sampling_parameters': seed must be an integer in"),
        (llm_request(seed=1.8446744073709552e19), "parameter 'seed': seed must be an integer in"),
        (llm_request({"temperature": -1}), "temperature must be non-negative, got -1.0."),
        (llm_request(temperature=float("inf")), "temperature must be a finite number, got inf."),
        (llm_request({"top_p": 1.5}), "top_p must be in (0, 1], got 1.5."),
        (llm_request(top_p="0"), "parameter 'top_p': top_p must be in (0, 1], got 0.0."),
        (llm_request({"top_k": -2}), "top_k must be 0 (disable), or at least 1, got -2."),
        (llm_request({"max_tokens": 0}), "max_tokens must be at least 1, got 0."),
        (llm_request({"max_tokens": 2.5}), "max_tokens must be an integer, got 2.5"),
        (llm_request({"ignore_eos": "yes"}), "ignore_eos must be true or false, got 'yes'"),
        (llm_request({"seed": [1, 2]}), "seed must be an integer, got [1, 2]"),
        (llm_request({"best_of": 2}), "unknown key(s) ['best_of']; this model takes"),
        (llm_request("[1]"), "input 'sampling_parameters' must be a JSON object"),
        (llm_request("[" * 100_000), "input 'sampling_parameters' must be a JSON object"),
        (
            llm_request({"max_tokens": 600}),
            "input 'sampling_parameters': max_tokens: 600 new tokens after a 6-token prompt "
            "exceed this model's maximum context length of 512 tokens; at most 506",
        ),
    ],
)
def test_a_value_out_of_its_rule_is_refused_naming_the_key_and_the_rule(
    req: InferRequest, says: str
) -> None:
    assert says in refused(req)


def test_the_input_is_read_before_the_parameter_and_values_are_converted() -> None:
    # The input's valid value wins; the parameter's bad one is not read (as the model).
    checked = validate(
        llm_request({"seed": 5, "max_tokens": "7"}, seed=2**70), planned(LLM, ENDPOINT)
    )
    assert checked.max_tokens == 7  # a string of digits, as vLLM's int() takes it
    assert validate(llm_request({"max_tokens": 9.0}), LLM_PLAN).max_tokens == 9
    assert validate(llm_request({"max_tokens": None}, max_tokens=3), LLM_PLAN).max_tokens == 3
    assert validate(llm_request(seed=-1, top_k=-1), LLM_PLAN).max_tokens == 16


def test_keys_without_a_rule_and_other_parameters_pass() -> None:
    values = check_sampling(
        {"stop": ["\n"], "n": 2},
        {"fair_rows": "{}", "tenant": "x", "priority": 3},
        SamplingRules.VLLM,
        input_name="sampling_parameters",
    )
    assert values == {"n": 2}
    with pytest.raises(InvalidArgument, match=r"min_tokens must be less than or equal to"):
        check_sampling({"min_tokens": 9, "max_tokens": 4}, {}, SamplingRules.VLLM, input_name="s")
    with pytest.raises(InvalidArgument, match=r"presence_penalty must be in \[-2, 2\]"):
        check_sampling({}, {"presence_penalty": 3}, SamplingRules.VLLM, input_name="s")


def test_without_the_prompts_count_max_tokens_leaves_room_for_one_prompt_token() -> None:
    def check(max_tokens: int, prompt: int | None) -> None:
        check_sampling(
            {"max_tokens": max_tokens},
            {},
            SamplingRules.VLLM,
            input_name="s",
            max_model_len=512,
            prompt_tokens=prompt,
        )

    check(511, None)
    with pytest.raises(InvalidArgument, match="at most 511"):
        check(512, None)
    check(500, 12)
    with pytest.raises(InvalidArgument, match="at most 500 for this prompt"):
        check(501, 12)
    check(10**6, 512)  # the prompt alone is too long: its own check says so


@given(doc=st.none() | SAMPLING, params=PARAMS)
@settings(max_examples=500, deadline=None)
def test_the_door_and_the_model_answer_every_value_alike(
    doc: dict[str, Any] | None, params: dict[str, Any]
) -> None:
    """Whatever a client sends, the frontend refuses exactly what the model refuses, and
    what both take they read as the same values: a request the door lets through never
    fails in the engine for its sampling parameters, and the door refuses nothing the
    model would serve."""
    text = None if doc is None else json.dumps(doc)
    try:
        model: Any = decode_sampling_parameters(text, json.dumps(params))
    except RequestError as err:
        model = err
    try:
        door: Any = check_sampling(
            None if text is None else json.loads(text),
            params,
            SamplingRules.VLLM,
            input_name="sampling_parameters",
            keys=LLM_KEYS,
        )
    except InvalidArgument as err:
        door = err
    assert isinstance(door, InvalidArgument) == isinstance(model, RequestError), (door, model)
    if isinstance(door, dict):
        for key, value in door.items():
            if key == "seed":
                assert model.seed == (None if value == -1 else value)
            elif key == "top_k":
                assert model.top_k == (0 if value == -1 else value)
            else:
                assert getattr(model, key) == value, key


def test_config_checks_the_sampling_fields(tmp_path: Path) -> None:
    data = config_dict()
    data["endpoints"]["llm"].pop("sampling_rules")
    with pytest.raises(ConfigError, match=r"endpoints.llm.sampling_keys: needs sampling_rules"):
        parse_config(data)
    data["endpoints"]["llm"]["sampling_rules"] = "vllm"
    data["endpoints"]["llm"]["sampling_keys"] = ["seed", "temprature"]
    with pytest.raises(ConfigError, match=r"\['temprature'\] are not sampling parameters"):
        parse_config(data)
    data["endpoints"]["llm"]["sampling_rules"] = "openai"
    with pytest.raises(ConfigError, match="sampling_rules"):
        parse_config(data)
