"""Decoupled: one response per element of IN (OUT = [element]), then the final flag.

Triton's repeat example in miniature. IN may be empty: then only the final flag is sent.
A cancelled request (its client left) stops within 256 responses, as a model should: it
asks between responses, not at each one, since asking costs a round trip to the backend.
"""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)
            for i, v in enumerate(values):
                if i % 256 == 255 and sender.is_cancelled():
                    break
                out = pb_utils.Tensor("OUT", np.array([v], dtype=np.int32))
                sender.send(pb_utils.InferenceResponse([out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
