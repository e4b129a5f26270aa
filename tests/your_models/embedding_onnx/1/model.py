"""Triton's entry point for the ONNX embedding stand-in (python_backend.standins)."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from python_backend.standins import EmbeddingStandIn


class TritonPythonModel(EmbeddingStandIn):
    pb = pb_utils
