"""Triton's repeat backend: OUT = IN[i], IDX = i, one response each, DELAY[i] ms apart.

A request that names a gate (the ``test_gate`` parameter: ``fair_frontend.kit.testing.Gate``)
is held at it after its first response, until the test opens it: a stream that runs
until the test says so; one named ``test_gate_first`` holds it before its first response
(a stream in Triton that has answered nothing yet). A request without one is answered
as Triton's example does.
"""

import time

import numpy as np
import triton_python_backend_utils as pb_utils

from fair_frontend.kit.gates import GATE_FIRST_PARAMETER, hold_at_gate


def _values(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            values, delays = _values(request, "IN"), _values(request, "DELAY")
            hold_at_gate(request.parameters(), name=GATE_FIRST_PARAMETER)  # none: passes
            for index, value in enumerate(values):
                time.sleep(int(delays[index]) / 1e3 if index < len(delays) else 0)
                outputs = [
                    pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
                    pb_utils.Tensor("IDX", np.array([index], dtype=np.uint32)),
                ]
                sender.send(pb_utils.InferenceResponse(outputs))
                if index == 0:
                    hold_at_gate(request.parameters())  # no gate named: passes at once
            time.sleep(int(_values(request, "WAIT")[0]) / 1e3)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
