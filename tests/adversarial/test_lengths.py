"""A wide row cannot blow up its neighbours' batch (issue 11, item 4).

Where an endpoint pads ragged rows, every row of a batch is padded to the widest. One
row 256K tokens wide among 8-token rows made a batch of 32 rows x 256K: 32 MiB of
padding sent for 256 tokens of neighbours (16M wide: gigabytes). Now the padded width
is part of the batch key, coarsely (``batching.width_class``): a row wide enough that a
full batch padded to it would exceed ``max_request_bytes`` is batched only with rows of
its own power-of-two width class. Ordinary ragged rows still share batches.

The token count is the width the frontend actually sends: the claimed-length input
(``INPUT_LENGTHS``) is gone (``lengths_field`` carries the real width to the model), and
the end-to-end test checks that a wide row is charged its real width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import tritonclient.grpc as grpcclient

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.batching import batch_key, pack
from fair_frontend.config import Config, CostUnit, Endpoint, PaddedInput, Padding, parse_config
from fair_frontend.core.dispatch import CoreRequest
from fair_frontend.endpoint import plan
from fair_frontend.kit.testing import eventually
from fair_frontend.models import ModelInfo, TensorSpec
from fair_frontend.protocol import InferRequest, Tensor
from fair_frontend.scheduler import EndpointPolicy, GlobalCaps, Scheduler, TenantSpec
from fair_frontend.wire.records import Call
from tests.support import KEYS, config_dict, ids_input, planned, running_frontend

MAX_ROWS = 32
MAX_BYTES = 1 << 20  # the endpoint's max_request_bytes: 256K INT32 tokens
SETTLE_S = 30.0  # deadline of a count polled on the core; met far sooner
TENANTS = {name: TenantSpec("paid") for name in ("liar", "n1", "n2", "n3")}
INFO = ModelInfo(
    name="embed",
    max_batch_size=MAX_ROWS,
    inputs={"INPUT_IDS": TensorSpec("INPUT_IDS", "INT32", (-1,))},
    outputs={"EMBEDDING": TensorSpec("EMBEDDING", "FP32", (4,))},
    takes_rows=True,  # as model_repository/embed asks: its rows' lengths come in fair_rows
)
ENDPOINT = Endpoint(
    cost=CostUnit.TOKENS,
    max_request_bytes=MAX_BYTES,
    padding=Padding(inputs={"INPUT_IDS": PaddedInput(lengths_field="length")}),
)
PLAN = plan(Config(tiers=["paid"], endpoints={"embed": ENDPOINT}), "embed", INFO)


class _Route:
    def answer(self, answer: Any) -> None:  # never called: nothing is dispatched here
        raise AssertionError(answer)


def queued(tenant: str, width: int, n: int) -> CoreRequest:
    """A validated one-row request ``width`` tokens wide, as the core queues it."""
    data = np.full((1, width), n, dtype=np.int32)
    request = InferRequest(
        model="embed", id=f"r{n}", inputs=[Tensor("INPUT_IDS", "INT32", (1, width), data)]
    )
    call = Call(n, tenant, 1, 0.0, 0.0, 1, width, request.nbytes, [width], request)
    return CoreRequest(
        tenant,
        1,
        width,
        request.nbytes,
        1,
        None,
        batch_key(request, PLAN),
        call=call,
        route=_Route(),
    )


def batches(requests: Sequence[CoreRequest]) -> list[list[CoreRequest]]:
    """What the real scheduler makes of ``requests`` (all queued before the first batch)."""
    policy = EndpointPolicy(
        cost=CostUnit.TOKENS,
        max_batch_size=MAX_ROWS,
        max_batch_tokens=None,
        quantum=1e9,  # DRR turns do not end a batch here: only the batch key may
        tiers=("paid",),
    )
    scheduler = Scheduler(policy, TENANTS, GlobalCaps())
    for req in requests:
        scheduler.enqueue(req, 0.0)
    out = []
    while batch := scheduler.next_batch(0.0):
        out.append(batch)
    return cast(list[list[CoreRequest]], out)  # the CoreRequests it was given


def test_a_wide_row_does_not_pad_its_neighbours_batch() -> None:
    liar_width = MAX_BYTES // 4  # as wide as the endpoint lets one row be
    requests = [queued(f"n{1 + i % 3}", 8, i) for i in range(12)]
    requests.insert(5, queued("liar", liar_width, 99))
    made = batches(requests)
    assert sorted(r.call.id for b in made for r in b) == sorted(r.call.id for r in requests)
    for batch in made:
        (ids,) = [t for t in pack(batch, planned(INFO, ENDPOINT)).inputs if t.name == "INPUT_IDS"]
        sent = sum(r.request.nbytes for r in batch)
        # Never more than one request's worth of bytes, or twice what its rows sent.
        assert ids.data.nbytes <= max(MAX_BYTES, 2 * sent), [r.call.id for r in batch]
        if any(r.tenant != "liar" for r in batch):
            assert ids.shape[1] == 8  # the neighbours are padded to their own width
    liar_batch = next(b for b in made if any(r.tenant == "liar" for r in b))
    assert [r.tenant for r in liar_batch] == ["liar"]


def test_ragged_rows_of_ordinary_widths_still_share_a_batch() -> None:
    widths = [3, 17, 120, 511, 64, 9, 2048, 1]
    made = batches([queued(f"n{1 + i % 3}", w, i) for i, w in enumerate(widths)])
    assert len(made) == 1
    (ids,) = pack(made[0], planned(INFO, ENDPOINT)).inputs
    assert ids.shape == (len(widths), max(widths))


def test_wide_rows_share_a_batch_with_rows_of_their_width_class() -> None:
    wide = MAX_BYTES // 4 // MAX_ROWS * 4  # beyond class 0: a full batch of it is 4 MiB
    requests = [queued("n1", wide, 1), queued("n2", wide - 100, 2), queued("n3", 2 * wide, 3)]
    made = batches(requests)
    assert sorted([r.call.id for r in b] for b in made) == [[1, 2], [3]]


# ---- end to end: what the wide row is charged ----------------------------------------


def test_a_wide_row_is_charged_the_width_it_sent(triton: EmbeddedTriton) -> None:
    """``sleeper`` counts cost in tokens of its padded INPUT_IDS; its tenant is charged
    (fair_served_tokens, fair_served_cost) the width it sent, not a claimed length."""
    data = config_dict()
    data["endpoints"]["sleeper"] = {
        "cost": "tokens",
        "throttle": False,
        "padding": {"inputs": {"INPUT_IDS": {"lengths_field": "length"}}},
    }
    config = parse_config(data)
    width = 3000
    with running_frontend(config, triton) as fe:
        ids = np.ones((1, width), dtype=np.int32)
        client = grpcclient.InferenceServerClient(fe.grpc_url)
        out = client.infer(
            "sleeper", [ids_input(grpcclient, ids)], headers={"x-api-key": KEYS["hooli"]}
        )
        assert out.as_numpy("OUT").tolist() == [[width]]  # the model was told the real width
        registry = fe.frontend.registry
        labels = {"tenant": "hooli", "endpoint": "sleeper"}

        # Counted as the batch's end is recorded, on the core's loop, which may be after
        # the client has its answer.
        def counted() -> tuple[float | None, float | None] | None:
            got = tuple(
                registry.get_sample_value(f"fair_served_{what}_total", labels)
                for what in ("tokens", "cost")
            )
            return got if None not in got else None

        assert eventually(counted, SETTLE_S, what="the batch's tokens and cost counted") == (
            width,
            width,
        )
