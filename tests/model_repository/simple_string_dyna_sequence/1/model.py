"""Triton's dyna_sequence backend with string ids: a running sum, plus the correlation id at END
(a string id holding an integer, as that backend requires)."""

import numpy as np
import triton_python_backend_utils as pb_utils


def _first(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0]


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            corrid = str(request.correlation_id())
            value = int(_first(request, "INPUT"))
            if _first(request, "START"):
                self.sums[corrid] = 0
            self.sums[corrid] = self.sums.get(corrid, 0) + value
            out = self.sums[corrid]
            if _first(request, "END"):
                out += int(corrid)
                del self.sums[corrid]
            tensor = pb_utils.Tensor("OUTPUT", np.array([[out]], dtype=np.int32))
            responses.append(pb_utils.InferenceResponse([tensor]))
        return responses
