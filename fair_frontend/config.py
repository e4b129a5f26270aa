"""The frontend's configuration: typed, documented where declared, validated up front.

``load_config(path)`` reads YAML and either returns a ``Config`` or raises one
``ConfigError`` that lists every problem found (schema errors and cross-references),
so an operator fixes a file in one pass. Defaults are named constants below.

Shape (see ``examples/config.yaml`` for a complete, commented example)::

    scheduling: fair                 # fair | fifo (fifo: one shared queue, the baseline)
    endpoints:                       # client-facing model name = Triton model name
      embed:    {cost: tokens,   max_batch_size: 32, latency_target_ms: 1000}
      generate: {cost: requests, max_batch_size: 8,  latency_target_ms: 5000}
    tiers: [enterprise, standard, trial]        # highest first
    tier_models:                                # who may call what; closed by default
      enterprise: ["*"]                         # "*": every model, now and later
      trial: [embed]
    tier_limits:
      trial: {generate: {requests_per_minute: 10, tokens_per_month: 200000}}
    tenants:
      acme: {tier: enterprise, weight: 1, api_keys: ["sha256:<hex>", "<plain key>"]}
"""

from __future__ import annotations

import difflib
import enum
import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fair_frontend.admission.slo import SloClass, SloKind
from fair_frontend.admission.storage import (
    DEFAULT_RATELIMIT_STORAGE,
    DEFAULT_RATELIMIT_TIMEOUT_MS,
)
from fair_frontend.admission.throttle import DEFAULT_LATENCY_TARGET_MS, DEFAULT_THROTTLE_SAFETY
from fair_frontend.feedback.delta import DEFAULT_METRICS_INTERVAL_S
from fair_frontend.feedback.service import DEFAULT_EMA_ALPHA
from fair_frontend.protocol import (
    FRONTEND_PREFIX,
    MAX_NAME_BYTES,
    PROGRAM_PARAMETER,
    RESERVED_PARAMETERS,
    RESERVED_PREFIX,
    SLO_CLASS_PARAMETER,
    TENANT_PARAMETER,
)
from fair_frontend.sampling import KNOWN_KEYS, SamplingRules
from fair_frontend.scheduler.caps import (
    DEFAULT_ENGINE_QUEUE_SLOTS,
    DEFAULT_GLOBAL_MAX_QUEUED,
    DEFAULT_GLOBAL_MAX_QUEUED_BYTES,
    DEFAULT_PROGRAMS_PER_TENANT,
    DEFAULT_TENANT_BYTES_SHARE,
    DEFAULT_TENANT_MAX_QUEUED,
)
from fair_frontend.scheduler.cost import CostUnit
from fair_frontend.scheduler.fairness import FAIRNESS_POLICIES
from fair_frontend.scheduler.types import DEFAULT_DEBT_CARRIED
from fair_frontend.wire.framing import DEFAULT_STALLED_SHELL_S, MAX_FRAME
from fair_frontend.wire.remote import MESSAGE_BYTES

# ---- defaults, named once -------------------------------------------------------------
# (those of the scheduler, the admission and the feedback loop are theirs: imported above)

DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 8001
DEFAULT_METRICS_PORT = 8002
DEFAULT_METRICS_HOST = "127.0.0.1"  # the operator's listener: loopback unless asked otherwise
DEFAULT_PRIORITY_LEVELS = 10
DEFAULT_DISPATCH_LEAD_MS = 3.0
DEFAULT_MAX_OUTAGE_S = 60.0
# A streamed request whose client reads none of its parts for this long is cancelled.
DEFAULT_STALLED_STREAM_S = 30.0
# A shell process that reads nothing of what the core sends it for this long is cut off.
DEFAULT_MAX_REQUEST_BYTES = 64 << 20  # 64 MiB, Triton's HTTP default body limit (a ceiling)
# A request on the wire (an HTTP body, a gRPC message) may be this many times its tensor
# payload limit (JSON text of numbers, protobuf varints and BYTES framing run to about
# twice their binary size), plus this much for the rest (names, shapes, parameters).
WIRE_EXPANSION = 2
WIRE_FRAMING_BYTES = 1 << 20
# Requests of one ModelStreamInfer stream handled at once: above any engine's slots
# (64-256) and a client's usual pipelining depth, so a legitimate client never waits on
# it; it bounds one stream's tasks and undelivered replies.
DEFAULT_GRPC_STREAM_MAX_INFLIGHT = 1024
DEFAULT_HTTP_BODY_TIMEOUT_S = 30.0
# The door's bounds on connections (per shell process; see README, "The door"). A client
# sends a request's headers in one packet: 10 s is far above any network's, and bounds
# what a connection that sends nothing, or headers a byte at a time, holds.
DEFAULT_HEADER_TIMEOUT_S = 10.0
# Open connections per shell: idle, 28 MiB of HTTP ones and 64 MiB of gRPC ones at most
# (7 and 16 KiB each, measured by benchmarks/bench_door.py), far above a client pool's
# (perf_analyzer opens one per concurrent request over HTTP, one in all over gRPC). One
# address may hold a quarter of them, so that one client cannot take all from the others.
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_MAX_CONNECTIONS_PER_PEER = 1024
# HTTP/2 streams (calls) at once on one gRPC connection. gRPC's clients hold a call over
# it while the connection's streams stay open, but fail part of a burst that turns streams
# over faster than the server frees them (REFUSED_STREAM, benchmarks/bench_streams.py): so
# it sits far above a client's own concurrency (perf_analyzer 128; the noisy-neighbour
# burst, 1,250 a connection), a bound on what one connection holds before each call's key
# is checked (64 KiB, HTTP/2's initial window, a call), not flow control.
DEFAULT_GRPC_MAX_STREAMS_PER_CONNECTION = 4096
# Calls a shell handles at once beyond what the global queue can hold: those holding no
# queue slot (in flight to Triton, side doors, streams between requests).
GRPC_CALLS_HEADROOM = 1000
DEFAULT_GRPC_MAX_CONNECTION_IDLE_S = 300.0
DEFAULT_GRPC_MAX_CONNECTION_AGE_S = 3600.0
# Bodies read and decoded at once in a shell, in multiples of the largest request.
HTTP_READING_REQUESTS = 4
DEFAULT_TOKEN_INPUT = "INPUT_IDS"
DEFAULT_MAX_METRIC_TENANTS = 1000
DEFAULT_METADATA_TTL_S = 60.0
DEFAULT_READY_TTL_S = 1.0
DEFAULT_NEGATIVE_TTL_S = 1.0
DEFAULT_SIDE_DOOR_CACHE_ENTRIES = 1024

# The core's port for shells on other hosts (``core_link``): each shell holds one
# connection with one stream on it, so these sit far above a fleet's (shells restarting
# or failing over at once included) and bound what anyone who reaches the port holds
# before the secret is checked. A shell connects and opens its stream at once.
DEFAULT_LINK_MAX_CONNECTIONS = 1024
DEFAULT_LINK_MAX_STREAMS_PER_CONNECTION = 8
DEFAULT_LINK_HANDSHAKE_TIMEOUT_S = 10.0

SHA256_PREFIX = "sha256:"
# In a list of models a tenant may call: every model, those Triton serves now and any
# an operator adds later (an explicit opt-in; without it a model no list names is closed).
ALL_MODELS = "*"
_SHA256_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


class ConfigError(ValueError):
    """Raised once, listing every problem in the configuration."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid configuration {source}: {len(problems)} problem(s)\n{lines}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---- building blocks -------------------------------------------------------------------


class Limits(_Strict):
    """Rate limits, each ``<unit>_per_<window>``; unset means unlimited.

    Windows slide: "per minute" means in any 60 s, "per month" in any 30 days.
    """

    requests_per_second: int | None = Field(
        default=None, ge=0, description="Requests in any 1 second."
    )
    requests_per_minute: int | None = Field(
        default=None, ge=0, description="Requests in any 1 minute."
    )
    requests_per_hour: int | None = Field(default=None, ge=0, description="Requests in any 1 hour.")
    requests_per_day: int | None = Field(default=None, ge=0, description="Requests in any 1 day.")
    requests_per_month: int | None = Field(
        default=None, ge=0, description="Requests in any 30 days."
    )
    tokens_per_second: int | None = Field(default=None, ge=0, description="Tokens in any 1 second.")
    tokens_per_minute: int | None = Field(default=None, ge=0, description="Tokens in any 1 minute.")
    tokens_per_hour: int | None = Field(default=None, ge=0, description="Tokens in any 1 hour.")
    tokens_per_day: int | None = Field(default=None, ge=0, description="Tokens in any 1 day.")
    tokens_per_month: int | None = Field(default=None, ge=0, description="Tokens in any 30 days.")

    def items(self) -> list[tuple[str, str, int]]:
        """The set limits as ``(unit, window, amount)``, in declaration order."""
        out = []
        for name, value in self:
            if value is not None:
                unit, _, window = name.partition("_per_")
                out.append((unit, window, value))
        return out

    def merged(self, override: Limits | None) -> Limits:
        """These limits with every field that ``override`` sets replaced."""
        if override is None:
            return self
        return self.model_copy(update=override.model_dump(exclude_none=True))


class PaddedInput(_Strict):
    """How ragged rows of one input are batched: right-padded to the longest row."""

    pad_value: float = Field(default=0, description="Value the padding is filled with.")
    lengths_field: str | None = Field(
        default=None,
        description="Per-row list of the fair_rows request parameter in which the frontend "
        "sends each row's true length (the shipped models read `length`; without it a row "
        "is as long as the input is wide, as for a direct client). Unset: the model is not "
        "told, and sees the padding.",
    )


class PaddedOutput(_Strict):
    """How a padded output is cut back to each row's true length."""

    lengths_output: str = Field(
        description="Output holding each row's true length ([B, 1] INT32), which the model "
        "emits for the frontend's batches only. The frontend asks for it, cuts the padded "
        "output back by it, and never returns it: a direct client does not get it either.",
    )


class Padding(_Strict):
    inputs: dict[str, PaddedInput] = Field(
        default_factory=dict, description="Inputs padded to the longest row, by name."
    )
    outputs: dict[str, PaddedOutput] = Field(
        default_factory=dict, description="Padded outputs cut back per row, by name."
    )


class Endpoint(_Strict):
    """Scheduling policy of one model (client-facing name = Triton model name)."""

    cost: CostUnit = Field(
        default=CostUnit.REQUESTS,
        description="DRR cost unit: 1 per row (requests) or the row's token count (tokens).",
    )
    max_batch_size: int | None = Field(
        default=None,
        ge=0,
        description="Rows per batch sent to Triton. Unset: the model's own max_batch_size. "
        "0: the model does not batch; requests go one at a time.",
    )
    max_batch_tokens: int | None = Field(
        default=None, gt=0, description="Tokens per batch; unset means no token cap."
    )
    quantum: float | None = Field(
        default=None,
        gt=0,
        description="DRR budget per round, in cost units, before weight. Unset: one request for "
        "request-cost endpoints, a full batch for token-cost endpoints: max_batch_tokens, or "
        "without it max_batch_size rows of the mean tokens per row seen so far. Backlogged "
        "tenants take a round's budget in turns, a slice at a time (about weight requests a "
        "visit): every batch holds each one's share by weight.",
    )
    max_queue_delay_ms: float = Field(
        default=0.0,
        ge=0,
        description="How long an under-full batch may wait for more rows while Triton is idle. "
        "0 (the default) is strictly work-conserving.",
    )
    latency_target_ms: float = Field(
        default=DEFAULT_LATENCY_TARGET_MS,
        gt=0,
        description="The throttle rejects a request whose predicted wait exceeds this.",
    )
    throttle: bool = Field(
        default=True,
        description="Reject at admission (503 + Retry-After) a request whose predicted wait "
        "exceeds the smaller of latency_target_ms and its own deadline. Off: requests queue "
        "until served, expired at their deadline or refused by a queue cap.",
    )
    throttle_safety: float = Field(
        default=DEFAULT_THROTTLE_SAFETY,
        ge=1,
        description="The throttle's predicted wait is multiplied by this before it is "
        "compared with the target: a margin for the noise in batch times, so that admitted "
        "requests' tail (not only their median) stays within the target.",
    )
    max_inflight: int | None = Field(
        default=None,
        ge=1,
        description="Engine mode, for a model that batches inside itself (continuous "
        "batching: Triton's vLLM and TensorRT-LLM backends, the shipped `llm`): each request "
        "goes to Triton alone, and at most this many are in the engine at once (its slots, "
        "e.g. 64-256). Who gets a free slot is decided here: tier, then fair share, then "
        "priority; with `cost: tokens` the fair share is, unless fairness says otherwise, "
        "over tokens served (virtual token counters: input tokens when a request gets its "
        "slot, output tokens as they stream). Unset: batches are built here "
        "(max_inflight_batches).",
    )
    fairness: str | None = Field(
        default=None,
        description="How the tenants of one tier share the endpoint (selector 2, by name). "
        "drr: deficit round robin, each tenant's share of the cost units in proportion to "
        "its weight. vtc: virtual token counters, the least weighted tokens served goes "
        "next (input tokens when a request is sent, output tokens as they are counted). "
        "fifo: first come first served across the tier's tenants, weights ignored (the "
        "baseline the others are compared against; tiers still go in their order, unlike "
        "scheduling: fifo). Unset: vtc for an engine endpoint (max_inflight) with "
        "`cost: tokens`, drr otherwise.",
    )
    debt_carried: float = Field(
        default=DEFAULT_DEBT_CARRIED,
        ge=0,
        allow_inf_nan=False,
        description="vtc on an engine endpoint: how much of what a tenant is owed it keeps "
        "when its queue empties and fills again, in turnovers of the engine (max_inflight "
        "requests of the mean cost seen), over its weight. An agent whose queue empties "
        "while its step's last calls run comes back owed what the others took meanwhile, "
        "up to this, and its token share follows its weight; idle time banks no more. 0: "
        "VTC's own lift (the least active counter), idle time banks nothing.",
    )
    reserved_slots: int = Field(
        default=0,
        ge=0,
        description="Engine mode: no one tenant holds more than max_inflight - "
        "reserved_slots of the slots, so another tenant's first request finds one free "
        "instead of waiting for a slot to turn over (a hog's generations can be long). "
        "Costs a lone tenant that many slots of the engine's batch.",
    )
    light_slots: int = Field(
        default=0,
        ge=0,
        description="Engine mode: the last light_slots free slots go only to a request "
        "whose program holds no slot (a chat's call beside its own or another tenant's "
        "agent fan-out; programs: x-program-id, the OpenAI user field, the program "
        "parameter; a request naming none is its tenant's one program), the fairest such "
        "request first, so it finds a slot free instead of waiting for one to turn over. "
        "The rest wait for more slots to free: costs a busy engine up to that many idle "
        "slots while no such request waits.",
    )
    tokenizer: str | None = Field(
        default=None,
        description="A `tokenizers` JSON file (tokenizer.json; relative paths are from the "
        "config file's folder): a BYTES token_input is counted in its tokens (text prompts), "
        "and so is a BYTES token_output that comes in one piece. For a model that takes "
        "token ids (INT32 token_input): the tokenizer that turns text into them, for the "
        "routes that take text (rerank: its pair template joins query and document).",
    )
    token_output: str | None = Field(
        default=None,
        description="Output holding the generated tokens, for charge-back: each streamed "
        "response that carries it counts one token (engines stream one per decode step), "
        "or the tokens token_count_output gives; a "
        "response in one piece counts its elements (numeric ids) or its text's tokens "
        "(BYTES, with the tokenizer; a prompt echoed at its start is not counted). Unset: "
        "no output is counted, and what admission charged stands.",
    )
    token_count_output: str | None = Field(
        default=None,
        description="Output giving the tokens of each response (Triton's vLLM backend: "
        "`num_output_tokens`, in a stream the tokens that response carries), asked of the "
        "model through token_count_input: a streamed response counts what it says, in "
        "tokens whatever a response carries (vLLM's stream interval), where without it "
        "each streamed response counts one. It reaches a client only where it asked.",
    )
    token_count_input: str | None = Field(
        default=None,
        description="BOOL input that asks the model for token_count_output (Triton's vLLM "
        "backend: `return_num_output_tokens`), set on every stream sent to it.",
    )
    sampling_parameters_input: str | None = Field(
        default=None,
        description="BYTES input holding a JSON object of sampling parameters (Triton's vLLM "
        "backend: `sampling_parameters`), whose max_tokens_parameter key is read first.",
    )
    sampling_rules: SamplingRules | None = Field(
        default=None,
        description="Check the sampling parameters at admission by these rules, refusing a "
        "value out of its rule (400 / INVALID_ARGUMENT naming the key and the rule) before "
        "it queues. `vllm`: the types and ranges of vLLM's SamplingParams, in its words "
        "(Triton's vLLM backend; the shipped llm): max_tokens >= 1 and, where the model's "
        "config has a max_model_len parameter, within it with the prompt; temperature "
        "finite and >= 0; top_p in (0, 1]; top_k -1, 0 or >= 1; min_p in [0, 1]; "
        "presence_penalty and frequency_penalty in [-2, 2]; repetition_penalty > 0; n >= 1; "
        "min_tokens in [0, max_tokens]; logprobs >= -1; every integer, seed included, within "
        "64 bits (fair_frontend.sampling). Each key is read from sampling_parameters_input's "
        "JSON object first, then from the request parameter of that name (where Triton's HTTP "
        "generate extension puts a body's top-level keys). Unset: not checked here (the "
        "max_tokens_parameter still is).",
    )
    sampling_keys: list[str] | None = Field(
        default=None,
        description="With sampling_rules: the keys the model takes in "
        "sampling_parameters_input's JSON object (the shipped llm: max_tokens, temperature, "
        "top_p, top_k, seed, ignore_eos); any other key there is refused, as the model "
        "would refuse it, and only these are checked. Unset: every key of the rules is "
        "checked, and keys without a rule are left to the model.",
    )
    output_token_weight: float = Field(
        default=1.0,
        gt=0,
        description="What one output token costs relative to an input token, in token "
        "cost and charge-back (decoding a token costs more than prefilling one; VTC's "
        "paper uses 2, as API prices do).",
    )
    unary: Literal["one_hop", "relay"] = Field(
        default="one_hop",
        description="How a unary request's tensors reach Triton where shells are processes "
        "of their own (--workers > 1, remote shells). one_hop: the shell keeps them and "
        "sends the core only the request's facts; the core forms the fair batches as "
        "ever and grants each shell its rows of each, which the shell sends to Triton "
        "itself (the rows of several shells meet in Triton's dynamic batcher). relay: "
        "the tensors go through the core, which sends each batch and hands back the "
        "answers. Streams, stateful (sequence) models and engine endpoints always go as "
        "they do (streams take one hop already). A shell in the core's process relays.",
    )
    max_inflight_batches: int | None = Field(
        default=None,
        ge=1,
        description="Batches in Triton at once for this model. Unset: one per model instance "
        "(Triton's instance_group counts), so requests wait in the frontend, where fairness "
        "is decided, and the next batch is assembled at the moment an instance frees up.",
    )
    dispatch_lead_ms: float = Field(
        default=DEFAULT_DISPATCH_LEAD_MS,
        ge=0,
        description="Send the next batch this long before the batches in flight are "
        "predicted to finish (from the learned batch times), so Triton never idles between "
        "batches; the batch is still assembled at that last moment. In one hop "
        "(`unary: one_hop`), earlier by the shells' hops as measured (their parts then wait in "
        "Triton's queue, where its batcher merges them). 0: only when a slot is free (one "
        "round trip of idle GPU per batch).",
    )
    default_priority: int | None = Field(
        default=None, ge=1, description="Level for priority 0; unset: the middle level."
    )
    normalize_cost: bool = Field(
        default=False,
        description="Charge each request its predicted service seconds, in cost units "
        "(predicted seconds / EMA of observed seconds per unit; fair_frontend.feedback). "
        "Off by default: on batched generation it changes nothing measurable (a batch runs "
        "as long as its longest row, so every row occupies the decoder alike: "
        "bench_generation_cost), and engine mode charges the tokens actually produced.",
    )
    token_input: str = Field(
        default=DEFAULT_TOKEN_INPUT,
        description="Input whose element count per row is the row's token count.",
    )
    max_tokens_parameter: str | None = Field(
        default=None,
        description="Request parameter in which a client asks how many tokens to generate "
        "(`max_tokens`, as Triton's vLLM backend takes it); added to each row's token "
        "count. The frontend moves it into each row's fair_rows entry, so requests asking "
        "for different counts share a batch.",
    )
    max_tokens_default: int | None = Field(
        default=None,
        ge=1,
        description="Tokens a request that does not send max_tokens_parameter asks for (the "
        "model's own default); required with max_tokens_parameter.",
    )
    max_tokens_limit: int | None = Field(
        default=None,
        ge=1,
        description="Largest max_tokens_parameter accepted (the model's own limit); beyond, "
        "400. Unset: no limit but the integer range.",
    )
    input_defaults: dict[str, list[float]] = Field(
        default_factory=dict,
        description="Values the frontend fills in for optional inputs a request leaves out, so "
        "rows with and without them share a batch (the model's own defaults).",
    )
    padding: Padding = Field(
        default_factory=Padding,
        description="How ragged rows share a batch; without it only equal shapes do.",
    )
    max_request_bytes: int | None = Field(
        default=None,
        gt=0,
        description="Largest request (input tensor bytes); beyond, 400; its HTTP body or "
        "gRPC message may be twice that and 1 MiB more. Unset: what the model can accept, "
        "at most 64 MiB: max_batch_size rows of each input's dims in its datatype, a text "
        "(BYTES) input of an endpoint with a tokenizer and max_model_len holding at most "
        "max_model_len of the tokenizer's longest tokens; the body's bound then follows "
        "from the longest form each element takes on the wire (JSON text, varints). A "
        "request over it is refused from its Content-Length or gRPC message size, unread.",
    )
    max_request_tokens: int | None = Field(
        default=None, gt=0, description="Largest request in tokens; beyond, 400."
    )
    max_model_len: int | None = Field(
        default=None,
        gt=0,
        description="The most tokens one row (a sequence) takes: engine endpoints, prompt "
        "+ generated tokens (vLLM's max_model_len); batch endpoints, the network's context "
        "(a row's tokens; an embeddings input, a rerank query and document together). A "
        "text prompt or embeddings input (counted with the tokenizer) longer than this is "
        "refused with 400, before it is tokenised where its bytes already prove it (each "
        "token covers at most the tokenizer's longest token). Unset: the model config's "
        "max_model_len parameter, if it has one.",
    )

    @field_validator("fairness")
    @classmethod
    def _known_fairness(cls, name: str | None) -> str | None:
        if name is not None and name not in FAIRNESS_POLICIES:
            raise ValueError(FAIRNESS_POLICIES.unknown(name))
        return name

    def fairness_policy(self) -> str:
        """The fairness policy's name: ``fairness``, else what it defaults to (engine
        endpoints in token cost: ``vtc``, fair shares of tokens as they are served)."""
        if self.fairness is not None:
            return self.fairness
        return "vtc" if self.max_inflight is not None and self.cost is CostUnit.TOKENS else "drr"

    @property
    def max_wire_bytes(self) -> int:
        """The largest request this endpoint's configuration lets through, as an HTTP body
        or a gRPC message: ``max_request_bytes`` (or its default) of tensors as they
        travel, and the rest of the request. A model's own bound, which the shells read
        each request against, is at most this (``models.ModelInfo.bounds``)."""
        return self.request_bytes_ceiling * WIRE_EXPANSION + WIRE_FRAMING_BYTES

    @property
    def request_bytes_ceiling(self) -> int:
        """``max_request_bytes``, or its default where unset."""
        return self.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES

    def effective_quantum(self, max_batch_size: int) -> float | None:
        """The DRR quantum: configured, else derived from the batching policy; None for a
        token-cost endpoint without max_batch_tokens, whose full batch in tokens is
        learned from its requests (``Scheduler``: max_batch_size rows of the mean tokens
        per row)."""
        if self.quantum is not None:
            return self.quantum
        if self.cost is CostUnit.REQUESTS:
            return 1.0
        if self.max_batch_tokens is not None:
            return float(self.max_batch_tokens)
        return None


class SloClassConfig(_Strict):
    """One SLO class (``slo_classes``): interactive (TTFT and inter-token targets) or batch
    (a completion deadline); ``fair_frontend.admission.slo`` says what each changes."""

    kind: Literal["interactive", "batch"] = Field(
        description="interactive: the throttle refuses at once a request whose predicted "
        "time to first token exceeds ttft_ms; batch: only one that cannot complete within "
        "deadline_s even at the wait predicted for it, and inside its tenant it goes after "
        "every other request (batch work takes the slack)."
    )
    ttft_ms: float | None = Field(
        default=None, gt=0, description="interactive: the time-to-first-token target."
    )
    itl_ms: float | None = Field(
        default=None,
        gt=0,
        description="interactive, optional: the inter-token target (shown, not enforced: an "
        "engine's step time follows its slots, not its queue's order).",
    )
    deadline_s: float | None = Field(
        default=None, gt=0, description="batch: the completion deadline, from arrival."
    )

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> SloClassConfig:
        if self.kind == SloKind.INTERACTIVE:
            if self.ttft_ms is None:
                raise ValueError("an interactive class needs ttft_ms")
            if self.deadline_s is not None:
                raise ValueError("deadline_s is a batch class's (interactive: ttft_ms, itl_ms)")
        else:
            if self.deadline_s is None:
                raise ValueError("a batch class needs deadline_s")
            if self.ttft_ms is not None or self.itl_ms is not None:
                raise ValueError(
                    "ttft_ms and itl_ms are an interactive class's (batch: deadline_s)"
                )
        return self

    def slo_class(self, name: str) -> SloClass:
        """The policy's parameters, in seconds."""
        return SloClass(
            name,
            SloKind(self.kind),
            ttft_s=None if self.ttft_ms is None else self.ttft_ms / 1000.0,
            itl_s=None if self.itl_ms is None else self.itl_ms / 1000.0,
            deadline_s=self.deadline_s,
        )


class Tenant(_Strict):
    tier: str = Field(description="One of tiers.")
    weight: float = Field(default=1.0, gt=0, description="Share relative to its tier's peers.")
    api_keys: list[str] = Field(
        default_factory=list,
        description='Keys as "sha256:<hex of the key>" (preferred) or plain text.',
    )
    api_keys_file: str | None = Field(
        default=None, description="File with one key per line (same forms as api_keys)."
    )
    api_keys_env: str | None = Field(
        default=None, description="Environment variable with comma-separated keys."
    )
    default_priority: int | None = Field(
        default=None, ge=1, description="Level for this tenant's priority-0 requests."
    )
    max_queued: int | None = Field(
        default=None,
        ge=1,
        description="Requests this tenant may have queued per model; beyond, 503. Unset: "
        f"{DEFAULT_TENANT_MAX_QUEUED:,} on a batching endpoint, queues.engine_queue_slots x "
        "max_inflight on an engine endpoint.",
    )
    max_queued_bytes: int | None = Field(
        default=None,
        ge=1,
        description="Tensor bytes this tenant may have queued per model; beyond, 503. Unset: "
        "queues.tenant_bytes_share of queues.max_queued_bytes, over all models together.",
    )
    limits: dict[str, Limits] = Field(
        default_factory=dict,
        description="Per endpoint; overrides the tier's limits field by field.",
    )
    models: list[str] | None = Field(
        default=None,
        description='Models this tenant may call, instead of its tier\'s tier_models list ("*": '
        "every model). Unset: its tier's list.",
    )
    extra_models: list[str] = Field(
        default_factory=list,
        description="Models this tenant may call beside its tier's list (widens it; "
        "excludes models).",
    )
    denied_models: list[str] = Field(
        default_factory=list,
        description="Models this tenant may not call whatever the lists say (narrows its "
        'tier\'s list; "*": none at all, e.g. to suspend a tenant and keep its keys).',
    )
    slo_class: str | None = Field(
        default=None,
        description="The SLO class (one of slo_classes) of this tenant's requests that name "
        "none. Unset: its tier's (tier_slo_classes), if any.",
    )


class Server(_Strict):
    host: str = Field(default="0.0.0.0", description="Address the HTTP and gRPC listeners bind.")
    http_port: int = Field(
        default=DEFAULT_HTTP_PORT, ge=0, le=65535, description="KServe v2 HTTP (0: any free)."
    )
    grpc_port: int = Field(
        default=DEFAULT_GRPC_PORT, ge=0, le=65535, description="KServe v2 gRPC (0: any free)."
    )
    metrics_port: int = Field(
        default=DEFAULT_METRICS_PORT,
        ge=0,
        le=65535,
        description="Prometheus /metrics of the frontend (0: any free).",
    )
    metrics_host: str = Field(
        default=DEFAULT_METRICS_HOST,
        description="Address of the operator's listener: /metrics, and Triton's statistics "
        "extension over HTTP (/v2/models/stats, no key: every tenant's traffic is on it). "
        "Operator-only: loopback by default; 0.0.0.0 (the pod network) where Prometheus "
        "scrapes from elsewhere, with a network policy that lets only Prometheus reach it. "
        "Apart from host, so the tenant ports can face the world while this does not.",
    )
    metrics_grpc_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="A gRPC listener for the operator on metrics_host: ModelStatistics "
        "(tritonclient's get_inference_statistics), ServerLive, ServerReady, "
        "ServerMetadata; nothing else (0: any free). Unset: none.",
    )
    tls_cert_file: str | None = Field(
        default=None,
        description="PEM certificate (its chain) of the tenant ports: with tls_key_file, "
        "HTTP and gRPC are served over TLS on http_port and grpc_port (HTTPS; gRPC with "
        "TLS), nothing in clear there. Loaded by every start check (serve, up, core, "
        "check-config: a pair that does not load is refused) and by each process that "
        "listens (shells on other hosts: the same path on theirs); a restart reads a "
        "renewed one. Unset: plain "
        "HTTP and gRPC, for a TLS terminator in front (docker/README.md: never expose the "
        "plain ports: every request carries its tenant's key).",
    )
    tls_key_file: str | None = Field(
        default=None, description="The PEM private key of tls_cert_file; both or neither."
    )
    statistics: Literal["keyed", "operator"] = Field(
        default="keyed",
        description="Where Triton's statistics extension (/v2/models/{m}/stats, gRPC "
        "ModelStatistics: the model's traffic over every tenant) is served. keyed: also on "
        "the tenant ports, to any tenant's key, as Triton serves it (perf_analyzer reads it "
        "when the server metadata lists it). operator: only on the operator's listener "
        "(metrics_host); the tenant ports answer 501 / UNIMPLEMENTED and their server "
        "metadata no longer lists the extension, so perf_analyzer does not ask.",
    )
    workers: int | None = Field(
        default=None,
        ge=1,
        description="Shell processes serving HTTP and gRPC in front of the one core process "
        "(--workers overrides). Unset: the cores this process may use less one, at most 8 "
        "(so 1 on 2 cores). 1: the whole frontend in one process.",
    )
    grpc_stream_max_inflight: int = Field(
        default=DEFAULT_GRPC_STREAM_MAX_INFLIGHT,
        ge=1,
        description="Requests of one gRPC stream (ModelStreamInfer) handled at once. At the "
        "bound, and while the replies the client has not read fill the stream's small "
        "buffer, the stream's next messages are not read (gRPC flow control holds the "
        "client back) and start no work: a client that sends and never reads costs a "
        "bounded amount of memory.",
    )
    http_body_timeout_s: float = Field(
        default=DEFAULT_HTTP_BODY_TIMEOUT_S,
        gt=0,
        description="Longest an HTTP request's body may take to arrive, counted from its "
        "headers; beyond, 408 and the connection is closed (a client trickling its body "
        "holds a connection and a buffer no longer than this).",
    )
    header_timeout_s: float = Field(
        default=DEFAULT_HEADER_TIMEOUT_S,
        gt=0,
        description="Longest a new connection may wait before its first request's headers "
        "have arrived (HTTP; gRPC: its HTTP/2 handshake), and an HTTP request's headers may "
        "take from their first byte; beyond, the connection is closed. Bounds a client "
        "that connects and sends nothing, or its headers a byte at a time (slowloris). "
        "Idle keep-alive connections between requests are not affected.",
    )
    http_max_connections: int = Field(
        default=DEFAULT_MAX_CONNECTIONS,
        ge=1,
        description="Open HTTP connections per shell process; one over it is closed at "
        "once, unread (counted in fair_connections_refused_total).",
    )
    http_max_connections_per_peer: int | None = Field(
        default=DEFAULT_MAX_CONNECTIONS_PER_PEER,
        ge=1,
        description="Open HTTP connections per shell process from one client address; one "
        "over it is closed at once, unread. Behind a proxy every connection has the "
        "proxy's address: raise it to http_max_connections, or null for no per-address "
        "cap.",
    )
    http_max_reading_bytes: int | None = Field(
        default=None,
        ge=1,
        description="Bytes of HTTP request bodies a shell process reads and decodes at "
        "once, over all its connections: a body counts its Content-Length (a chunked or "
        "compressed one, its model's body limit) from its headers until it is decoded; one "
        "that does not fit is refused 503 'Exceeds maximum queue size' before it is read. "
        "A body that names its model (the OpenAI and rerank routes) counts what is read of "
        "it until its model is let in, then as above. "
        "Default: 4 times the largest body limit of any model. At least that limit.",
    )
    grpc_max_connections: int = Field(
        default=DEFAULT_MAX_CONNECTIONS,
        ge=1,
        description="Open gRPC connections per shell process (gRPC's "
        "grpc.max_allowed_incoming_connections): one over it is refused by gRPC itself.",
    )
    grpc_max_streams_per_connection: int = Field(
        default=DEFAULT_GRPC_MAX_STREAMS_PER_CONNECTION,
        ge=1,
        description="Calls at once on one gRPC connection (HTTP/2's "
        "SETTINGS_MAX_CONCURRENT_STREAMS). gRPC's clients hold a call over it while the "
        "connection's streams stay open, but fail part of a burst that turns streams over "
        "faster than the server frees them (UNAVAILABLE, RST_STREAM REFUSED_STREAM): keep "
        "it above any client's concurrency on one connection (a gateway multiplexing many "
        "tenants included).",
    )
    grpc_max_concurrent_calls: int | None = Field(
        default=None,
        ge=1,
        description="gRPC calls a shell process handles at once; one over it is refused "
        "UNAVAILABLE 'Exceeds maximum queue size' before its message is read. Default: "
        "queues.max_queued + 1000 (a call beyond what the queue can hold would be refused "
        "there anyway; the 1000 hold no queue slot: in flight, side doors, open streams).",
    )
    grpc_max_connection_idle_s: float | None = Field(
        default=DEFAULT_GRPC_MAX_CONNECTION_IDLE_S,
        gt=0,
        description="A gRPC connection without a call for this long is closed (GOAWAY; "
        "gRPC's clients reconnect on their next call). null: never.",
    )
    grpc_max_connection_age_s: float | None = Field(
        default=DEFAULT_GRPC_MAX_CONNECTION_AGE_S,
        gt=0,
        description="A gRPC connection this old (+-10 %) takes no new calls (GOAWAY; "
        "clients open a new one, which also spreads them over the shells again); its calls "
        "in flight and open streams finish first, for up to "
        "grpc_max_connection_age_grace_s. null: never.",
    )
    grpc_max_connection_age_grace_s: float | None = Field(
        default=None,
        gt=0,
        description="How long an aged gRPC connection's calls and streams may still run "
        "before they are cancelled. null (default): as long as they take, so that age "
        "never cuts a generation or a client's long-lived stream.",
    )
    grpc_bdp_probe: bool = Field(
        default=False,
        description="gRPC's bandwidth-delay-product probing, which grows each stream's "
        "receive window with the measured bandwidth (up to 1 GiB). Off (default), a "
        "call's message waits in HTTP/2's 64 KiB window until its key is checked; a "
        "refused call has sent no more. On, an unkeyed call's whole message (measured: "
        "200 calls of 1 MiB, 204 MiB) may arrive before it is refused; large messages "
        "over long, fast links upload faster.",
    )

    @model_validator(mode="after")
    def _tls_both_or_neither(self) -> Server:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("server.tls_cert_file and server.tls_key_file: both or neither")
        return self


class CoreLink(_Strict):
    """The core's port for shells on other hosts (``fair-frontend core --listen``): its
    own bounds, as the tenant ports have theirs. Fixed at start."""

    max_connections: int = Field(
        default=DEFAULT_LINK_MAX_CONNECTIONS,
        ge=1,
        description="Open connections to the core's port (gRPC's "
        "grpc.max_allowed_incoming_connections): one over it is closed at once, unread. "
        "Each shell process holds one.",
    )
    max_streams_per_connection: int = Field(
        default=DEFAULT_LINK_MAX_STREAMS_PER_CONNECTION,
        ge=1,
        description="Streams at once on one connection (HTTP/2's "
        "SETTINGS_MAX_CONCURRENT_STREAMS); a shell opens one.",
    )
    handshake_timeout_s: float = Field(
        default=DEFAULT_LINK_HANDSHAKE_TIMEOUT_S,
        gt=0,
        description="Longest a new connection may take over its HTTP/2 handshake (TLS's "
        "included), and a connection may stay without a stream open (before its first, "
        "after its last); beyond, it is closed. Bounds a peer that connects and sends "
        "nothing.",
    )
    max_message_bytes: int | None = Field(
        default=None,
        ge=MESSAGE_BYTES,
        le=MAX_FRAME,
        description="Largest message a shell may send, and largest record (frame) in what "
        "it sends: one over it is refused (RESOURCE_EXHAUSTED), or ends the shell's "
        "connection, before it is buffered whole. Shells send messages of at most 4 MiB. "
        "Default, and the least allowed: twice the largest request a model accepts and 1 "
        "MiB (a request's tensors, and the rest of its body), at least 4 MiB.",
    )


class TritonBackend(_Strict):
    """One Triton of the pool that serves the endpoints (``triton.backends``)."""

    grpc_url: str = Field(
        description="This Triton's gRPC address, HOST:PORT (metadata, decoupled streams, and "
        "batches and generate streams where http_url is unset)."
    )
    http_url: str | None = Field(
        default=None,
        description="This Triton's HTTP address, e.g. http://host:8000: where set, its batches "
        "go there, and the streams whose clients read Triton's generate events (as "
        "triton.http_url does for a single Triton).",
    )
    metrics_url: str | None = Field(
        default=None,
        description="This Triton's Prometheus endpoint. The feedback loop reads the first "
        "backend's that has one.",
    )


class Triton(_Strict):
    url: str = Field(default="localhost:8001", description="Triton's gRPC address (serve mode).")
    backends: list[TritonBackend] = Field(
        default_factory=list,
        description="A pool of Tritons serving every endpoint (each: grpc_url, optional "
        "http_url, metrics_url). Each batch or stream goes to the healthy one that starts it "
        "soonest; each has the endpoint's slots (max_inflight, max_inflight_batches) of its "
        "own; one that goes away takes only what runs on it, and the endpoint is down only "
        "when all are. Empty (default): the one Triton of serve's --triton-url, with "
        "http_url and metrics_url below. A repeated --triton-url replaces this list (a URL "
        "listed here keeps its http_url and metrics_url). With backends, leave the section's "
        "http_url and metrics_url unset: each backend names its own.",
    )
    http_url: str | None = Field(
        default=None,
        description="Triton's HTTP address, e.g. http://localhost:8000: where set, batches go "
        "there (an HTTP request costs the core a third of the CPU of a gRPC call), and so do "
        "the streams of generate_stream and OpenAI clients of an endpoint that counts tokens "
        "from the model (token_count_output): the shell reads Triton's own generate_stream "
        "events and passes them on. Metadata and the other decoupled streams stay on gRPC. "
        "up mode sets it to its own Triton.",
    )
    metrics_url: str | None = Field(
        default=None, description="Triton's Prometheus endpoint, e.g. http://localhost:8002/metrics"
    )
    metrics_interval_s: float = Field(
        default=DEFAULT_METRICS_INTERVAL_S, gt=0, description="How often Triton's metrics are read."
    )
    request_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Longest a call to Triton may take before it is answered UNAVAILABLE; "
        "for a decoupled model's stream (an engine's generation), the longest time without a "
        "response from Triton, not a total: a generation may stream for as long as it "
        "produces. A stream cut for it is answered UNAVAILABLE alone: only a failure to "
        "reach Triton marks it down for every model.",
    )
    max_outage_s: float = Field(
        default=DEFAULT_MAX_OUTAGE_S,
        gt=0,
        description="While Triton is unreachable, queued requests wait for it this long at "
        "most (or to their own deadline); then they, and new requests until Triton is back, "
        "are answered UNAVAILABLE.",
    )

    def first_metrics_url(self) -> str | None:
        """The Prometheus endpoint the feedback loop reads: ``metrics_url``, or the first
        backend's that has one."""
        if self.metrics_url is not None:
            return self.metrics_url
        return next((b.metrics_url for b in self.backends if b.metrics_url), None)

    def pool(self, urls: Sequence[str] = ()) -> list[TritonBackend]:
        """The Tritons to serve from: ``urls`` (serve's --triton-url, repeated) where given,
        each with what ``backends`` says of it (the first, when ``backends`` is empty, with
        this section's http_url and metrics_url: one Triton, as before pools); else
        ``backends``; else the one at ``url``."""
        if not urls:
            if self.backends:
                return list(self.backends)
            urls = [self.url]
        listed = {b.grpc_url: b for b in self.backends}
        pool = []
        for i, url in enumerate(urls):
            known = listed.get(url)
            if known is not None:
                pool.append(known)
            elif i == 0 and not self.backends:
                pool.append(
                    TritonBackend(
                        grpc_url=url, http_url=self.http_url, metrics_url=self.metrics_url
                    )
                )
            else:
                pool.append(TritonBackend(grpc_url=url))
        return pool


class Queues(_Strict):
    """Caps on what waits: global ones, per-tenant defaults, and answers held for clients."""

    max_queued: int = Field(
        default=DEFAULT_GLOBAL_MAX_QUEUED,
        ge=1,
        description="Requests queued in the whole frontend; beyond, 503 'Exceeds maximum "
        "queue size'.",
    )
    max_queued_bytes: int = Field(
        default=DEFAULT_GLOBAL_MAX_QUEUED_BYTES,
        ge=1,
        description="Tensor bytes queued in the whole frontend; beyond, the same 503.",
    )
    tenant_bytes_share: float = Field(
        default=DEFAULT_TENANT_BYTES_SHARE,
        gt=0,
        le=1,
        description="Fraction of max_queued_bytes one tenant may have queued, over all models "
        "together, unless its own max_queued_bytes says otherwise: one tenant cannot fill the "
        "global cap and lock the others out (0.25: at least four tenants share it). Beyond, "
        "503 'Exceeds maximum queue size', shed by the shells once the core has said so.",
    )
    engine_queue_slots: float = Field(
        default=DEFAULT_ENGINE_QUEUE_SLOTS,
        gt=0,
        description="Engine endpoints (max_inflight): requests one tenant may have queued per "
        "model, in multiples of the endpoint's slots (4 x 64 = 256 for the shipped llm), "
        "unless its own max_queued says otherwise. The throttle refuses sooner what would "
        "wait for a slot beyond the latency target.",
    )
    programs_per_tenant: int = Field(
        default=DEFAULT_PROGRAMS_PER_TENANT,
        ge=1,
        description="Programs (an agent's run, a chat session: the x-program-id header, the "
        "program parameter, an OpenAI call's user) one tenant's queue on one model keeps "
        "apart; its programs share its turns by least attained service (halved every 10 s). "
        "Beyond, an idle program's place is taken, or, where every one has queued work, "
        "further ids share one overflow program: a flood of ids costs bounded memory. 1: "
        "programs are not told apart (one queue per tenant, as before). Program ids are "
        "never metric labels.",
    )
    stalled_stream_s: float = Field(
        default=DEFAULT_STALLED_STREAM_S,
        gt=0,
        description="A streamed request (a decoupled model's responses) whose client does not "
        "read is held back: its shell stops reading its stream from Triton (gRPC flow control "
        "holds Triton's sender) while a response waits for the client. Held so for this long, "
        "the request is cancelled in Triton (its slot freed) and ends CANCELLED.",
    )
    stalled_shell_s: float = Field(
        default=DEFAULT_STALLED_SHELL_S,
        gt=0,
        description="A shell process whose link to the core has answers waiting unsent "
        "(beyond the socket's buffers) and takes none of them for this long is cut off (it "
        "stopped reading: hung or stopped); its requests are dropped and it is restarted. A "
        "shell that drains a large burst, however slowly, is never cut.",
    )


class TierGuard(_Strict):
    """Optional guard against starving lower tiers; off unless min_share is set.

    Trade-off: a tier's minimum share is taken from the tiers above it, so under
    overload a paid tier's latency rises by up to that share.
    """

    min_share: dict[str, float] = Field(
        default_factory=dict, description="Tier -> minimum fraction of batches rows, 0-1."
    )


class RateLimiting(_Strict):
    storage: str = Field(
        default=DEFAULT_RATELIMIT_STORAGE, description='"memory://" or "redis://host:port[/db]".'
    )
    on_storage_error: Literal["fail_open", "fail_closed"] = Field(
        default="fail_open",
        description="A check the storage does not answer (down, or silent past timeout_ms): "
        "admit it uncounted (fail_open) or answer 503 (fail_closed); decided per check and "
        "counted in fair_rate_limit_storage_errors_total. After 1 s of nothing but failures "
        "checks take the mode at once, and one every 0.25 s probes the storage.",
    )
    timeout_ms: float = Field(
        default=DEFAULT_RATELIMIT_TIMEOUT_MS,
        gt=0,
        description="Longest Redis may stay silent on a round trip (connecting, or for its "
        "reply, timed from the write on the storage's own connection and thread: this "
        "process's queueing and event-loop lag never count) before its checks take "
        "on_storage_error.",
    )
    storage_password_env: str | None = Field(
        default=None,
        description="Environment variable holding the Redis password (its requirepass), "
        "put into storage's URI at start: the password stays out of the config file and "
        "out of every log line and error. Excludes storage_password_file.",
    )
    storage_password_file: str | None = Field(
        default=None,
        description="File holding the Redis password (its first line), e.g. a mounted "
        "Secret; read at start, never logged. Excludes storage_password_env.",
    )

    def storage_url(self, environ: Mapping[str, str] | None = None) -> str:
        """``storage`` with the password of ``storage_password_env`` / ``_file`` in it
        (``redis://[user]:<password>@host:port/db``): what the limiter connects to. Never
        log it. Raises ``ConfigError`` (naming the field, never the value) when the
        variable is unset or empty, or the file unreadable or empty."""
        env = os.environ if environ is None else environ
        where = "rate_limiting.storage_password_env"
        if self.storage_password_env is not None:
            password = env.get(self.storage_password_env, "")
            if not password:
                raise ConfigError(
                    "(rate_limiting)",
                    [f"{where}: variable {self.storage_password_env} is not set or empty"],
                )
        elif self.storage_password_file is not None:
            where = "rate_limiting.storage_password_file"
            try:
                lines = Path(self.storage_password_file).read_text().splitlines()
            except (OSError, UnicodeDecodeError) as err:
                reason = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
                raise ConfigError(
                    "(rate_limiting)",
                    [f"{where}: cannot read {self.storage_password_file}: {reason}"],
                ) from None
            password = lines[0] if lines else ""
            if not password:
                raise ConfigError(
                    "(rate_limiting)", [f"{where}: {self.storage_password_file} is empty"]
                )
        else:
            return self.storage
        return url_with_password(self.storage, password)


class Auth(_Strict):
    trusted_gateway: bool = Field(
        default=False,
        description="Trust x-tenant-id / the tenant parameter of a request without an API key "
        "when it comes from the authenticating gateway, as trusted_gateway_secret and/or "
        "trusted_gateway_peers prove (one is required). Off by default: never trust a "
        "tenant a client names.",
    )
    trusted_gateway_secret: str | None = Field(
        default=None,
        description="Shared secret the gateway sends in the x-gateway-secret header "
        '(plain, or "sha256:<hex>" of it); compared constant-time. With '
        "trusted_gateway_peers, both must hold.",
    )
    trusted_gateway_secret_env: str | None = Field(
        default=None,
        description="Environment variable holding trusted_gateway_secret instead (read at "
        "start and on reload).",
    )
    trusted_gateway_peers: list[str] = Field(
        default_factory=list,
        description="Addresses or CIDR networks the gateway connects from (the TCP peer; "
        "X-Forwarded-For is never read). With trusted_gateway_secret, both must hold.",
    )


class Observability(_Strict):
    max_metric_tenants: int = Field(
        default=DEFAULT_MAX_METRIC_TENANTS,
        ge=1,
        description="Tenants that get their own metric label; the rest share 'other'.",
    )
    log_format: Literal["json", "text"] = Field(
        default="json", description="One JSON object per log line, or plain text."
    )
    request_log: Literal["shell", "core"] = Field(
        default="shell",
        description="Who writes the request-log line of a request that takes one hop (a "
        "unary call of an endpoint with unary: one_hop, and a decoupled model's stream, "
        "with shells in processes of their own): shell, the shell that answers it (the "
        "default: the line costs the core nothing; a fleet's log is its cores' and shells' "
        "together), or core, which writes every request's line (one log, at a line's CPU "
        "per request on the core). Every other request's line is the core's either way.",
    )
    ema_alpha: float = Field(
        default=DEFAULT_EMA_ALPHA,
        gt=0,
        le=1,
        description="Weight of the newest interval in the feedback loop's moving averages.",
    )


class Tracing(_Strict):
    """OpenTelemetry traces of requests (``fair_frontend.observability.tracing``): off
    unless an OTLP endpoint is named."""

    otlp_endpoint: str | None = Field(
        default=None,
        description="Where spans go: an OTLP/HTTP traces URL (e.g. "
        "http://otel-collector:4318/v1/traces); none: no traces, no cost (the default). "
        "The exporter reads OTEL_EXPORTER_OTLP_HEADERS for a collector's credentials.",
    )
    sample_ratio: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="The share of requests traced among those whose client sent no "
        "traceparent; a client's traceparent decides for its own request (sampled or "
        "not, W3C trace context).",
    )
    service_name: str = Field(
        default="fair-frontend", min_length=1, description="The traces' service.name."
    )
    export_delay_s: float = Field(
        default=1.0,
        gt=0,
        description="How long finished spans gather before they are sent (in a batch, "
        "off the event loop).",
    )


class SideDoors(_Strict):
    """Model metadata, config, readiness and statistics calls: what each shell keeps of
    Triton's answers, so that a flood of them reaches Triton once per question and TTL."""

    metadata_ttl_s: float = Field(
        default=DEFAULT_METADATA_TTL_S,
        ge=0,
        description="How long a model's metadata and config (per model and version) are kept "
        "before Triton is asked again; 0: not kept (concurrent identical calls still share "
        "one lookup). A config reload empties the cache.",
    )
    ready_ttl_s: float = Field(
        default=DEFAULT_READY_TTL_S,
        ge=0,
        description="How long a model's (and the server's) readiness is kept.",
    )
    negative_ttl_s: float = Field(
        default=DEFAULT_NEGATIVE_TTL_S,
        ge=0,
        description="How long Triton's answer that a model or version does not exist is kept "
        "(model names are client input).",
    )
    max_entries: int = Field(
        default=DEFAULT_SIDE_DOOR_CACHE_ENTRIES,
        ge=1,
        description="Answers kept per shell at most; the least recently used go first.",
    )


class Config(_Strict):
    scheduling: Literal["fair", "fifo"] = Field(
        default="fair",
        description="fair: tier, deficit round robin, priority. fifo: one shared queue in "
        "arrival order (the baseline for comparisons).",
    )
    priority_levels: int = Field(
        default=DEFAULT_PRIORITY_LEVELS,
        ge=1,
        description="Request priorities 1 (highest) .. this; 0 asks for the default level.",
    )
    server: Server = Field(default_factory=Server, description="Listeners.")
    triton: Triton = Field(default_factory=Triton, description="The Triton behind the frontend.")
    queues: Queues = Field(
        default_factory=Queues, description="Queue caps: global, per-tenant defaults, answers."
    )
    tier_guard: TierGuard = Field(
        default_factory=TierGuard, description="Optional minimum share of lower tiers."
    )
    rate_limiting: RateLimiting = Field(
        default_factory=RateLimiting, description="Where rate-limit counters live."
    )
    auth: Auth = Field(default_factory=Auth, description="Tenant identity.")
    core_link: CoreLink = Field(
        default_factory=CoreLink,
        description="The core's port for shells on other hosts: its bounds.",
    )
    observability: Observability = Field(
        default_factory=Observability, description="Metrics labels, logs, feedback."
    )
    tracing: Tracing = Field(
        default_factory=Tracing, description="Request traces (OpenTelemetry), off by default."
    )
    side_doors: SideDoors = Field(
        default_factory=SideDoors,
        description="Caching of model metadata, config and readiness answers.",
    )
    endpoints: dict[str, Endpoint] = Field(
        default_factory=dict, description="Scheduling policy per model (Triton model name)."
    )
    default_endpoint: Endpoint = Field(
        default_factory=Endpoint,
        description="Policy for Triton models without an entry in endpoints.",
    )
    tiers: list[str] = Field(
        min_length=1, description="SLA tiers, highest first; served in strict order."
    )
    tier_models: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Models each tier's tenants may call (Triton model names; "
        '"*": every model, those added to Triton later too). Closed by default: a model '
        "no list opens is refused (403 / PERMISSION_DENIED naming it) on every door: "
        "inference, streams, generate, model metadata, config, readiness and statistics. "
        "A tier without an entry may call none; a tenant's models, extra_models and "
        "denied_models change its own list. Names need no endpoints entry.",
    )
    tier_limits: dict[str, dict[str, Limits]] = Field(
        default_factory=dict, description="Rate limits per tier and model."
    )
    tier_top_priority: dict[str, int] = Field(
        default_factory=dict,
        description="The highest priority level each tier's requests may ask for (1 = the "
        "highest); one asking higher gets this level (clamped, not refused), on every route "
        "(the OpenAI routes' service_tier echoes the tier used). A tier without an entry: "
        "every level. Priority only orders a tenant's own queue.",
    )
    tenants: dict[str, Tenant] = Field(
        default_factory=dict, description="Tenants by name: tier, weight, keys, limits."
    )
    slo_classes: dict[str, SloClassConfig] = Field(
        default_factory=dict,
        description="SLO classes by name, e.g. `interactive: {kind: interactive, ttft_ms: "
        "500, itl_ms: 50}`, `bulk: {kind: batch, deadline_s: 600}`. A request's class is the "
        "one it names (the slo_class parameter or the x-slo-class header; a name not here is "
        "refused with 400), else its tenant's slo_class, else its tier's (tier_slo_classes); "
        "none: the endpoint's latency_target_ms, as before. The throttle judges a request "
        "against its class's target; attainment is exported per tenant and class "
        "(fair_slo_attainment, fair_slo_class_attainment).",
    )
    tier_slo_classes: dict[str, str] = Field(
        default_factory=dict,
        description="Tier -> SLO class (one of slo_classes) of its tenants' requests that "
        "name none and whose tenant has no slo_class.",
    )

    @model_validator(mode="after")
    def _cross_references(self) -> Config:
        problems = reference_problems(self.model_dump(mode="json"))
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _reading_fits_a_request(self) -> Config:
        reading = self.server.http_max_reading_bytes
        if reading is not None and reading < self.max_wire_bytes():
            raise ValueError(
                f"server.http_max_reading_bytes: {reading} is less than the largest request "
                f"body a model accepts ({self.max_wire_bytes()} bytes), which could then "
                "never be read"
            )
        return self

    @model_validator(mode="after")
    def _link_carries_a_request(self) -> Config:
        given = self.core_link.max_message_bytes
        if given is not None and given < self.least_link_message_bytes():
            raise ValueError(
                f"core_link.max_message_bytes: {given} is less than the largest record a "
                f"shell may need to send ({self.least_link_message_bytes()} bytes: twice the "
                "largest request a model accepts and 1 MiB), which would end its connection"
            )
        return self

    # -- derived views -------------------------------------------------------------------

    def least_link_message_bytes(self) -> int:
        """The largest record a shell sends the core: a request's tensors (at most its
        model's max_request_bytes) and the rest of it (at most its body), each at most
        ``max_wire_bytes``, and 1 MiB; at least what one message carries."""
        need = 2 * self.max_wire_bytes() + WIRE_FRAMING_BYTES
        return min(max(need, MESSAGE_BYTES), MAX_FRAME)

    def link_max_message_bytes(self) -> int:
        """``core_link.max_message_bytes``, or its default."""
        return self.core_link.max_message_bytes or self.least_link_message_bytes()

    def endpoint(self, model: str) -> Endpoint:
        """The policy for a model: its entry, else the default policy."""
        return self.endpoints.get(model, self.default_endpoint)

    def max_wire_bytes(self) -> int:
        """The largest request any model accepts (``Endpoint.max_wire_bytes``): the
        transports' own caps, a backstop behind each request's own model's bound."""
        eps = [*self.endpoints.values(), self.default_endpoint]
        return max(ep.max_wire_bytes for ep in eps)

    def http_max_reading_bytes(self) -> int:
        """Bytes of HTTP bodies a shell reads and decodes at once (``server``'s, else
        ``HTTP_READING_REQUESTS`` of the largest request)."""
        explicit = self.server.http_max_reading_bytes
        return explicit if explicit is not None else HTTP_READING_REQUESTS * self.max_wire_bytes()

    def grpc_max_concurrent_calls(self) -> int:
        """gRPC calls a shell handles at once (``server``'s, else what the global queue
        holds and ``GRPC_CALLS_HEADROOM``)."""
        explicit = self.server.grpc_max_concurrent_calls
        return explicit if explicit is not None else self.queues.max_queued + GRPC_CALLS_HEADROOM

    def limits_for(self, tenant: str, endpoint: str) -> Limits:
        """The tenant's effective limits on an endpoint (tier's, overridden by the tenant's)."""
        t = self.tenants[tenant]
        base = self.tier_limits.get(t.tier, {}).get(endpoint, Limits())
        return base.merged(t.limits.get(endpoint))

    def top_priority(self, tenant: str) -> int:
        """The highest level the tenant's requests may ask for (``tier_top_priority``)."""
        t = self.tenants.get(tenant)
        return 1 if t is None else self.tier_top_priority.get(t.tier, 1)

    def slo_classes_by_name(self) -> dict[str, SloClass]:
        """The SLO classes by name, as the policy takes them (seconds)."""
        return {name: c.slo_class(name) for name, c in self.slo_classes.items()}

    def slo_class_of(self, tenant: str) -> str | None:
        """The SLO class of ``tenant``'s requests that name none: its own, else its tier's."""
        t = self.tenants.get(tenant)
        if t is None:
            return None
        return t.slo_class or self.tier_slo_classes.get(t.tier)

    def default_priority(self, tenant: str | None, endpoint: str) -> int:
        """The level a request with priority 0 gets: tenant's, endpoint's, or the middle level."""
        if tenant is not None:
            level = self.tenants[tenant].default_priority
            if level is not None:
                return level
        ep = self.endpoint(endpoint).default_priority
        if ep is not None:
            return ep
        return (self.priority_levels + 1) // 2


def reference_problems(data: Mapping[str, Any]) -> list[str]:
    """Problems across fields (unknown tiers, shared keys, ...), on raw or dumped data.

    Defensive about types so that it also runs on a file whose fields failed validation:
    then the operator sees every problem at once.
    """
    problems: list[str] = []

    def mapping(value: Any) -> Mapping[str, Any]:
        return value if isinstance(value, Mapping) else {}

    raw_tiers = data.get("tiers")
    tier_list = [t for t in raw_tiers if isinstance(t, str)] if isinstance(raw_tiers, list) else []
    tiers = set(tier_list)
    if len(tiers) != len(tier_list):
        problems.append(f"tiers: duplicate names in {tier_list}")
    for name in tier_list:
        if not _NAME_RE.match(name):
            problems.append(f"tiers: {name!r} is not a valid name")
    for tier in mapping(data.get("tier_limits")):
        if tier not in tiers:
            problems.append(f"tier_limits.{tier}: unknown tier (tiers: {tier_list})")
    levels = data.get("priority_levels", DEFAULT_PRIORITY_LEVELS)
    for tier, top in mapping(data.get("tier_top_priority")).items():
        if tier not in tiers:
            problems.append(f"tier_top_priority.{tier}: unknown tier (tiers: {tier_list})")
        elif not isinstance(top, int) or (isinstance(levels, int) and not 1 <= top <= levels):
            problems.append(f"tier_top_priority.{tier}: {top} is not a level 1 to {levels}")
    for tier, models in mapping(data.get("tier_models")).items():
        if tier not in tiers:
            problems.append(f"tier_models.{tier}: unknown tier (tiers: {tier_list})")
        problems.extend(_model_list_problems(f"tier_models.{tier}", models))
    slo_names = set(mapping(data.get("slo_classes")))
    for tier, slo in mapping(data.get("tier_slo_classes")).items():
        if tier not in tiers:
            problems.append(f"tier_slo_classes.{tier}: unknown tier (tiers: {tier_list})")
        if slo not in slo_names:
            problems.append(
                f"tier_slo_classes.{tier}: unknown SLO class {slo!r} "
                f"(slo_classes: {sorted(slo_names)})"
            )
    for tname, raw_tenant in mapping(data.get("tenants")).items():
        slo = mapping(raw_tenant).get("slo_class")
        if slo is not None and slo not in slo_names:
            problems.append(
                f"tenants.{tname}.slo_class: unknown SLO class {slo!r} "
                f"(slo_classes: {sorted(slo_names)})"
            )
    for name in slo_names:
        if not _NAME_RE.match(str(name)):
            problems.append(f"slo_classes: {name!r} is not a valid name")
    shares = mapping(mapping(data.get("tier_guard")).get("min_share"))
    for tier, share in shares.items():
        if tier not in tiers:
            problems.append(f"tier_guard.min_share.{tier}: unknown tier")
        if isinstance(share, (int, float)) and not 0 <= share < 1:
            problems.append(f"tier_guard.min_share.{tier}: {share} is not in [0, 1)")
    if sum(v for v in shares.values() if isinstance(v, (int, float))) >= 1:
        problems.append("tier_guard.min_share: shares must add up to less than 1")
    levels = data.get("priority_levels", DEFAULT_PRIORITY_LEVELS)
    levels = levels if isinstance(levels, int) else DEFAULT_PRIORITY_LEVELS
    seen_keys: dict[str, str] = {}
    for tname, raw_tenant in mapping(data.get("tenants")).items():
        where = f"tenants.{tname}"
        tenant = mapping(raw_tenant)
        if not _NAME_RE.match(str(tname)):
            problems.append(f"{where}: {tname!r} is not a valid tenant name")
        tenant_tier = tenant.get("tier")
        if isinstance(tenant_tier, str) and tenant_tier not in tiers:
            problems.append(f"{where}.tier: unknown tier {tenant_tier!r} (tiers: {tier_list})")
        level = tenant.get("default_priority")
        if isinstance(level, int) and level > levels:
            problems.append(f"{where}.default_priority: {level} exceeds priority_levels ({levels})")
        problems.extend(_tenant_models_problems(where, tenant))
        keys = tenant.get("api_keys")
        for i, key in enumerate(keys if isinstance(keys, list) else []):
            if not isinstance(key, str):
                continue
            # Never echo a key in an error: say where, not what.
            if key.startswith(SHA256_PREFIX) and not _SHA256_RE.match(key):
                problems.append(
                    f"{where}.api_keys[{i}]: 'sha256:' must be followed by 64 lowercase hex digits"
                )
            if not key.strip():
                problems.append(f"{where}.api_keys[{i}]: empty key")
            ident = key if key.startswith(SHA256_PREFIX) else key.strip()
            if seen_keys.setdefault(ident, str(tname)) != tname:
                problems.append(
                    f"{where}.api_keys[{i}]: the same key is given to tenant {seen_keys[ident]!r}"
                )
    for ename, raw_ep in mapping(data.get("endpoints")).items():
        ep = mapping(raw_ep)
        level = ep.get("default_priority")
        if isinstance(level, int) and level > levels:
            problems.append(
                f"endpoints.{ename}.default_priority: exceeds priority_levels ({levels})"
            )
        problems.extend(_endpoint_problems(f"endpoints.{ename}", ep))
    default_ep = data.get("default_endpoint")
    if isinstance(default_ep, Mapping):
        problems.extend(_endpoint_problems("default_endpoint", default_ep))
    problems.extend(_auth_problems(mapping(data.get("auth"))))
    problems.extend(_storage_problems(mapping(data.get("rate_limiting"))))
    problems.extend(_triton_problems(mapping(data.get("triton"))))
    return problems


def _triton_problems(triton: Mapping[str, Any]) -> list[str]:
    """A pool's URLs: each named once, and a single Triton's fields not beside a pool."""
    problems: list[str] = []
    backends = triton.get("backends")
    if not isinstance(backends, list) or not backends:
        return problems
    if triton.get("http_url") is not None or triton.get("metrics_url") is not None:
        problems.append(
            "triton.http_url and metrics_url are for a single Triton: with triton.backends, "
            "set them on each backend"
        )
    urls = [b.get("grpc_url") for b in backends if isinstance(b, Mapping)]
    for i, url in enumerate(urls):
        if isinstance(url, str) and not url.strip():
            problems.append(f"triton.backends[{i}].grpc_url: empty")
    named = [u for u in urls if isinstance(u, str)]
    if len(set(named)) != len(named):
        problems.append(f"triton.backends: a grpc_url is listed twice ({named})")
    return problems


REDIS_SCHEMES = ("redis", "rediss", "unix")


def _storage_problems(limiting: Mapping[str, Any]) -> list[str]:
    """The Redis password comes from one place, and only a Redis takes one. Problems name
    the fields, never the URI (it may hold a password)."""
    problems: list[str] = []
    storage = limiting.get("storage")
    env, file = limiting.get("storage_password_env"), limiting.get("storage_password_file")
    if env is not None and file is not None:
        problems.append(
            "rate_limiting: storage_password_env and storage_password_file exclude each other"
        )
    if not isinstance(storage, str) or (env is None and file is None):
        return problems
    parts = urlsplit(storage)
    field = "storage_password_env" if env is not None else "storage_password_file"
    if parts.scheme not in REDIS_SCHEMES:
        problems.append(
            f"rate_limiting.{field}: only a Redis storage (redis://, rediss://, unix://) takes "
            "a password"
        )
    elif parts.password is not None:
        problems.append(
            f"rate_limiting.{field}: storage's URI already holds a password; keep it in one "
            "place (the variable or file, not the URI)"
        )
    for name in ("storage_password_env", "storage_password_file"):
        value = limiting.get(name)
        if isinstance(value, str) and not value.strip():
            problems.append(f"rate_limiting.{name}: empty")
    return problems


def url_with_password(url: str, password: str) -> str:
    """``url`` with ``password`` as its userinfo's password (percent-encoded; redis-py
    decodes it), keeping a user name the URL has: ``redis://[user]:<password>@host...``."""
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0] if at else ""
    netloc = f"{user}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _model_list_problems(where: str, models: Any) -> list[str]:
    """A list of model names: each a name a request could send (a model name needs no
    endpoints entry: Triton may serve models the config does not name)."""
    problems: list[str] = []
    for i, name in enumerate(models if isinstance(models, list) else []):
        if not isinstance(name, str):
            continue
        if not name.strip():
            problems.append(f"{where}[{i}]: empty model name")
        elif name != name.strip():
            problems.append(f"{where}[{i}]: {name!r} has spaces around it")
        elif len(name.encode()) > MAX_NAME_BYTES:
            problems.append(f"{where}[{i}]: a model name is at most {MAX_NAME_BYTES} bytes")
    return problems


def _tenant_models_problems(where: str, tenant: Mapping[str, Any]) -> list[str]:
    """A tenant's own access lists: valid names, and no model both opened and denied."""
    problems: list[str] = []

    def names(field: str) -> list[str]:
        value = tenant.get(field)
        problems.extend(_model_list_problems(f"{where}.{field}", value))
        return [n for n in value if isinstance(n, str)] if isinstance(value, list) else []

    own, extra, denied = names("models"), names("extra_models"), names("denied_models")
    if tenant.get("models") is not None and extra:
        problems.append(
            f"{where}: models (instead of the tier's list) and extra_models (beside it) "
            "exclude each other: list every model in models"
        )
    opened = set(own) | set(extra)
    if ALL_MODELS in denied and opened:
        problems.append(
            f"{where}.denied_models: '*' closes every model, but models or extra_models "
            f"open {sorted(opened)}"
        )
    both = opened & set(denied)
    if both - {ALL_MODELS}:
        problems.append(
            f"{where}.denied_models: {sorted(both)} also opened by models or extra_models"
        )
    return problems


def _auth_problems(auth: Mapping[str, Any]) -> list[str]:
    """The trusted gateway needs proof of who sends: a secret, peers, or both."""
    problems: list[str] = []
    secret, env = auth.get("trusted_gateway_secret"), auth.get("trusted_gateway_secret_env")
    peers = auth.get("trusted_gateway_peers")
    peers = peers if isinstance(peers, list) else []
    if secret is not None and env is not None:
        problems.append(
            "auth: trusted_gateway_secret and trusted_gateway_secret_env exclude each other"
        )
    if isinstance(secret, str) and not secret.strip():
        problems.append("auth.trusted_gateway_secret: empty secret")
    hashed = isinstance(secret, str) and secret.startswith(SHA256_PREFIX)
    if hashed and not _SHA256_RE.match(str(secret)):
        problems.append(
            "auth.trusted_gateway_secret: 'sha256:' must be followed by 64 lowercase hex digits"
        )
    if isinstance(env, str) and not os.environ.get(env):
        problems.append(f"auth.trusted_gateway_secret_env: variable {env} is not set")
    for i, peer in enumerate(peers):
        try:
            ipaddress.ip_network(str(peer), strict=False)
        except ValueError:
            problems.append(
                f"auth.trusted_gateway_peers[{i}]: {peer!r} is not an address or CIDR network"
            )
    if auth.get("trusted_gateway") is True and secret is None and env is None and not peers:
        problems.append(
            "auth.trusted_gateway: set trusted_gateway_secret (or trusted_gateway_secret_env), "
            "trusted_gateway_peers, or both: without proof that a request comes from the "
            "gateway, anyone who reaches the port could name any tenant"
        )
    return problems


# Fields of earlier versions, and what replaced them (said instead of "extra inputs").
REMOVED_FIELDS = {
    "lengths_input": "removed: row lengths travel in the fair_rows request parameter, not "
    "as a model input; name its list with lengths_field (the shipped models: `length`)",
    "max_tokens_input": "removed: tokens to generate are a request parameter, not a model "
    "input; use max_tokens_parameter (the shipped generate: `max_tokens`), "
    "max_tokens_default and max_tokens_limit",
}
# fair_rows lists the frontend always sends; a model's own lists must not reuse them.
ROW_FIELDS = ("tenant", "priority", "deadline_us", "id")


def _endpoint_problems(where: str, ep: Mapping[str, Any]) -> list[str]:
    """An endpoint's cross-field problems: the max_tokens fields, the fair_rows lists."""
    problems: list[str] = []
    param = ep.get("max_tokens_parameter")
    default, limit = ep.get("max_tokens_default"), ep.get("max_tokens_limit")
    if isinstance(param, str):
        reserved = param in RESERVED_PARAMETERS or param in (
            TENANT_PARAMETER,
            PROGRAM_PARAMETER,
            SLO_CLASS_PARAMETER,
        )
        if reserved or param.startswith((RESERVED_PREFIX, FRONTEND_PREFIX)) or not param:
            problems.append(
                f"{where}.max_tokens_parameter: {param!r} is reserved (Triton's, the "
                "frontend's or the tenant's parameter)"
            )
        if default is None:
            problems.append(
                f"{where}.max_tokens_default: required with max_tokens_parameter (the "
                "tokens a request that does not send it asks for: the model's default)"
            )
    else:
        for name in ("max_tokens_default", "max_tokens_limit"):
            if ep.get(name) is not None:
                problems.append(f"{where}.{name}: needs max_tokens_parameter")
    if isinstance(default, int) and isinstance(limit, int) and default > limit:
        problems.append(f"{where}.max_tokens_default: {default} exceeds max_tokens_limit ({limit})")
    if ep.get("max_inflight") is not None and ep.get("max_inflight_batches") is not None:
        problems.append(
            f"{where}: max_inflight (engine mode: requests in the engine) and "
            "max_inflight_batches (batches built here) exclude each other"
        )
    slots = ep.get("max_inflight")
    for name in ("reserved_slots", "light_slots"):
        kept = ep.get(name)
        if isinstance(kept, int) and kept:
            if not isinstance(slots, int):
                problems.append(f"{where}.{name}: needs max_inflight (engine mode)")
            elif kept >= slots:
                problems.append(f"{where}.{name}: {kept} must be less than max_inflight ({slots})")
    keys, rules = ep.get("sampling_keys"), ep.get("sampling_rules")
    if isinstance(keys, list):
        known = KNOWN_KEYS.get(SamplingRules(rules)) if rules in list(SamplingRules) else None
        if rules is None:
            problems.append(f"{where}.sampling_keys: needs sampling_rules")
        elif known is not None:
            strange = [k for k in keys if k not in known]
            if strange:
                problems.append(
                    f"{where}.sampling_keys: {strange} are not sampling parameters of "
                    f"{SamplingRules(rules).value} (known: {', '.join(known)})"
                )
    tokenizer = ep.get("tokenizer")
    if isinstance(tokenizer, str) and not os.path.isfile(tokenizer):
        problems.append(f"{where}.tokenizer: no such file: {tokenizer}")
    padding = ep.get("padding")
    inputs = padding.get("inputs") if isinstance(padding, Mapping) else None
    fields: dict[str, str] = {}
    for name, spec in (inputs if isinstance(inputs, Mapping) else {}).items():
        field = spec.get("lengths_field") if isinstance(spec, Mapping) else None
        if not isinstance(field, str):
            continue
        at = f"{where}.padding.inputs.{name}.lengths_field"
        if field in ROW_FIELDS or field == param:
            problems.append(
                f"{at}: {field!r} is already a fair_rows list (taken: "
                f"{', '.join([*ROW_FIELDS, *([param] if isinstance(param, str) else [])])})"
            )
        elif field in fields:
            problems.append(f"{at}: {field!r} is also the lengths_field of {fields[field]}")
        fields.setdefault(field, name)
    return problems


def _format_validation_error(err: ValidationError) -> list[str]:
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        last = e["loc"][-1] if e["loc"] else None
        if e["type"] == "extra_forbidden" and last in REMOVED_FIELDS:
            problems.append(f"{loc}: {REMOVED_FIELDS[str(last)]}")
        elif e["type"] == "value_error" and "; " in msg:
            problems.extend(msg.split("; "))
        else:
            problems.append(f"{loc}: {msg}")
    return problems


def parse_config(data: Mapping[str, Any], source: str = "<dict>") -> Config:
    """Validate a mapping; raise ``ConfigError`` listing every problem."""
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        problems = _format_validation_error(err)
    # Field errors stop pydantic before the cross-field check: run it on the raw data too.
    for problem in reference_problems(data):
        if problem not in problems:
            problems.append(problem)
    raise ConfigError(source, problems)


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML file; raise ``ConfigError`` listing every problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise ConfigError(str(p), [f"cannot read: {err.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(str(p), [f"not valid YAML: {err}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(str(p), ["the top level must be a mapping"])
    resolve_relative_paths(data, p.parent)
    return parse_config(data, str(p))


def model_name_warnings(config: Config) -> list[str]:
    """Model names in ``tier_models``, the limits and the tenants' model lists that no
    ``endpoints`` entry carries, each with the closest endpoint's name where one is close
    (``difflib``). Said at start (and by check-config), not refused: a name needs no entry
    (Triton may serve models the config does not name, with ``default_endpoint``'s
    policy), but a misspelt one opens or limits nothing the operator meant it to. Nothing
    to say where no endpoints are configured."""
    known = sorted(config.endpoints)
    if not known:
        return []
    named: list[tuple[str, str]] = []  # (where, name)
    for tier, models in config.tier_models.items():
        named += [(f"tier_models.{tier}", m) for m in models]
    for tier, per_model in config.tier_limits.items():
        named += [(f"tier_limits.{tier}", m) for m in per_model]
    for tname, tenant in config.tenants.items():
        named += [(f"tenants.{tname}.limits", m) for m in tenant.limits]
        for field in ("models", "extra_models", "denied_models"):
            named += [(f"tenants.{tname}.{field}", m) for m in getattr(tenant, field) or []]
    warnings = []
    for where, name in named:
        if name == ALL_MODELS or name in config.endpoints:
            continue
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        warnings.append(
            f"{where}: no endpoint is named '{name}'{hint}; endpoints: {', '.join(known)}. "
            "It applies only to a Triton model of that name, served with default_endpoint's "
            "policy"
        )
    return warnings


def resolve_relative_paths(data: dict[str, Any], folder: Path) -> None:
    """Relative tokenizer paths are from the config file's folder: made absolute in
    ``data`` (the raw mapping, before validation)."""
    endpoints = data.get("endpoints")
    eps = list(endpoints.values()) if isinstance(endpoints, dict) else []
    eps.append(data.get("default_endpoint"))
    for ep in eps:
        path = ep.get("tokenizer") if isinstance(ep, dict) else None
        if isinstance(path, str) and path and not os.path.isabs(path):
            ep["tokenizer"] = str((folder / path).resolve())


def reference() -> str:
    """The configuration reference as Markdown tables, from the field declarations
    (``fair-frontend config-reference``; the README embeds it and a test keeps it current)."""
    sections: list[tuple[str, type[BaseModel]]] = [
        ("top level", Config),
        ("`server`", Server),
        ("`triton`", Triton),
        ("`triton.backends[]`", TritonBackend),
        ("`queues`", Queues),
        ("`tier_guard`", TierGuard),
        ("`rate_limiting`", RateLimiting),
        ("`auth`", Auth),
        ("`core_link`", CoreLink),
        ("`observability`", Observability),
        ("`tracing`", Tracing),
        ("`side_doors`", SideDoors),
        ("`endpoints.<model>` and `default_endpoint`", Endpoint),
        ("`padding` (of an endpoint)", Padding),
        ("`padding.inputs.<input>`", PaddedInput),
        ("`padding.outputs.<output>`", PaddedOutput),
        ("`tenants.<name>`", Tenant),
        ("`slo_classes.<name>`", SloClassConfig),
        ("limits (`tier_limits.<tier>.<model>`, `tenants.<name>.limits.<model>`)", Limits),
    ]
    out = []
    for title, model in sections:
        out.append(f"#### {title}\n")
        out.append("| field | type | default | meaning |")
        out.append("| --- | --- | --- | --- |")
        for name, field in model.model_fields.items():
            annotation = str(field.annotation)
            for noise in (
                "typing.",
                "fair_frontend.config.",
                "fair_frontend.sampling.",
                "<class '",
                "'>",
            ):
                annotation = annotation.replace(noise, "")
            annotation = annotation.replace("|", "or")
            if field.is_required():
                default = "required"
            elif field.default_factory is not None:
                factory: Any = field.default_factory
                nested = isinstance(factory, type) and issubclass(factory, BaseModel)
                default = "its section" if nested else f"`{factory()!r}`"
            else:
                value = field.default
                default = f"`{value.value if isinstance(value, enum.Enum) else value}`"
            doc = (field.description or "").replace("|", "\\|")
            out.append(f"| `{name}` | {annotation} | {default} | {doc} |")
        out.append("")
    return "\n".join(out)
