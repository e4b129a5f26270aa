"""The API bodies' checks as they were before ``fair_frontend.shell.api.body``: ``json.loads``,
then checks walking the dicts and lists (OpenAI's routes), or pydantic over the decoded
object (rerank's, as the routes called it). Kept verbatim as the oracle that
``tests/test_api_body.py`` holds the new decoders to: on any body, the same request or
the same refusal."""

# ruff: noqa
# mypy: ignore-errors

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from fair_frontend.shell.api.openai import (
    CHAT_ANSWER,
    CHAT_TEMPLATE,
    MAX_EMBEDDING_INPUTS,
    MAX_MESSAGES,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_USER_CHARS,
    PRIORITY_HEADER,
    ROLES,
    SERVICE_TIERS,
    Embeddings,
    Generation,
    ParamError,
)
from fair_frontend.shell.api.rerank import MAX_DOCUMENTS, MAX_PROBLEMS, RerankCall
from fair_frontend.config import Config
from fair_frontend.errors import InvalidArgument
from fair_frontend.protocol import INT64_MAX

TOKEN_ID_MAX = 2**31 - 1


def parse_body(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ParamError(None, f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(doc, dict):
        raise ParamError(None, "The request body must be a JSON object")
    return doc


def _get(doc: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], default: Any) -> Any:
    value = doc.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ParamError(name, f"Invalid type for '{name}': expected {_kind(kinds)}, got a bool")
    if not isinstance(value, kinds):
        raise ParamError(
            name, f"Invalid type for '{name}': expected {_kind(kinds)}, got {type(value).__name__}"
        )
    return value


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
    value = doc.get(name)
    if value is not None and value not in allowed:
        raise ParamError(name, f"'{name}' is not supported: {why}", "unsupported_parameter")


# ---- completions (chat and plain) -----------------------------------------------------------


def chat_request(doc: Mapping[str, Any], headers: Mapping[str, str], config: Config) -> Generation:
    """A ``/v1/chat/completions`` body, checked."""
    model = require_model(doc)
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ParamError("messages", "'messages' must be a non-empty array of messages")
    if len(messages) > MAX_MESSAGES:
        raise ParamError("messages", f"'messages' holds at most {MAX_MESSAGES} messages")
    parts = [_message(i, m) for i, m in enumerate(messages)]
    _refuse_unless(doc, "tools", ([],), "this model calls no tools")
    _refuse_unless(doc, "functions", ([],), "this model calls no functions")
    _refuse_unless(doc, "tool_choice", ("none",), "this model calls no tools")
    fmt = doc.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise ParamError(
            "response_format", "only {'type': 'text'} is supported", "unsupported_parameter"
        )
    _refuse_unless(doc, "logprobs", (False,), "no log probabilities are returned")
    _refuse_unless(doc, "top_logprobs", (0,), "no log probabilities are returned")
    max_tokens = _integer(doc, "max_completion_tokens", 1, 2**63 - 1)
    if max_tokens is None:
        max_tokens = _integer(doc, "max_tokens", 1, 2**63 - 1)
    return _generation(doc, headers, config, model, "".join(parts) + CHAT_ANSWER, max_tokens, True)


def _message(i: int, message: Any) -> str:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ParamError(where, f"'{where}' must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ROLES:
        raise ParamError(
            f"{where}.role", f"'{where}.role' must be one of {', '.join(sorted(ROLES))}"
        )
    content = message.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ParamError(
                    f"{where}.content[{j}]",
                    f"'{where}.content[{j}]': only text parts are supported",
                    "unsupported_parameter",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ParamError(
                    f"{where}.content[{j}].text", f"'{where}.content[{j}].text' must be a string"
                )
            texts.append(text)
        content = "".join(texts)
    if not isinstance(content, str):
        raise ParamError(f"{where}.content", f"'{where}.content' must be a string or text parts")
    return CHAT_TEMPLATE.format(role=role, content=content)


def completion_request(
    doc: Mapping[str, Any], headers: Mapping[str, str], config: Config
) -> Generation:
    """A ``/v1/completions`` body, checked: one text prompt."""
    model = require_model(doc)
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
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
    doc: Mapping[str, Any],
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
        include_usage = _get(options, "include_usage", bool, False)
    priority, tier = priority_of(doc, headers, config)
    return Generation(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stops(doc.get("stop")),
        stream=stream,
        include_usage=include_usage,
        priority=priority,
        service_tier=tier,
        chat=chat,
        user=user,  # (since programs: the request's program, as the decoder now keeps it)
    )


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ParamError("stop", "'stop' must be a string or an array of strings")
    if len(stops) > MAX_STOPS:
        raise ParamError("stop", f"'stop' holds at most {MAX_STOPS} sequences")
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


def embeddings_request(doc: Mapping[str, Any]) -> Embeddings:
    """A ``/v1/embeddings`` body, checked: ``input`` as a string, strings, token ids
    (integers) or lists of token ids."""
    model = require_model(doc)
    value = doc.get("input")
    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        texts = value
    elif isinstance(value, list) and value and all(_is_id(v) for v in value):
        ids = [value]
    elif isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        if not all(v and all(_is_id(t) for t in v) for v in value):
            raise ParamError(
                "input", f"each token id list in 'input' is non-empty, ids 0 to {TOKEN_ID_MAX}"
            )
        ids = value
    else:
        raise ParamError(
            "input",
            "'input' must be a non-empty string, array of strings, array of token ids or "
            "array of token id arrays",
        )
    count = len(texts if texts is not None else ids or [])
    if count > MAX_EMBEDDING_INPUTS:
        raise ParamError("input", f"'input' holds at most {MAX_EMBEDDING_INPUTS} items")
    if texts is not None and any(not t for t in texts):
        raise ParamError("input", "'input' cannot contain an empty string")
    fmt = _get(doc, "encoding_format", str, "float")
    if fmt not in ("float", "base64"):
        raise ParamError("encoding_format", "'encoding_format' must be 'float' or 'base64'")
    dimensions = _integer(doc, "dimensions", 1, 2**31 - 1)
    _get(doc, "user", str, "")
    return Embeddings(model, texts, ids, fmt == "base64", dimensions)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= TOKEN_ID_MAX


class _Body(BaseModel):
    # Strict: a JSON number is not a string, nor "5" an integer, nor 1 a boolean.
    model_config = ConfigDict(extra="ignore", strict=True)


class TextDocument(_Body):
    """A document given as an object: its ``text`` (other keys are ignored)."""

    text: StrictStr


class RelevantSpans(_Body):
    mode: Literal["enabled", "disabled"]


class CohereRerankRequest(_Body):
    """Cohere's ``POST /v2/rerank`` body (``cohere.v2`` ``rerank``'s parameters)."""

    model: StrictStr
    query: StrictStr
    documents: list[StrictStr | TextDocument]
    top_n: StrictInt | None = None
    max_tokens_per_doc: StrictInt | None = None
    priority: StrictInt | None = None
    relevant_spans: RelevantSpans | None = None


class JinaRerankRequest(_Body):
    """Jina's and vLLM's ``POST /v1/rerank`` body."""

    model: StrictStr | None = None
    query: StrictStr
    documents: list[StrictStr | TextDocument]
    top_n: StrictInt | None = None
    return_documents: StrictBool = True
    priority: StrictInt | None = None  # vLLM's: lower is earlier


def parse_cohere(body: Any, *, max_documents: int = MAX_DOCUMENTS) -> RerankCall:
    """A Cohere v2 rerank body (JSON text, or the object it decodes to) -> ``RerankCall``;
    ``InvalidArgument`` naming the field where it is malformed or out of range."""
    req = _validate(CohereRerankRequest, body)
    if req.relevant_spans is not None and req.relevant_spans.mode == "enabled":
        raise InvalidArgument(
            "relevant_spans: not supported by this model (it scores each document whole)"
        )
    if req.max_tokens_per_doc is not None and req.max_tokens_per_doc < 1:
        raise InvalidArgument(
            f"max_tokens_per_doc must be at least 1, got {req.max_tokens_per_doc}"
        )
    documents = _documents(req.documents, max_documents)
    return RerankCall(
        model=req.model,
        query=_query(req.query),
        documents=documents,
        top_n=_top_n(req.top_n, len(documents), zero_is_all=False),
        max_tokens_per_doc=req.max_tokens_per_doc,
        return_documents=False,
        priority=_priority(req.priority),
    )


def parse_jina(body: Any, *, max_documents: int = MAX_DOCUMENTS) -> RerankCall:
    """A Jina/vLLM ``/v1/rerank`` body (JSON text, or the object it decodes to) ->
    ``RerankCall``; ``InvalidArgument`` naming the field where it is malformed."""
    req = _validate(JinaRerankRequest, body)
    documents = _documents(req.documents, max_documents)
    return RerankCall(
        model=req.model,
        query=_query(req.query),
        documents=documents,
        top_n=_top_n(req.top_n, len(documents), zero_is_all=True),
        max_tokens_per_doc=None,
        return_documents=req.return_documents,
        priority=_priority(req.priority),
    )


def _validate(model: type[_Body], body: Any) -> Any:
    try:
        if isinstance(body, (bytes, bytearray, str)):
            return model.model_validate_json(body)
        if not isinstance(body, Mapping):
            raise InvalidArgument("the request body must be a JSON object")
        return model.model_validate(body)
    except ValidationError as err:
        raise InvalidArgument(_problems(err)) from None


# Names pydantic adds to a location for the branch of a union it tried.
_UNION_BRANCHES = frozenset({"str", "TextDocument"})


def _problems(err: ValidationError) -> str:
    """What is wrong, field by field (the first problem of each): ``documents[3] must be a
    string, or an object with a string 'text'; top_n: input should be a valid integer``."""
    seen: dict[str, str] = {}
    for e in err.errors(include_url=False, include_input=False):
        if e["type"] == "json_invalid":
            return f"the request body is not valid JSON: {e['msg'].removeprefix('Invalid JSON: ')}"
        if e["type"] == "model_type" and not e["loc"]:
            return "the request body must be a JSON object"
        loc = [part for part in e["loc"] if part not in _UNION_BRANCHES]
        if len(loc) >= 2 and loc[0] == "documents" and isinstance(loc[1], int):
            # Either branch of the union failed: one message for the document.
            seen.setdefault(
                f"documents[{loc[1]}]", "must be a string, or an object with a string 'text'"
            )
            continue
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        if e["type"] == "missing":
            seen.setdefault(where, "is required")
        else:
            seen.setdefault(where, ": " + e["msg"][:1].lower() + e["msg"][1:])
    lines = [
        f"{where}{message}" if message.startswith(":") else f"{where} {message}"
        for where, message in seen.items()
    ]
    more = len(lines) - MAX_PROBLEMS
    return "; ".join(lines[:MAX_PROBLEMS]) + (f"; and {more} more" if more > 0 else "")


def _documents(given: Sequence[str | TextDocument], max_documents: int) -> list[str]:
    if not given:
        raise InvalidArgument("documents must hold at least one document")
    if len(given) > max_documents:
        raise InvalidArgument(
            f"documents: {len(given)} documents; at most {max_documents} per call"
        )
    return [d if isinstance(d, str) else d.text for d in given]


def _query(query: str) -> str:
    if not query:
        raise InvalidArgument("query must not be empty")
    return query


def _top_n(top_n: int | None, documents: int, *, zero_is_all: bool) -> int:
    if top_n is None or (zero_is_all and top_n == 0):
        return documents
    if top_n < 1:
        lowest = "0 (all) or more" if zero_is_all else "at least 1"
        raise InvalidArgument(f"top_n must be {lowest}, got {top_n}")
    return min(top_n, documents)


def _priority(priority: int | None) -> int | None:
    if priority is not None and not 0 <= priority <= INT64_MAX:
        raise InvalidArgument(f"priority must be between 0 and {INT64_MAX}, got {priority}")
    return priority
