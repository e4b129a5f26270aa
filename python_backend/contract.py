"""The ``TritonPythonModel`` contract, once for both models.

One response per request, in order; a bad request gets its own error response and the
others are still served; an unexpected failure of the shared forward pass answers every
request of that batch with an INTERNAL error instead of raising out of ``execute``.
``model_repository/<m>/1/model.py`` binds it to a model: ``pb`` (Triton's
``triton_python_backend_utils``, importable only inside the stub), the model class and
its input names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Protocol

from python_backend.metering import TenantMeters
from python_backend.rows import RequestData, RequestError


class Model(Protocol):
    """What the contract needs of a model (``EmbedModel``, ``GenerateModel``)."""

    settings: Any

    def decode(self, data: RequestData) -> Any: ...

    def run(self, requests: list[Any]) -> list[dict[str, Any]]: ...


class TritonContract:
    """Base of each model's ``TritonPythonModel``."""

    pb: ClassVar[Any]  # triton_python_backend_utils
    model_class: ClassVar[Any]  # has from_triton_args(args) -> Model
    inputs: ClassVar[Iterable[str]]

    def initialize(self, args: dict[str, str]) -> None:
        self.name = args["model_name"]
        self.model: Model = self.model_class.from_triton_args(args)
        self.meters = TenantMeters(self.pb, self.name, self.model.settings.max_metric_tenants)

    def _read(self, request: Any) -> RequestData:
        inputs = {}
        for name in self.inputs:
            tensor = self.pb.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        return RequestData(
            inputs=inputs,
            parameters=request.parameters(),
            request_id=request.request_id(),
            requested_outputs=frozenset(request.requested_output_names()),
        )

    def _error(self, message: str, code: Any) -> Any:
        return self.pb.InferenceResponse(error=self.pb.TritonError(message, code))

    def execute(self, requests: list[Any]) -> list[Any]:
        pb = self.pb
        responses: list[Any] = [None] * len(requests)
        accepted = []
        for i, request in enumerate(requests):
            try:
                accepted.append((i, self.model.decode(self._read(request))))
            except RequestError as err:
                responses[i] = self._error(str(err), pb.TritonError.INVALID_ARG)
            except Exception as err:  # a bug, not the client's fault: still only this one
                responses[i] = self._error(f"cannot read request: {err!r}", pb.TritonError.INTERNAL)
        if accepted:
            try:
                results = self.model.run([decoded for _, decoded in accepted])
            except Exception as err:  # one shared forward pass: it fails for all of them
                for i, _ in accepted:
                    responses[i] = self._error(
                        f"{self.name} failed: {err!r}", pb.TritonError.INTERNAL
                    )
            else:
                for (i, _), outputs in zip(accepted, results, strict=True):
                    tensors = [pb.Tensor(name, value) for name, value in outputs.items()]
                    responses[i] = pb.InferenceResponse(output_tensors=tensors)
                self.meters.record(u for _, decoded in accepted for u in decoded.usage())
        return responses

    def finalize(self) -> None:
        self.meters.close()  # Metric objects before their MetricFamily, as Triton requires
