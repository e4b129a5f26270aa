"""The feedback loop against a real Triton: learn a known cost, and Triton's own accounting.

One Triton for the module, serving ``tests/model_repository`` and ``model_repository``
(``--model-repository`` twice) but loading only ``sleeper`` and ``embed``
(``--model-control-mode=explicit``), on free loopback ports; stopped at the end. The test
plays the frontend: it sends batches straight to Triton with tritonclient, reports them
to a ``ServiceModel`` as the shell would, and lets ``TritonMetrics`` scrape between
groups of batches.

Timing on 2 shared cores is noisy, and one-sided: Triton's time for an execution includes
the Python stub's wait for a CPU, and a busy wait that is off the CPU at its deadline
overshoots. Measured at load averages of 4-6 (other test suites running): the fitted
per-token cost stays within 8 % of the configured 20 us, but the fixed cost comes out
0.3-1.7 ms high with 2 ms or 10 ms configured, and 3-7 ms high with 20 ms. So the
per-token cost is held to 25 % of the configuration, or above it to 25 % over the slope
Triton measured in the same run where the machine's load stretched it; the fixed cost to
between 75 % of the configuration and 125 % of it plus the largest overhead Triton measured
over the batch shapes in the same run (a fit over shapes whose overshoots differ may put
the largest in its fixed cost: 3.0 ms fitted against 2.4 ms configured + the smallest
batch's overhead, in one CI run); and the fitted model must reproduce Triton's mean time
of every batch shape.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient

from fair_frontend.backends.triton.embedded import EmbeddedTriton, default_model_repository
from fair_frontend.backends.triton.metrics import TenantUsage, TritonMetrics
from fair_frontend.feedback import ServiceModel, Source, TritonDelta
from fair_frontend.kit.testing import aeventually, ascrape, eventually
from fair_frontend.scheduler.cost import CostUnit
from tests.support import TEST_MODEL_REPOSITORY

SLEEPER_FIXED_S = 0.002  # tests/model_repository/sleeper/config.pbtxt
SLEEPER_PER_TOKEN_S = 20e-6
# (rows, width) of the batches: 16 to 2048 tokens, 2 to 43 ms each; rows and tokens vary
# independently enough for the fit to tell the fixed cost from the per-token one.
SHAPES = [(1, 16), (32, 16), (4, 256), (16, 128), (8, 64), (2, 512), (32, 64), (1, 1024)]
PER_GROUP = 5  # batches of one shape between two scrapes
ROUNDS = 5


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedTriton]:
    triton = EmbeddedTriton(
        TEST_MODEL_REPOSITORY,
        extra_args=[
            f"--model-repository={default_model_repository()}",
            "--model-control-mode=explicit",
            "--load-model=sleeper",
            "--load-model=embed",
        ],
    )
    triton.start()
    try:
        yield triton
    finally:
        triton.stop()


@pytest.fixture
async def client(server: EmbeddedTriton) -> AsyncIterator[aioclient.InferenceServerClient]:
    c = aioclient.InferenceServerClient(server.grpc_url)
    try:
        yield c
    finally:
        await c.close()


def ids(rows: int, width: int) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("INPUT_IDS", [rows, width], "INT32")
    tensor.set_data_from_numpy(np.ones((rows, width), dtype=np.int32))
    return tensor


def padded(tenant: str, lengths: list[int]) -> dict[str, str]:
    """Real row lengths as the frontend sends them: in the ``fair_rows`` parameter."""
    return {"fair_rows": json.dumps({"tenant": [tenant] * len(lengths), "length": lengths})}


async def test_sleeper_answers_each_rows_token_count(
    client: aioclient.InferenceServerClient,
) -> None:
    result = await client.infer("sleeper", [ids(3, 10)], parameters=padded("t", [10, 4, 1]))
    assert result.as_numpy("OUT").tolist() == [[10], [4], [1]]
    result = await client.infer("sleeper", [ids(2, 7)])
    assert result.as_numpy("OUT").tolist() == [[7], [7]]


@dataclass
class Learned:
    both: ServiceModel  # fed by the frontend's timings and Triton's metrics
    frontend_only: ServiceModel
    deltas: list[TritonDelta] = field(default_factory=list)
    # Triton's mean execution time of each group, by shape.
    measured: dict[tuple[int, int], list[float]] = field(default_factory=dict)


def learn(server: EmbeddedTriton) -> Learned:
    """Send ROUNDS x SHAPES groups of PER_GROUP batches, one at a time; scrape after each."""

    def model() -> ServiceModel:
        # Memory longer than the test (a few seconds), so that every group counts alike.
        return ServiceModel(
            "sleeper",
            cost_unit=CostUnit.TOKENS,
            max_batch_size=32,
            interval_s=60.0,
            min_memory_batches=10_000,
        )

    out = Learned(model(), model())

    def on_delta(delta: TritonDelta) -> None:
        if delta.model == "sleeper":
            out.deltas.append(delta)
            out.both.observe_triton(delta)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        client = aioclient.InferenceServerClient(server.grpc_url)
        try:
            async with TritonMetrics(server.metrics_url, on_delta=on_delta) as metrics:
                earlier = await _executions(server)  # (the module's other tests')
                for _ in range(3):  # the first execution pays for start-up
                    await client.infer("sleeper", [ids(1, 16)])
                # The baseline once Triton has counted them (it counts an execution just
                # after answering it: on a loaded machine the third came after a scrape
                # taken at once, and counted as one of the test's).
                warm = earlier + 3
                seen: list[float] = []

                async def counted_warm() -> bool:
                    # All three, and no other still being counted (the module's other
                    # tests' too: two looks 50 ms apart agree).
                    seen.append(await _executions(server))
                    return seen[-1] >= warm and seen[-2:] == [seen[-1]] * 2

                await aeventually(counted_warm, 10, 0.05, what="the warm-ups counted")
                assert await metrics.scrape_once()  # the baseline
                sent_batches = 0
                for _ in range(ROUNDS):
                    for rows, width in SHAPES:
                        first = len(out.deltas)
                        for _ in range(PER_GROUP):
                            # One at a time: each request is one execution.
                            sent = loop.time()
                            await client.infer("sleeper", [ids(rows, width)])
                            done = loop.time()
                            sent_batches += 1
                            for m in (out.both, out.frontend_only):
                                m.observe_batch(rows, rows * width, sent, done, done)
                        # Triton counts an execution just after answering it: poll until
                        # its counters show the whole group (the model copes either way;
                        # this keeps each group's numbers apart, for `measured`).
                        assert await metrics.scrape_once()

                        async def counted(total: int = sent_batches) -> bool:
                            if sum(d.exec_count for d in out.deltas) >= total:
                                return True
                            assert await metrics.scrape_once()
                            return False

                        # Scrapes back to back, as many as it takes, within a deadline.
                        await aeventually(counted, 10, 0, what=f"Triton to count {sent_batches}")
                        group = out.deltas[first:]
                        seconds = sum(d.compute_infer_us for d in group) / 1e6
                        requests = sum(d.request_success for d in group)
                        out.measured.setdefault((rows, width), []).append(seconds / requests)
        finally:
            await client.close()

    asyncio.run(run())
    return out


async def _executions(server: EmbeddedTriton) -> float:
    """Triton's count of the sleeper's executions so far."""
    page = await ascrape(server.metrics_url)
    return page.family_sum("nv_inference_exec_count", model="sleeper")


@pytest.fixture(scope="module")
def learned(server: EmbeddedTriton) -> Learned:
    return learn(server)


def test_triton_counts_every_batch(learned: Learned) -> None:
    batches = ROUNDS * len(SHAPES) * PER_GROUP
    assert sum(d.exec_count for d in learned.deltas) == batches
    assert sum(d.request_success for d in learned.deltas) == batches
    rows = ROUNDS * PER_GROUP * sum(r for r, _ in SHAPES)
    assert sum(d.inference_count for d in learned.deltas) == rows
    assert not any(d.reset for d in learned.deltas)


def test_learns_the_sleepers_cost_from_tritons_metrics(learned: Learned) -> None:
    status = learned.both.status()
    assert status.source is Source.TRITON and not status.triton_stale
    bt = status.batch_time
    means = {shape: statistics.fmean(v) for shape, v in learned.measured.items()}
    # What Triton measured beyond the sleeper's configured time, per batch shape: the
    # one-sided timing error (the module docstring); the fit may put the largest in its
    # fixed cost.
    overhead = max(
        0.0,
        *(
            mean - (SLEEPER_FIXED_S + rows * width * SLEEPER_PER_TOKEN_S)
            for (rows, width), mean in means.items()
        ),
    )
    print(
        f"\ntriton: {bt}\nfrontend: {learned.frontend_only.batch_time()}"
        f"\nlargest overhead over the batch shapes: {overhead * 1e3:.2f} ms"
    )
    # Triton's own time per token: the slope of its measured means over the shapes. A
    # loaded machine stretches it, never shrinks it (one-sided, as the fixed cost's): 26
    # us for the configured 20 in a fresh clone at a load average of 17-19.
    tokens = [float(rows * width) for rows, width in means]
    slope = float(np.polyfit(tokens, list(means.values()), 1)[0])
    top = 1.25 * max(SLEEPER_PER_TOKEN_S, slope)
    assert 0.75 * SLEEPER_PER_TOKEN_S <= bt.per_token_s <= top, (bt, slope)
    assert bt.fixed_s <= 1.25 * (SLEEPER_FIXED_S + overhead)
    if overhead < SLEEPER_FIXED_S / 2:
        # Found where Triton's timing error is well below it. (A fresh clone beside two
        # CPU hogs: milliseconds of error, and the fit, rightly, kept no fixed term: a
        # 2 ms cost under a larger error is not one it can tell from noise.)
        assert bt.fixed_s >= 0.75 * SLEEPER_FIXED_S, (bt, overhead)
    # The fit reproduces what Triton measured, shape by shape, within the timing error
    # Triton's own measurements showed (on a loaded machine, milliseconds of it, unevenly
    # across the shapes: more than a linear fit can follow).
    for (rows, width), measured in means.items():
        predicted = learned.both.predict_batch_seconds(rows, rows * width)
        slack = max(0.001, overhead)
        assert predicted == pytest.approx(measured, rel=0.15, abs=slack), (rows, width, overhead)
    # The frontend's round trips add the network and gRPC to every batch.
    assert learned.frontend_only.source is Source.FRONTEND
    assert learned.frontend_only.batch_time().fixed_s >= bt.fixed_s


async def test_tenant_totals_equal_what_was_sent(
    server: EmbeddedTriton, client: aioclient.InferenceServerClient
) -> None:
    tenant = f"feedback-{uuid.uuid4().hex[:8]}"
    deltas: list[TritonDelta] = []
    sent = [(1, 8, None), (4, 16, None), (3, 32, [5, 32, 1]), (2, 100, [100, 40])]
    async with TritonMetrics(
        server.metrics_url, on_delta=lambda d: deltas.append(d) if d.model == "embed" else None
    ) as metrics:
        assert await metrics.scrape_once()
        assert tenant not in metrics.tenant_totals("embed")
        for rows, width, real in sent:
            params = padded(tenant, real) if real else {"tenant": tenant}
            await client.infer("embed", [ids(rows, width)], parameters=params)
        # Triton counts a request's success after its response went out: scrape until
        # the last one shows (a deadline, not a sleep), adding up the deltas.
        deadline = time.monotonic() + 10
        while sum(d.request_success for d in deltas) < len(sent):
            assert time.monotonic() < deadline, deltas
            assert await metrics.scrape_once()
        rows_sent = sum(rows for rows, _, _ in sent)
        # Real tokens only: padding (beyond each row's length) is never counted.
        tokens_sent = sum(sum(real) if real else rows * width for rows, width, real in sent)
        assert metrics.tenant_totals("embed")[tenant] == TenantUsage(rows_sent, tokens_sent)
    totals = (
        sum(_exported(d.rows) for d in deltas),
        sum(_exported(d.tokens) for d in deltas),
        sum(d.request_success for d in deltas),
    )
    assert totals == (rows_sent, tokens_sent, len(sent))


def _exported(count: int | None) -> int:
    """A per-tenant count of a model that exports them (embed does): never None."""
    assert count is not None
    return count


def test_a_restarted_triton_is_a_counter_reset() -> None:
    triton = EmbeddedTriton(
        TEST_MODEL_REPOSITORY,
        extra_args=["--model-control-mode=explicit", "--load-model=sleeper"],
    )
    deltas: list[TritonDelta] = []

    async def send(count: int) -> None:
        client = aioclient.InferenceServerClient(triton.grpc_url)
        try:
            for _ in range(count):
                await client.infer("sleeper", [ids(2, 8)])
        finally:
            await client.close()

    async def scrape(metrics: TritonMetrics) -> None:
        assert await metrics.scrape_once()

    def record(delta: TritonDelta) -> None:
        if delta.model == "sleeper":
            deltas.append(delta)

    triton.start()
    try:
        metrics = TritonMetrics(triton.metrics_url, on_delta=record)
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(send(10))
            loop.run_until_complete(scrape(metrics))  # baseline: 10 executions
            loop.run_until_complete(metrics.stop())  # no connection held across the restart
            triton.restart()
            loop.run_until_complete(send(3))

            def counted() -> bool:
                # Triton counts an execution once its execute() returned, a moment after
                # the client had its answer: scraped again until all three are counted.
                loop.run_until_complete(scrape(metrics))
                return sum(d.exec_count for d in deltas) >= 3

            eventually(counted, 60.0, what="Triton's count of the three calls after its restart")
        finally:
            loop.run_until_complete(metrics.stop())
            loop.close()
    finally:
        triton.stop()
    assert deltas[0].reset and not any(d.reset for d in deltas[1:])
    counts = [(d.exec_count, d.inference_count, d.request_success) for d in deltas]
    assert tuple(map(sum, zip(*counts, strict=True))) == (3, 6, 3), counts
