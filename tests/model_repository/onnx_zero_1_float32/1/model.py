"""Identity stand-in for Triton's qa identity models (qa/common/gen_qa_identity_models.py):
OUTPUTi = INPUTi for every input the config declares, whatever the datatype."""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.pairs = [
            (i["name"], o["name"]) for i, o in zip(config["input"], config["output"], strict=True)
        ]

    def execute(self, requests):
        responses = []
        for request in requests:
            outputs = []
            for name_in, name_out in self.pairs:
                tensor = pb_utils.get_input_tensor_by_name(request, name_in)
                outputs.append(pb_utils.Tensor(name_out, tensor.as_numpy()))
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
