"""The engine's scheduler: what runs this step. It admits queued requests in arrival order while
their sequences fit `max_running` and their caches fit `max_memory` (`schedule`, `fits`; "why did
this request wait?" is answered here), hands prefill chunks out round-robin under the step's token
budget and the late prompts' time share (`prefill_chunks`), and retires finished sequences, returning
their slots and memory (`retire`).

It owns the queue, the running set, the memory reservation and the lock `wake` that guards them
(the engine's API threads queue and cancel through it; the worker thread schedules under it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from hybridlm.engine.delivery import Delivery
from hybridlm.engine.memory import CacheCost
from hybridlm.engine.request import CANCELLED, Event, Request, Timings, Usage
from hybridlm.engine.sequence import Running, Sequences
from hybridlm.engine.share import PrefillShare
from hybridlm.engine.stats import EngineStats

# One logger for the whole engine, as before it was split into rooms (log filters name it).
log = logging.getLogger("hybridlm.engine.engine")


class Scheduler:
    """Admission, prefill turns and retirement of the engine's sequences.

    max_running: most sequences at once. max_batch_tokens: tokens per step (decode and verify rows
    first, then prefill chunks). max_memory: bytes of caches the running sequences may reserve.
    prefill_share: the late prompts' fraction of the decode steps' seconds (`PrefillShare`).
    """

    def __init__(
        self,
        sequences: Sequences,
        cost: CacheCost,
        delivery: Delivery,
        stats: EngineStats,
        max_running: int,
        max_batch_tokens: int,
        max_memory: int,
        prefill_share: float,
    ):
        self.sequences = sequences
        self.cost = cost
        self.delivery = delivery
        self.stats = stats
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.max_memory = max_memory
        self.share = PrefillShare(prefill_share)
        self.queue: deque[Request] = deque()
        self.running: list[Running] = []
        self.wake = threading.Condition()
        self.closed = False
        self.reserved = 0  # bytes the running sequences' admissions reserved
        self._admitted = 0  # sequences admitted so far (their `admitted` order)
        self._last_prefilled = 0  # admission order of the sequence that ran the last prefill chunk

    def schedule(self) -> list[Running] | None:
        """Admit queued requests up to `max_running`; block while there is nothing to do.
        Returns the running set (None when closed and drained)."""
        dropped: list[Request] = []
        with self.wake:
            while True:
                for request in [r for r in self.queue if r.cancelled]:
                    self.queue.remove(request)
                    dropped.append(request)
                while self.queue and self.fits(self.queue[0]):
                    self.running.append(self._start(self.queue.popleft()))
                if self.running or dropped:
                    break
                if self.closed:
                    return None
                self.wake.wait()
        for request in dropped:  # cancelled while waiting: they never ran
            now = time.perf_counter()
            usage = Usage(len(request.prompt_ids), 0)
            timings = Timings((now - request.arrival) * 1e3, 0.0, None, 0.0, (now - request.arrival) * 1e3)
            self.delivery.deliver_rest(request, Event(finish_reason=CANCELLED, usage=usage, timings=timings))
            with self.stats.lock:
                self.stats.finished[CANCELLED] += 1
        return self.running

    def fits(self, request: Request) -> bool:
        """Whether `request`'s sequences (its n choices) fit `max_running` and their caches fit
        `max_memory` beside the running ones (alone they always do: n <= max_running)."""
        if not self.running:
            return True
        sequences = sum(1 + r.forks for r in self.running) + request.params.n
        return sequences <= self.max_running and self.reserved + self.bytes_for(request) <= self.max_memory

    def bytes_for(self, request: Request) -> int:
        """Bytes of state and KV the request's n sequences may hold (prompt + max_tokens each; the
        prompt's KV rows that forks share counted once)."""
        tokens = self.sequences.tokens(request)
        forks = self.cost.fork_bytes(len(request.prompt_ids), tokens) * (request.params.n - 1)
        return self.cost.bytes(tokens) + forks

    def _start(self, request: Request) -> Running:
        running = self.sequences.start(request, 0)
        running.forks = request.params.n - 1
        running.reserved = self.bytes_for(request)
        self.reserved += running.reserved
        self._admitted += 1
        running.admitted = self._admitted
        with self.stats.lock:
            self.stats.queue_seconds.observe(running.started - request.arrival)
        log.debug(
            "event=started request=%d queue_ms=%.1f", request.id, (running.started - request.arrival) * 1e3
        )
        return running

    def prefill_chunks(
        self,
        prefilling: list[Running],
        decoding: list[Running],
        decode_seconds: float,
        rows: int,
        size: Callable[[Running], int | Event],
        run: Callable[[Running], Event | None],
    ) -> list[tuple[Running, Event]]:
        """Run prefill chunks of `prefilling` (admission order): round-robin, one chunk per sequence
        per turn, starting after the sequence that ran the last one, while `rows + chunk <=
        max_batch_tokens` (`rows`: the step's decode and verify rows, which count first; at least
        one chunk per step unless the time share holds back every prompt: a chunk is never cut).

        Prompts that arrived after a stream of `decoding` began decoding are late: they run a chunk
        only when the time share allows it (`decode_seconds`: what this step's decode took). `size`
        gives a sequence's next chunk in tokens (or the event of its failed begin); `run` runs it
        (an event after the last chunk: the first token, or a failure). Returns the events."""
        # By arrival, not admission: prompts of one burst are admitted over the first steps (the first
        # prefill chunk runs before the others are taken from the queue) and stay peers.
        since = min((r.prefill_done for r in decoding), default=None)
        late = {id(r) for r in prefilling if since is not None and r.request.arrival > since}
        self.share.open(decode_seconds if decoding else 0.0, waiting=bool(late))
        out: list[tuple[Running, Event]] = []
        chunks = 0
        turn = sorted(prefilling, key=lambda r: (r.admitted <= self._last_prefilled, r.admitted))
        while turn:
            waiting = []
            for running in turn:
                if running.request.cancelled:
                    out.append((running, self.delivery.finish(running, CANCELLED)))
                    continue
                piece = size(running)
                if isinstance(piece, Event):  # its session could not begin
                    out.append((running, piece))
                    continue
                if chunks and rows + piece > self.max_batch_tokens:
                    continue
                throttled = id(running) in late
                if throttled and not self.share.allows(piece):
                    continue
                t0 = time.perf_counter()
                event = run(running)
                self.share.ran(piece, time.perf_counter() - t0, throttled)
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

    def join(self, forks: list[Running]) -> None:
        """Add the choices forked during a step to the running set (their reservations are parts of
        their parent's admission)."""
        with self.wake:
            self.running.extend(forks)

    def retire(self, outputs: list[tuple[Running, Event]]) -> None:
        """Deliver each sequence's event; a finished sequence leaves the running set, its caches and
        reservation freed and its prefix-cache session ended."""
        for running, event in outputs:
            if running.index:
                event = replace(event, index=running.index)
            if event.finished:
                with self.wake:
                    self.running.remove(running)
                    self.reserved -= running.reserved
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
        heir = next((r for r in self.running if r.request is running.request), None)
        if heir is not None:
            heir.reserved += running.shared_reserved
            heir.shared_reserved += running.shared_reserved
            self.reserved += running.shared_reserved
