"""Stateful: OUTPUT is the running sum of INPUT over the sequence (reset at its start)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            sequence = request.correlation_id()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy().reshape(-1)
            value = int(pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()[0])
            if start[0]:
                self.sums[sequence] = 0
            self.sums[sequence] = self.sums.get(sequence, 0) + value
            out = np.array([self.sums[sequence]], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
