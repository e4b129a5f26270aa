"""Decoupled: COUNT responses of SIZE bytes each (OUT, one string), after DELAY_MS ms.

A stand-in for a model that streams a lot, fast (long generations, large chunks): the
frontend's answer queues and its link to the shells must stay bounded when a client does
not read. Each request runs on a thread of its own, so requests sent together stream
together; a cancelled request (its stream closed) stops at its next response.
"""

import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else int(tensor.as_numpy().reshape(-1)[0])


def _flood(request):
    sender = request.get_response_sender()
    count = _scalar(request, "COUNT", 1)
    size = _scalar(request, "SIZE", 1)
    time.sleep(max(0, _scalar(request, "DELAY_MS", 0)) / 1e3)
    chunk = np.array([b"x" * max(0, size)], dtype=np.object_)
    for _ in range(max(0, count)):
        if sender.is_cancelled():
            break
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", chunk)]))
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class TritonPythonModel:
    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        self.threads = [t for t in self.threads if t.is_alive()]
        for request in requests:
            thread = threading.Thread(target=_flood, args=(request,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return None

    def finalize(self):
        for thread in self.threads:
            thread.join(timeout=5)
