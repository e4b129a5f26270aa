"""Triton's entry point for ``embed``: the ``TritonPythonModel`` contract, nothing else.

The model itself is ``python_backend.embed`` (importable because the stub runs the
project's virtual environment). This file owns the contract: one response per request, in
order; a bad request gets its own error response and the others are still served; an
unexpected failure of the shared forward pass answers every request of that batch with
an INTERNAL error instead of raising out of ``execute``.
"""

from __future__ import annotations

from typing import Any

import triton_python_backend_utils as pb_utils

from python_backend.embed import INPUTS, EmbedModel
from python_backend.metering import TenantMeters
from python_backend.rows import RequestData, RequestError


def _read(request: Any) -> RequestData:
    inputs = {}
    for name in INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor.as_numpy()
    return RequestData(
        inputs=inputs,
        parameters=request.parameters(),
        request_id=request.request_id(),
        requested_outputs=frozenset(request.requested_output_names()),
    )


def _error(message: str, code: Any) -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self.model = EmbedModel.from_triton_args(args)
        self.meters = TenantMeters(
            pb_utils, args["model_name"], self.model.settings.max_metric_tenants
        )

    def execute(self, requests: list[Any]) -> list[Any]:
        responses: list[Any] = [None] * len(requests)
        accepted = []
        for i, request in enumerate(requests):
            try:
                accepted.append((i, self.model.decode(_read(request))))
            except RequestError as err:
                responses[i] = _error(str(err), pb_utils.TritonError.INVALID_ARG)
            except Exception as err:  # a bug, not the client's fault: still only this one
                responses[i] = _error(
                    f"cannot read request: {err!r}", pb_utils.TritonError.INTERNAL
                )
        if accepted:
            try:
                results = self.model.run([decoded for _, decoded in accepted])
            except Exception as err:  # one shared forward pass: it fails for all of them
                for i, _ in accepted:
                    responses[i] = _error(f"embed failed: {err!r}", pb_utils.TritonError.INTERNAL)
            else:
                for (i, _), outputs in zip(accepted, results, strict=True):
                    tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items()]
                    responses[i] = pb_utils.InferenceResponse(output_tensors=tensors)
                self.meters.record(u for _, decoded in accepted for u in decoded.usage())
        return responses

    def finalize(self) -> None:
        self.meters.close()  # Metric objects before their MetricFamily, as Triton requires
