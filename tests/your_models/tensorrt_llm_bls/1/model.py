"""Triton's entry point for the tensorrt_llm_bls stand-in (python_backend.standins)."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from python_backend.standins import TrtLlmBlsStandIn


class TritonPythonModel(TrtLlmBlsStandIn):
    pb = pb_utils
