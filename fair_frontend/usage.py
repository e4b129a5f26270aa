"""What a request used, as the frontend counted it: the figures a tenant is billed by.

``prompt_tokens``: the input tokens admission counted (a text prompt in its tokenizer's
tokens, token ids one each; the output tokens asked for, ``max_tokens``, are not part of
it). ``completion_tokens``: the output tokens relayed to the client (engine streams: one
per streamed response; an answer in one piece: its token output's count), as the core
charges them back. One ``Usage`` per request, filled in by ``Gateway`` as the request goes:
the OpenAI and rerank routes answer with it, the KServe routes as response parameters
(``USAGE_PARAMETERS``, when the request asks with ``INCLUDE_USAGE``), and the core's
request log writes it per request for billing export.
"""

from __future__ import annotations

from dataclasses import dataclass

from fair_frontend.protocol import ParamValue

INCLUDE_USAGE = "include_usage"
"""KServe request parameter (bool): answer with ``USAGE_PARAMETERS`` on the final response.
Taken out of the request: the model never sees it."""
USAGE_PARAMETERS = ("usage_prompt_tokens", "usage_completion_tokens", "usage_total_tokens")


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_openai(self) -> dict[str, int]:
        """OpenAI's ``usage`` object."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }

    def as_parameters(self) -> dict[str, ParamValue]:
        """The KServe response parameters (``USAGE_PARAMETERS``)."""
        prompt, completion, total = USAGE_PARAMETERS
        return {
            prompt: self.prompt_tokens,
            completion: self.completion_tokens,
            total: self.total_tokens,
        }
