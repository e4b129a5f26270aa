"""Nothing a client names grows the frontend's memory (issue 11, items 5 and 9).

- ``Statistics`` kept an entry per (model, version) of every failed request, the version
  being whatever string the client sent: a client could add entries without end. Now a
  failure is counted under a version the model has (its own, or the latest for none),
  and not at all under any other (Triton keeps no statistics for a version it does not
  serve either).
- The request id is copied into every row's ``fair_rows`` entry, and a string sequence id
  is kept for the sequence's life; both had no length limit. Now ids longer than
  ``protocol.MAX_ID_BYTES`` are refused with INVALID_ARGUMENT.
- ``max_tokens`` times the rows, plus the input tokens, could exceed 64 bits (a
  sampling-parameters JSON or a string of digits holds any integer): the records between
  processes refuse such a count and 64-bit counters (Redis) wrap. Now refused up front.

Statistics and ids over the real stack (the session's Triton, one frontend of this
module's own, so that its statistics start empty); the token sum on ``validate``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import Endpoint
from fair_frontend.errors import InvalidArgument
from fair_frontend.models import ModelInfo, TensorSpec, validate
from fair_frontend.protocol import INT64_MAX, MAX_ID_BYTES, InferRequest, Tensor
from tests.support import (
    KEYS,
    RunningFrontend,
    ids_input,
    make_config,
    planned,
    running_frontend,
)

HEADERS = {"x-api-key": KEYS["umbrella"]}


@pytest.fixture(scope="module")
def fe(triton: EmbeddedTriton) -> Iterator[RunningFrontend]:
    with running_frontend(make_config(), triton) as running:
        yield running


def infer(url: str, model: str, inputs: list[Any], **kwargs: Any) -> Any:
    return grpcclient.InferenceServerClient(url).infer(model, inputs, headers=HEADERS, **kwargs)


def error(url: str, model: str, inputs: list[Any], **kwargs: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        infer(url, model, inputs, **kwargs)
    return info.value


def embed_ids(dtype: Any = np.int32) -> list[Any]:
    if dtype == np.int32:
        return [ids_input(grpcclient, np.arange(8, dtype=np.int32).reshape(1, 8))]
    inp = grpcclient.InferInput("INPUT_IDS", [1, 8], "INT64")
    inp.set_data_from_numpy(np.zeros((1, 8), dtype=np.int64))
    return [inp]  # the wrong datatype: refused by the shell's validation


def test_failures_under_made_up_versions_add_no_statistics(fe: RunningFrontend) -> None:
    url = fe.grpc_url
    for n in range(20):
        # Refused by Triton (no such version) and refused by the shell (bad input).
        error(url, "embed", embed_ids(), model_version=f"made-up-{n}")
        error(url, "embed", embed_ids(np.int64), model_version=f"also-made-up-{n}")
    error(url, "embed", embed_ids(np.int64))  # a failure of the real version: counted
    error(url, "embed", embed_ids(np.int64), model_version="1")
    stats = (
        grpcclient.InferenceServerClient(url).get_inference_statistics(headers=HEADERS).model_stats
    )
    assert [(m.name, m.version) for m in stats] == [("embed", "1")]
    assert stats[0].inference_stats.fail.count == 2


def test_a_request_id_longer_than_the_bound_is_refused(fe: RunningFrontend) -> None:
    longest = "r" * MAX_ID_BYTES
    assert infer(fe.grpc_url, "embed", embed_ids(), request_id=longest).get_response().id == longest
    err = error(fe.grpc_url, "embed", embed_ids(), request_id="r" * (MAX_ID_BYTES + 1))
    assert err.status() == "StatusCode.INVALID_ARGUMENT"
    assert "request id is too long" in err.message()


def test_a_string_sequence_id_longer_than_the_bound_is_refused(fe: RunningFrontend) -> None:
    inp = grpcclient.InferInput("INPUT", [1], "INT32")
    inp.set_data_from_numpy(np.array([1], dtype=np.int32))
    err = error(
        fe.grpc_url,
        "sequence_sum",
        [inp],
        sequence_id="s" * (MAX_ID_BYTES + 1),
        sequence_start=True,
        sequence_end=True,
    )
    assert err.status() == "StatusCode.INVALID_ARGUMENT"
    assert "sequence_id' is too long" in err.message()


# ---- max_tokens: the request's token count fits 64 bits -----------------------------------

GENERATE = ModelInfo(
    name="generate",
    max_batch_size=8,
    inputs={"INPUT_IDS": TensorSpec("INPUT_IDS", "INT32", (-1,))},
    outputs={"OUTPUT_IDS": TensorSpec("OUTPUT_IDS", "INT32", (-1,))},
    takes_rows=True,  # as model_repository/generate asks: max_tokens per row in fair_rows
)
UNLIMITED = Endpoint(max_tokens_parameter="max_tokens", max_tokens_default=16)


def two_rows(max_tokens: Any) -> InferRequest:
    ids = np.ones((2, 4), dtype=np.int32)
    return InferRequest(
        model="generate",
        inputs=[Tensor("INPUT_IDS", "INT32", (2, 4), ids)],
        parameters={"max_tokens": max_tokens},
    )


@pytest.mark.parametrize(
    "max_tokens",
    [INT64_MAX, str(INT64_MAX), str(2**64 - 1), str(2**64)],
    ids=["int64-max", "int64-max-string", "uint64-max-string", "2**64-string"],
)
def test_max_tokens_that_would_wrap_64_bits_are_refused(max_tokens: Any) -> None:
    with pytest.raises(InvalidArgument, match="max_tokens"):
        validate(two_rows(max_tokens), planned(GENERATE, UNLIMITED))


def test_max_tokens_up_to_the_64_bit_bound_are_accepted() -> None:
    """The bound refuses only what cannot be counted: the largest sum that fits passes,
    and crosses between processes (msgpack holds 64-bit integers)."""
    per_row = (INT64_MAX - 8) // 2
    checked = validate(two_rows(str(per_row)), planned(GENERATE, UNLIMITED))
    assert checked.tokens == 8 + 2 * per_row
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(checked.tokens)) == checked.tokens
