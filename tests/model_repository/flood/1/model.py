"""Large answers from small requests: each row's OUT = COUNT strings of SIZE bytes.

A batch endpoint's stand-in for a burst of large answers: the frontend's link to a
shell must deliver a burst of them whole to a shell that paused. Holds each ``execute``
at the gate its first request names (``fair_frontend.kit.testing.Gate``: the test opens it),
then sleeps DELAY_MS ms (the first row's), then answers every request of it.
"""

import time

import numpy as np
import triton_python_backend_utils as pb_utils

from fair_frontend.kit.gates import hold_at_gate


def _column(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)


class TritonPythonModel:
    def execute(self, requests):
        hold_at_gate(requests[0].parameters())
        delay = int(_column(requests[0], "DELAY_MS")[0])
        time.sleep(max(0, delay) / 1e3)
        responses = []
        for request in requests:
            counts, sizes = _column(request, "COUNT"), _column(request, "SIZE")
            width = int(counts.max()) if counts.size else 0
            rows = [[b"x" * max(0, int(size))] * width for size in sizes]
            out = np.array(rows, dtype=np.object_).reshape(len(sizes), width)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
        return responses
