"""The contracts between the engine and its callers: requests, the events they stream, results."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridlm.engine.params import SamplingParams

# Finish reasons. "stop": EOS, a stop token id or a stop string; "length": max_tokens or the context
# length; "cancelled": the caller cancelled (client disconnect); "error": the engine failed this request.
STOP, LENGTH, CANCELLED, ERROR = "stop", "length", "cancelled", "error"


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability (natural log, model distribution) of one generated id and the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SpeculativeUsage:
    """Speculative decoding of one request: draft tokens verified, of those accepted, verify passes."""

    drafted_tokens: int
    accepted_tokens: int
    verify_passes: int


@dataclass(frozen=True)
class Usage:
    """Token counts of one request. cached: prompt tokens restored from the prefix cache (not
    recomputed by the model); replayed: of those, tokens recovered by replaying recurrent layers'
    scan inputs; prefilled: prompt tokens actually run through the model; restore_ms: time to
    restore the cached prefix; speculative: None unless the request decoded speculatively."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    replayed_tokens: int = 0
    restore_ms: float = 0.0
    speculative: SpeculativeUsage | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    """Milliseconds. queue: arrival → scheduled; prefill: scheduled → prompt logits; first_token: arrival →
    first token emitted (TTFT); decode: first token → finish; total: arrival → finish."""

    queue_ms: float
    prefill_ms: float
    first_token_ms: float | None
    decode_ms: float
    total_ms: float


@dataclass(frozen=True)
class Event:
    """One step's news for one request, in order. `text` is safe to show (never part of a stop string);
    it may be '' while `token_ids` is not (an incomplete character or a possible stop string is held).
    The last event has `finish_reason` set and carries `usage` and `timings` (and `error` on failure).
    `index`: the choice it belongs to (`SamplingParams.n` > 1: each choice's events are in order and
    each choice ends with its own last event; the request is over when all have)."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended the request
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None
    index: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


Sink = Callable[[Event], None]
_ids = itertools.count(1)


class Request:
    """A caller's handle on one submitted request. Events reach `sink` from the engine thread, in order."""

    def __init__(
        self, prompt_ids: list[int], params: SamplingParams, sink: Sink, on_cancel: Callable[[], None]
    ):
        self.id = next(_ids)
        self.prompt_ids = prompt_ids
        self.params = params
        self.sink = sink
        self.arrival = time.perf_counter()
        self._cancelled = threading.Event()
        self._on_cancel = on_cancel
        self.open_choices = set(range(params.n))  # choices whose last event has not been delivered

    def cancel(self) -> None:
        """Stop this request (e.g. its client went away); the engine drops it before its next step.
        Safe from any thread, idempotent, harmless after it finished."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._on_cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass
class Completion:
    """A whole request's output, accumulated from its events (blocking `Engine.generate`, non-streaming
    HTTP). `token_ids` holds every generated id, a final EOS / stop id included; `text` excludes it."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None

    def add(self, event: Event) -> None:
        self.token_ids += event.token_ids
        self.text += event.text
        self.logprobs += event.logprobs
        if event.finished:
            self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason
            self.usage, self.timings, self.error = event.usage, event.timings, event.error
