"""Triton's repeat backend: OUT = IN[i], IDX = i, one response each, DELAY[i] ms apart."""

import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _values(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            values, delays = _values(request, "IN"), _values(request, "DELAY")
            for index, value in enumerate(values):
                time.sleep(int(delays[index]) / 1e3 if index < len(delays) else 0)
                outputs = [
                    pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
                    pb_utils.Tensor("IDX", np.array([index], dtype=np.uint32)),
                ]
                sender.send(pb_utils.InferenceResponse(outputs))
            time.sleep(int(_values(request, "WAIT")[0]) / 1e3)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
