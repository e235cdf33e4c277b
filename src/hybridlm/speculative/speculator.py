"""Engine-facing speculative decoding: a drafter per request, one depth controller for all, and
the counters `usage.speculative` and `/metrics` report."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hybridlm.cache.base import LayerCache
from hybridlm.speculative.base import Draft, Drafter, HiddenStateDrafter, TargetCacheDrafter, TargetPolicy
from hybridlm.speculative.controller import DepthController, StepShare
from hybridlm.speculative.draft import DraftModelDrafter
from hybridlm.speculative.mtp import MTPDrafter
from hybridlm.speculative.verify import Emit, VerifyResult, VerifyRows

if TYPE_CHECKING:
    from hybridlm.prefix.session import Session


@dataclass
class SpeculationCounts:
    """Draft tokens verified, of those accepted, and verify passes (a plain step counts in none);
    per draft position i (0-based): how often it was judged against the target and accepted.
    Totals are written by the engine thread and read unlocked by `/metrics` (a scrape may see one
    round half counted)."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_passes: int = 0
    judged_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def add(self, result: VerifyResult, judged: int) -> None:
        """Count a verify pass whose first `judged` draft positions were compared with the target."""
        self.drafted_tokens += result.drafted
        self.accepted_tokens += result.accepted
        self.verify_passes += 1
        grow = judged - len(self.judged_at)
        if grow > 0:
            self.judged_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(judged):
            self.judged_at[i] += 1
            self.accepted_at[i] += i < result.accepted

    def acceptance_by_position(self) -> list[float]:
        """Fraction of judged drafts accepted, per draft position."""
        return [a / j if j else 0.0 for a, j in zip(self.accepted_at, self.judged_at, strict=True)]


class Speculator:
    """Speculative decoding for one engine.

    make_drafter: returns a fresh `Drafter` per request (e.g. `NgramDrafter`, a `DraftModel`).
    max_depth: most draft tokens per verify pass (ignored when a `controller` is given).
    """

    def __init__(
        self,
        make_drafter: Callable[[], Drafter],
        max_depth: int = 8,
        controller: DepthController | None = None,
    ):
        self.make_drafter = make_drafter
        self.controller = controller or DepthController(max_depth=max_depth)
        self.totals = SpeculationCounts()

    def start(self, prompt_ids: list[int], reproducible: bool = False) -> RequestSpeculation:
        """A request's speculation; `reproducible` (seeded sampling) keeps its draft lengths
        independent of timings and other requests (see `RequestDepth`)."""
        return RequestSpeculation(self, prompt_ids, reproducible)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode step of `rows` rows took `seconds` (see `DepthController.observe_step`)."""
        self.controller.observe_step(rows, seconds)


class RequestSpeculation:
    """One request's speculative decoding. Each decode step the engine asks `propose` for a draft
    (None: a plain decode row this step), schedules its verify rows with `verify_rows`, runs them
    (alone or packed beside other sequences' rows) and hands the logits to `commit`; the step's
    time goes to `Speculator.observe_step`. When `reads_hidden`, the engine also hands every other
    committed target forward (prefill chunks, plain steps) to `observe`, with the rows
    `hidden_rows` asks for; `commit` reports its own. Before the request's first target forward the
    engine hands its live caches (and its prefix-cache session, if any) to `attach`."""

    def __init__(self, owner: Speculator, prompt_ids: list[int], reproducible: bool = False):
        self.owner = owner
        self.drafter = owner.make_drafter()
        self.depth = owner.controller.start(reproducible)
        self.run = list(prompt_ids)  # prompt + emitted tokens, extended lazily from the engine's output
        self.prompt_len = len(prompt_ids)
        self.counts = SpeculationCounts()
        self._draft_seconds = 0.0

    @property
    def reads_hidden(self) -> bool:
        """The drafter reads the target's hidden states (see `HiddenStateDrafter`)."""
        return isinstance(self.drafter, HiddenStateDrafter)

    @property
    def keeps_hidden(self) -> bool:
        """The drafter rebuilds its context from the stored hidden states of a restored prefix (an
        MTP head): the prefix-cache session should store every committed position's."""
        return isinstance(self.drafter, MTPDrafter)

    @property
    def hidden_rows(self) -> str:
        """The hidden states each report carries: "all" or "last" (see `HiddenStateDrafter`)."""
        return self.drafter.hidden_rows

    def attach(self, caches: Sequence[LayerCache | None], session: Session | None = None) -> None:
        """The request's live target caches, for a drafter that reads them (`TargetCacheDrafter`),
        and its prefix-cache session: a draft model resumes from the draft session, an MTP head
        from the stored hidden states of the restored prefix."""
        if isinstance(self.drafter, TargetCacheDrafter):
            self.drafter.attach(caches)
        if session is None:
            return
        if session.draft is not None and isinstance(self.drafter, DraftModelDrafter):
            self.drafter.resume(session.draft)
        if session.hidden is not None and isinstance(self.drafter, MTPDrafter):
            self.drafter.resume(session.fed[: session.cached], session.hidden)

    def observe(self, offset: int, tokens: list[int], hidden: torch.Tensor) -> None:
        """The target was fed `tokens` at committed positions offset … offset+L-1; hidden: [L, d] its
        final-normed hidden states there ([1, d], the last one's, when `hidden_rows` is "last")."""
        self.drafter.observe(offset, tokens, hidden)

    def propose(
        self, output_ids: list[int], limit: int, policy: TargetPolicy, share: StepShare | None = None
    ) -> Draft | None:
        """A draft continuing prompt + `output_ids` of at most `limit` tokens (the controller picks
        the length for a step holding `share` besides it; None: alone), or None for a plain step."""
        depth = self.owner.controller.depth(self.depth, limit, share)
        if depth == 0:
            return None
        self.run.extend(output_ids[len(self.run) - self.prompt_len :])
        t0 = time.perf_counter()
        draft = self.drafter.propose(self.run, depth, policy)
        self._draft_seconds = time.perf_counter() - t0
        return draft if len(draft) else None

    def expected_tokens(self, drafted: int) -> float:
        """Tokens a round of `drafted` drafts commits on average at this request's acceptance."""
        return self.owner.controller.expected_tokens(drafted, self.depth.acceptance.value)

    def verify_rows(self, caches: Sequence[LayerCache | None], draft: Draft, offset: int) -> VerifyRows:
        """Schedule the verify pass of the draft `propose` just returned after the last emitted
        token, on caches holding `offset` tokens: the rows to run next (see `VerifyRows`)."""
        return VerifyRows.schedule(caches, self.run[-1], draft, offset)

    def commit(
        self,
        rows: VerifyRows,
        logits: torch.Tensor,
        states: torch.Tensor | None,
        policy: TargetPolicy,
        emit: Emit,
    ) -> VerifyResult:
        """Accept, emit and commit from the verify rows' logits [1 + n, V] (states: [1 + n, d] their
        hidden states when `reads_hidden`), and learn from the outcome."""
        result = rows.commit(logits, policy, emit, states)
        if self.reads_hidden:  # the drafter's work per committed token is part of the round's cost
            kept = result.hidden if self.hidden_rows == "all" else result.hidden[-1:]
            self.observe(rows.offset, result.committed, kept)
        if result.stopped and len(result.tokens) == result.accepted:
            judged = result.accepted  # stopped on an accepted draft: the rest was never compared
        else:
            judged = min(result.accepted + 1, result.drafted)
        self.owner.controller.observe_round(
            self.depth, result.drafted, judged, result.accepted, self._draft_seconds
        )
        self.counts.add(result, judged)
        self.owner.totals.add(result, judged)
        return result

    def close(self) -> None:
        self.drafter.close()
