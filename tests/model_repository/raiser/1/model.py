"""Echoes X as Y, but its execute() raises when any value in the whole call is 13.

An exception in execute() fails every request of that call: through the frontend, a
shared batch must not take its neighbours down with it.
"""

import numpy as np
import triton_python_backend_utils as pb_utils

UNLUCKY = 13


class TritonPythonModel:
    def execute(self, requests):
        xs = [pb_utils.get_input_tensor_by_name(r, "X").as_numpy() for r in requests]
        if any((x == UNLUCKY).any() for x in xs):
            raise ValueError(f"raiser: refusing the value {UNLUCKY}")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array(x))]) for x in xs]
