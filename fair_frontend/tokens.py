"""Token counts of text: an endpoint's own tokenizer (``tokenizer.json``, the `tokenizers`
library's format, which Hugging Face models ship and vLLM and TensorRT-LLM read).

A text prompt (a BYTES input) is one tensor element, but many tokens: without its
tokenizer a 100K-token prompt would count as one token for limits and cost. Loaded once
per file and process; encoding runs in Rust, without the GIL, at a few microseconds per
short prompt.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np
from tokenizers import Tokenizer


@functools.lru_cache(maxsize=16)
def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer in ``path`` (read once per process)."""
    return Tokenizer.from_file(path)


def text_of(element: object) -> str:
    """A BYTES element as text (invalid UTF-8 is replaced, as a model would see it)."""
    if isinstance(element, bytes):
        return element.decode("utf-8", errors="replace")
    if isinstance(element, np.bytes_):
        return bytes(element).decode("utf-8", errors="replace")
    return str(element)


def count_tokens(tokenizer: Tokenizer, texts: Iterable[str]) -> list[int]:
    """Tokens of each text, without special tokens (what the prompt itself costs)."""
    batch = list(texts)
    if not batch:
        return []
    encodings = tokenizer.encode_batch(batch, add_special_tokens=False)
    return [len(e.ids) for e in encodings]


def count_text_tokens(path: str, texts: Iterable[object]) -> list[int]:
    """Tokens of each BYTES element with the tokenizer in ``path``."""
    return count_tokens(load_tokenizer(path), [text_of(t) for t in texts])
