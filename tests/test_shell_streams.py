"""A shell process killed while it relays 50 engine streams: their slots come back at once.

Real processes: the session's ``tritonserver`` (the streaming ``llm``), the core in this
process and two shell processes (``workers=2``). One gRPC connection carries 50 streams
of one tenant, so one shell relays them all (a connection stays with the shell that
accepted it); another connection, on the other shell, is kept for later. Both
connections are placed (each shell found) before the 50 streams start, so the streams are
killed a moment after they are all relaying, long before their 400 tokens are out. The
core holds 50 granted slots; the shell is SIGKILLed.

The bound, as an order of events rather than a time. The kernel closes a dead process's
sockets as it tears the process down; the core's end of the Unix socket then reads
end-of-file in its loop's next poll, and ``ShellConnection.connection_lost`` drops the
shell's route (``Core.drop_route``): each granted stream's task is cancelled, and the
loop's next iteration runs their ``finally``, which returns the slot and records the
outcome, CANCELLED, once. So every slot is back within two iterations of the core's loop
after it read the socket's end, with no timeout in the path (a shell that stops reading
is cut after ``queues.stalled_shell_s``, 10 s; a stream without progress after
``triton.request_timeout_s``, 60 s). The test checks exactly that: ``drop_route`` ran for
the killed shell, and a callback the test queued on the core's loop two iterations after
it found all 50 outcomes recorded. (Measured, for scale: 9 ms from the kill to the last
slot back on a quiet machine, 33-95 ms at a load average of 9; not asserted.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from fair_frontend.backends.triton.embedded import EmbeddedTriton
from fair_frontend.config import Config
from fair_frontend.core import Core
from fair_frontend.core.shells import ShellConnection
from fair_frontend.kit.testing import aeventually, ascrape
from fair_frontend.observability.observe import Observer
from fair_frontend.outcomes import Outcome
from fair_frontend.server import BackgroundServer, FrontendServer, Listen
from tests.support import KEYS, make_config

SLOTS = 64  # the llm's own max_num_seqs: the 50 streams and a probe fit
STREAMS = 50
LONG = 400  # output tokens: still streaming long after the kill (prompt + 400 < 512)
SETUP_S = 60.0  # deadlines for what the test waits on before the kill (a hang fails)
PROMPT = "a shell relays this stream until it is killed"
OWN = [("grpc.use_local_subchannel_pool", 1)]  # a channel of one's own: its own connection


class Outcomes(Observer):
    """Every outcome the core records, by request id, with ``time.monotonic()`` when."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.outcome: dict[str, Outcome] = {}
        self.at: dict[str, float] = {}

    def request_finished(self, *, request_id: str = "", outcome: Outcome, **kw: Any) -> None:
        self.count[request_id] += 1
        self.outcome[request_id] = outcome
        self.at[request_id] = time.monotonic()


def engine_config() -> Config:
    base = make_config()
    llm = base.endpoints["llm"].model_copy(update={"max_inflight": SLOTS, "reserved_slots": 0})
    return base.model_copy(update={"endpoints": {**base.endpoints, "llm": llm}})


def llm_request(request_id: str, max_tokens: int) -> dict[str, Any]:
    text = grpcaio.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
    flag = grpcaio.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([True]))
    sampling = grpcaio.InferInput("sampling_parameters", [1], "BYTES")
    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    sampling.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
    return {"model_name": "llm", "inputs": [text, flag, sampling], "request_id": request_id}


class Streams:
    """Streams on one client (one connection), each read to its end; tokens counted."""

    def __init__(self, url: str, tenant: str) -> None:
        self.client = grpcaio.InferenceServerClient(url, channel_args=OWN)
        self.headers = {"x-api-key": KEYS[tenant]}
        self.tokens: Counter[str] = Counter()
        self.tasks: dict[str, asyncio.Task[str | None]] = {}
        self.calls: dict[str, Any] = {}

    def start(self, request_id: str, max_tokens: int) -> None:
        self.tasks[request_id] = asyncio.ensure_future(self._read(request_id, max_tokens))

    async def _read(self, request_id: str, max_tokens: int) -> str | None:
        """None when every token came; else the error the stream ended with."""

        async def one() -> AsyncIterator[dict[str, Any]]:
            yield llm_request(request_id, max_tokens)

        replies = self.client.stream_infer(one(), headers=self.headers)
        self.calls[request_id] = replies
        try:
            async for result, error in replies:
                if error is not None:
                    return str(error)
                text = result.as_numpy("text_output")
                if text is not None and text.size:
                    self.tokens[request_id] += 1
                    if self.tokens[request_id] == max_tokens:
                        return None
        except (InferenceServerException, grpc.aio.AioRpcError) as err:
            return str(err)
        return f"ended after {self.tokens[request_id]} of {max_tokens} tokens"

    def cancel(self, request_id: str) -> None:
        self.calls[request_id].cancel()

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await self.client.close()


def holder(server: FrontendServer, request_id: str) -> ShellConnection | None:
    """The shell connection whose granted call ``request_id`` is (None: not granted yet)."""
    assert server.shells is not None
    for conn in list(server.shells.server.connections):
        for req in list(conn.calls.values()):
            if req is not None and req.call.request.id == request_id and req.ended is not None:
                return conn
    return None


async def test_a_shell_killed_with_50_streams_gives_their_slots_back_at_once(
    triton: EmbeddedTriton,
) -> None:
    outcomes = Outcomes()
    server = FrontendServer(
        engine_config(),
        triton.grpc_url,
        Listen(),
        workers=2,
        core_factory=lambda c, f: Core(c, f, observers=[outcomes]),
    )
    with BackgroundServer(server):
        core, shells = server.core, server.shells
        assert core is not None and shells is not None
        url = f"127.0.0.1:{server.grpc_port}"
        metrics = f"http://127.0.0.1:{server.metrics_port}/metrics"
        doomed: Streams | None = None
        kept = Streams(url, "globex")
        try:
            # Each connection placed first (a probe stream finds the shell that accepted
            # it, then goes away): the kept one, then one for the 50 on the other shell
            # (the kernel spreads connections over the two).
            await _probe(server, kept, "probe-kept")
            kept_shell = holder(server, "probe-kept")
            assert kept_shell is not None
            kept.cancel("probe-kept")
            victim: ShellConnection | None = None
            probes = ["probe-kept"]
            for attempt in range(20):
                doomed = Streams(url, "acme")
                probe = f"probe-doomed{attempt}"
                probes.append(probe)
                await _probe(server, doomed, probe)
                victim = holder(server, probe)
                doomed.cancel(probe)
                if victim is not kept_shell:
                    break
                await doomed.close()
                doomed, victim = None, None
            assert doomed is not None and victim is not None, "20 connections, all on one shell"
            await aeventually(lambda: _idle(core), SETUP_S, what="the probes' slots back")
            await aeventually(
                lambda: all(outcomes.count[p] == 1 for p in probes),
                SETUP_S,
                what="the probes' outcomes recorded",
            )

            ids = [f"doomed{i}" for i in range(STREAMS)]
            for request_id in ids:
                doomed.start(request_id, LONG)
            # All 50 granted, on one shell, and every one of them streaming to its client.
            # A slot is taken when the request is launched, granted to its shell a loop
            # iteration later: wait for both.
            runtime = core.runtimes["llm"]
            await aeventually(
                lambda: (
                    runtime.inflight == STREAMS and all(holder(server, i) is not None for i in ids)
                ),
                SETUP_S,
                what="50 slots granted",
            )
            assert all(holder(server, i) is victim for i in ids), "one connection, one shell"
            await aeventually(
                lambda: all(doomed.tokens[i] for i in ids),
                SETUP_S,
                what="50 streams relaying",
            )
            before = (await ascrape(metrics)).sum(
                "fair_requests_total", tenant="acme", endpoint="llm", outcome="cancelled"
            )
            # The streams the kill cuts are those not yet ended when it comes: on a slow
            # machine the first ones started may finish their LONG tokens while the last
            # ones start, and are served whole (counted as served, not as cut).
            finished = {i for i in ids if outcomes.count[i]}
            recorded = _after_drop(core, victim, lambda: sum(outcomes.count[i] for i in ids))

            killed_at = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)
            # The core's loop runs in its own thread: the drop is judged once the spy has
            # read the outcomes two iterations after it (read before, a slot count of 0
            # could be seen while the drop was still recording them).
            await aeventually(
                lambda: recorded and runtime.inflight == 0, SETUP_S, 0.005, what="every slot back"
            )
            # Every slot back by the socket's end, at once, each stream's outcome once.
            assert all(outcomes.count[i] == 1 for i in ids), outcomes.count
            cut = [i for i in ids if outcomes.outcome[i] is Outcome.CANCELLED]
            served = [i for i in ids if i not in cut]
            assert cut, f"all {STREAMS} streams ended before the kill: nothing was cut"
            assert {outcomes.outcome[i] for i in served} <= {Outcome.DISPATCHED}
            assert all(doomed.tokens[i] == LONG for i in served), "served whole"
            back_s = max(outcomes.at[i] for i in cut) - killed_at
            assert back_s >= 0, back_s  # after the kill, not before
            assert recorded == [STREAMS], (
                f"outcomes recorded within two loop iterations of the shell's socket end: "
                f"{recorded} of {STREAMS}, {len(finished)} served before the kill "
                f"(the last cut one {back_s:.3f} s after the kill)"
            )

            async def counted() -> float:
                page = await ascrape(metrics)
                name = "fair_requests_total"
                return page.sum(name, tenant="acme", endpoint="llm", outcome="cancelled") - before

            cancelled = await aeventually(
                lambda: _at_least(counted, len(cut)), SETUP_S, what="the cancellations counted"
            )
            assert cancelled == len(cut)
            errors = await asyncio.wait_for(
                asyncio.gather(*(doomed.tasks[i] for i in cut)), SETUP_S
            )
            assert all(e is not None for e in errors)  # their clients saw them fail

            # The surviving shell's client: a new stream is granted a slot and served.
            kept.start("after", 8)
            assert await asyncio.wait_for(kept.tasks["after"], SETUP_S) is None
            assert kept.tokens["after"] == 8
            # Its end (Triton's final response) may come just after its last token.
            await aeventually(lambda: runtime.inflight == 0, SETUP_S, what="its slot back")
            await aeventually(lambda: outcomes.count["after"] == 1, SETUP_S, what="its end")
            assert outcomes.outcome["after"] is Outcome.DISPATCHED
        finally:
            if doomed is not None:
                await doomed.close()
            await kept.close()


async def _probe(server: FrontendServer, streams: Streams, request_id: str) -> None:
    """A long stream on ``streams``' connection, until the core granted it to a shell."""
    streams.start(request_id, LONG)
    await aeventually(
        lambda: holder(server, request_id), SETUP_S, what=f"{request_id} granted to a shell"
    )


def _idle(core: Core) -> bool:
    runtime = core.runtimes.get("llm")
    return runtime is not None and runtime.inflight == 0


async def _at_least(value: Callable[[], Awaitable[float]], least: float) -> float | None:
    """``value()`` once it has reached ``least`` (None before: a poll's not yet)."""
    got = await value()
    return got if got >= least else None


def _after_drop(core: Core, shell: ShellConnection, recorded: Callable[[], int]) -> list[int]:
    """What ``recorded()`` says two iterations of the core's loop after the core dropped
    ``shell``'s route (``Core.drop_route``: it read the end of that shell's socket), once
    per drop of it; the list fills as the core does it."""
    seen: list[int] = []
    drop_route = core.drop_route

    def spied(route: Any) -> int:
        dropped = drop_route(route)
        if route is shell:
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, lambda: seen.append(recorded()))
        return dropped

    core.drop_route = spied  # type: ignore[method-assign]  # a spy on the instance
    return seen
