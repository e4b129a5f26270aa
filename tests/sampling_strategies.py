"""Generated sampling parameters for the ``llm`` engine's properties (hypothesis).

Values a client may send where vLLM-style sampling parameters go: huge, negative, NaN,
infinite, strings (numeric or not), lists, objects, floats for integers, booleans, and
keys the model does not take. Shared by the unit property (the engine, no Triton), the
direct-to-Triton sample and the sample through the frontend.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

LLM_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")
KEYS = st.sampled_from(LLM_KEYS)
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([2**64, 2**63, 2**63 - 1, -(2**63), -(2**63) - 1, -1, 0, 1, 2]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-1e-4, max_value=1e-4),
    st.sampled_from(["7", " 3 ", "-1", "1e309", "nan", "inf", "0x10", "1_0", "true", "", "⚡"]),
    st.text(max_size=8),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
UNKNOWN_KEYS = st.sampled_from(["best_of", "n", "stop", ""])
# The sampling_parameters input's JSON object: anything JSON holds.
SAMPLING = st.dictionaries(st.one_of(KEYS, UNKNOWN_KEYS), VALUES, max_size=6)
# Request parameters are typed (int64, double, bool, string): Triton builds their JSON.
PARAM_VALUES = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([-(2**63), 2**63 - 1, -1, 0, 1]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
PARAMS = st.dictionaries(KEYS, PARAM_VALUES, max_size=6)


def _long(value: Any) -> bool:
    """A max_tokens that a real-size context would run for long (17..600 tokens)."""
    if isinstance(value, bool):
        return False
    try:
        number = float(value.strip()) if isinstance(value, str) else value
        return isinstance(number, (int, float)) and math.isfinite(number) and 17 <= number <= 600
    except (ValueError, OverflowError):
        return False


# Against the real model (a 512-token context), generations kept short.
SHORT_VALUES = VALUES.filter(lambda v: not _long(v))
SHORT_SAMPLING = st.dictionaries(st.one_of(KEYS, UNKNOWN_KEYS), SHORT_VALUES, max_size=6)
SHORT_PARAMS = st.dictionaries(KEYS, PARAM_VALUES.filter(lambda v: not _long(v)), max_size=6)
