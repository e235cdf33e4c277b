"""The engine's step: running what the scheduler chose. Decode rows and every speculative sequence's
verify rows go through one packed forward (`_decode`), each sequence then commits its own accepted
prefix (`_commit`); prefill chunks run one forward each (`_prefill`, `_forward`), their session
beginning with the longest cached prefix (`_begin`); when a prompt of n choices is in, the other
choices fork from its state (`_fork`). A failure fails only its own request (`_guarded`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from hybridlm.batch import Batch
from hybridlm.cache.base import LayerCache
from hybridlm.cache.fork import fork_caches
from hybridlm.engine.delivery import Delivery
from hybridlm.engine.memory import CacheCost
from hybridlm.engine.request import CANCELLED, ERROR, Event, TokenLogprob
from hybridlm.engine.scheduler import Scheduler
from hybridlm.engine.sequence import Rows, Running, Sequences
from hybridlm.models.base import CausalLM, forward_packed
from hybridlm.ops.quant_gemm import prompt_rows
from hybridlm.prefix.cache import PrefixCache
from hybridlm.speculative import Speculator, StepShare, TargetPolicy

# One logger for the whole engine, as before it was split into rooms (log filters name it).
log = logging.getLogger("hybridlm.engine.engine")


class Step:
    """Packing, forwards, speculative verification and commits of one engine step.

    prefill_chunk: most prompt tokens per forward. `progress` is when the last forward or step
    ended (`time.monotonic()`): the engine's stall check reads it.
    """

    def __init__(
        self,
        model: CausalLM,
        scheduler: Scheduler,
        sequences: Sequences,
        cost: CacheCost,
        delivery: Delivery,
        prefix: PrefixCache | None,
        speculative: Speculator | None,
        prefill_chunk: int,
    ):
        self.model = model
        self.scheduler = scheduler
        self.sequences = sequences
        self.cost = cost
        self.delivery = delivery
        self.prefix = prefix
        self.speculative = speculative
        self.prefill_chunk = prefill_chunk
        self.progress = time.monotonic()
        self._rows_run = 0  # decode and verify rows of the step being run
        self._forked: list[Running] = []  # choices forked in the step being run

    def run(self, batch: list[Running]) -> list[tuple[Running, Event]]:
        """Advance every running sequence by one unit of work; one event per sequence that produced
        tokens or finished. The decode rows and verify rows of every sequence past its prefill share
        one packed forward; then the scheduler hands out prefill chunks (`Scheduler.prefill_chunks`)."""
        out: list[tuple[Running, Event]] = []
        decoding: list[Running] = []
        prefilling: list[Running] = []
        self._rows_run = 0
        for running in batch:
            if running.request.cancelled:
                out.append((running, self.delivery.finish(running, CANCELLED)))
            elif running.prefill_done is None:
                prefilling.append(running)
            else:
                decoding.append(running)
        t0 = time.perf_counter()
        out.extend(self._decode(decoding))
        decode_seconds = time.perf_counter() - t0
        size = lambda running: self._guarded(running, self._next_chunk)
        run = lambda running: self._guarded(running, self._advance)
        rows = self._rows_run
        out.extend(self.scheduler.prefill_chunks(prefilling, decoding, decode_seconds, rows, size, run))
        for fork in self._forked:  # choices > 0 of a prompt whose prefill just ended: their first token
            out.append((fork, self._guarded(fork, self.delivery.next_token)))
        self.scheduler.join(self._forked)
        self._forked = []
        return out

    def _guarded(self, running: Running, work: Callable[..., object], *args):
        """`work(running, *args)`; a failure finishes that request with an error event (never the engine)."""
        try:
            return work(running, *args)
        except Exception as e:  # a failing request must not take the engine down with it
            log.exception("event=failed request=%d", running.request.id)
            return self.delivery.finish(running, ERROR, error=f"{type(e).__name__}: {e}")

    def _fork(self, parent: Running) -> None:
        """Start the other choices of `parent`'s request, its prefill having just ended: each continues
        from the prompt's state (`fork_caches`: KV rows shared copy-on-write; with a prefix cache in a
        session of its own, `PrefixCache.fork`) with the prompt's logits and takes its part of the
        admission's reservation; they join the running set at the end of this step."""
        forks = []
        for index in range(1, parent.forks + 1):
            fork = self.sequences.start(parent.request, index)
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
        own = self.cost.fork_bytes(len(parent.request.prompt_ids), self.sequences.tokens(parent.request))
        for fork in forks:
            fork.reserved = own
            parent.reserved -= own
        parent.shared_reserved = parent.reserved - own
        parent.forks = 0
        self._forked.extend(forks)

    def _decode(self, batch: list[Running]) -> list[tuple[Running, Event]]:
        """One decode step of every sequence in `batch` (past their prefill): each speculative one
        drafts (its depth chosen for this step's rows) and schedules its verify rows; then one packed
        forward runs every sequence's decode row or verify rows (when the model packs and several
        run; else one forward each), and each sequence commits its own accepted prefix."""
        if len(batch) < 2 or not self.model.packs:
            return [(r, self._guarded(r, self._advance)) for r in batch]
        out: list[tuple[Running, Event]] = []
        planned: list[Rows] = []
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
            return out + [(p.running, self.delivery.finish(p.running, ERROR, error=error)) for p in planned]
        logits, states = result if hidden else (result, [None] * len(planned))
        for rows, row_logits, row_states in zip(planned, logits, states, strict=True):
            event = self._guarded(rows.running, self._commit, rows, row_logits, row_states)
            out.append((rows.running, event))
        if self.speculative is not None:
            self.speculative.observe_step(sum(len(p.ids) for p in planned), time.perf_counter() - t0)
        return out

    def _next_chunk(self, running: Running) -> int:
        """Tokens of `running`'s next prefill chunk (its session begins here: the restored prefix
        decides where chunks start)."""
        if running.prefill_pos is None:
            self._begin(running)
        return min(self.prefill_chunk, len(running.request.prompt_ids) - running.prefill_pos)

    def _begin(self, running: Running) -> None:
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

    def _prefill(self, running: Running) -> torch.Tensor | None:
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
        self, running: Running, caches: list[LayerCache | None], ids: list[int], offset: int
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
        self.progress = time.monotonic()
        if running.session is not None:
            running.session.advance(ids, hidden if spec is not None and spec.keeps_hidden else None)
        return logits

    def _advance(self, running: Running) -> Event | None:
        """One unit of `running`'s work: a prefill chunk (an event only after the last: the first
        token), a speculative round or one decode step."""
        request = running.request
        if request.cancelled:
            return self.delivery.finish(running, CANCELLED)
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
        return self.delivery.next_token(running)

    def _decode_alone(self, running: Running) -> Event:
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

    def _rows(self, running: Running, share: StepShare | None = None) -> Rows:
        """`running`'s rows for this step: a speculative sequence drafts (the depth chosen for a step
        holding `share` beside it; None: alone) and schedules its verify rows; otherwise, or when it
        drafts nothing, one decode row (its last emitted token)."""
        spec = running.speculation
        rows = Rows(running, [running.output_ids[-1]])
        if spec is not None:
            policy = self._policy(running)
            # Every emitted token counts against max_tokens: draft no further than the last one allowed.
            limit = running.max_tokens - len(running.output_ids) - 1
            draft = spec.propose(running.output_ids, limit, policy, share)
            if draft is not None:
                verify = spec.verify_rows(running.caches, draft, running.position)
                rows = Rows(running, verify.ids, verify, policy)
        self._rows_run += len(rows.ids)
        return rows

    def _policy(self, running: Running) -> TargetPolicy:
        """How a verify pass picks `running`'s tokens: its sampling parameters and generator."""
        params = running.request.params
        adjust = None
        if params.penalised or running.matcher is not None:
            # Called per position after the tokens before it were emitted: the counts and the
            # grammar state are then those of that position, and a forbidden draft is rejected.
            adjust = lambda logits: self.delivery.adjust(running, logits)
        return TargetPolicy(
            params.temperature, params.top_k, params.top_p, params.min_p, running.generator, adjust
        )

    def _run_alone(self, rows: Rows) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        self, running: Running, rows: Rows, logits: torch.Tensor, states: torch.Tensor | None
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
            return self.delivery.next_token(running)
        tokens: list[int] = []
        texts: list[str] = []
        logprobs: list[TokenLogprob] = []
        ended: list[tuple[str, str | int | None]] = []

        def emit(token: int, logits: torch.Tensor) -> bool:
            reason, stop_reason, text, lp = self.delivery.record(running, token, logits[None])
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
            text = "".join(texts)
            return self.delivery.finish(running, reason, stop_reason, tuple(tokens), text, tuple(logprobs))
        return Event(tuple(tokens), "".join(texts), tuple(logprobs))
