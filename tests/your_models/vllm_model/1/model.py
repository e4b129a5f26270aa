"""Triton's entry point for the vLLM-backend stand-in (python_backend.standins)."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from python_backend.standins import VllmStandIn


class TritonPythonModel(VllmStandIn):
    pb = pb_utils
