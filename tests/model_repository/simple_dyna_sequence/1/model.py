"""Triton's `simple_dyna_sequence`: OUTPUT = INPUT + START + END * CORRID for a ready slot.

Each execute waits the config's ``execute_delay_ms`` first, as the original does.
"""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _control(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy().astype(np.int64)


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.delay_s = int(parameters.get("execute_delay_ms", {}).get("string_value", "0")) / 1e3

    def execute(self, requests):
        time.sleep(self.delay_s)
        responses = []
        for request in requests:
            value = _control(request, "INPUT")
            start, end, ready = (_control(request, n) for n in ("START", "END", "READY"))
            corrid = _control(request, "CORRID").reshape(end.shape)
            out = np.where(ready == 1, value + start + end * corrid, 0).astype(np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
