"""The engine: a worker thread that serves many queued requests at once (continuous batching).

Loop: `_schedule` admits requests from a bounded FIFO queue into the running set, in arrival order,
up to `max_running` and while their memory fits; `_step` advances every running sequence by one unit
of work — every decode row and every speculative sequence's verify rows in one packed forward (each
weight read once for all of them, each row computed as it is alone; each sequence then commits its
own accepted prefix), and prefill chunks round-robin under the per-step token budget (prompts that
arrive while streams decode on a decode-priority time share, `engine/share.py`); `_emit` hands each
request its event and retires the finished ones, whose slots go back at once. A request of n choices
prefills once and forks n sequences. A request's output never depends on what else runs: its prefill
is cut into the chunks it gets alone, and its decode and verify rows go through the per-token
kernels, which compute each row independently.

Callers talk to the engine through `Request` handles: events arrive through a sink (called on the
engine thread, so it must be quick); `stream`/`generate` wrap that for blocking code and
`AsyncStream` for asyncio code.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from hybridlm.batch import Batch
from hybridlm.cache.base import LayerCache
from hybridlm.cache.fork import fork_caches
from hybridlm.engine.errors import EngineClosed, InvalidParameter, PromptTooLong, QueueFull
from hybridlm.engine.grammar import GrammarCompiler, Matcher
from hybridlm.engine.memory import CacheCost, HeapTrimmer, available_memory
from hybridlm.engine.params import SamplingParams
from hybridlm.engine.request import (
    CANCELLED,
    ERROR,
    LENGTH,
    STOP,
    Completion,
    Event,
    Request,
    Sink,
    SpeculativeUsage,
    Timings,
    TokenLogprob,
    Usage,
)
from hybridlm.engine.share import PrefillShare
from hybridlm.engine.stats import EngineStats
from hybridlm.engine.stop import StopStrings
from hybridlm.models.base import CausalLM, forward_packed
from hybridlm.models.tokenizer import IncrementalDecoder, Tokenizer
from hybridlm.ops.quant_gemm import prompt_rows
from hybridlm.ops.sampling import apply_penalties, sample, token_logprobs
from hybridlm.prefix.cache import PrefixCache, Session
from hybridlm.runtime import keep_freed_memory
from hybridlm.speculative import Drafter, RequestSpeculation, Speculator, StepShare, TargetPolicy, VerifyRows

log = logging.getLogger(__name__)

DECODE_CONTEXT = 4  # prompt ids that condition the first output text (SentencePiece spacing), never emitted


@dataclass
class _Running:
    """Engine-side state of one scheduled request."""

    request: Request
    max_tokens: int
    started: float
    generator: torch.Generator | None
    decoder: IncrementalDecoder | None
    stopper: StopStrings
    caches: list[LayerCache | None] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [1, V] float32: the next token's distribution
    position: int = 0  # tokens held by the caches
    output_ids: list[int] = field(default_factory=list)
    output_counts: torch.Tensor | None = None  # [1, V] float32, for presence / frequency penalties
    seen: torch.Tensor | None = None  # [1, V] bool, prompt ∪ output ids, for the repetition penalty
    cached_tokens: int = 0
    session: Session | None = None  # the prefix-cache session holding this request's caches
    speculation: RequestSpeculation | None = None  # None: plain decoding
    prefill_pos: int | None = None  # next prompt position to prefill (None: prefill not begun)
    reserved: int = 0  # bytes of state and KV its admission counted
    shared_reserved: int = 0  # the part of `reserved` its forks read (shared KV rows)
    matcher: Matcher | None = None  # the request's grammar state (None: unconstrained)
    prefill_done: float | None = None
    first_token: float | None = None
    index: int = 0  # its choice of the request (`SamplingParams.n`)
    forks: int = 0  # choices still to fork from it when its prefill ends
    forked: bool = False  # a choice > 0: its prompt state was copied, not computed
    admitted: int = 0  # admission order (prefill chunks go round-robin in this order)


@dataclass
class _Rows:
    """One sequence's part of a decode step: its last emitted token (a plain decode row) or, when it
    drafted, its verify rows (that token and the drafts, scheduled in `verify`)."""

    running: _Running
    ids: list[int]
    verify: VerifyRows | None = None
    policy: TargetPolicy | None = None

    @property
    def which(self) -> str:
        """The rows whose logits the sequence needs: "last" (a decode row) or "all" (verify rows)."""
        return "last" if self.verify is None else "all"


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
        self.prefill_share = prefill_share
        self._share = PrefillShare(prefill_share)
        self._admitted = 0  # sequences admitted so far (their `admitted` order)
        self._last_prefilled = 0  # admission order of the sequence that ran the last prefill chunk
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.max_memory = max_memory if max_memory is not None else available_memory() // 2
        self._reserved = 0
        # It allocates a sequence's caches: on this thread with more than one torch thread that would
        # make a second OpenMP pool beside the engine's, and every decode step would pay the futex
        # wake-ups `serial_setup` describes (83 ms per served token instead of 66, Qwen3.5-0.8B shape).
        with serial_setup():
            self._cost = CacheCost.of(model)
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.model = model
        self.tokenizer = tokenizer
        self.prefill_chunk = prefill_chunk
        self.max_queue = max_queue
        self.prefix = prefix
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
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) if tokenizer else frozenset()
        self.grammars = GrammarCompiler(tokenizer, model.vocab_size) if tokenizer else None
        self.stats = EngineStats()
        self._queue: deque[Request] = deque()
        self._running: list[_Running] = []
        self._wake = threading.Condition()
        self._closed = False
        self._progress = time.monotonic()  # when the worker last finished a unit of work
        self._failed = False  # the worker ended on an error outside any request
        self._step_rows = 0  # decode and verify rows of the step being run
        self._forked: list[_Running] = []  # choices forked in the step being run
        keep_freed_memory()
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, name="hybridlm-engine", daemon=True)
        self._thread.start()

    # -- submitting -------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> Request:
        """Queue a request; its events go to `sink` (called on the engine thread, in order, last one
        finished). Raises `InvalidParameter` / `PromptTooLong` (bad input), `QueueFull`, `EngineClosed`."""
        self.validate(prompt_ids, params)
        with self._wake:
            if self._closed:
                raise EngineClosed("the engine is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(
                    f"server busy: {len(self._queue)} requests are waiting (limit {self.max_queue})"
                )
            request = Request(list(prompt_ids), params, sink, on_cancel=self._notify)
            if not self._queue and not self._running:  # the idle time before is no stall
                self._progress = time.monotonic()
            self._queue.append(request)
            self._wake.notify()
        log.debug(
            "event=queued request=%d prompt_tokens=%d queue_depth=%d",
            request.id,
            len(prompt_ids),
            len(self._queue),
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
        if params.n > self.max_running:
            limit = f"n must be <= {self.max_running} (the sequences this server runs at once)"
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
    def queue_depth(self) -> int:
        """Requests waiting to be scheduled."""
        return len(self._queue)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def memory_occupancy(self) -> float:
        """Share of `max_memory` the running sequences' admission reserved."""
        return self._reserved / self.max_memory if self.max_memory else 0.0
    def health_problem(self) -> str | None:
        """None while the engine serves; else why it cannot: its worker thread has ended, or it has
        had work for `stall_seconds` without finishing a forward pass."""
        if self._failed or not self._thread.is_alive():
            return "engine closed" if self._closed and not self._failed else "engine thread dead"
        if (self._running or self._queue) and time.monotonic() - self._progress > self.stall_seconds:
            return "engine stalled"
        return None

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop accepting requests, cancel the waiting and running ones, and stop the worker thread."""
        with self._wake:  # a re-entrant lock: cancel() notifies through it
            self._closed = True
            for request in [*self._queue, *(r.request for r in self._running)]:
                request.cancel()
            self._wake.notify()
        self._thread.join(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    # -- the worker loop --------------------------------------------------------------------------

    def _loop(self) -> None:
        # Denormal flushing is a per-thread CPU flag; set it on the thread that runs the model (the
        # recurrent kernels slow down ~10x on subnormal floats otherwise).
        torch.set_flush_denormal(True)
        # OpenMP's team size is per thread; the creator's setting may have been made elsewhere.
        torch.set_num_threads(self._threads)
        try:
            while True:
                batch = self._schedule()
                if batch is None:
                    return
                t0 = time.perf_counter()
                outputs = self._step(batch)
                with self.stats.lock:
                    self.stats.step_seconds.observe(time.perf_counter() - t0)
                self._emit(outputs)
                if self.prefix is not None:
                    self._trim(self.prefix.released_bytes)
                self._progress = time.monotonic()
        except Exception as e:  # a bug outside any one request: fail every request rather than hang
            log.exception("event=engine_failed")
            with self._wake:
                self._closed = self._failed = True
                stranded = [*self._queue, *(r.request for r in self._running)]
                self._queue.clear()
                self._running.clear()
            for request in stranded:
                error = Event(finish_reason=ERROR, error=f"engine failed: {type(e).__name__}")
                self._deliver_rest(request, error)

    def _schedule(self) -> list[_Running] | None:
        """Admit queued requests up to `max_running`; block while there is nothing to do.
        Returns the running set (None when closed and drained)."""
        dropped: list[Request] = []
        with self._wake:
            while True:
                for request in [r for r in self._queue if r.cancelled]:
                    self._queue.remove(request)
                    dropped.append(request)
                while self._queue and self._fits(self._queue[0]):
                    self._running.append(self._start(self._queue.popleft()))
                if self._running or dropped:
                    break
                if self._closed:
                    return None
                self._wake.wait()
        for request in dropped:  # cancelled while waiting: they never ran
            now = time.perf_counter()
            usage = Usage(len(request.prompt_ids), 0)
            timings = Timings((now - request.arrival) * 1e3, 0.0, None, 0.0, (now - request.arrival) * 1e3)
            self._deliver_rest(request, Event(finish_reason=CANCELLED, usage=usage, timings=timings))
            with self.stats.lock:
                self.stats.finished[CANCELLED] += 1
        return self._running

    def _fits(self, request: Request) -> bool:
        """Whether `request`'s sequences (its n choices) fit `max_running` and their caches fit
        `max_memory` beside the running ones (alone they always do: n <= max_running)."""
        if not self._running:
            return True
        sequences = sum(1 + r.forks for r in self._running) + request.params.n
        return sequences <= self.max_running and self._reserved + self._bytes_for(request) <= self.max_memory

    def _bytes_for(self, request: Request) -> int:
        """Bytes of state and KV the request's n sequences may hold (prompt + max_tokens each; the
        prompt's KV rows that forks share counted once)."""
        tokens = self._tokens_for(request)
        forks = self._cost.fork_bytes(len(request.prompt_ids), tokens) * (request.params.n - 1)
        return self._cost.bytes(tokens) + forks

    def _tokens_for(self, request: Request) -> int:
        room = self.context_length - len(request.prompt_ids)
        return len(request.prompt_ids) + min(request.params.max_tokens or room, room)

    def _start(self, request: Request) -> _Running:
        running = self._sequence(request, 0)
        running.forks = request.params.n - 1
        running.reserved = self._bytes_for(request)
        self._reserved += running.reserved
        self._admitted += 1
        running.admitted = self._admitted
        with self.stats.lock:
            self.stats.queue_seconds.observe(running.started - request.arrival)
        log.debug(
            "event=started request=%d queue_ms=%.1f", request.id, (running.started - request.arrival) * 1e3
        )
        return running

    def _sequence(self, request: Request, index: int) -> _Running:
        """Engine-side state of choice `index` of `request`: its own generator (seeded with
        `choice_seed(index)`), decoder, stop strings, grammar state and speculation."""
        params = request.params
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.model.device)
            seed = params.choice_seed(index)
            generator.manual_seed(seed if seed is not None else secrets.randbits(63))
        decoder = None
        if self.tokenizer is not None:
            context = request.prompt_ids[-DECODE_CONTEXT:]
            decoder = IncrementalDecoder(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens, context=context
            )
        room = self.context_length - len(request.prompt_ids)
        max_tokens = min(params.max_tokens or room, room)
        stopper = StopStrings(params.stop)
        running = _Running(request, max_tokens, time.perf_counter(), generator, decoder, stopper, index=index)
        if params.grammar is not None:
            running.matcher = self.grammars.matcher(params.grammar)
        if self.speculative is not None and params.speculative:
            # A seeded sampled request must draw the same random numbers on every run: its draft
            # lengths may then depend only on its own outcomes.
            reproducible = not params.greedy and params.seed is not None
            running.speculation = self.speculative.start(request.prompt_ids, reproducible)
        return running

    def _fork(self, parent: _Running) -> None:
        """Start the other choices of `parent`'s request, its prefill having just ended: each continues
        from the prompt's state (`fork_caches`: KV rows shared copy-on-write; with a prefix cache in a
        session of its own, `PrefixCache.fork`) with the prompt's logits and takes its part of the
        admission's reservation; they join the running set at the end of this step."""
        forks = []
        for index in range(1, parent.forks + 1):
            fork = self._sequence(parent.request, index)
            if parent.session is not None:  # its continuation goes to the trie too
                fork.session = self.prefix.fork(parent.session)
                fork.caches = fork.session.caches
            else:
                fork.caches = fork_caches(parent.caches, self.model.make_caches(1))
            fork.forked = True
            fork.started, fork.prefill_done = parent.started, parent.prefill_done
            fork.prefill_pos = fork.position = parent.position
            fork.logits = parent.logits
            if fork.speculation is not None:  # its drafter starts from the prompt's tokens alone
                fork.speculation.attach(fork.caches)
            forks.append(fork)
        own = self._cost.fork_bytes(len(parent.request.prompt_ids), self._tokens_for(parent.request))
        for fork in forks:
            fork.reserved = own
            parent.reserved -= own
        parent.shared_reserved = parent.reserved - own
        parent.forks = 0
        self._forked.extend(forks)

    def _step(self, batch: list[_Running]) -> list[tuple[_Running, Event]]:
        """Advance every running sequence by one unit of work; one event per sequence that produced
        tokens or finished. The decode rows and verify rows of every sequence past its prefill share
        one packed forward; then prefill chunks (`_prefill_chunks`)."""
        out: list[tuple[_Running, Event]] = []
        decoding: list[_Running] = []
        prefilling: list[_Running] = []
        self._step_rows = 0
        for running in batch:
            if running.request.cancelled:
                out.append((running, self._finish(running, CANCELLED)))
            elif running.prefill_done is None:
                prefilling.append(running)
            else:
                decoding.append(running)
        t0 = time.perf_counter()
        out.extend(self._decode(decoding))
        decode_seconds = time.perf_counter() - t0
        # Prompts that arrived after a stream began decoding are late: they prefill on the time share.
        # By arrival, not admission: prompts of one burst are admitted over the first steps (the first
        # prefill chunk runs before the others are taken from the queue) and stay peers.
        since = min((r.prefill_done for r in decoding), default=None)
        late = {id(r) for r in prefilling if since is not None and r.request.arrival > since}
        self._share.open(decode_seconds if decoding else 0.0, waiting=bool(late))
        out.extend(self._prefill_chunks(prefilling, late))
        for fork in self._forked:  # choices > 0 of a prompt whose prefill just ended: their first token
            out.append((fork, self._guarded(fork, self._next_token)))
        with self._wake:
            self._running.extend(self._forked)
        self._forked = []
        return out

    def _prefill_chunks(self, prefilling: list[_Running], late: set[int]) -> list[tuple[_Running, Event]]:
        """Run prefill chunks of `prefilling` (admission order): round-robin, one chunk per sequence
        per turn, starting after the sequence that ran the last one, while `rows + chunk <=
        max_batch_tokens` (decode and verify rows count first; at least one chunk per step unless the
        time share holds back every prompt: a chunk is never cut). A late prompt (id in `late`) runs
        a chunk only when the time share allows it. Events of sequences that finished their prefill
        (first token) or failed."""
        out: list[tuple[_Running, Event]] = []
        rows = self._step_rows  # tokens this step runs: decode and verify rows, then prefill chunks
        chunks = 0
        turn = sorted(prefilling, key=lambda r: (r.admitted <= self._last_prefilled, r.admitted))
        while turn:
            waiting = []
            for running in turn:
                if running.request.cancelled:
                    out.append((running, self._finish(running, CANCELLED)))
                    continue
                piece = self._guarded(running, self._next_chunk)
                if isinstance(piece, Event):  # its session could not begin
                    out.append((running, piece))
                    continue
                if chunks and rows + piece > self.max_batch_tokens:
                    continue
                throttled = id(running) in late
                if throttled and not self._share.allows(piece):
                    continue
                t0 = time.perf_counter()
                event = self._guarded(running, self._advance)
                self._share.ran(piece, time.perf_counter() - t0, throttled)
                chunks += 1
                rows += piece
                self._last_prefilled = running.admitted
                if event is not None:
                    out.append((running, event))
                elif running.prefill_done is None:
                    waiting.append(running)
            turn = waiting
        with self.stats.lock:
            self.stats.batch_rows.observe(rows)
        return out

    def _guarded(self, running: _Running, work: Callable[..., object], *args):
        """`work(running, *args)`; a failure finishes that request with an error event (never the engine)."""
        try:
            return work(running, *args)
        except Exception as e:  # a failing request must not take the engine down with it
            log.exception("event=failed request=%d", running.request.id)
            return self._finish(running, ERROR, error=f"{type(e).__name__}: {e}")

    def _decode(self, batch: list[_Running]) -> list[tuple[_Running, Event]]:
        """One decode step of every sequence in `batch` (past their prefill): each speculative one
        drafts (its depth chosen for this step's rows) and schedules its verify rows; then one packed
        forward runs every sequence's decode row or verify rows (when the model packs and several
        run; else one forward each), and each sequence commits its own accepted prefix."""
        if len(batch) < 2 or not self.model.packs:
            return [(r, self._guarded(r, self._advance)) for r in batch]
        out: list[tuple[_Running, Event]] = []
        planned: list[_Rows] = []
        step = StepShare(len(batch), float(len(batch)))  # each sequence one plain row until it drafts
        for running in batch:
            rows = self._guarded(running, self._rows, StepShare(step.rows - 1, step.tokens - 1.0))
            if isinstance(rows, Event):  # its drafting failed: it is finished
                step.rows, step.tokens = step.rows - 1, step.tokens - 1.0
                out.append((running, rows))
                continue
            planned.append(rows)
            if rows.verify is not None:
                drafted = len(rows.ids) - 1
                step.rows += drafted
                step.tokens += running.speculation.expected_tokens(drafted) - 1.0
        if not planned:
            return out
        t0 = time.perf_counter()
        hidden = any(p.running.speculation and p.running.speculation.reads_hidden for p in planned)
        device = self.model.device
        segments = [Batch.single(p.ids, offset=p.running.position, device=device) for p in planned]
        caches = [p.running.caches for p in planned]
        try:
            result = forward_packed(self.model, segments, caches, [p.which for p in planned], hidden)
        except Exception as e:  # the forward may have advanced some caches and not others: all fail
            log.exception("event=failed requests=%s", [p.running.request.id for p in planned])
            for p in planned:
                if p.verify is not None:
                    p.verify.abort()
            error = f"{type(e).__name__}: {e}"
            return out + [(p.running, self._finish(p.running, ERROR, error=error)) for p in planned]
        logits, states = result if hidden else (result, [None] * len(planned))
        for rows, row_logits, row_states in zip(planned, logits, states, strict=True):
            event = self._guarded(rows.running, self._commit, rows, row_logits, row_states)
            out.append((rows.running, event))
        if self.speculative is not None:
            self.speculative.observe_step(sum(len(p.ids) for p in planned), time.perf_counter() - t0)
        return out

    def _emit(self, outputs: list[tuple[_Running, Event]]) -> None:
        for running, event in outputs:
            if running.index:
                event = replace(event, index=running.index)
            if event.finished:
                with self._wake:
                    self._running.remove(running)
                    self._reserved -= running.reserved
                    self._hand_down_shared(running)
                running.caches = []  # release the cache memory now, not when the handle dies
                if running.speculation is not None:
                    running.speculation.close()
                if running.session is not None:
                    self._end_session(running.session, event.finish_reason)
                if running.forks:  # it ended before its prefill did: so do the choices never forked
                    self._deliver_rest(running.request, event)
                    continue
            self._deliver(running.request, event)

    def _hand_down_shared(self, running: _Running) -> None:
        """The KV rows a finished choice shared with its forks live on while one of them runs: its
        reservation of them passes to a running choice of the same request."""
        if not running.shared_reserved:
            return
        heir = next((r for r in (*self._running, *self._forked) if r.request is running.request), None)
        if heir is not None:
            heir.reserved += running.shared_reserved
            heir.shared_reserved += running.shared_reserved
            self._reserved += running.shared_reserved

    @staticmethod
    def _end_session(session: Session, reason: str | None) -> None:
        """Hand a finished request's work to the prefix cache; if that fails (a bug), the cache drops
        the session's state instead and the engine serves on."""
        try:
            # A failed forward may have left layers at different offsets: drop that state.
            if reason == ERROR:
                session.abandon()
            else:
                session.close()
        except Exception:
            log.exception("event=prefix_cache_failed action=abandon")
            session.closed = False  # close() marked it closed before failing: abandon must run
            session.abandon()

    def _deliver_rest(self, request: Request, event: Event) -> None:
        """`event` (a last one) as the last event of every choice of `request` still open."""
        for index in sorted(request.open_choices):
            self._deliver(request, replace(event, index=index))

    def _deliver(self, request: Request, event: Event) -> None:
        if event.finished:
            request.open_choices.discard(event.index)
        try:
            request.sink(event)
        except Exception:  # the receiver is gone (e.g. its event loop closed): stop generating for it
            log.warning("event=sink_failed request=%d action=cancel", request.id, exc_info=True)
            request.cancel()

    # -- one request's work -----------------------------------------------------------------------

    def _next_chunk(self, running: _Running) -> int:
        """Tokens of `running`'s next prefill chunk (its session begins here: the restored prefix
        decides where chunks start)."""
        if running.prefill_pos is None:
            self._begin(running)
        return min(self.prefill_chunk, len(running.request.prompt_ids) - running.prefill_pos)

    def _begin(self, running: _Running) -> None:
        """Give `running` its caches: fresh ones, or with a prefix cache the longest stored prefix of
        its prompt restored into a slot of its own."""
        ids = running.request.prompt_ids
        if self.prefix is None:
            caches, start, session = self.model.make_caches(1), 0, None
        else:
            session = running.session = self.prefix.begin(ids, draft=running.speculation is not None)
            caches, start = session.caches, session.offset
        if running.speculation is not None:
            running.speculation.attach(caches, session)
        running.caches, running.cached_tokens, running.prefill_pos = caches, start, start

    def _prefill(self, running: _Running) -> torch.Tensor | None:
        """Run `running`'s next prefill chunk: chunks start at multiples of `prefill_chunk` after the
        restored prefix, whatever else runs. Returns the [1, V] logits of the last prompt token after
        the last chunk, else None. A cancelled prefill still hands what it computed to the trie (a
        retry resumes)."""
        if running.prefill_pos is None:
            self._begin(running)
        ids = running.request.prompt_ids
        pos = running.prefill_pos
        piece = ids[pos : pos + self.prefill_chunk]
        logits = self._forward(running, running.caches, piece, pos)
        running.prefill_pos = pos + len(piece)
        return logits if running.prefill_pos == len(ids) else None

    @prompt_rows()  # quantized layers compute every chunk's rows as a one-piece prefill does
    def _forward(
        self, running: _Running, caches: list[LayerCache | None], ids: list[int], offset: int
    ) -> torch.Tensor:
        """[1, V] logits after running prefill chunk `ids` at `offset` through the target, recorded
        in the prefix-cache session; a drafter that reads the target's hidden states is
        handed them (and the session keeps them for one that resumes from them)."""
        batch = Batch.single(ids, offset=offset, device=self.model.device)
        spec = running.speculation
        hidden = None
        if spec is None or not spec.reads_hidden:
            logits = self.model(batch, caches)
        else:
            logits, hidden = self.model(batch, caches, hidden=spec.hidden_rows)
            hidden = hidden[0]
            spec.observe(offset, ids, hidden)
        self._progress = time.monotonic()
        if running.session is not None:
            running.session.advance(ids, hidden if spec is not None and spec.keeps_hidden else None)
        return logits

    def _advance(self, running: _Running) -> Event | None:
        """One unit of `running`'s work: a prefill chunk (an event only after the last: the first
        token), a speculative round or one decode step."""
        request = running.request
        if request.cancelled:
            return self._finish(running, CANCELLED)
        if running.prefill_done is None:
            running.logits = self._prefill(running)
            if running.logits is None:
                return None
            running.position = len(request.prompt_ids)
            running.prefill_done = time.perf_counter()
            if running.forks:
                self._fork(running)
        else:
            return self._decode_alone(running)
        return self._next_token(running)

    def _decode_alone(self, running: _Running) -> Event:
        """One decode step of `running` in a forward of its own (the same rows and the same commit
        as in a packed step)."""
        rows = self._rows(running)
        t0 = time.perf_counter()
        try:
            logits, states = self._run_alone(rows)
        except BaseException:
            if rows.verify is not None:
                rows.verify.abort()
            raise
        event = self._commit(running, rows, logits, states)
        if self.speculative is not None:
            self.speculative.observe_step(len(rows.ids), time.perf_counter() - t0)
        return event

    def _rows(self, running: _Running, share: StepShare | None = None) -> _Rows:
        """`running`'s rows for this step: a speculative sequence drafts (the depth chosen for a step
        holding `share` beside it; None: alone) and schedules its verify rows; otherwise, or when it
        drafts nothing, one decode row (its last emitted token)."""
        spec = running.speculation
        rows = _Rows(running, [running.output_ids[-1]])
        if spec is not None:
            policy = self._policy(running)
            # Every emitted token counts against max_tokens: draft no further than the last one allowed.
            limit = running.max_tokens - len(running.output_ids) - 1
            draft = spec.propose(running.output_ids, limit, policy, share)
            if draft is not None:
                verify = spec.verify_rows(running.caches, draft, running.position)
                rows = _Rows(running, verify.ids, verify, policy)
        self._step_rows += len(rows.ids)
        return rows

    def _policy(self, running: _Running) -> TargetPolicy:
        """How a verify pass picks `running`'s tokens: its sampling parameters and generator."""
        params = running.request.params
        adjust = None
        if params.penalised or running.matcher is not None:
            # Called per position after the tokens before it were emitted: the counts and the
            # grammar state are then those of that position, and a forbidden draft is rejected.
            adjust = lambda logits: self._adjust(running, logits)
        return TargetPolicy(
            params.temperature, params.top_k, params.top_p, params.min_p, running.generator, adjust
        )

    def _run_alone(self, rows: _Rows) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `rows` through the target on their sequence's caches: (logits [1, V] of a decode row
        or [1 + n, V] of verify rows, the matching hidden states when the drafter reads them)."""
        running = rows.running
        spec = running.speculation
        batch = Batch.single(rows.ids, offset=running.position, device=self.model.device)
        if spec is None or not spec.reads_hidden:
            logits = self.model(batch, running.caches, logits=rows.which)
            return (logits if rows.verify is None else logits[0]), None
        hidden = "all" if rows.verify is not None else spec.hidden_rows
        logits, states = self.model(batch, running.caches, logits=rows.which, hidden=hidden)
        return (logits if rows.verify is None else logits[0]), states[0]

    def _commit(
        self, running: _Running, rows: _Rows, logits: torch.Tensor, states: torch.Tensor | None
    ) -> Event:
        """Hand `running` what its rows computed: a decode row's logits [1, V] become the next
        token's distribution; verify rows' logits [1 + n, V] decide the accepted prefix, which is
        emitted through the stop rules (with the target's own token) and committed. states: the
        rows' hidden states for a drafter that reads them (else None)."""
        spec = running.speculation
        keeps_hidden = spec is not None and spec.keeps_hidden
        if rows.verify is None:
            if spec is not None and spec.reads_hidden:
                spec.observe(running.position, rows.ids, states)
            if running.session is not None:
                running.session.advance(rows.ids, states if keeps_hidden else None)
            running.logits = logits
            running.position += 1
            return self._next_token(running)
        tokens: list[int] = []
        texts: list[str] = []
        logprobs: list[TokenLogprob] = []
        ended: list[tuple[str, str | int | None]] = []

        def emit(token: int, logits: torch.Tensor) -> bool:
            reason, stop_reason, text, lp = self._record(running, token, logits[None])
            tokens.append(token)
            texts.append(text)
            logprobs.extend(lp)
            if reason is not None:
                ended.append((reason, stop_reason))
            return reason is not None

        result = spec.commit(rows.verify, logits, states, rows.policy, emit)
        running.position = result.offset
        if running.session is not None:
            running.session.advance(result.committed, result.hidden if keeps_hidden else None)
        if ended:
            reason, stop_reason = ended[0]
            return self._finish(running, reason, stop_reason, tuple(tokens), "".join(texts), tuple(logprobs))
        return Event(tuple(tokens), "".join(texts), tuple(logprobs))

    def _adjust(self, running: _Running, logits: torch.Tensor) -> torch.Tensor:
        """[1, V] raw logits -> the logits the request samples from: penalties applied, ids its
        grammar forbids masked out (a new tensor when anything changes)."""
        params = running.request.params
        if params.penalised:
            self._ensure_penalty_state(running)
            logits = apply_penalties(
                logits,
                running.output_counts,
                running.seen,
                repetition_penalty=params.repetition_penalty,
                presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty,
            )
        if running.matcher is not None:
            logits = running.matcher.mask(logits)
        return logits

    def _next_token(self, running: _Running) -> Event:
        """Sample from `running.logits`, record the token, apply the stop rules; the token enters the
        caches at the next step (so a finished request costs no extra forward)."""
        params = running.request.params
        logits = self._adjust(running, running.logits)
        chosen = sample(
            logits,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            generator=running.generator,
        )
        token = int(chosen[0])
        reason, stop_reason, text, logprobs = self._record(running, token, running.logits)
        if reason is None:
            return Event((token,), text, logprobs)
        return self._finish(running, reason, stop_reason, (token,), text, logprobs)

    def _record(
        self, running: _Running, token: int, logits: torch.Tensor
    ) -> tuple[str | None, str | int | None, str, tuple[TokenLogprob, ...]]:
        """Record an emitted token chosen from raw `logits` [1, V] and apply the stop rules: (finish
        reason or None, stop reason, text safe to stream, logprobs)."""
        params = running.request.params
        logprobs: tuple[TokenLogprob, ...] = ()
        if params.logprobs is not None:
            chosen = torch.tensor([token], device=logits.device)
            lp, top_ids, top_lp = token_logprobs(logits, chosen, params.logprobs)
            top = tuple(zip(top_ids[0].tolist(), top_lp[0].tolist(), strict=True))
            logprobs = (TokenLogprob(token, float(lp[0]), top),)
        if running.matcher is not None:
            running.matcher.advance(token)
        # Recorded before it is streamed: the output (and, later, the prefix trie) always knows it.
        running.output_ids.append(token)
        if running.output_counts is not None:
            running.output_counts[0, token] += 1
            running.seen[0, token] = True
        if running.first_token is None:
            running.first_token = time.perf_counter()
        with self.stats.lock:
            self.stats.generation_tokens += 1

        reason, stop_reason, text = None, None, ""
        if token in self.eos_token_ids and not params.ignore_eos or token in params.stop_token_ids:
            reason, stop_reason = STOP, token
        else:
            if running.decoder is not None:
                text = running.stopper.feed(running.decoder.add(token))
            if running.stopper.matched is not None:
                reason, stop_reason = STOP, running.stopper.matched
            elif len(running.output_ids) >= running.max_tokens:
                reason = LENGTH
        return reason, stop_reason, text, logprobs

    @staticmethod
    def _speculative_usage(running: _Running) -> SpeculativeUsage | None:
        if running.speculation is None:
            return None
        c = running.speculation.counts
        return SpeculativeUsage(c.drafted_tokens, c.accepted_tokens, c.verify_passes)

    def _ensure_penalty_state(self, running: _Running) -> None:
        if running.output_counts is not None:
            return
        vocab = running.logits.shape[-1]
        device = running.logits.device
        running.output_counts = torch.zeros(1, vocab, device=device)
        running.seen = torch.zeros(1, vocab, dtype=torch.bool, device=device)
        running.seen[0, torch.as_tensor(running.request.prompt_ids, device=device)] = True

    def _finish(
        self,
        running: _Running,
        reason: str,
        stop_reason: str | int | None = None,
        token_ids: tuple[int, ...] = (),
        text: str = "",
        logprobs: tuple[TokenLogprob, ...] = (),
        error: str | None = None,
    ) -> Event:
        """The last event: releases held-back text (unless a stop string matched), usage, timings."""
        if (
            reason not in (CANCELLED, ERROR)
            and running.decoder is not None
            and running.stopper.matched is None
        ):
            text += running.stopper.feed(running.decoder.flush())
            if running.stopper.matched is not None:  # the flushed tail completed a stop string
                reason, stop_reason = STOP, running.stopper.matched
            else:
                text += running.stopper.flush()
        request = running.request
        now = time.perf_counter()
        prompt = len(request.prompt_ids)
        # A forked choice computed none of its prompt (its usage counts only its own tokens).
        done = running.prefill_done is not None and not running.forked
        prefilled = prompt - running.cached_tokens if done else 0
        session = running.session
        usage = Usage(
            prompt,
            len(running.output_ids),
            running.cached_tokens,
            prefilled,
            session.replayed if session is not None else 0,
            session.restore_ms if session is not None else 0.0,
            self._speculative_usage(running),
        )
        first = running.first_token
        timings = Timings(
            queue_ms=(running.started - request.arrival) * 1e3,
            prefill_ms=((running.prefill_done or now) - running.started) * 1e3,
            first_token_ms=(first - request.arrival) * 1e3 if first is not None else None,
            decode_ms=(now - first) * 1e3 if first is not None else 0.0,
            total_ms=(now - request.arrival) * 1e3,
        )
        with self.stats.lock:
            s = self.stats
            s.finished[reason] += 1
            s.prompt_tokens += 0 if running.forked else prompt
            s.prefilled_tokens += prefilled
            s.cached_tokens += running.cached_tokens
            s.e2e_seconds.observe(now - request.arrival)
            if done:
                s.prefill_seconds.observe(running.prefill_done - running.started)
            if first is not None:
                s.time_to_first_token_seconds.observe(first - request.arrival)
                if len(running.output_ids) > 1:
                    s.time_per_output_token_seconds.observe((now - first) / (len(running.output_ids) - 1))
        log.info(
            "event=finished request=%d reason=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d "
            "queue_ms=%.1f prefill_ms=%.1f ttft_ms=%.1f decode_ms=%.1f",
            request.id,
            reason,
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.completion_tokens,
            timings.queue_ms,
            timings.prefill_ms,
            timings.first_token_ms or 0.0,
            timings.decode_ms,
        )
        return Event(token_ids, text, logprobs, reason, stop_reason, usage, timings, error)


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
