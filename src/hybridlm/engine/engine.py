"""The engine: a worker thread that serves many queued requests at once (continuous batching).

Loop: the scheduler admits requests from a bounded FIFO queue into the running set, in arrival order,
up to `max_running` and while their memory fits; the step advances every running sequence by one unit
of work — every decode row and every speculative sequence's verify rows in one packed forward (each
weight read once for all of them, each row computed as it is alone; each sequence then commits its
own accepted prefix), and prefill chunks round-robin under the per-step token budget (prompts that
arrive while streams decode on a decode-priority time share, `engine/share.py`); `retire` hands each
request its event and retires the finished ones, whose slots go back at once. A request of n choices
prefills once and forks n sequences. A request's output never depends on what else runs: its prefill
is cut into the chunks it gets alone, and its decode and verify rows go through the per-token
kernels, which compute each row independently.

The engine is built from rooms of one job each, objects it owns: `engine.scheduler` (`scheduler.py`:
the queue and running set, admission under `max_running` and memory, prefill turns, retirement),
`engine.step` (`step.py`: packing, forwards, speculative verification, commits, forks of n choices)
and `engine.delivery` (`delivery.py`: sampling, stop rules, usage, events, the prefix-cache
session's end); `sequence.py` holds the per-sequence state and how a sequence starts. This file
holds the public API and the worker loop.

Callers talk to the engine through `Request` handles: events arrive through a sink (called on the
engine thread, so it must be quick); `stream`/`generate` wrap that for blocking code and
`AsyncStream` for asyncio code.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from hybridlm.engine.delivery import Delivery
from hybridlm.engine.errors import EngineClosed, InvalidParameter, PromptTooLong, QueueFull
from hybridlm.engine.grammar import GrammarCompiler
from hybridlm.engine.memory import CacheCost, HeapTrimmer, available_memory
from hybridlm.engine.params import SamplingParams
from hybridlm.engine.request import ERROR, Completion, Event, Request, Sink
from hybridlm.engine.scheduler import Scheduler
from hybridlm.engine.sequence import Sequences
from hybridlm.engine.stats import EngineStats
from hybridlm.engine.step import Step
from hybridlm.models.base import CausalLM
from hybridlm.models.tokenizer import Tokenizer
from hybridlm.prefix.cache import PrefixCache
from hybridlm.runtime import keep_freed_memory
from hybridlm.speculative import Drafter, Speculator

log = logging.getLogger(__name__)


@contextmanager
def serial_setup() -> Iterator[None]:
    """Run model set-up (loading, warm-up) on the calling thread with one torch thread.

    The engine runs the model on its own thread. Had the set-up thread run parallel torch work too,
    the process would hold two OpenMP thread pools — more threads than cores — and libgomp then
    stops spinning between parallel regions: every one of the ~200 parallel regions of a decode step
    pays a futex wake-up (a Qwen3.5-0.8B-shaped decode step: 82 ms instead of 65, 2 cores). The
    thread count is restored on exit; no pool exists until the engine's thread makes one.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Engine:
    """Serves generation requests for one model on a dedicated worker thread.

    model: a loaded `CausalLM`; tokenizer: its `Tokenizer` (None: token ids only, no text or stop strings).
    prefill_chunk: most prompt tokens per forward (bounds activation memory; cancellation is checked
        between chunks). max_queue: most requests waiting to be scheduled (`submit` raises `QueueFull`
        beyond). context_length: most tokens (prompt + output) per request; default the model's
        `max_position_embeddings`. prefix: the prefix cache shared by all requests (None: every
        request prefills its whole prompt into fresh caches). speculative: a `Speculator`, or a
        function returning a fresh `Drafter` per request (wrapped in a default `Speculator`); None
        decodes one token per step. Requests opt out with `SamplingParams(speculative=False)`.
        max_running: most sequences advanced together (each has its own caches; a prefix cache gets as
        many slots). max_batch_tokens: tokens per step: decode and verify rows first, then prefill
        chunks round-robin across the prompts while they fit (at least one chunk per step unless the
        time share holds every prompt back; a chunk is never cut). max_memory: bytes of caches (state +
        KV for prompt and max_tokens) the running sequences may hold; a request that does not fit waits
        (alone it is always admitted). Default: half of the memory available at start. prefill_share:
        while streams decode, prefill chunks of prompts that arrived after a stream's first token (late
        prompts) get at most this fraction of the decode steps' seconds, on average (> 0; a time share,
        measured online: a late chunk runs once the credit each decode step adds covers its expected
        seconds).
    """

    # `health_problem` calls the engine stalled when it holds work yet no forward pass or scheduling
    # round has ended for this long (seconds; a forward of one prefill chunk takes far less).
    stall_seconds = 120.0

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer | None,
        prefill_chunk: int = 512,
        max_queue: int = 64,
        context_length: int | None = None,
        prefix: PrefixCache | None = None,
        speculative: Speculator | Callable[[], Drafter] | None = None,
        max_running: int = 8,
        max_batch_tokens: int = 512,
        max_memory: int | None = None,
        prefill_share: float = 0.5,
    ):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if not prefill_share > 0:
            raise ValueError(f"prefill_share must be > 0, got {prefill_share}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.model = model
        self.tokenizer = tokenizer
        self.prefill_chunk = prefill_chunk
        self.max_queue = max_queue
        self.prefill_share = prefill_share
        self.prefix = prefix
        # It allocates a sequence's caches: on this thread with more than one torch thread that would
        # make a second OpenMP pool beside the engine's, and every decode step would pay the futex
        # wake-ups `serial_setup` describes (83 ms per served token instead of 66, Qwen3.5-0.8B shape).
        with serial_setup():
            cost = CacheCost.of(model)
        self._trim = HeapTrimmer()  # evicted snapshots' heap pages back to the system
        if prefix is not None:
            prefix.reserve(max_running)
        if speculative is not None and not isinstance(speculative, Speculator):
            speculative = Speculator(speculative)
        self.speculative: Speculator | None = speculative
        limit = int(model.config.get("max_position_embeddings") or 0)
        self.context_length = context_length or limit or 4096
        if self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
        self.grammars = GrammarCompiler(tokenizer, model.vocab_size) if tokenizer else None
        self.stats = EngineStats()
        eos = frozenset(tokenizer.eos_token_ids) if tokenizer else frozenset()
        self.delivery = Delivery(self.stats, eos)
        sequences = Sequences(model.device, tokenizer, self.context_length, self.grammars, speculative)
        self.scheduler = Scheduler(
            sequences,
            cost,
            self.delivery,
            self.stats,
            max_running,
            max_batch_tokens,
            max_memory if max_memory is not None else available_memory() // 2,
            prefill_share,
        )
        self.step = Step(
            model, self.scheduler, sequences, cost, self.delivery, prefix, speculative, prefill_chunk
        )
        self._failed = False  # the worker ended on an error outside any request
        keep_freed_memory()
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, name="hybridlm-engine", daemon=True)
        self._thread.start()

    # -- submitting -------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> Request:
        """Queue a request; its events go to `sink` (called on the engine thread, in order, last one
        finished). Raises `InvalidParameter` / `PromptTooLong` (bad input), `QueueFull`, `EngineClosed`."""
        self.validate(prompt_ids, params)
        scheduler = self.scheduler
        with scheduler.wake:
            if scheduler.closed:
                raise EngineClosed("the engine is shutting down")
            if len(scheduler.queue) >= self.max_queue:
                waiting = len(scheduler.queue)
                raise QueueFull(f"server busy: {waiting} requests are waiting (limit {self.max_queue})")
            request = Request(list(prompt_ids), params, sink, on_cancel=self._notify)
            if not scheduler.queue and not scheduler.running:  # the idle time before is no stall
                self.step.progress = time.monotonic()
            scheduler.queue.append(request)
            scheduler.wake.notify()
        log.debug(
            "event=queued request=%d prompt_tokens=%d queue_depth=%d",
            request.id,
            len(prompt_ids),
            len(scheduler.queue),
        )
        return request

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise `InvalidParameter` for what `SamplingParams` cannot check alone (ids, lengths)."""
        vocab = self.model.vocab_size
        if not prompt_ids:
            raise InvalidParameter("prompt", "prompt is empty")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            raise InvalidParameter("prompt", f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt_ids) >= self.context_length:
            raise PromptTooLong(
                "prompt",
                f"prompt has {len(prompt_ids)} tokens, which leaves no room to generate within this "
                f"server's context length of {self.context_length} tokens",
            )
        if params.n > self.scheduler.max_running:
            limit = f"n must be <= {self.scheduler.max_running} (the sequences this server runs at once)"
            raise InvalidParameter("n", f"{limit}, got {params.n}")
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidParameter("stop_token_ids", f"stop_token_ids must be < {vocab}")
        if params.stop and self.tokenizer is None:
            raise InvalidParameter("stop", "stop strings need a tokenizer (this model has none)")
        if params.grammar is not None:
            if self.grammars is None:
                message = "a grammar needs a tokenizer (this model has none)"
                raise InvalidParameter(params.grammar.param, message)
            if params.ignore_eos:  # a complete grammar allows nothing but EOS
                raise InvalidParameter("ignore_eos", "ignore_eos cannot be combined with a grammar")
            self.grammars.check(params.grammar)

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[Event]:
        """Blocking iterator over a request's events (of all its choices, each `Event.index`); closing
        it early cancels the request."""
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        request = self.submit(prompt_ids, params, events.put)
        open_choices = params.n
        try:
            while open_choices:
                event = events.get()
                open_choices -= event.finished
                yield event
        finally:
            if open_choices:
                request.cancel()

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Run one request (n = 1) to completion (blocking) and return everything it produced."""
        if params.n != 1:
            raise ValueError("generate runs one choice: use generate_choices for n > 1")
        return self.generate_choices(prompt_ids, params)[0]

    def generate_choices(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        """Run one request to completion (blocking): what each of its n choices produced, by index."""
        results = [Completion() for _ in range(params.n)]
        for event in self.stream(prompt_ids, params):
            results[event.index].add(event)
        return results

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end a request unless it ignores EOS (the tokenizer's; settable)."""
        return self.delivery.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.delivery.eos_token_ids = ids

    @property
    def queue_depth(self) -> int:
        """Requests waiting to be scheduled."""
        return len(self.scheduler.queue)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def memory_occupancy(self) -> float:
        """Share of `max_memory` the running sequences' admission reserved."""
        limit = self.scheduler.max_memory
        return self.scheduler.reserved / limit if limit else 0.0

    def health_problem(self) -> str | None:
        """None while the engine serves; else why it cannot: its worker thread has ended, or it has
        had work for `stall_seconds` without finishing a forward pass."""
        if self._failed or not self._thread.is_alive():
            return "engine closed" if self.scheduler.closed and not self._failed else "engine thread dead"
        busy = self.scheduler.running or self.scheduler.queue
        if busy and time.monotonic() - self.step.progress > self.stall_seconds:
            return "engine stalled"
        return None

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop accepting requests, cancel the waiting and running ones, and stop the worker thread."""
        scheduler = self.scheduler
        with scheduler.wake:  # a re-entrant lock: cancel() notifies through it
            scheduler.closed = True
            for request in [*scheduler.queue, *(r.request for r in scheduler.running)]:
                request.cancel()
            scheduler.wake.notify()
        self._thread.join(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _notify(self) -> None:
        with self.scheduler.wake:
            self.scheduler.wake.notify()

    # -- the worker loop --------------------------------------------------------------------------

    def _loop(self) -> None:
        # Denormal flushing is a per-thread CPU flag; set it on the thread that runs the model (the
        # recurrent kernels slow down ~10x on subnormal floats otherwise).
        torch.set_flush_denormal(True)
        # OpenMP's team size is per thread; the creator's setting may have been made elsewhere.
        torch.set_num_threads(self._threads)
        try:
            while True:
                batch = self.scheduler.schedule()
                if batch is None:
                    return
                t0 = time.perf_counter()
                outputs = self.step.run(batch)
                with self.stats.lock:
                    self.stats.step_seconds.observe(time.perf_counter() - t0)
                self.scheduler.retire(outputs)
                if self.prefix is not None:
                    self._trim(self.prefix.released_bytes)
                self.step.progress = time.monotonic()
        except Exception as e:  # a bug outside any one request: fail every request rather than hang
            log.exception("event=engine_failed")
            scheduler = self.scheduler
            with scheduler.wake:
                scheduler.closed = self._failed = True
                stranded = [*scheduler.queue, *(r.request for r in scheduler.running)]
                scheduler.queue.clear()
                scheduler.running.clear()
            for request in stranded:
                error = Event(finish_reason=ERROR, error=f"engine failed: {type(e).__name__}")
                self.delivery.deliver_rest(request, error)


class AsyncStream:
    """A request's events (of all its choices) for asyncio code: `async for event in stream`.
    Construct it inside the running event loop, or on a worker thread given that `loop` (`submit`
    validates the whole prompt: a server keeps that off its loop); the engine thread hands events
    over with
    `loop.call_soon_threadsafe`."""

    def __init__(
        self,
        engine: Engine,
        prompt_ids: list[int],
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        loop = loop or asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._open = params.n  # choices whose last event has not arrived
        self.request = engine.submit(
            prompt_ids, params, lambda e: loop.call_soon_threadsafe(self._events.put_nowait, e)
        )

    @property
    def _done(self) -> bool:
        return self._open == 0

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Event:
        if self._done:
            raise StopAsyncIteration
        event = await self._events.get()
        self._open -= event.finished
        return event

    def cancel(self) -> None:
        """Cancel the request unless its last event has already arrived."""
        if not self._done:
            self.request.cancel()
