"""Sampling parameters checked at the door, by the rules of the engine behind an endpoint.

An engine endpoint takes vLLM-style sampling parameters in two places: a BYTES input
holding a JSON object (``Endpoint.sampling_parameters_input``: Triton's vLLM backend's
``sampling_parameters``) and request parameters of the same names (where Triton's HTTP
generate extension puts a body's top-level keys). Each key is read from the JSON object
first, then from the request parameters, as the shipped ``llm`` reads them; ``null`` is
no value (vLLM's backend drops ``None``: the default applies). A value its engine cannot
take is refused here, before it queues, with a message naming the key and the rule:

- one engine thread serves every tenant, so a value that slipped through the engine's own
  checks could stop it for all of them (issue 17: a seed beyond 64 bits reached
  ``torch.Generator.manual_seed`` on the engine thread);
- the engine refuses it anyway, but over a gRPC stream Triton carries a model's error as
  a message without its code, so the client would be answered 500 where 400 is due.

``SamplingRules.VLLM``: vLLM's ``SamplingParams`` (``_verify_args``, in its words), and
its OpenAI server's bound on ``seed`` (a signed 64-bit integer, ``torch.long``). Values
convert the way Triton's vLLM backend converts them (``TritonSamplingParams.from_dict``:
``int(v)``, ``float(v)``, ``bool(v)``), but strictly: an integer is an integer, a float
without a fraction or a string of decimal digits (``int(2.5)`` would silently be 2); a
number is a number or a numeric string, and finite; a boolean is a boolean or the string
``true`` / ``false`` (``bool("false")`` would be True); every integer fits in 64 bits.
Only the scalar keys have rules here; the others (``stop``, ``logit_bias``...) are left to
the engine, or refused as unknown where the endpoint lists the keys its model takes
(``sampling_keys``).

The shipped ``llm`` checks the same rules itself (``python_backend/llm.py``,
``decode_sampling_parameters``) for clients that call Triton directly; a test holds the
two to the same answer for every value.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fair_frontend.errors import InvalidArgument
from fair_frontend.protocol import INT64_MAX, INT64_MIN, InferRequest

_INTEGER = re.compile(r"[+-]?[0-9]+")


class SamplingRules(str, enum.Enum):
    """Whose rules an endpoint's sampling parameters are checked by."""

    VLLM = "vllm"  # vLLM's SamplingParams (Triton's vLLM backend; the shipped llm)


Check = Callable[[Any], "str | None"]  # the broken rule (after the key), or None


@dataclass(frozen=True, slots=True)
class Rule:
    """One key's type and range."""

    kind: Literal["int", "float", "bool"]
    check: Check | None = None


def _at_least(low: int) -> Check:
    return lambda v: None if v >= low else f"must be at least {low}, got {v}."


def _within(low: float, high: float) -> Check:
    return lambda v: None if low <= v <= high else f"must be in [{low:g}, {high:g}], got {v}."


def _non_negative_or_minus_one(v: int) -> str | None:
    return None if v >= -1 else f"must be non-negative or -1, got {v}."


# vLLM's SamplingParams, its scalar fields (vllm/sampling_params.py, _verify_args).
VLLM_RULES: Mapping[str, Rule] = {
    "n": Rule("int", _at_least(1)),
    "presence_penalty": Rule("float", _within(-2.0, 2.0)),
    "frequency_penalty": Rule("float", _within(-2.0, 2.0)),
    "repetition_penalty": Rule(
        "float", lambda v: None if v > 0 else f"must be greater than zero, got {v}."
    ),
    "temperature": Rule("float", lambda v: None if v >= 0 else f"must be non-negative, got {v}."),
    "top_p": Rule("float", lambda v: None if 0 < v <= 1 else f"must be in (0, 1], got {v}."),
    "top_k": Rule(  # vLLM quietly takes -1 for 0
        "int", lambda v: None if v >= -1 else f"must be 0 (disable), or at least 1, got {v}."
    ),
    "min_p": Rule("float", _within(0.0, 1.0)),
    "seed": Rule("int"),  # any 64-bit integer; -1 is none
    "max_tokens": Rule("int", _at_least(1)),
    "min_tokens": Rule(
        "int", lambda v: None if v >= 0 else f"must be greater than or equal to 0, got {v}."
    ),
    "logprobs": Rule("int", _non_negative_or_minus_one),
    "prompt_logprobs": Rule("int", _non_negative_or_minus_one),
    "ignore_eos": Rule("bool"),
    "detokenize": Rule("bool"),
    "skip_special_tokens": Rule("bool"),
    "spaces_between_special_tokens": Rule("bool"),
    "include_stop_str_in_output": Rule("bool"),
}
# vLLM's other request keys: no rule here (the engine checks them), but known, so that an
# endpoint's sampling_keys can name them (Triton's vLLM backend adds lora_name and maps
# guided_decoding onto structured_outputs).
VLLM_OTHER_KEYS = (
    "stop",
    "stop_token_ids",
    "bad_words",
    "logit_bias",
    "allowed_token_ids",
    "structured_outputs",
    "guided_decoding",
    "lora_name",
)
RULES: Mapping[SamplingRules, Mapping[str, Rule]] = {SamplingRules.VLLM: VLLM_RULES}
KNOWN_KEYS: Mapping[SamplingRules, tuple[str, ...]] = {
    SamplingRules.VLLM: (*VLLM_RULES, *VLLM_OTHER_KEYS)
}


def read_sampling_input(req: InferRequest, name: str | None) -> dict[str, Any] | None:
    """The JSON object in input ``name`` (the endpoint's sampling_parameters_input),
    parsed once for every check that reads it; None when the endpoint names none or the
    request does not send it."""
    if name is None:
        return None
    t = req.input(name)
    if t is None or t.data.size == 0:
        return None
    raw = t.data.flat[0]
    try:
        doc = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else str(raw))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise InvalidArgument(f"input '{name}' must be a JSON object") from None
    if not isinstance(doc, dict):
        raise InvalidArgument(f"input '{name}' must be a JSON object")
    return doc


def check_sampling(
    doc: Mapping[str, Any] | None,
    parameters: Mapping[str, Any],
    rules: SamplingRules,
    *,
    input_name: str | None,
    keys: Sequence[str] | None = None,
    max_model_len: int | None = None,
    prompt_tokens: int | None = None,
) -> dict[str, int | float | bool]:
    """Check every sampling parameter of a request by ``rules``; the values, converted.

    ``doc``: the sampling parameters input's object (``input_name``), read first;
    ``parameters``: the request's parameters, read for the same keys where ``doc`` has
    none (their other entries are not sampling parameters). ``keys``: the keys the model
    takes; any other in ``doc`` is refused. ``max_model_len``: the model's context (prompt
    plus generated tokens); with ``prompt_tokens``, the prompt's tokens. Raises
    ``InvalidArgument`` naming the key, where it came from and the rule it breaks.
    """
    table = RULES[rules]
    doc = doc or {}
    if keys is not None:
        unknown = sorted(k for k in doc if k not in keys)
        if unknown:
            raise InvalidArgument(
                f"input '{input_name}': unknown key(s) {unknown}; this model takes {list(keys)}"
            )
    values: dict[str, int | float | bool] = {}
    where: dict[str, str] = {}
    for key, rule in table.items():
        if keys is not None and key not in keys:
            continue
        if doc.get(key) is not None:
            value, at = doc[key], f"input '{input_name}'"
        elif parameters.get(key) is not None:
            value, at = parameters[key], f"parameter '{key}'"
        else:
            continue
        number = convert(key, value, rule.kind, at)
        broken = rule.check(number) if rule.check is not None else None
        if broken is not None:
            raise InvalidArgument(f"{at}: {key} {broken}")
        values[key], where[key] = number, at
    max_tokens, min_tokens = values.get("max_tokens"), values.get("min_tokens")
    if isinstance(max_tokens, int) and isinstance(min_tokens, int) and min_tokens > max_tokens:
        raise InvalidArgument(
            f"{where['min_tokens']}: min_tokens must be less than or equal to "
            f"max_tokens={max_tokens}, got {min_tokens}."
        )
    if isinstance(max_tokens, int) and max_model_len is not None:
        _check_context(max_tokens, where["max_tokens"], max_model_len, prompt_tokens)
    return values


def _check_context(max_tokens: int, at: str, max_model_len: int, prompt_tokens: int | None) -> None:
    """Prompt and generated tokens within the model's context (the model's own message:
    python_backend/llm.py ``decode_request``); without the prompt's count, at least one
    token of it."""
    prompt = max(1, prompt_tokens or 0)
    if prompt >= max_model_len:
        return  # the prompt alone is too long: the prompt's check says so
    if prompt + max_tokens > max_model_len:
        after = f"a {prompt}-token prompt" if prompt_tokens else "the prompt"
        raise InvalidArgument(
            f"{at}: max_tokens: {max_tokens} new tokens after {after} exceed this model's "
            f"maximum context length of {max_model_len} tokens; at most "
            f"{max_model_len - prompt} for this prompt"
        )


def convert(key: str, value: Any, kind: Literal["int", "float", "bool"], at: str) -> Any:
    """``value`` as ``kind``, strictly (see the module docstring), or ``InvalidArgument``."""
    if kind == "int":
        number = _integer(value)
        if number is None:
            raise InvalidArgument(f"{at}: {key} must be an integer, got {shown(value)}")
        if not INT64_MIN <= number <= INT64_MAX:
            raise InvalidArgument(
                f"{at}: {key} must be an integer in [{INT64_MIN}, {INT64_MAX}] (64 bits), "
                f"got {shown(number)}."
            )
        return number
    if kind == "float":
        real = _real(value)
        if real is None:
            raise InvalidArgument(f"{at}: {key} must be a number, got {shown(value)}")
        if not math.isfinite(real):
            raise InvalidArgument(f"{at}: {key} must be a finite number, got {shown(value)}.")
        return real
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InvalidArgument(f"{at}: {key} must be true or false, got {shown(value)}")


def _integer(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        try:
            return int(value.strip())
        except ValueError:  # more digits than Python converts
            return None
    return None


def _real(value: Any) -> float | None:
    try:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            return float(value.strip())
    except (ValueError, OverflowError):
        return None
    return None


def shown(value: Any, limit: int = 64) -> str:
    """A client's value for an error message, cut short (it may be megabytes)."""
    try:
        text = repr(value)
    except ValueError:  # an integer of more digits than Python prints
        return "an integer of more than 4300 digits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
