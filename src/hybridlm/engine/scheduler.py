"""The engine's scheduler: what runs this step. It admits queued requests in arrival order while
their sequences fit `max_running` and their caches fit `max_memory` (`_schedule`, `_fits`; "why did
this request wait?" is answered here), starts each choice's sequence (`_sequence`), hands prefill
chunks out round-robin under the step's token budget and the late prompts' time share
(`_prefill_chunks`), and retires finished sequences, returning their slots and memory (`_emit`).

A part of `Engine` (engine.py), which owns the state it reads: the queue, the running set, the
reservation and the lock `_wake`.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import replace

import torch

from hybridlm.engine.request import CANCELLED, Event, Request, Timings, Usage
from hybridlm.engine.sequence import DECODE_CONTEXT, Running
from hybridlm.engine.stop import StopStrings
from hybridlm.models.tokenizer import IncrementalDecoder

# One logger for the whole engine, as before it was split into rooms (log filters name it).
log = logging.getLogger("hybridlm.engine.engine")


class Scheduler:
    """Admission, prefill turns and retirement of the engine's sequences (a part of `Engine`)."""

    def _schedule(self) -> list[Running] | None:
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
            self.delivery.deliver_rest(request, Event(finish_reason=CANCELLED, usage=usage, timings=timings))
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

    def _start(self, request: Request) -> Running:
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

    def _sequence(self, request: Request, index: int) -> Running:
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
        running = Running(request, max_tokens, time.perf_counter(), generator, decoder, stopper, index=index)
        if params.grammar is not None:
            running.matcher = self.grammars.matcher(params.grammar)
        if self.speculative is not None and params.speculative:
            # A seeded sampled request must draw the same random numbers on every run: its draft
            # lengths may then depend only on its own outcomes.
            reproducible = not params.greedy and params.seed is not None
            running.speculation = self.speculative.start(request.prompt_ids, reproducible)
        return running

    def _prefill_chunks(self, prefilling: list[Running], late: set[int]) -> list[tuple[Running, Event]]:
        """Run prefill chunks of `prefilling` (admission order): round-robin, one chunk per sequence
        per turn, starting after the sequence that ran the last one, while `rows + chunk <=
        max_batch_tokens` (decode and verify rows count first; at least one chunk per step unless the
        time share holds back every prompt: a chunk is never cut). A late prompt (id in `late`) runs
        a chunk only when the time share allows it. Events of sequences that finished their prefill
        (first token) or failed."""
        out: list[tuple[Running, Event]] = []
        rows = self._step_rows  # tokens this step runs: decode and verify rows, then prefill chunks
        chunks = 0
        turn = sorted(prefilling, key=lambda r: (r.admitted <= self._last_prefilled, r.admitted))
        while turn:
            waiting = []
            for running in turn:
                if running.request.cancelled:
                    out.append((running, self.delivery.finish(running, CANCELLED)))
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

    def _emit(self, outputs: list[tuple[Running, Event]]) -> None:
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
                    self.delivery.end_session(running.session, event.finish_reason)
                if running.forks:  # it ended before its prefill did: so do the choices never forked
                    self.delivery.deliver_rest(running.request, event)
                    continue
            self.delivery.deliver(running.request, event)

    def _hand_down_shared(self, running: Running) -> None:
        """The KV rows a finished choice shared with its forks live on while one of them runs: its
        reservation of them passes to a running choice of the same request."""
        if not running.shared_reserved:
            return
        heir = next((r for r in (*self._running, *self._forked) if r.request is running.request), None)
        if heir is not None:
            heir.reserved += running.shared_reserved
            heir.shared_reserved += running.shared_reserved
            self._reserved += running.shared_reserved
