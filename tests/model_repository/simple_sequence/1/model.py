"""Triton's batching sequence example model (qa/common/gen_qa_sequence_models.py):
OUTPUT = INPUT + START for a ready slot, 0 for an empty one. What the sequence client
examples expect: 1 for a sequence started with 0, then each value as sent."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            ready = pb_utils.get_input_tensor_by_name(request, "READY").as_numpy()
            out = np.where(ready == 1, value + start, 0).astype(np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
