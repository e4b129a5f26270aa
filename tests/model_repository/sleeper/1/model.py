"""Busy-waits a known time per execute(): fixed_ms + per_token_us * tokens of the whole call.

A busy wait (a perf_counter loop, not sleep) so it occupies a core like real compute;
with the parameter ``wait: sleep`` it sleeps instead, so that several Tritons on one
machine can each take that time at once (a GPU's time is its own, not the host's CPU).
A row's tokens are its entry in the ``length`` list of the ``fair_rows`` request parameter
(as the frontend sends it where it pads ragged rows), else the width of INPUT_IDS. OUT is
each row's token count. The cost parameters come from config.pbtxt (defaults 2 ms, 20 us).
A request that names a gate (``fair_frontend.kit.testing.Gate``) is held there first, until
the test opens it: a blocker that holds the model exactly as long as the test needs.
"""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from fair_frontend.kit.gates import hold_at_gate


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})

        def param(key, default):
            return float(params.get(key, {}).get("string_value", default))

        self.fixed_s = param("fixed_ms", 2.0) / 1e3
        self.per_token_s = param("per_token_us", 20.0) / 1e6
        self.sleep = params.get("wait", {}).get("string_value", "busy") == "sleep"

    def execute(self, requests):
        lengths = []
        for request in requests:
            hold_at_gate(request.parameters())
            ids = pb_utils.get_input_tensor_by_name(request, "INPUT_IDS").as_numpy()
            rows = json.loads(json.loads(request.parameters() or "{}").get("fair_rows", "{}"))
            if "length" in rows:
                lengths.append(np.array(rows["length"], dtype=np.int32).reshape(-1, 1))
            else:
                lengths.append(np.full((ids.shape[0], 1), ids.shape[1], dtype=np.int32))
        tokens = sum(int(n.sum()) for n in lengths)
        cost_s = self.fixed_s + self.per_token_s * tokens
        if self.sleep:
            time.sleep(cost_s)
        until = time.perf_counter() + cost_s
        while not self.sleep and time.perf_counter() < until:
            pass
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", n)]) for n in lengths]
