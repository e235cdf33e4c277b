"""What a request asks of the engine: `SamplingParams`, checked on construction (`errors`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridlm.engine.errors import InvalidParameter

if TYPE_CHECKING:
    from hybridlm.engine.grammar import Grammar

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
_SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts


def _number(name: str, value, low: float, high: float, *, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidParameter(name, f"{name} must be a finite number, got {value!r}")
    if value < low or (low_open and value == low) or value > high:
        lo = "(" if low_open else "["
        raise InvalidParameter(name, f"{name} must lie in {lo}{low}, {high}], got {value!r}")


def _integer(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameter(name, f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidParameter(name, f"{name} must be {bound}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction (`InvalidParameter` names the field).

    temperature: 0 = greedy (argmax); else logits / temperature are sampled.
    top_k: keep the k most likely ids (0 = all). top_p: keep the smallest set with this mass.
    min_p: drop ids whose probability is below min_p × the top probability.
    repetition_penalty: > 0, 1 = off; divides positive and multiplies negative logits of ids in prompt or
        output.
    presence_penalty, frequency_penalty: in [-2, 2]; subtract per generated id (once / per occurrence).
    seed: seeds this request's own generator: the same seed gives the same output whatever else runs.
    max_tokens: most tokens to generate (None: up to the context length).
    stop: strings that end generation when the text contains them; the text stops before the match.
    stop_token_ids: ids that end generation like EOS (the id's text is not output).
    logprobs: None = off; n ≥ 0 = the chosen token's logprob plus the top n alternatives.
    ignore_eos: keep generating past EOS ids (benchmarks).
    skip_special_tokens: leave special tokens out of the output text.
    speculative: allow speculative decoding when the engine has it (False: decode one token per step).
    grammar: the output must match this `Grammar` (constrained decoding); None: unconstrained.
    n: samples of the prompt (choices), each its own sequence continuing from the one prefill;
        choice i samples with seed + i (wrapping at 2**64), so it equals the same request with
        n = 1 and that seed (greedy: n equal choices).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    speculative: bool = True
    grammar: Grammar | None = None
    n: int = 1

    def __post_init__(self) -> None:
        _number("temperature", self.temperature, 0.0, 100.0)
        if self.top_k == -1:  # vLLM's spelling of "off"
            object.__setattr__(self, "top_k", 0)
        _integer("top_k", self.top_k, 0)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("repetition_penalty", self.repetition_penalty, 0.0, 100.0, low_open=True)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _integer("seed", self.seed, _SEED_RANGE[0], _SEED_RANGE[1] - 1)
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, 1)
        # Only a string or a sequence: tuple() would take any iterable (a dict's keys) or raise TypeError.
        if not isinstance(self.stop, str | list | tuple):
            raise InvalidParameter("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidParameter("stop", f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if not isinstance(self.stop_token_ids, list | tuple):
            raise InvalidParameter(
                "stop_token_ids", f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}"
            )
        ids = tuple(self.stop_token_ids)
        for i in ids:
            _integer("stop_token_ids", i, 0)
        object.__setattr__(self, "stop_token_ids", ids)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _integer("n", self.n, 1)
        for name in ("ignore_eos", "skip_special_tokens", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameter(name, f"{name} must be a boolean, got {getattr(self, name)!r}")

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice `index` (None without a seed): seed + index, wrapped into the range
        `torch.Generator.manual_seed` takes."""
        if self.seed is None:
            return None
        low, high = _SEED_RANGE
        return (self.seed + index - low) % (high - low) + low

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return (self.repetition_penalty, self.presence_penalty, self.frequency_penalty) != (1.0, 0.0, 0.0)
