"""The one place that talks to Triton: tritonclient's asyncio gRPC client.

Errors come back as ``UpstreamError`` carrying Triton's own gRPC code and the HTTP
status Triton's HTTP server would have used for it, so a client sees through the
frontend what it would have seen from Triton. An unreachable Triton is ``Unavailable``
(the dispatch loop then holds work for its return); Triton's own UNAVAILABLE about one
model or version ("... is not at ready state") is ``ModelUnavailable``, which fails the
requests that asked for it and nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from tritonclient.grpc import (
    InferenceServerException,
    service_pb2,
)
from tritonclient.grpc import aio as grpcclient

from fair_frontend import grpc_codec
from fair_frontend.backends.protocol import SideDoor, StreamReply
from fair_frontend.backends.triton.http import TritonHttp, carries
from fair_frontend.backends.triton.model_config import model_info
from fair_frontend.backends.triton.sse import TritonEvents
from fair_frontend.backends.triton.upstream import upstream_error, upstream_message_error
from fair_frontend.backends.triton.watchdog import Watchdog
from fair_frontend.errors import (
    FrontendError,
    Unavailable,
)
from fair_frontend.models import ModelInfo
from fair_frontend.protocol import (
    EMPTY_FINAL_RESPONSE,
    FINAL_RESPONSE,
    Batch,
    Tensor,
)

_STREAM_RESPONSE = service_pb2.ModelStreamInferResponse.FromString
# Large batches of embeddings can exceed gRPC's 4 MiB default; Triton allows 2 GiB.
_MAX_MESSAGE = 2**31 - 1


def _rpc_exception(err: grpc.aio.AioRpcError) -> InferenceServerException:
    """tritonclient's form of a failed call (as its own clients raise it)."""
    return InferenceServerException(err.details(), str(err.code()))


REOPEN_WAIT_S = 2.0  # a stream that never reached Triton: how long its second try waits
# A stream whose last response came, left to end on its own: cancelled if it has not
# ended this long after (Triton ends it as soon as it has sent that response).
FINISH_WAIT_S = 5.0
_finishing: set[Any] = set()  # such calls, held until they end (a dropped call is cancelled)


def _let_finish(call: Any) -> None:
    """Leave a call whose last response has come to end as Triton ends it.

    Its status follows that response at once; cancelling it in between reaches Triton
    while it is finishing the request, and Triton 2.51 then never releases the request's
    trace (its root span is never exported: a traced stream's spans hang from a parent
    nobody sees). Held here until it ends, since grpc.aio cancels a call it collects."""
    late = asyncio.get_running_loop().call_later(FINISH_WAIT_S, call.cancel)
    _finishing.add(call)

    def ended(_: Any) -> None:
        late.cancel()
        _finishing.discard(call)

    call.add_done_callback(ended)


# The side doors' calls of tritonclient's client, by the frontend's name for each door.
_SIDE_DOORS: dict[str, str] = {
    "model_metadata": "get_model_metadata",
    "model_config": "get_model_config",
    "model_ready": "is_model_ready",
}


class TritonStream:
    """One request to a decoupled model over ``ModelStreamInfer``: its responses, as an
    async iterator of ``StreamReply`` (the last one an error, if one ended it).

    Always asks Triton for the empty final response, so the end of a request is known
    even when its last real response does not say so. No deadline on the call: a
    generation streams for as long as it produces; ``Watchdog`` bounds the time without
    progress (``NoProgress``) and the time its consumer holds a response
    (``StalledStream``). ``stop(err)`` cancels it in Triton from outside (the core took its
    slot back): the consumer's next reply is ``err``. ``on_stop`` hears of every stop made
    while the consumer may not be reading (the watchdog's, or ``stop``'s), at once.
    """

    def __init__(
        self,
        call: Any,
        timeout_s: float,
        stalled_s: float | None,
        reopen: Callable[[], Awaitable[Any]] | None = None,
        *,
        raw: bool = False,
    ) -> None:
        self._call = call
        self._raw = raw
        # A call that never reached Triton (its channel was still reconnecting: a Triton
        # the core saw come back a moment ago) is made once more, once the channel is up.
        self._reopen = reopen
        self._finished = False  # its last response came: Triton ends the call itself
        self._watch = Watchdog(self.stop, timeout_s, stalled_s)
        self.stopped: FrontendError | None = None
        self.on_stop: Callable[[FrontendError], None] = lambda err: None
        self._replies = self._read()

    def stop(self, err: FrontendError) -> None:
        if self.stopped is None:
            self.stopped = err
            self._call.cancel()
            self.on_stop(err)

    def __aiter__(self) -> AsyncIterator[StreamReply]:
        return self._replies

    async def aclose(self) -> None:
        """Closed on every way out: cancels the request in Triton at once if not done."""
        self._watch.close()
        self._end()
        await self._replies.aclose()

    def _end(self) -> None:
        if not self._finished:
            self._call.cancel()
        elif not self._call.done() and self._call not in _finishing:
            _let_finish(self._call)

    async def _read(self) -> AsyncGenerator[StreamReply, None]:
        watch = self._watch
        try:
            if self._reopen is not None:
                first = await self._first()
                if first is None:
                    return
                self._call = first
            async for got in self._call:
                watch.progress()
                reply = _STREAM_RESPONSE(got) if self._raw else got
                if reply.error_message:
                    yield StreamReply(error=upstream_message_error(reply.error_message))
                    return
                r = reply.infer_response
                final = (
                    r.parameters[FINAL_RESPONSE].bool_param
                    if FINAL_RESPONSE in r.parameters
                    else False
                )
                watch.hold()
                self._finished = final
                if self._raw:
                    yield StreamReply(r.model_version, [], final, None, got, reply)
                else:
                    yield StreamReply(r.model_version, grpc_codec.decode_outputs(r), final)
                if final:
                    return
                watch.progress()  # asked for the next response: the wait for Triton
            if self.stopped is not None:  # cancelled between two responses
                yield StreamReply(error=self.stopped)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.stopped is None or (task is not None and task.cancelling()):
                raise  # the request's own cancellation (its client went away)
            yield StreamReply(error=self.stopped)
        except grpc.aio.AioRpcError as err:
            stopped = self.stopped if err.code() is grpc.StatusCode.CANCELLED else None
            yield StreamReply(error=stopped or upstream_error(_rpc_exception(err)))
        except FrontendError as err:  # made again, and not connected in time
            yield StreamReply(error=err)
        finally:
            watch.close()
            self._end()

    async def _first(self) -> Any:
        """The call, once it has reached Triton: made again (once) where it never did;
        None where the stream was stopped meanwhile."""
        call = self._call
        try:
            await call.wait_for_connection()
            return call
        except grpc.aio.AioRpcError as err:
            error = upstream_error(_rpc_exception(err))
            if not (isinstance(error, Unavailable) and error.never_sent) or self.stopped:
                raise
        assert self._reopen is not None
        again = await self._reopen()
        return None if self.stopped is not None else again


class TritonForwarder:
    """Sends requests and batches to one Triton server over gRPC."""

    def __init__(
        self, url: str, *, request_timeout_s: float = 60.0, http_url: str | None = None
    ) -> None:
        self.url = url
        self.request_timeout_s = request_timeout_s
        # Batches go over Triton's HTTP endpoint where it is given (cheaper per call in
        # this process: fair_frontend.backends.triton.http); everything else stays on gRPC.
        self.http = TritonHttp(http_url, request_timeout_s=request_timeout_s) if http_url else None
        # Streams whose client reads Triton's own events (generate_stream) read them there.
        self.events = (
            TritonEvents(http_url, request_timeout_s=request_timeout_s) if http_url else None
        )
        self._raw_method: Any = None  # ``_raw_stream``, made on first use
        self._client = grpcclient.InferenceServerClient(
            url,
            channel_args=[
                ("grpc.max_send_message_length", _MAX_MESSAGE),
                ("grpc.max_receive_message_length", _MAX_MESSAGE),
                # Reconnect quickly when Triton comes back after a restart.
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 2_000),
            ],
        )

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()
        if self.events is not None:
            await self.events.close()
        await self._client.close()

    async def infer(self, batch: Batch) -> tuple[str, list[Tensor]]:
        """One inference request; returns (the model version that ran, its outputs).

        ``sequence``: the client's ``sequence_id`` / ``sequence_start`` / ``sequence_end``,
        passed through for sequence-batched (stateful) models. The request is built with
        raw contents straight from the tensors and sent on the generated stub: one batch
        costs one protobuf message and one call, nothing per element. ``traceparent``:
        the W3C trace context Triton's own spans join (``fair_frontend.observability.tracing``).
        """
        if self.http is not None and carries(batch.all_parameters(), batch.request_id):
            return await self.http.infer(batch)
        msg = grpc_codec.encode_request(batch)
        try:
            response = await self.stub.ModelInfer(
                msg,
                timeout=self.request_timeout_s,
                metadata=(("traceparent", batch.traceparent),) if batch.traceparent else None,
            )
        except grpc.aio.AioRpcError as err:
            raise upstream_error(_rpc_exception(err)) from None
        return response.model_version, grpc_codec.decode_outputs(response)

    def stream(
        self, batch: Batch, *, stalled_s: float | None = None, raw: bool = False
    ) -> TritonStream:
        """One request to a decoupled model: its responses (``TritonStream``); a consumer
        that holds one for ``stalled_s`` has the request cancelled. tritonclient's aio
        client refuses ``triton_`` parameters, so this one call uses the generated stub.
        ``traceparent``: as for ``infer``. ``raw``: each response as Triton serialized it
        (``StreamReply.raw``), parsed but not decoded, for a caller that passes it on."""
        msg = grpc_codec.encode_request(batch)
        msg.parameters[EMPTY_FINAL_RESPONSE].bool_param = True
        metadata = (("traceparent", batch.traceparent),) if batch.traceparent else None
        method = self._raw_stream() if raw else self.stub.ModelStreamInfer
        call = method(iter([msg]), metadata=metadata)

        async def reopen() -> Any:
            # The channel is reconnecting (a backoff of at most 1 s): this call waits for
            # it, up to REOPEN_WAIT_S, rather than failing fast as the first did.
            again = method(iter([msg]), metadata=metadata, wait_for_ready=True)
            try:
                await asyncio.wait_for(again.wait_for_connection(), REOPEN_WAIT_S)
            except TimeoutError:
                again.cancel()
                raise Unavailable(
                    f"Triton {self.url} is unavailable: not connected within {REOPEN_WAIT_S:g} s",
                    never_sent=True,
                ) from None
            return again

        return TritonStream(call, self.request_timeout_s, stalled_s, reopen, raw=raw)

    def _raw_stream(self) -> Any:
        """``ModelStreamInfer`` on the client's channel, its responses left serialized."""
        if self._raw_method is None:
            self._raw_method = self._client._channel.stream_stream(
                "/inference.GRPCInferenceService/ModelStreamInfer",
                request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                response_deserializer=None,
            )
        return self._raw_method

    async def call(self, method: str, **kwargs: Any) -> Any:
        """A non-infer call of tritonclient's aio client, errors mapped."""
        try:
            return await getattr(self._client, method)(
                client_timeout=self.request_timeout_s, **kwargs
            )
        except InferenceServerException as err:
            raise upstream_error(err) from None

    async def side_door(self, door: SideDoor, model: str = "", version: str = "") -> Any:
        """KServe's answer to a side door (``BackendServer.side_door``): tritonclient's
        call of that name."""
        if door == "server_metadata":
            return await self.call("get_server_metadata")
        return await self.call(_SIDE_DOORS[door], model_name=model, model_version=version)

    async def server_ready(self) -> bool:
        try:
            return bool(await self._client.is_server_ready(client_timeout=2.0))
        except InferenceServerException:
            return False

    async def model_config(self, model: str, version: str = "") -> Any:
        response = await self.call("get_model_config", model_name=model, model_version=version)
        return response.config

    async def describe(self, model: str) -> ModelInfo:
        """``model`` in the frontend's words: its config read (``model_info``), with the
        versions its metadata says are ready."""
        cfg = await self.model_config(model)
        meta = await self.call("get_model_metadata", model_name=model)
        return model_info(cfg, tuple(meta.versions))

    @property
    def stub(self) -> Any:
        """The raw generated stub, for the calls tritonclient's aio client has no method for
        (bidirectional streaming passes requests through untouched)."""
        return self._client._client_stub
