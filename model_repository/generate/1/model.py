"""Triton's entry point for ``generate``: the ``TritonPythonModel`` contract
(``python_backend.contract``) bound to the model (``python_backend.generate``), which is
importable because the stub runs the project's virtual environment.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from python_backend.contract import TritonContract
from python_backend.generate import INPUTS, GenerateModel


class TritonPythonModel(TritonContract):
    pb = pb_utils
    model_class = GenerateModel
    inputs = INPUTS
