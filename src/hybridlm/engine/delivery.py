"""The engine's delivery: from logits to what a caller receives. Sampling with the request's
penalties and grammar (`adjust`, `next_token`), recording each emitted token through the stop
rules and logprobs (`record`), the last event with its usage and timings (`finish`), handing
events to the request's sink (`deliver`) and a finished request's work to the prefix cache
(`end_session`).

The engine (engine.py) holds one as `engine.delivery`; its scheduler and step hand it every token
they choose and every sequence they end.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from hybridlm.engine.request import (
    CANCELLED,
    ERROR,
    LENGTH,
    STOP,
    Event,
    Request,
    SpeculativeUsage,
    Timings,
    TokenLogprob,
    Usage,
)
from hybridlm.engine.sequence import Running
from hybridlm.engine.stats import EngineStats
from hybridlm.ops.sampling import apply_penalties, sample, token_logprobs
from hybridlm.prefix.session import Session

# One logger for the whole engine, as before it was split into rooms (log filters name it).
log = logging.getLogger("hybridlm.engine.engine")


class Delivery:
    """Sampling, stop rules, usage and events of the engine's sequences. stats: the engine's counters
    (updated under their lock); eos_token_ids: the ids that end a request unless it ignores EOS."""

    def __init__(self, stats: EngineStats, eos_token_ids: frozenset[int]):
        self.stats = stats
        self.eos_token_ids = eos_token_ids

    def adjust(self, running: Running, logits: torch.Tensor) -> torch.Tensor:
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

    def next_token(self, running: Running) -> Event:
        """Sample from `running.logits`, record the token, apply the stop rules; the token enters the
        caches at the next step (so a finished request costs no extra forward)."""
        params = running.request.params
        logits = self.adjust(running, running.logits)
        chosen = sample(
            logits,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            generator=running.generator,
        )
        token = int(chosen[0])
        reason, stop_reason, text, logprobs = self.record(running, token, running.logits)
        if reason is None:
            return Event((token,), text, logprobs)
        return self.finish(running, reason, stop_reason, (token,), text, logprobs)

    def record(
        self, running: Running, token: int, logits: torch.Tensor
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
    def _speculative_usage(running: Running) -> SpeculativeUsage | None:
        if running.speculation is None:
            return None
        c = running.speculation.counts
        return SpeculativeUsage(c.drafted_tokens, c.accepted_tokens, c.verify_passes)

    def _ensure_penalty_state(self, running: Running) -> None:
        if running.output_counts is not None:
            return
        vocab = running.logits.shape[-1]
        device = running.logits.device
        running.output_counts = torch.zeros(1, vocab, device=device)
        running.seen = torch.zeros(1, vocab, dtype=torch.bool, device=device)
        running.seen[0, torch.as_tensor(running.request.prompt_ids, device=device)] = True

    def finish(
        self,
        running: Running,
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

    @staticmethod
    def end_session(session: Session, reason: str | None) -> None:
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

    def deliver_rest(self, request: Request, event: Event) -> None:
        """`event` (a last one) as the last event of every choice of `request` still open."""
        for index in sorted(request.open_choices):
            self.deliver(request, replace(event, index=index))

    def deliver(self, request: Request, event: Event) -> None:
        if event.finished:
            request.open_choices.discard(event.index)
        try:
            request.sink(event)
        except Exception:  # the receiver is gone (e.g. its event loop closed): stop generating for it
            log.warning("event=sink_failed request=%d action=cancel", request.id, exc_info=True)
            request.cancel()
