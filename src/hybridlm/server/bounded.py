"""`BoundedTokenizer`: the served tokenizer, refusing at once a text that cannot fit the context.

Tokenizing a 16 MiB prompt costs seconds of CPU (42 s on a loaded 2-core machine) and converting its
8 M ids to a Python list holds the GIL for ≈ 0.7 s, which stalls the event loop even from a worker
thread. A text whose token count provably exceeds the context is refused before either happens.
"""

from __future__ import annotations

from typing import Any

from hybridlm.models.tokenizer import Tokenizer
from hybridlm.server.protocol import APIError

# Normalizers may compose characters (NFC: a letter and a combining mark become one), so a token can
# stand for more characters of the raw text than of its own: a margin keeps the bound a bound.
NORMALIZATION_MARGIN = 4


class BoundedTokenizer:
    """`tokenizer` with `encode` refusing (APIError 400, `context_length_exceeded`) a text longer than
    `context_length` × the most characters one token stands for (× `NORMALIZATION_MARGIN`): it has
    more tokens than the context holds. Everything else is the tokenizer's own."""

    def __init__(self, tokenizer: Tokenizer, context_length: int):
        self._tokenizer = tokenizer
        self.context_length = context_length
        self.max_chars = context_length * tokenizer.max_token_chars() * NORMALIZATION_MARGIN

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > self.max_chars:
            raise APIError(
                400,
                f"the prompt has {len(text)} characters, more tokens than this server's context length "
                f"of {self.context_length} tokens can hold",
                code="context_length_exceeded",
            )
        return self._tokenizer.encode(text, add_special_tokens)
