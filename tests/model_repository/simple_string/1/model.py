"""Triton's `simple_string`: the integers the strings hold, summed and subtracted, as strings."""

import numpy as np
import triton_python_backend_utils as pb_utils


def _ints(request, name):
    values = pb_utils.get_input_tensor_by_name(request, name).as_numpy()
    return np.vectorize(int, otypes=[np.int64])(values)


def _strings(values):
    return np.vectorize(lambda v: str(v).encode(), otypes=[object])(values)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a, b = _ints(request, "INPUT0"), _ints(request, "INPUT1")
            outputs = [
                pb_utils.Tensor("OUTPUT0", _strings(a + b)),
                pb_utils.Tensor("OUTPUT1", _strings(a - b)),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
