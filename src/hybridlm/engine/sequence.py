"""What the engine holds for each running sequence (one choice of a request): `Running`, how one
is started (`Sequences`: on admission and when a prompt's other choices fork), and the rows it
contributes to a decode step (`Rows`)."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

import torch

from hybridlm.cache.base import LayerCache
from hybridlm.engine.grammar import GrammarCompiler, Matcher
from hybridlm.engine.request import Request
from hybridlm.engine.stop import StopStrings
from hybridlm.models.tokenizer import IncrementalDecoder, Tokenizer
from hybridlm.prefix.session import Session
from hybridlm.speculative import RequestSpeculation, Speculator, TargetPolicy, VerifyRows

DECODE_CONTEXT = 4  # prompt ids that condition the first output text (SentencePiece spacing), never emitted


@dataclass
class Running:
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
class Sequences:
    """Starts the engine-side state of a request's choices: what the scheduler's admission and the
    step's forks of n choices share."""

    device: torch.device
    tokenizer: Tokenizer | None
    context_length: int
    grammars: GrammarCompiler | None
    speculative: Speculator | None

    def tokens(self, request: Request) -> int:
        """Most tokens a sequence of `request` holds: its prompt plus the output that fits the context."""
        room = self.context_length - len(request.prompt_ids)
        return len(request.prompt_ids) + min(request.params.max_tokens or room, room)

    def start(self, request: Request, index: int) -> Running:
        """Engine-side state of choice `index` of `request`: its own generator (seeded with
        `choice_seed(index)`), decoder, stop strings, grammar state and speculation."""
        params = request.params
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.device)
            seed = params.choice_seed(index)
            generator.manual_seed(seed if seed is not None else secrets.randbits(63))
        decoder = None
        if self.tokenizer is not None:
            context = request.prompt_ids[-DECODE_CONTEXT:]
            decoder = IncrementalDecoder(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens, context=context
            )
        max_tokens = self.tokens(request) - len(request.prompt_ids)
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


@dataclass
class Rows:
    """One sequence's part of a decode step: its last emitted token (a plain decode row) or, when it
    drafted, its verify rows (that token and the drafts, scheduled in `verify`)."""

    running: Running
    ids: list[int]
    verify: VerifyRows | None = None
    policy: TargetPolicy | None = None

    @property
    def which(self) -> str:
        """The rows whose logits the sequence needs: "last" (a decode row) or "all" (verify rows)."""
        return "last" if self.verify is None else "all"
