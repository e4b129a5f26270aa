"""The core's own CPU per request, without the transport and without Triton.

What one core process can admit, schedule, batch and answer per second bounds the whole
frontend however many shells feed it. This drives ``Core`` in-process with the example
config's ``embed`` endpoint (throttle and metrics on, as deployed), calls built as a shell
builds them (128-token requests, several tenants), and a stand-in for Triton that answers
every batch at once with the right outputs; it measures the process CPU time per request
over the whole path: ``Core.submit`` -> scheduler -> batch -> pack -> (stand-in) ->
unpack -> answer -> metrics, statistics, request outcome. Also the same for the shell's
side (``Gateway``: identity, validation, the Call) and the IPC codec (one frame each way).

With ``--limits`` every tenant has rate limits on ``embed`` (requests per second and
tokens per day, set far above what the run sends: every request is admitted), so each
request takes the limiter's hot path (``check_now``, ``memory://``) and its answer carries
a quota (results: ``core_limits.json``).

With ``--one-hop`` it measures a unary request as a shell process sends it (issue 30):
its facts (``Call`` without the tensor, with the batch key ``batching.wire_key`` gives),
the core's batch granted to its shell (``Rows``), and the shell's report of it served
(``RowsDone``), each as the link delivers it (decoded from its frame) and read into the
core's intake (``shells.Intake``) as the link reads it: the core's own Python work per
request without the link that ``bench_core_capacity`` adds; four ways in one run, each
twice, alternated: the request log off, on with its lines written by the shells (the
default), on with the core writing them, and the default with the core deciding per call
instead of per tick (each call judged by the throttle, and whether a batch goes decided, at
each call: before ``Core.judge_together`` and ``Core.tick``) (results:
``core_one_hop.json``).

With ``--streams`` it measures a new stream instead (issue 30): the example config's
``llm`` (decoupled, engine mode, 64 slots, two tenants of weights 2:1 kept backlogged),
each ``Call`` decoded from its frame as the link delivers it, granted, then one
``Produced`` record (its one token, ``Core.produced_all``) and its ``Ended``: the core's
own Python work per stream, without the link that ``bench_core_capacity`` adds; three
ways, each twice, alternated: the request log off, on with each stream's line written by
its shell (the default), on with the core writing it (results: ``core_streams.json``).

With ``--tokens`` it measures the core's CPU per output token its shells report (issue
30): 64 granted streams, a shell's ``Produced`` record of a tick carrying 1, 4 or 8
tokens of each, decoded from its frame, its calls found as ``ShellConnection`` finds
them, charged and observed (``Core.produced_all``); ``--requests / 4`` records each way
(results: ``core_tokens.json``).

    .venv/bin/python -m benchmarks.bench_core [--requests 20000] [--limits] [--streams]
        [--one-hop] [--tokens]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from typing import Any, cast

import numpy as np
import uvloop
from tritonclient.grpc import model_config_pb2

from benchmarks.harness import load_example_config, progress, write_result
from fair_frontend.backends.protocol import BackendServer
from fair_frontend.backends.triton.model_config import model_info
from fair_frontend.config import parse_config
from fair_frontend.core import Core
from fair_frontend.core.shells import Intake, ShellConnection
from fair_frontend.endpoint import plan
from fair_frontend.errors import Unavailable
from fair_frontend.models import ModelInfo
from fair_frontend.protocol import Batch, InferRequest, Tensor
from fair_frontend.shell.gateway import Gateway
from fair_frontend.shell.link import LocalLink
from fair_frontend.wire.framing import encode, to_core, to_shell
from fair_frontend.wire.records import Answer, Call, Grant, Produced, Rows, RowsDone, gaps_from

TOKENS = 128
TENANTS = 8


def embed_info() -> ModelInfo:
    cfg = model_config_pb2.ModelConfig(name="embed", max_batch_size=32)
    cfg.input.add(name="INPUT_IDS", data_type=model_config_pb2.TYPE_INT32, dims=[-1])
    cfg.output.add(name="EMBEDDING", data_type=model_config_pb2.TYPE_FP32, dims=[128])
    cfg.instance_group.add(count=1)
    return model_info(cfg, ("1",))


class InstantTriton:
    """Answers every batch at once: EMBEDDING [rows, 128]."""

    def __init__(self) -> None:
        self.batches = 0

    async def infer(self, batch: Batch) -> Any:
        self.batches += 1
        rows = batch.inputs[0].shape[0]
        data = np.zeros((rows, 128), dtype=np.float32)
        return "1", [Tensor("EMBEDDING", "FP32", (rows, 128), data)]

    async def server_ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass


class Sink:
    """A route that counts answers."""

    def __init__(self) -> None:
        self.answers = 0

    def answer(self, answer: Answer | Grant) -> None:
        self.answers += 1


LIMITS = False  # --limits: every tenant limited (never reached) on embed
HIGH_LIMITS = {"embed": {"requests_per_second": 10**9, "tokens_per_day": 10**15}}


def config() -> Any:
    data = load_example_config()
    data.pop("tier_limits", None)
    data["tenants"] = {
        f"t{i}": {"tier": "standard", "api_keys": [f"key-{i}"], "max_queued": 1_000_000}
        for i in range(TENANTS)
    }
    if LIMITS:
        for terms in data["tenants"].values():
            terms["limits"] = HIGH_LIMITS
    data["queues"] = {"max_queued": 10_000_000}
    return parse_config(data)


def request(i: int) -> InferRequest:
    ids = np.full((1, TOKENS), i % 4000, dtype=np.int32)
    return InferRequest("embed", inputs=[Tensor("INPUT_IDS", "INT32", (1, TOKENS), ids)])


def make_call(i: int) -> Call:
    """What a shell hands the core for request i (tenant i mod TENANTS)."""
    tokens, nbytes = TOKENS, 4 * TOKENS
    arrived, wall = time.monotonic(), time.time()
    return Call(i, f"t{i % TENANTS}", 5, arrived, wall, 1, tokens, nbytes, [tokens], request(i))


async def core_per_request(n: int) -> dict[str, float]:
    """Submit n calls in waves of 256 (a burst at a time, answered as Triton frees)."""
    triton = InstantTriton()
    core = Core(config(), cast(BackendServer, triton))
    core._runtime("embed", embed_info())
    core.models._infos["embed"] = _done(embed_info())
    sink = Sink()
    calls = [make_call(i) for i in range(n)]
    cpu0 = time.process_time()
    wall0 = time.perf_counter()
    for start in range(0, n, 256):
        for call in calls[start : start + 256]:
            core.submit(call, sink)
        while sink.answers < min(n, start + 256):
            await asyncio.sleep(0)
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - wall0
    assert sink.answers == n
    return {"us_per_request": cpu / n * 1e6, "requests_per_s": n / wall, "batches": triton.batches}


async def gateway_per_request(n: int) -> dict[str, float]:
    """The shell's side: identify, validate, build the Call, read the answer."""
    triton = InstantTriton()
    cfg = config()
    core = Core(cfg, cast(BackendServer, triton))
    core._runtime("embed", embed_info())
    core.models._infos["embed"] = _done(embed_info())
    gateway = Gateway(cfg, core.keyring, LocalLink(core, Intake(core)), cast(BackendServer, triton))
    headers = [{"authorization": f"Bearer key-{i}"} for i in range(TENANTS)]
    cpu0 = time.process_time()
    for start in range(0, n, 256):
        await asyncio.gather(
            *(
                gateway.infer(request(i), headers[i % TENANTS])
                for i in range(start, min(n, start + 256))
            )
        )
    cpu = time.process_time() - cpu0
    return {"us_per_request_with_core": cpu / n * 1e6}


def ipc_per_request(n: int) -> dict[str, float]:
    """One Call frame encoded and decoded, one Answer frame encoded and decoded."""
    call = make_call(1)
    out = Tensor("EMBEDDING", "FP32", (1, 128), np.zeros((1, 128), dtype=np.float32))
    answer = Answer(1, "1", [out], queued_s=0.01)
    cpu0 = time.process_time()
    for _ in range(n):
        to_core.decode(encode(call)[4:])
        to_shell.decode(encode(answer)[4:])
    return {"us_per_request": (time.process_time() - cpu0) / n * 1e6}


def llm_info() -> ModelInfo:
    """The shipped ``llm``'s config (decoupled)."""
    from google.protobuf import text_format

    from benchmarks.harness import ROOT

    text = (ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()
    return model_info(text_format.Parse(text, model_config_pb2.ModelConfig()), ("1",))


class Shell:
    """A route that keeps the grants."""

    def __init__(self) -> None:
        self.grants: list[Grant] = []

    def answer(self, answer: Answer | Grant) -> None:
        if isinstance(answer, Grant):
            self.grants.append(answer)


def stream_config() -> Any:
    """The example config, ``llm`` unthrottled and unlimited, acme 2 : globex 1."""
    data = load_example_config()
    data.pop("tier_limits", None)
    data["default_endpoint"] = {"throttle": False}
    data["endpoints"]["llm"]["throttle"] = False
    for tenant, weight in (("acme", 2.0), ("globex", 1.0)):
        data["tenants"][tenant].update(weight=weight, max_queued=1_000_000)
        data["tenants"][tenant].pop("limits", None)
    return parse_config(data)


async def core_per_stream(n: int, *, logged: bool = True) -> dict[str, float]:
    """``n`` new streams on ``llm``, 256 waiting at any time (acme 2 : globex 1);
    ``logged``: their shells write their request-log lines (``Call.logged``: the default,
    ``observability.request_log: shell``), else the core does."""
    core = Core(stream_config(), cast(BackendServer, InstantTriton()))
    core._runtime("llm", llm_info())
    shell = Shell()
    # What a shell sends of a stream: its facts, the tensors kept to stream them from
    # Triton once granted (``Gateway._handle``).
    request = InferRequest("llm")
    reqs: dict[int, Any] = {}
    ids = iter(range(1, 1 << 62))

    def submit(tenant: str) -> None:
        i = next(ids)
        call = Call(i, tenant, 2, time.monotonic(), time.time(), 1, 17, 64, None, request, True, 1,
                    logged=logged)  # fmt: skip
        reqs[i] = core.submit(cast(Call, to_core.decode(encode(call)[4:])), shell)  # as it arrives

    for k in range(256):
        submit(("acme", "globex")[k % 2])
    done = seen = 0
    cpu0 = time.process_time()
    wall0 = time.perf_counter()
    while done < n:
        grants, seen = shell.grants[seen:], len(shell.grants)
        for grant in grants:
            req = reqs.pop(grant.id)
            core.produced_all([(req, 1, 0.001)])
            core.stream_ended(req, "1", None, False)
            submit(req.tenant)
            done += 1
        await asyncio.sleep(0)
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - wall0
    core.runtimes["llm"].fail_queued(Unavailable("the run is over"))
    for req in list(reqs.values()):
        if req is not None and not req.answered:
            core.stream_ended(req, "1", None, True)
    await core.runtimes["llm"].drain(1.0)
    return {"us_per_stream": cpu / done * 1e6, "streams_per_s": done / wall}


class RowsShell:
    """A route that takes grants of rows (``Rows``) and keeps them to report."""

    def __init__(self) -> None:
        self.rows: list[Rows] = []

    def answer(self, answer: Answer | Grant) -> None:
        raise AssertionError(f"an answer where rows were expected: {answer}")

    def grant_rows(self, rows: Rows) -> None:
        self.rows.append(cast(Rows, to_shell.decode(encode(rows)[4:])))  # as the link delivers it


class IntakeConn:
    """Stands in for a shell's connection to the intake (``ShellConnection.admit``): its
    calls into the core, their grants to ``route``."""

    closed = False

    def __init__(self, core: Core, route: RowsShell) -> None:
        self.core = core
        self.route = route

    def admit(self, call: Call, *, judged: bool = False) -> None:
        self.core.submit(call, self.route, judged=judged)


async def core_per_request_one_hop(
    n: int, *, logged: bool = True, per_tick: bool = True
) -> dict[str, float]:
    """``n`` unary requests as facts, 256 waiting at any time, each wave read into the
    core's intake (``shells.Intake``) as the link does: admitted per tenant in turn, a
    slice at a time, each slice one tick of the core's: the throttle judging each tenant's
    calls of it together (``Core.judge_together``), the batches decided at its end
    (``Core.tick``); ``per_tick=False``: each call judged and each batch decided at each
    call, as before. Each
    wave's grants are reported served at once (one ``RowsDone`` per ``Rows``), as a shell
    does when Triton answered its part. ``logged``: the calls say their shell writes their
    request-log line (``Call.logged``: the default, ``observability.request_log: shell``),
    else the core writes it (``request_log: core``)."""
    from fair_frontend.batching import wire_key

    # The throttle decides every request as deployed, against a target no wave of this
    # run can miss however slow the machine: a refusal would end the run, not measure it.
    data = config().model_dump(mode="json")
    data["endpoints"]["embed"]["latency_target_ms"] = 3_600_000
    cfg = parse_config(data)
    core = Core(cfg, cast(BackendServer, InstantTriton()))
    if not per_tick:  # the core before the tick: each call judged, each batch decided, alone
        # (patched on the instance)
        core.judge_together = lambda calls: [False] * len(calls)  # type: ignore[method-assign]
        core.tick = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    core._runtime("embed", embed_info())
    core.models._infos["embed"] = _done(embed_info())
    key = wire_key(request(0), plan(cfg, "embed", embed_info()))
    facts = InferRequest("embed")
    shell = RowsShell()
    intake = Intake(core)
    conn = cast(ShellConnection, IntakeConn(core, shell))
    frames = [
        encode(
            Call(i, f"t{i % TENANTS}", 5, 0.0, 0.0, 1, TOKENS, 4 * TOKENS, [TOKENS], facts,
                 key=key, logged=logged)
        )[4:]
        for i in range(n)
    ]  # fmt: skip
    served = 0
    cpu0 = time.process_time()
    wall0 = time.perf_counter()
    for start in range(0, n, 256):
        for frame in frames[start : start + 256]:
            call = cast(Call, to_core.decode(frame))
            call.arrived, call.arrived_wall = time.monotonic(), time.time()
            intake.push(call, conn)
        while served < min(n, start + 256):
            granted, shell.rows = shell.rows, []
            for rows in granted:
                done = RowsDone(rows.model, rows.batch, [(c, 0) for c in rows.calls], [], None,
                                "1", 0.0)  # fmt: skip
                core.rows_done(cast(RowsDone, to_core.decode(encode(done)[4:])), shell)
                served += len(rows.calls)
            await asyncio.sleep(0)
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - wall0
    assert served == n
    return {"us_per_request": cpu / n * 1e6, "requests_per_s": n / wall}


async def one_hop_async(n: int) -> dict[str, Any]:
    """One hop four ways, in one run: the request log off (the core logs warnings only);
    on, as deployed (INFO, JSON lines to a file: ``/dev/null``), each line written by the
    shell that answered the call (the default), or by the core (``request_log: core``);
    and the default again with the core deciding per call, not per tick (the throttle's
    decision and whether a batch goes, at each call: before ``Core.tick``). Each way twice,
    alternated, the machine's drift shared alike."""
    import logging
    import os

    from fair_frontend.observability.logs import configure_logging

    configure_logging("json", "INFO")
    handler = cast("logging.StreamHandler[Any]", logging.getLogger().handlers[0])
    handler.stream = open(os.devnull, "w")  # noqa: SIM115
    requests = logging.getLogger("fair_frontend.requests")
    out: dict[str, Any] = {"requests": n, "tokens": TOKENS, "tenants": TENANTS}
    ways = (
        ("log_off", logging.WARNING, True, True),
        ("log_by_shells", logging.INFO, True, True),
        ("log_by_core", logging.INFO, False, True),
        ("per_call", logging.INFO, True, False),
    )
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in ways}
    for round_ in (1, 2):
        for name, level, logged, per_tick in ways:
            requests.setLevel(level)
            progress(f"core, round {round_}: {n} unary requests, one hop ({name}): "
                     f"Call (facts) .. Rows .. RowsDone")  # fmt: skip
            await core_per_request_one_hop(n // 4, logged=logged, per_tick=per_tick)  # warm-up
            runs[name].append(await core_per_request_one_hop(n, logged=logged, per_tick=per_tick))
            progress(f"  {runs[name][-1]['us_per_request']:.1f} us of CPU per request")
    for name, got in runs.items():
        out[name] = {
            "us_per_request": min(r["us_per_request"] for r in got),
            "requests_per_s": max(r["requests_per_s"] for r in got),
            "rounds_us_per_request": [r["us_per_request"] for r in got],
        }

    def ratio(a: str, b: str) -> float:
        return float(out[a]["us_per_request"] / out[b]["us_per_request"])

    out["log_by_core_vs_shells"] = ratio("log_by_core", "log_by_shells")
    out["per_call_vs_per_tick"] = ratio("per_call", "log_by_shells")
    progress(f"the core's CPU per request, its request log by the core / by the shells: "
             f"{out['log_by_core_vs_shells']:.2f}x; per call / per tick: "
             f"{out['per_call_vs_per_tick']:.2f}x")  # fmt: skip
    return out


async def core_per_token(per_entry: int, records: int) -> dict[str, float]:
    """The core's CPU per reported token: 64 granted streams of ``llm`` (acme 2 : globex
    1), each of a shell's ``Produced`` records (one tick) carrying ``per_entry`` tokens of
    each stream with their gaps, decoded from its frame as the link delivers it, its
    calls found as ``ShellConnection`` finds them, then ``Core.produced_all``."""
    core = Core(stream_config(), cast(BackendServer, InstantTriton()))
    core._runtime("llm", llm_info())
    shell = Shell()
    calls: dict[int, Any] = {}
    for i in range(1, 65):
        tenant = ("acme", "globex")[i % 2]
        call = Call(i, tenant, 2, time.monotonic(), time.time(), 1, 17, 64, None,
                    InferRequest("llm"), True, 1)  # fmt: skip
        calls[i] = core.submit(call, shell)
    while len(shell.grants) < 64:
        await asyncio.sleep(0)
    # Each tenant's inter-token times of the tick, binned as its shell bins them.
    times = [(t, "llm", *gaps_from([0.01] * per_entry * 32)) for t in ("acme", "globex")]
    frame = encode(Produced([(g.id, per_entry, -1.0) for g in shell.grants], times))
    frame = frame[4:]
    cpu0 = time.process_time()
    for _ in range(records):
        record = cast(Produced, to_core.decode(frame))
        reports = []
        for call_id, tokens, first_s in record.entries:
            req = calls.get(call_id)
            if req is not None:
                reports.append((req, tokens, first_s))
        core.produced_all(reports, record.gaps)
    cpu = time.process_time() - cpu0
    for req in calls.values():
        core.stream_ended(req, "1", None, False)
    await core.runtimes["llm"].drain(1.0)
    return {"us_per_token": cpu / (records * 64 * per_entry) * 1e6}


async def tokens_async(records: int) -> dict[str, Any]:
    import logging

    logging.getLogger("fair_frontend.requests").setLevel(logging.WARNING)
    out: dict[str, Any] = {"streams": 64, "records": records}
    for per_entry in (1, 4, 8):
        progress(f"core: {records} Produced records of 64 streams, {per_entry} token(s) each")
        await core_per_token(per_entry, records // 4)  # warm-up
        got = [await core_per_token(per_entry, records) for _ in range(3)]
        out[f"tokens_per_entry_{per_entry}"] = {
            "us_per_token": min(g["us_per_token"] for g in got),
            "rounds_us_per_token": [g["us_per_token"] for g in got],
        }
        progress(f"  {out[f'tokens_per_entry_{per_entry}']['us_per_token']:.2f} us of CPU "
                 "per reported token")  # fmt: skip
    return out


def _done(value: ModelInfo) -> asyncio.Task[ModelInfo]:
    """A finished lookup, as the registry keeps one (a Future where it keeps a Task: what
    it reads of one, a Future has)."""
    fut: asyncio.Future[ModelInfo] = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return cast("asyncio.Task[ModelInfo]", fut)


async def streams_async(n: int) -> dict[str, Any]:
    """New streams three ways, each twice, alternated: the request log off (the core logs
    warnings only); on as deployed (INFO, JSON lines to a file: ``/dev/null``), each
    stream's line written by its shell (the default); on, written by the core
    (``request_log: core``)."""
    import logging
    import os

    from fair_frontend.observability.logs import configure_logging

    configure_logging("json", "INFO")
    handler = cast("logging.StreamHandler[Any]", logging.getLogger().handlers[0])
    handler.stream = open(os.devnull, "w")  # noqa: SIM115
    requests = logging.getLogger("fair_frontend.requests")
    ways = (
        ("log_off", logging.WARNING, True),
        ("log_by_shells", logging.INFO, True),
        ("log_by_core", logging.INFO, False),
    )
    runs: dict[str, list[float]] = {name: [] for name, *_ in ways}
    for round_ in (1, 2):
        for name, level, logged in ways:
            requests.setLevel(level)
            progress(f"core, round {round_}: {n} new streams of llm ({name}), "
                     "Call .. Grant .. Produced .. Ended")  # fmt: skip
            await core_per_stream(n // 4, logged=logged)  # warm-up
            runs[name].append((await core_per_stream(n, logged=logged))["us_per_stream"])
            progress(f"  {runs[name][-1]:.1f} us of CPU per new stream")
    out: dict[str, Any] = {"streams": n}
    for name, got in runs.items():
        out[name] = {"us_per_stream": min(got), "rounds_us_per_stream": got}
    out["us_per_stream"] = out["log_by_shells"]["us_per_stream"]  # as deployed
    out["log_by_core_vs_shells"] = (
        out["log_by_core"]["us_per_stream"] / out["log_by_shells"]["us_per_stream"]
    )
    progress(f"the core's CPU per new stream, its request log by the core / by the shells: "
             f"{out['log_by_core_vs_shells']:.2f}x")  # fmt: skip
    return out


async def main_async(n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": n, "tokens": TOKENS, "tenants": TENANTS}
    import logging

    logging.getLogger("fair_frontend.requests").setLevel(logging.WARNING)
    progress(f"core: {n} requests through Core.submit .. answer (instant Triton)")
    await core_per_request(n // 4)  # warm-up
    out["core"] = await core_per_request(n)
    progress(f"  {out['core']['us_per_request']:.1f} us of CPU per request")
    progress("shell gateway + core, in one process")
    out["gateway"] = await gateway_per_request(n)
    progress(f"  {out['gateway']['us_per_request_with_core']:.1f} us of CPU per request")
    out["ipc"] = ipc_per_request(n)
    progress(f"IPC codec: {out['ipc']['us_per_request']:.1f} us per request (both frames)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--limits", action="store_true", help="every tenant rate-limited")
    parser.add_argument("--streams", action="store_true", help="new streams of llm instead")
    parser.add_argument("--one-hop", action="store_true", help="unary requests as facts")
    parser.add_argument("--tokens", action="store_true", help="streams' token reports")
    args = parser.parse_args()
    if args.tokens:
        write_result("core_tokens", uvloop.run(tokens_async(args.requests // 4)))
        return
    if args.one_hop:
        write_result("core_one_hop", uvloop.run(one_hop_async(args.requests)))
        return
    if args.streams:
        write_result("core_streams", uvloop.run(streams_async(args.requests)))
        return
    global LIMITS
    LIMITS = args.limits
    results = uvloop.run(main_async(args.requests))
    results["limits"] = HIGH_LIMITS if LIMITS else None
    write_result("core_limits" if LIMITS else "core", results)


if __name__ == "__main__":
    main()
