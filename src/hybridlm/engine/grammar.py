"""Grammar-constrained decoding: a request's `Grammar`, compiled by llguidance into a per-request
`Matcher` that masks the logits before every choice and advances on every emitted token.

llguidance was chosen over xgrammar by measurement on this CPU (Qwen3.5-0.8B-shaped vocabulary of
248320 ids, a nested JSON schema, `hybridlm bench grammar`): both compute a token mask in tens of
microseconds, far below the 3 ms budget (5% of a ~60 ms decode step); llguidance covers more of JSON
schema and also compiles Lark grammars with embedded `%json{...}` schemas, which is how forced tool
calls are written for every tool-call format; it has no dependency but its own wheel.

The engine masks the logits a request samples from (after penalties, before temperature and the
top-k / top-p / min-p filters), and a speculative verify pass does the same for each position
once the tokens before it were emitted (`TargetPolicy.adjust`), so a draft the grammar forbids is
rejected and the output is exactly the non-speculative one. Logprobs stay those of the model's
own distribution.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from hybridlm.engine.errors import InvalidParameter
from hybridlm.models.tokenizer import Tokenizer

GrammarKind = Literal["json_schema", "lark"]

# JSON is generated the way `json.dumps` writes it (", " and ": ", no other whitespace): a model may
# not pad its output with whitespace forever, and a parsed-then-dumped value re-renders to the very
# text the model produced (a stable history for the prefix cache). `%json{...}` in Lark grammars
# takes the same options as an "x-guidance" key of the schema.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match.

    kind: "json_schema" (source: a JSON schema as JSON text) or "lark" (source: an llguidance Lark
        grammar, which may embed JSON schemas as `%json{...}`).
    param: the request field a bad grammar is blamed on (an API's own name: "response_format", "tools").
    """

    kind: GrammarKind
    source: str
    param: str = "grammar"

    @staticmethod
    def json_schema(schema: dict | bool, param: str = "grammar") -> Grammar:
        return Grammar("json_schema", json.dumps(schema, ensure_ascii=False), param)

    def compiled(self) -> str:
        """The llguidance grammar text (raises `InvalidParameter` naming `param` when malformed)."""
        import llguidance

        try:
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_STYLE)
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        except (ValueError, RuntimeError, TypeError) as e:
            raise InvalidParameter(self.param, f"{self.param}: invalid grammar: {e}") from None


class Matcher:
    """One request's grammar state: `mask(logits)` and `advance(token)`. Not thread-safe (it lives
    on the engine thread)."""

    def __init__(self, matcher, vocab: int):
        self._matcher = matcher
        self._vocab = vocab
        self._bits = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def allowed(self) -> torch.Tensor:
        """[V] bool: the ids the grammar allows next."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._vocab]
        return torch.from_numpy(bits.view(np.bool_))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits -> a copy with the ids the grammar forbids next set to -inf."""
        allowed = self.allowed().to(logits.device)
        return logits.masked_fill(~allowed, float("-inf"))

    def advance(self, token: int) -> None:
        """Consume an emitted token; a token the grammar forbids is an engine bug, so it raises."""
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            raise RuntimeError(f"grammar rejected token {token}: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete (only an end-of-sequence id may follow)."""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """Builds `Matcher`s for one tokenizer; the llguidance tokenizer (≈0.5 s for a 248k vocabulary)
    is made once, on first use, from the same tokenizer.json. `vocab` is the model's logits width
    (embeddings may be padded past the tokenizer's ids; those ids are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, vocab: int):
        self.tokenizer = tokenizer
        self.vocab = vocab
        self._ll = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self):
        import llguidance

        with self._lock:
            if self._ll is None:
                eos = sorted(self.tokenizer.eos_token_ids)
                self._ll = llguidance.LLTokenizer(
                    self.tokenizer.backend_json(), n_vocab=self.vocab, eos_token=eos or None
                )
            return self._ll

    def check(self, grammar: Grammar) -> None:
        """Raise `InvalidParameter` (naming `grammar.param`) unless the grammar compiles."""
        import llguidance

        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar.compiled(), self._ll_tokenizer()
        )
        if failed:
            raise InvalidParameter(grammar.param, f"{grammar.param}: invalid grammar: {messages[0]}")

    def matcher(self, grammar: Grammar) -> Matcher:
        import llguidance

        m = llguidance.LLMatcher(self._ll_tokenizer(), grammar.compiled())
        if m.is_error():
            raise InvalidParameter(grammar.param, f"{grammar.param}: invalid grammar: {m.get_error()}")
        return Matcher(m, self.vocab)
