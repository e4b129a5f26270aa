"""Triton's entry point for ``rerank``: the ``TritonPythonModel`` contract
(``python_backend.contract``) bound to the model (``python_backend.rerank``), which is
importable because the stub runs the project's virtual environment.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from python_backend.contract import TritonContract
from python_backend.rerank import INPUTS, RerankModel


class TritonPythonModel(TritonContract):
    pb = pb_utils
    model_class = RerankModel
    inputs = INPUTS
