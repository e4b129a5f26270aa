"""OUTPUT0: the sum of whichever optional inputs came (0 for none); COUNT: how many came."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            total = np.zeros(1, dtype=np.float32)
            count = 0
            for name in ("INPUT0", "INPUT1"):
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    total += tensor.as_numpy().reshape(1)
                    count += 1
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("OUTPUT0", total),
                        pb_utils.Tensor("COUNT", np.array([count], dtype=np.int32)),
                    ]
                )
            )
        return responses
