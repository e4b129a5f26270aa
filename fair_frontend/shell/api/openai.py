"""OpenAI's API as the frontend answers it: requests in, KServe ``InferRequest`` out, and
OpenAI's responses, stream chunks and errors back. No I/O here: the shell's routes
(``fair_frontend.shell.api_http``) read the bodies, call the ``Gateway`` and write.

Each OpenAI call becomes the KServe call(s) a client of the model would make, so the fair
scheduler, rate limits, charge-back and metrics apply unchanged:

- ``/v1/chat/completions`` and ``/v1/completions``: one streamed request to an engine
  endpoint (a decoupled model shaped like Triton's vLLM backend: a BYTES text input, the
  endpoint's ``token_input``; ``stream`` and ``exclude_input_in_output`` inputs where the
  model has them; the sampling parameters as the JSON object of its
  ``sampling_parameters_input``, or, for a model without one, each as the input of its
  name where the model has one, TensorRT-LLM's ``max_tokens``, ``temperature``, ``top_p``,
  and as request parameters otherwise). Chat messages become one prompt by ``CHAT_TEMPLATE``.
  The model streams one response per token; the route relays them as OpenAI chunks, or
  gathers them for a whole answer. ``stop`` strings are found here, in the text as it
  streams (vLLM's server does the same): the text ends before the stop string, and the
  request is cancelled, which frees its engine slot at once.
- ``/v1/embeddings``: one request per input to a token-cost endpoint (its
  ``token_input``: token ids, one row), so the fair batches interleave a tenant's long
  list with other tenants' short ones; only the first counts against the requests limits.
  An exported encoder's other required inputs go with the ids (``COMPANION_FILL``:
  ``attention_mask`` of ones, ``token_type_ids`` of zeros).

Errors are OpenAI's envelope, ``{"error": {"message", "type", "param", "code"}}``, with
the statuses OpenAI's SDKs branch on (``envelope``): 429 ``rate_limit_exceeded``
(retryable: the window will open) versus 429 ``insufficient_quota`` (a day or month
allowance used up: clients must not retry).
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import msgspec
import numpy as np

from fair_frontend import errors
from fair_frontend.config import Config
from fair_frontend.endpoint import EndpointPlan
from fair_frontend.errors import FrontendError, InvalidArgument
from fair_frontend.models import ModelInfo
from fair_frontend.protocol import PROGRAM_PARAMETER, InferRequest, RequestedOutput, Tensor
from fair_frontend.shell.api.body import (
    ABSENT,
    TOKEN_ID_MAX,
    Body,
    Container,
    InvalidText,
    Members,
    NotAnObject,
    NotJson,
    count,
    elements,
    first_element,
    holds_array,
    kind,
    token_ids,
    type_name,
)
from fair_frontend.usage import Usage

# The built-in chat template (ChatML, as Qwen and many others write it): each message as
# ``<|im_start|>{role}\n{content}<|im_end|>\n``, then ``<|im_start|>assistant\n`` for the
# answer. The shipped ``llm`` has no special tokens: the markers are plain text to it.
CHAT_TEMPLATE = "<|im_start|>{role}\n{content}<|im_end|>\n"
CHAT_ANSWER = "<|im_start|>assistant\n"
Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES = frozenset(get_args(Role))

MAX_MESSAGES = 4096
MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_CONTENT_PARTS = 4096  # a message's content parts
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit
MAX_USER_CHARS = 256
OWNED_BY = "fair-frontend"
# A rerank row's longest where neither the model nor the endpoint says (``max_model_len``).
DEFAULT_ROW_TOKENS = 512

# OpenAI's service tiers -> a priority level (``service_tier``): "priority" the highest,
# "flex" the lowest, "auto"/"default" the tenant's default. Priority orders a tenant's own
# queue only (selector 3): no level takes anything from another tenant.
SERVICE_TIERS = ("auto", "default", "flex", "priority")
PRIORITY_HEADER = "x-priority"


class ParamError(InvalidArgument):
    """400 ``invalid_request_error`` naming the request field at fault (``param``)."""

    def __init__(self, param: str | None, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ModelNotFound(InvalidArgument):
    """404 ``model_not_found``: no such model, or not one this route serves."""

    http_status = 404

    def __init__(self, model: str, why: str = "does not exist") -> None:
        super().__init__(f"The model `{model}` {why}")
        self.param = "model"
        self.code = "model_not_found"


def unsupported(model: str, why: str) -> ParamError:
    """400: the model exists but does not serve this route (vLLM answers the same)."""
    return ParamError("model", f"The model `{model}` {why}", "model_not_supported")


# ---- errors ------------------------------------------------------------------------------


def envelope(err: FrontendError) -> tuple[int, dict[str, Any]]:
    """The status and OpenAI error body of ``err`` (``Retry-After`` is the caller's, from
    ``err.retry_after_header``, as on every route)."""
    param = getattr(err, "param", None)
    code = getattr(err, "code", None)
    status = err.http_status
    kind = "invalid_request_error"
    if isinstance(err, errors.UnknownModel):
        status, param, code = 404, "model", "model_not_found"
    elif isinstance(err, errors.Unauthenticated):
        code = "invalid_api_key"
    elif isinstance(err, errors.PermissionDenied):
        kind, code = "permission_error", "model_not_allowed"
    elif isinstance(err, errors.QuotaExhausted):
        kind = code = "insufficient_quota"
    elif isinstance(err, errors.RateLimited):
        kind = "tokens" if " tokens per " in err.message else "requests"
        code = "rate_limit_exceeded"
    elif isinstance(err, errors.Unsupported):
        status, code = 400, code or "unsupported_parameter"
    elif isinstance(err, errors.Unavailable):
        kind, code = "server_error", code or "overloaded"
    elif status >= 500:
        kind = "server_error"
    body = {"error": {"message": err.message, "type": kind, "param": param, "code": code}}
    return status, body


# ---- reading bodies ------------------------------------------------------------------------
#
# A body is read from its bytes (``body.Body``): its top-level members as raw JSON, each then
# decoded when the checks below ask for it, arrays counted before their elements are
# decoded. The checks are written against a ``Mapping`` (``body.Members``), in the order
# they have always run, so that each malformed field is refused with the message it has
# always had: an array or object where a scalar is due is seen as a ``Container``, unbuilt.


class _GenerationShape(msgspec.Struct):
    """The members both completion routes read (any other member is skipped unbuilt)."""

    model: msgspec.Raw = ABSENT
    max_tokens: msgspec.Raw = ABSENT
    logprobs: msgspec.Raw = ABSENT
    n: msgspec.Raw = ABSENT
    frequency_penalty: msgspec.Raw = ABSENT
    presence_penalty: msgspec.Raw = ABSENT
    logit_bias: msgspec.Raw = ABSENT
    temperature: msgspec.Raw = ABSENT
    top_p: msgspec.Raw = ABSENT
    seed: msgspec.Raw = ABSENT
    user: msgspec.Raw = ABSENT
    stream: msgspec.Raw = ABSENT
    stream_options: msgspec.Raw = ABSENT
    service_tier: msgspec.Raw = ABSENT
    priority: msgspec.Raw = ABSENT
    stop: msgspec.Raw = ABSENT


class _ChatShape(_GenerationShape):
    messages: msgspec.Raw = ABSENT
    tools: msgspec.Raw = ABSENT
    functions: msgspec.Raw = ABSENT
    tool_choice: msgspec.Raw = ABSENT
    response_format: msgspec.Raw = ABSENT
    top_logprobs: msgspec.Raw = ABSENT
    max_completion_tokens: msgspec.Raw = ABSENT


class _CompletionShape(_GenerationShape):
    prompt: msgspec.Raw = ABSENT
    echo: msgspec.Raw = ABSENT
    best_of: msgspec.Raw = ABSENT
    suffix: msgspec.Raw = ABSENT


class _MessageShape(msgspec.Struct):
    role: msgspec.Raw = ABSENT
    content: msgspec.Raw = ABSENT


class _PartShape(msgspec.Struct):
    type: msgspec.Raw = ABSENT
    text: msgspec.Raw = ABSENT


class _StreamOptionsShape(msgspec.Struct):
    include_usage: msgspec.Raw = ABSENT


class _ResponseFormatShape(msgspec.Struct):
    type: msgspec.Raw = ABSENT


class _EmbeddingsShape(msgspec.Struct):
    model: msgspec.Raw = ABSENT
    input: msgspec.Raw = ABSENT
    encoding_format: msgspec.Raw = ABSENT
    dimensions: msgspec.Raw = ABSENT
    user: msgspec.Raw = ABSENT


@contextlib.contextmanager
def _reading() -> Iterator[None]:
    """What reading a body raises, as the 400s OpenAI answers (``ParamError``)."""
    try:
        yield
    except NotJson as err:
        raise ParamError(
            None, f"We could not parse the JSON body of your request: {err.detail}"
        ) from None
    except NotAnObject:
        raise ParamError(None, "The request body must be a JSON object") from None
    except InvalidText as err:
        where = err.where
        text = f"'{where}'" if where is not None else "The request body"
        raise ParamError(where, f"{text} is not valid Unicode text: {err.reason}") from None


def decode_chat(raw: bytes, headers: Mapping[str, str], config: Config) -> Generation:
    """A ``/v1/chat/completions`` body, from its bytes, checked."""
    with _reading():
        return _chat(Body(raw).members(_ChatShape), headers, config)


def decode_completion(raw: bytes, headers: Mapping[str, str], config: Config) -> Generation:
    """A ``/v1/completions`` body, from its bytes, checked."""
    with _reading():
        return _completion(Body(raw).members(_CompletionShape), headers, config)


def decode_embeddings(raw: bytes, most_ids: int | None = None) -> Embeddings:
    """A ``/v1/embeddings`` body, from its bytes, checked. ``most_ids``: the model's
    context, where known: a list of token ids longer is refused from its count, before
    any id in it is read."""
    with _reading():
        return _embeddings(Body(raw).members(_EmbeddingsShape), most_ids)


def parse_body(body: bytes) -> dict[str, Any]:
    """A body parsed whole (``json.loads``): for the callers of ``chat_request``,
    ``completion_request`` and ``embeddings_request``; the routes call ``decode_*``."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ParamError(None, f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(doc, dict):
        raise ParamError(None, "The request body must be a JSON object")
    return doc


def _encoded(doc: Mapping[str, Any]) -> bytes:
    """A document parsed by ``json.loads``, as JSON again (a lone surrogate in it as its
    escape, which ``decode_*`` then refuses naming its field)."""
    return json.dumps(doc).encode()


def chat_request(doc: Mapping[str, Any], headers: Mapping[str, str], config: Config) -> Generation:
    """A ``/v1/chat/completions`` body already parsed (``parse_body``), checked as
    ``decode_chat`` checks its bytes."""
    return decode_chat(_encoded(doc), headers, config)


def completion_request(
    doc: Mapping[str, Any], headers: Mapping[str, str], config: Config
) -> Generation:
    """A ``/v1/completions`` body already parsed, checked as ``decode_completion`` does."""
    return decode_completion(_encoded(doc), headers, config)


def embeddings_request(doc: Mapping[str, Any]) -> Embeddings:
    """A ``/v1/embeddings`` body already parsed, checked as ``decode_embeddings`` does."""
    return decode_embeddings(_encoded(doc))


def _get(doc: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], default: Any) -> Any:
    """A member of one of ``kinds`` (None: ``default``); an object member asked for as a
    ``dict`` comes back as its ``Container``, unbuilt."""
    value = doc.get(name)
    if value is None:
        return default
    seq = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, Container):
        if value.kind == "object" and dict in seq:
            return value
    elif isinstance(value, bool) and bool not in seq:
        raise ParamError(name, f"Invalid type for '{name}': expected {_kind(kinds)}, got a bool")
    elif isinstance(value, seq):
        return value
    raise ParamError(
        name, f"Invalid type for '{name}': expected {_kind(kinds)}, got {type_name(value)}"
    )


def _kind(kinds: type | tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    seq = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in seq))


def _number(doc: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = _get(doc, name, (int, float), None)
    if value is None:
        return None
    if not math.isfinite(value) or not low <= value <= high:
        raise ParamError(name, f"'{name}' must be between {low:g} and {high:g}, got {value}")
    return float(value)


def _integer(doc: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = _get(doc, name, int, None)
    if value is None:
        return None
    if not low <= value <= high:
        raise ParamError(name, f"'{name}' must be between {low} and {high}, got {value}")
    return int(value)


def require_model(doc: Mapping[str, Any]) -> str:
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise ParamError("model", "you must provide a model parameter")
    return model


def _refuse_unless(doc: Mapping[str, Any], name: str, allowed: Sequence[Any], why: str) -> None:
    """``name`` absent, null or equal to one of ``allowed`` (as ``==`` has it: 0 is False;
    an empty array or object is ``[]`` or ``{}``), else 400 ``unsupported_parameter``."""
    value = doc.get(name)
    if value is None:
        return
    if isinstance(value, Container):
        empty: Any = [] if value.kind == "array" else {}
        fits = empty in allowed and value.is_empty()
    else:
        fits = value in allowed
    if not fits:
        raise ParamError(name, f"'{name}' is not supported: {why}", "unsupported_parameter")


# ---- completions (chat and plain) -----------------------------------------------------------


@dataclass(slots=True)
class Generation:
    """One completion request, as the engine will run it."""

    model: str
    prompt: str
    max_tokens: int | None
    sampling: dict[str, Any]  # temperature, top_p, seed as given
    stop: list[str]
    stream: bool
    include_usage: bool
    priority: int  # 0: the tenant's default level
    service_tier: str  # what the response echoes
    chat: bool
    # Its ``user``: the program it belongs to inside its tenant ("": none; the gateway
    # takes it from the request's ``program`` parameter, ``protocol.take_program``).
    user: str = ""
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _chat(doc: Members, headers: Mapping[str, str], config: Config) -> Generation:
    """A ``/v1/chat/completions`` body, checked."""
    model = require_model(doc)
    messages = doc.raw("messages")
    n = count(messages, MAX_MESSAGES) if kind(messages) == "array" else 0
    if not n:
        raise ParamError("messages", "'messages' must be a non-empty array of messages")
    if n > MAX_MESSAGES:
        raise ParamError("messages", f"'messages' holds at most {MAX_MESSAGES} messages")
    prompt = _plain_messages(doc.body, messages)
    if prompt is None:
        prompt = "".join(_message(doc.body, i, m) for i, m in enumerate(elements(messages)))
    _refuse_unless(doc, "tools", ([],), "this model calls no tools")
    _refuse_unless(doc, "functions", ([],), "this model calls no functions")
    _refuse_unless(doc, "tool_choice", ("none",), "this model calls no tools")
    fmt = doc.get("response_format")
    if fmt is not None and not _text_format(doc.body, fmt):
        raise ParamError(
            "response_format", "only {'type': 'text'} is supported", "unsupported_parameter"
        )
    _refuse_unless(doc, "logprobs", (False,), "no log probabilities are returned")
    _refuse_unless(doc, "top_logprobs", (0,), "no log probabilities are returned")
    max_tokens = _integer(doc, "max_completion_tokens", 1, 2**63 - 1)
    if max_tokens is None:
        max_tokens = _integer(doc, "max_tokens", 1, 2**63 - 1)
    return _generation(doc, headers, config, model, prompt + CHAT_ANSWER, max_tokens, True)


def _text_format(body: Body, fmt: Any) -> bool:
    """``response_format`` is ``{"type": "text"}`` (other members ignored)."""
    if not isinstance(fmt, Container) or fmt.kind != "object":
        return False
    fields = body.members(_ResponseFormatShape, fmt.raw, "response_format.")
    return bool(fields.get("type") == "text")


class _PlainMessage(msgspec.Struct):
    role: Role
    content: str | None = None


_PLAIN_MESSAGES = msgspec.json.Decoder(list[_PlainMessage])


def _plain_messages(body: Body, raw: msgspec.Raw) -> str | None:
    """The messages as a prompt, decoded at once where each is well formed and its content
    a string (no array inside: nothing unbounded to build); None otherwise, for
    ``_message`` to read one at a time and name what is wrong."""
    if body.marker is not None or holds_array(raw):
        return None
    try:
        messages = _PLAIN_MESSAGES.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return "".join(CHAT_TEMPLATE.format(role=m.role, content=m.content or "") for m in messages)


def _message(body: Body, i: int, raw: msgspec.Raw) -> str:
    where = f"messages[{i}]"
    if kind(raw) != "object":
        raise ParamError(where, f"'{where}' must be an object with 'role' and 'content'")
    message = body.members(_MessageShape, raw, f"{where}.")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ParamError(
            f"{where}.role", f"'{where}.role' must be one of {', '.join(sorted(ROLES))}"
        )
    content = message.raw("content")
    what = kind(content)
    if what in ("absent", "null"):
        text = ""
    elif what == "array":
        text = _content_parts(body, f"{where}.content", content)
    elif what == "string":
        text = body.string(content, f"{where}.content") or ""
    else:
        raise ParamError(f"{where}.content", f"'{where}.content' must be a string or text parts")
    return CHAT_TEMPLATE.format(role=role, content=text)


def _content_parts(body: Body, where: str, raw: msgspec.Raw) -> str:
    """A message's content given as parts: text parts only, at most ``MAX_CONTENT_PARTS``."""
    if count(raw, MAX_CONTENT_PARTS) > MAX_CONTENT_PARTS:
        raise ParamError(where, f"'{where}' holds at most {MAX_CONTENT_PARTS} parts")
    texts = []
    for j, part in enumerate(elements(raw)):
        at = f"{where}[{j}]"
        fields = body.members(_PartShape, part, f"{at}.") if kind(part) == "object" else None
        if fields is None or fields.get("type") != "text":
            raise ParamError(at, f"'{at}': only text parts are supported", "unsupported_parameter")
        text = body.string(fields.raw("text"), f"{at}.text")
        if text is None:
            raise ParamError(f"{at}.text", f"'{at}.text' must be a string")
        texts.append(text)
    return "".join(texts)


def _completion(doc: Members, headers: Mapping[str, str], config: Config) -> Generation:
    """A ``/v1/completions`` body, checked: one text prompt."""
    model = require_model(doc)
    given = doc.raw("prompt")
    prompt = None
    if kind(given) == "array" and count(given, 1) == 1:
        prompt = doc.body.string(elements(given)[0], "prompt[0]")
    elif kind(given) == "string":
        prompt = doc.body.string(given, "prompt")
    if prompt is None:
        raise ParamError(
            "prompt",
            "'prompt' must be a string (or a list of one string): one prompt per request, as text",
        )
    _refuse_unless(doc, "echo", (False,), "the prompt is not echoed")
    _refuse_unless(doc, "best_of", (1,), "one completion per request")
    _refuse_unless(doc, "logprobs", (0,), "no log probabilities are returned")
    _refuse_unless(doc, "suffix", ("",), "no suffix is supported")
    max_tokens = _integer(doc, "max_tokens", 1, 2**63 - 1)
    return _generation(doc, headers, config, model, prompt, max_tokens, False)


def _generation(
    doc: Members,
    headers: Mapping[str, str],
    config: Config,
    model: str,
    prompt: str,
    max_tokens: int | None,
    chat: bool,
) -> Generation:
    n = _integer(doc, "n", 1, 2**63 - 1)
    if n not in (None, 1):
        raise ParamError("n", "'n' must be 1: one choice per request", "unsupported_parameter")
    for penalty in ("frequency_penalty", "presence_penalty"):
        if _number(doc, penalty, -2.0, 2.0):
            raise ParamError(penalty, f"'{penalty}' is not supported", "unsupported_parameter")
    _refuse_unless(doc, "logit_bias", ({},), "no logit bias is supported")
    sampling: dict[str, Any] = {}
    temperature = _number(doc, "temperature", 0.0, 2.0)
    if temperature is not None:
        sampling["temperature"] = temperature
    top_p = _number(doc, "top_p", 0.0, 1.0)
    if top_p is not None:
        if top_p == 0.0:
            raise ParamError("top_p", "'top_p' must be greater than 0")
        sampling["top_p"] = top_p
    seed = _integer(doc, "seed", -(2**63), 2**63 - 1)
    if seed is not None:
        sampling["seed"] = seed
    user = _get(doc, "user", str, "")
    if len(user) > MAX_USER_CHARS:
        raise ParamError("user", f"'user' is at most {MAX_USER_CHARS} characters")
    stream = _get(doc, "stream", bool, False)
    options = _get(doc, "stream_options", dict, None)
    include_usage = False
    if options is not None:
        if not stream:
            raise ParamError(
                "stream_options", "'stream_options' is only allowed when 'stream' is true"
            )
        fields = doc.body.members(_StreamOptionsShape, options.raw, "stream_options.")
        include_usage = _get(fields, "include_usage", bool, False)
    priority, tier = priority_of(doc, headers, config)
    return Generation(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stops(doc),
        stream=stream,
        include_usage=include_usage,
        priority=priority,
        service_tier=tier,
        chat=chat,
        user=user,
    )


def _stops(doc: Members) -> list[str]:
    value = doc.get("stop")
    if value is None:
        return []
    stops: list[Any] = [value]
    if isinstance(value, Container) and value.kind == "array":
        if count(value.raw, MAX_STOPS) > MAX_STOPS:
            raise ParamError("stop", f"'stop' holds at most {MAX_STOPS} sequences")
        stops = [doc.body.scalar(raw, "stop") for raw in elements(value.raw)]
    if not all(isinstance(s, str) for s in stops):
        raise ParamError("stop", "'stop' must be a string or an array of strings")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise ParamError("stop", f"each 'stop' sequence is 1 to {MAX_STOP_CHARS} characters")
    return stops


def priority_of(
    doc: Mapping[str, Any], headers: Mapping[str, str], config: Config
) -> tuple[int, str]:
    """The priority level (0: the default) and the service tier to echo: ``service_tier``
    ("priority" the highest level, "flex" the lowest), else ``priority`` in the body or the
    ``x-priority`` header (1 = highest, as Triton's; clamped to the configured levels,
    since a level only orders the tenant's own queue)."""
    levels = config.priority_levels
    tier = _get(doc, "service_tier", str, None)
    if tier is not None and tier not in SERVICE_TIERS:
        raise ParamError(
            "service_tier", f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}"
        )
    if tier == "priority":
        return 1, "priority"
    if tier == "flex":
        return levels, "flex"
    asked: Any = doc.get("priority")
    where = "priority"
    if asked is None and PRIORITY_HEADER in headers:
        where = PRIORITY_HEADER
        try:
            asked = int(headers[PRIORITY_HEADER].strip())
        except ValueError:
            raise ParamError(where, f"'{where}' must be an integer") from None
    if asked is None:
        return 0, "default"
    if isinstance(asked, bool) or not isinstance(asked, int):
        raise ParamError(where, f"'{where}' must be an integer")
    return (0 if asked <= 0 else min(asked, levels)), "default"


def tier_used(gen: Generation, config: Config, tenant: str | None) -> str:
    """The service tier to echo: "priority" only where the tenant's tier may ask for the
    highest level (``tier_top_priority``); the level is clamped by the gateway then."""
    if gen.service_tier == "priority" and tenant is not None and config.top_priority(tenant) > 1:
        return "default"
    return gen.service_tier


def engine_request(gen: Generation, plan: EndpointPlan) -> InferRequest:
    """The KServe request for ``gen`` to its model (``plan``): streamed, the prompt not
    echoed."""
    info, endpoint = plan.info, plan.endpoint
    if not info.decoupled or endpoint.token_output is None:
        raise unsupported(gen.model, "does not serve completions (it is not a streaming engine)")
    text = endpoint.token_input
    spec = info.inputs.get(text)
    if spec is None or spec.datatype != "BYTES":
        raise unsupported(gen.model, "takes no text prompt")
    inputs = [_tensor(info, text, "BYTES", np.array([gen.prompt.encode()], dtype=np.object_))]
    for name in ("stream", "exclude_input_in_output"):
        if name in info.inputs:
            inputs.append(_tensor(info, name, "BOOL", np.array([True])))
    sampling = dict(gen.sampling)
    if gen.max_tokens is not None:
        sampling[endpoint.max_tokens_parameter or "max_tokens"] = gen.max_tokens
    keys = endpoint.sampling_keys
    if keys is not None:
        for key in list(sampling):
            if key not in keys:
                raise ParamError(key, f"'{key}' is not supported by model '{gen.model}'")
    parameters: dict[str, Any] = {}
    sampling_input = endpoint.sampling_parameters_input
    if sampling_input is not None and sampling_input in info.inputs:
        blob = json.dumps(sampling).encode()
        inputs.append(_tensor(info, sampling_input, "BYTES", np.array([blob], dtype=np.object_)))
    else:
        # A model that takes each as an input of its own (TensorRT-LLM's tensorrt_llm_bls:
        # max_tokens INT32, temperature and top_p FP32) gets those as tensors; the rest as
        # request parameters, where such a model reads them.
        for key, value in sampling.items():
            spec = info.inputs.get(key)
            if spec is None or key == text:
                parameters[key] = value
            else:
                inputs.append(_tensor(info, key, spec.datatype, _scalar(key, value, spec.datatype)))
    if gen.user:
        parameters[PROGRAM_PARAMETER] = gen.user  # the gateway takes it out again
    return InferRequest(
        model=gen.model,
        id=f"{'chatcmpl' if gen.chat else 'cmpl'}-{gen.id}",
        inputs=inputs,
        outputs=[RequestedOutput(endpoint.token_output)],
        parameters=parameters,
        priority=gen.priority,
    )


_NUMERIC: dict[str, type[np.integer[Any]] | type[np.floating[Any]]] = {
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "FP32": np.float32,
    "FP64": np.float64,
}


def _scalar(key: str, value: Any, datatype: str) -> np.ndarray:
    """``value`` as a one-element array of the model input's ``datatype``, or 400 naming
    the parameter where it is not one (a float for an integer input, a value out of its
    range, an input of a type a sampling parameter never has)."""
    numeric = _NUMERIC.get(datatype)
    if numeric is None:
        raise ParamError(key, f"'{key}' cannot be given to this model's {datatype} input")
    if issubclass(numeric, np.integer):
        limits = np.iinfo(numeric)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamError(key, f"'{key}' must be an integer for this model")
        if not limits.min <= value <= limits.max:
            raise ParamError(key, f"'{key}' must be within [{limits.min}, {limits.max}]")
    return np.array([value], dtype=numeric)


def _tensor(info: ModelInfo, name: str, datatype: str, data: np.ndarray) -> Tensor:
    if info.max_batch_size > 0:
        data = data.reshape(1, -1)
    return Tensor(name, datatype, tuple(data.shape), data)


class StopScanner:
    """Finds the first of ``stops`` in text that arrives in pieces; holds back the tail
    that could still be the start of one (at most the longest stop minus one character),
    so that no text after a stop string is ever sent."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that may go out now; ``stopped`` once a stop string was found."""
        if not self.stops:
            return text
        buf = self.pending + text
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            self.pending = ""
            return buf[: min(found)]
        cut = max(len(buf) - self.hold, 0)
        self.pending = buf[cut:]
        return buf[:cut]

    def flush(self) -> str:
        """The text held back, once the stream ended without a stop string."""
        out, self.pending = self.pending, ""
        return out


def finish_reason(scanner: StopScanner) -> str:
    """ "stop" where a stop string ended it; "length" otherwise (the shipped engine has no
    end-of-sequence token: it always runs to ``max_tokens``)."""
    return "stop" if scanner.stopped else "length"


def completion_body(gen: Generation, text: str, reason: str, usage: Usage) -> dict[str, Any]:
    """The whole answer (``stream`` false)."""
    if gen.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return {
        **_head(gen),
        "object": "chat.completion" if gen.chat else "text_completion",
        "choices": [choice],
        "usage": usage.as_openai(),
    }


def _head(gen: Generation) -> dict[str, Any]:
    return {
        "id": f"{'chatcmpl' if gen.chat else 'cmpl'}-{gen.id}",
        "created": gen.created,
        "model": gen.model,
        "service_tier": gen.service_tier,
        "system_fingerprint": None,
    }


def chunk(
    gen: Generation,
    text: str | None,
    reason: str | None = None,
    *,
    first: bool = False,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """One stream chunk: a piece of text, the final one (``reason``), or, with
    ``include_usage``, the usage chunk after it (``usage``: no choices)."""
    doc: dict[str, Any] = {
        **_head(gen),
        "object": "chat.completion.chunk" if gen.chat else "text_completion",
    }
    if usage is not None:
        doc["choices"] = []
        doc["usage"] = usage.as_openai()
        return doc
    if gen.chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": text or ""}
    choice["logprobs"] = None
    choice["finish_reason"] = reason
    doc["choices"] = [choice]
    if gen.include_usage:
        doc["usage"] = None
    return doc


def token_events(gen: Generation) -> tuple[bytes, bytes]:
    """The bytes around a text chunk's JSON-quoted text: a stream writes one event per
    token, which then costs one ``json.dumps`` of the text alone. The same bytes as
    ``sse(chunk(gen, text))`` (checked by the tests)."""
    marker = "\x00MARK\x00"
    whole = sse(chunk(gen, marker)).decode()
    head, tail = whole.split(json.dumps(marker))
    return head.encode(), tail.encode()


def token_event(around: tuple[bytes, bytes], text: str) -> bytes:
    return around[0] + json.dumps(text).encode() + around[1]


def sse(doc: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# ---- embeddings ------------------------------------------------------------------------------


@dataclass(slots=True)
class Embeddings:
    model: str
    texts: list[str] | None  # text inputs (tokenised by the endpoint's tokenizer)
    ids: list[np.ndarray] | None  # token-id inputs: one int32 row each
    base64: bool
    dimensions: int | None


_INPUT_KINDS = (
    "'input' must be a non-empty string, array of strings, array of token ids or "
    "array of token id arrays"
)


def _embeddings(doc: Members, most_ids: int | None = None) -> Embeddings:
    """A ``/v1/embeddings`` body, checked: ``input`` as a string, strings, token ids
    (integers) or lists of token ids."""
    model = require_model(doc)
    texts, ids = _inputs(doc.body, doc.raw("input"), most_ids)
    if texts is not None and any(not t for t in texts):
        raise ParamError("input", "'input' cannot contain an empty string")
    fmt = _get(doc, "encoding_format", str, "float")
    if fmt not in ("float", "base64"):
        raise ParamError("encoding_format", "'encoding_format' must be 'float' or 'base64'")
    dimensions = _integer(doc, "dimensions", 1, 2**31 - 1)
    _get(doc, "user", str, "")
    return Embeddings(model, texts, ids, fmt == "base64", dimensions)


_TEXTS = msgspec.json.Decoder(list[str])


def _inputs(
    body: Body, raw: msgspec.Raw, most_ids: int | None = None
) -> tuple[list[str] | None, list[np.ndarray] | None]:
    """``input`` as texts or as rows of token ids. Its kind is told by its first element;
    a list of texts or of id lists is counted before its elements are decoded, and ids go
    straight into int32 rows (``body.token_ids``)."""
    if kind(raw) == "string":
        return [body.string(raw, "input") or ""], None
    first = first_element(raw) if kind(raw) == "array" else None
    if first is None:
        raise ParamError("input", _INPUT_KINDS)
    if first in b"-0123456789":
        _within_context(raw, most_ids, "input")
        row = token_ids(raw)
        if row is None:
            raise ParamError("input", _INPUT_KINDS)
        return None, [row]
    if first not in b'"[':
        raise ParamError("input", _INPUT_KINDS)
    if count(raw, MAX_EMBEDDING_INPUTS) > MAX_EMBEDDING_INPUTS:
        raise ParamError("input", f"'input' holds at most {MAX_EMBEDDING_INPUTS} items")
    if first == ord('"') and body.marker is None:
        try:  # all strings: at once
            return _TEXTS.decode(raw), None
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass  # one at a time, to name what is wrong
    items = elements(raw)
    if first == ord('"'):
        texts = [body.string(item, f"input[{i}]") for i, item in enumerate(items)]
        if any(t is None for t in texts):
            raise ParamError("input", _INPUT_KINDS)
        return [t or "" for t in texts], None
    if any(kind(item) != "array" for item in items):
        raise ParamError("input", _INPUT_KINDS)
    for i, item in enumerate(items):
        _within_context(item, most_ids, f"input[{i}]")
    rows = [token_ids(item) for item in items]
    if any(row is None for row in rows):
        raise ParamError(
            "input", f"each token id list in 'input' is non-empty, ids 0 to {TOKEN_ID_MAX}"
        )
    return None, [row for row in rows if row is not None]


def _within_context(raw: msgspec.Raw, most_ids: int | None, where: str) -> None:
    """A list of token ids longer than the model's context is refused from its count
    (a scan of its bytes), before any id is read: 24M ids cost a count, not a decode."""
    if most_ids is not None and count(raw, most_ids) > most_ids:
        raise ParamError(
            "input", f"{where} holds more than {most_ids} token ids, the model's context"
        )


def embedding_input(plan: EndpointPlan) -> str:
    """The endpoint's token-id input, or 404 where the model takes none."""
    info, endpoint, model = plan.info, plan.endpoint, plan.model
    spec = info.inputs.get(endpoint.token_input)
    if info.decoupled or spec is None or spec.datatype not in ("INT32", "INT64"):
        raise unsupported(model, "does not serve embeddings (it takes no token ids)")
    return spec.name


# The inputs an exported Hugging Face encoder requires beside its token ids (ONNX and
# TensorRT exports make every input required), and what a row of n ids sends in each: the
# route fills them, one row per request, so no padding is ever attended.
COMPANION_FILL = {"attention_mask": 1, "token_type_ids": 0}


def embedding_companions(plan: EndpointPlan) -> list[tuple[str, str, int]]:
    """(name, datatype, fill) of each required input beside the token ids, or 400 where
    the model requires one the route cannot fill."""
    info, endpoint, model = plan.info, plan.endpoint, plan.model
    out = []
    for spec in info.inputs.values():
        if spec.name == endpoint.token_input or spec.optional:
            continue
        fill = COMPANION_FILL.get(spec.name)
        if fill is None or spec.datatype not in ("INT32", "INT64"):
            raise unsupported(
                model,
                f"does not serve embeddings (it also requires input '{spec.name}', which "
                "the route cannot fill)",
            )
        out.append((spec.name, spec.datatype, fill))
    return out


def embedding_output(info: ModelInfo, model: str) -> str:
    """The model's one floating-point output (the embedding)."""
    for spec in info.outputs.values():
        if spec.datatype in ("FP32", "FP16", "FP64"):
            return spec.name
    raise unsupported(model, "does not serve embeddings (it has no floating-point output)")


def row_request(
    model: str,
    name: str,
    datatype: str,
    ids: Sequence[int] | np.ndarray,
    output: str,
    rid: str,
    companions: Sequence[tuple[str, str, int]] = (),
) -> InferRequest:
    """One input as its own KServe request: one row of token ids, and the ``companions``
    (``embedding_companions``) as wide, each filled with its value."""
    data = np.asarray(ids, dtype=np.int32 if datatype == "INT32" else np.int64).reshape(1, -1)
    inputs = [Tensor(name, datatype, tuple(data.shape), data)]
    for other, other_type, fill in companions:
        width = np.int32 if other_type == "INT32" else np.int64
        values = np.full(data.shape, fill, dtype=width)
        inputs.append(Tensor(other, other_type, tuple(values.shape), values))
    return InferRequest(
        model=model,
        id=rid,
        inputs=inputs,
        outputs=[RequestedOutput(output)],
    )


def embeddings_body(req: Embeddings, vectors: Sequence[np.ndarray], usage: Usage) -> dict[str, Any]:
    data = []
    for i, vector in enumerate(vectors):
        flat = np.asarray(vector, dtype=np.float32).reshape(-1)
        if req.dimensions is not None:
            if req.dimensions > flat.size:
                raise ParamError(
                    "dimensions",
                    f"'dimensions' is at most {flat.size} for model '{req.model}'",
                )
            flat = flat[: req.dimensions]
            norm = float(np.linalg.norm(flat))
            if norm > 0:  # shortened as OpenAI's text-embedding-3 are: renormalised
                flat = flat / norm
        embedding: Any = (
            base64.b64encode(flat.astype("<f4").tobytes()).decode() if req.base64 else flat.tolist()
        )
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return {
        "object": "list",
        "data": data,
        "model": req.model,
        "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
    }


# ---- models ------------------------------------------------------------------------------------


def model_entry(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": OWNED_BY}
