"""Triton's entry point for ``llm``: the decoupled ``TritonPythonModel`` contract of
``python_backend.llm`` (request decoding, the continuous-batching engine thread, the
response thread), importable because the stub runs the project's virtual environment.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from python_backend.llm import LlmContract


class TritonPythonModel(LlmContract):
    pb = pb_utils
