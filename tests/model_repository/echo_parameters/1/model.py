"""Answers each request with its parameters: KEY and VALUE, one entry per parameter, in
the order request.parameters() lists them, the same for every row (as qa/L0_parameters'
"parameter" model, with a batch dimension). A VALUE is the parameter as JSON, so that its
type shows: "x" is a string, 3 an integer, true a bool, 0.5 a double."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy().shape[0]
            params = json.loads(request.parameters() or "{}")
            keys = np.array([k.encode() for k in params], dtype=object).reshape(1, -1)
            values = np.array([json.dumps(v).encode() for v in params.values()], dtype=object)
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("KEY", np.repeat(keys, rows, axis=0)),
                        pb_utils.Tensor("VALUE", np.repeat(values.reshape(1, -1), rows, axis=0)),
                    ]
                )
            )
        return responses
