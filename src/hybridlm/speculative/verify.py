"""Verify a draft in one target forward and commit only what was accepted, on every cache kind.

The forward runs `[current, d1..dN]` at offset `p` with a restore point scheduled at `p+1 … p+N`
on every stateful cache (DESIGN.md §3.4) — alone (`verify_and_commit`) or as one segment of a
packed forward beside other sequences' rows (`VerifyRows`: schedule, run the rows, commit) — so
the state after any accepted prefix is at hand once acceptance is decided: KV and sliding caches
rewind their live buffer (`restore(None, t)`), scan caches (Gated DeltaNet, short conv) restore
the checkpoint captured inside the verify scan.

Acceptance is greedy (exact match with the target's argmax) or rejection sampling (accept `d` with
probability min(1, p(d)/q(d)); on rejection sample from normalise(max(p − q, 0)); after full
acceptance a bonus token from p), so the output distribution is the target's. Every emitted token
is handed to `emit` in order before the next position is looked at; when it answers "stop" (EOS, a
stop string, max_tokens) nothing after it is emitted and the stop token's state is not committed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridlm.batch import Batch
from hybridlm.cache.base import LayerCache, Snapshot
from hybridlm.ops.sampling import greedy
from hybridlm.speculative.base import Draft, TargetPolicy

Emit = Callable[[int, torch.Tensor], bool]
"""(token, raw float32 logits [V] of the position that produced it) -> True to stop after it."""


@dataclass(frozen=True)
class VerifyResult:
    """What one verify pass produced.

    tokens: emitted in order: the accepted drafts, then the target's own token (a correction after a
        rejection, or the bonus token after full acceptance) unless a stop came first.
    committed: the tokens that entered the caches (`current` and the accepted drafts before any stop).
    offset: the caches' offset after commit (= old offset + len(committed)).
    drafted / accepted: draft tokens verified / accepted (an accepted stop token counts).
    stopped: `emit` asked to stop at the last emitted token.
    hidden: [len(committed), d] the target's final-normed hidden states at the committed positions
        (when asked for; None otherwise).
    """

    tokens: list[int]
    committed: list[int]
    offset: int
    drafted: int
    accepted: int
    stopped: bool
    hidden: torch.Tensor | None = None

    @property
    def pending(self) -> int | None:
        """The emitted token not yet in the caches (fed by the next step); None after a stop."""
        return None if self.stopped else self.tokens[-1]


def verify_and_commit(
    model,
    caches: Sequence[LayerCache | None],
    current: int,
    draft: Draft,
    offset: int,
    policy: TargetPolicy | None = None,
    emit: Emit | None = None,
    hidden: bool = False,
) -> VerifyResult:
    """Verify `draft` after `current` (emitted, not yet in the caches, which hold `offset` tokens)
    with one forward of `model` (B = 1), accept a prefix, emit tokens, commit. `hidden`: also return
    the hidden states of the committed positions (for a `HiddenStateDrafter`).

    Captures already pending on the caches (e.g. the prefix cache's prompt restore points, taken
    when its session closes) are left pending; no capture may be scheduled on entry. An engine
    packing many sequences into one forward runs the two halves itself (`VerifyRows`).
    """
    rows = VerifyRows.schedule(caches, current, draft, offset)
    try:
        batch = Batch.single(rows.ids, offset=offset, device=model.device)
        if hidden:
            logits, states = model(batch, list(caches), logits="all", hidden="all")
            logits, states = logits[0], states[0]
        else:
            logits, states = model(batch, list(caches), logits="all")[0], None
    except BaseException:
        rows.abort()
        raise
    return rows.commit(logits, policy or TargetPolicy(), emit, states)


@dataclass
class VerifyRows:
    """A verify pass between its two halves: the rows to run (`ids` at `offset`: the current token
    and the drafts), then `commit` given the forward's logits over them.

    `schedule` sets the captures somebody else scheduled earlier aside and schedules a restore
    point after each row but the last on every stateful cache; whoever runs the rows (alone, or as
    one segment of a packed forward) then calls exactly one of `commit` (the forward ran) or
    `abort` (it failed), which hand the set-aside captures back for their owner to take.
    """

    stateful: list[LayerCache]
    ids: list[int]
    offset: int
    draft: Draft
    held: list[list[Snapshot]]

    @classmethod
    def schedule(
        cls, caches: Sequence[LayerCache | None], current: int, draft: Draft, offset: int
    ) -> VerifyRows:
        stateful = [c for c in caches if c is not None]
        ids = [current, *draft.tokens]
        rows = cls(stateful, ids, offset, draft, [c.take_snapshots() for c in stateful])
        try:
            for c in stateful:
                c.prepare_snapshots(list(range(offset + 1, offset + len(ids))))
        except BaseException:
            rows.abort()
            raise
        return rows

    def _take(self) -> list[list[Snapshot]]:
        """This pass's captures per stateful cache (the others handed back)."""
        captures = [c.take_snapshots() for c in self.stateful]
        for c, snaps in zip(self.stateful, self.held, strict=True):
            c.give_back(snaps)
        return captures

    def abort(self) -> None:
        """The forward failed: free its partial captures (the caches may stand anywhere)."""
        for snaps in self._take():
            for snap in snaps:
                snap.free()

    def commit(
        self,
        logits: torch.Tensor,
        policy: TargetPolicy,
        emit: Emit | None = None,
        states: torch.Tensor | None = None,
    ) -> VerifyResult:
        """Accept a prefix of the draft from the forward's logits [len(ids), V] float32, emit, and
        bring every cache to the accepted offset. states: [len(ids), d] the forward's hidden states
        (returned for the committed positions), or None."""
        captures = self._take()
        try:
            tokens, accepted, keep, stopped = _accept(logits, self.draft, policy, emit)
            commit_caches(self.stateful, captures, self.offset + keep)
        finally:
            for snaps in captures:
                for snap in snaps:
                    snap.free()
        kept = states[:keep] if states is not None else None
        end = self.offset + keep
        return VerifyResult(tokens, self.ids[:keep], end, len(self.draft), accepted, stopped, kept)


def commit_caches(
    stateful: Sequence[LayerCache], captures: Sequence[Sequence[Snapshot]], target: int
) -> None:
    """Bring every cache to `target`: live rewind where the cache allows it (KV, sliding), else the
    capture that ends at `target` (scan caches). Captures are not freed here."""
    for cache, snaps in zip(stateful, captures, strict=True):
        if cache.offset == target:
            continue
        if cache.can_rewind(target):
            ok = cache.restore(None, target)
        else:
            snap = next((s for s in snaps if s.end == target), None)
            ok = snap is not None and cache.restore(snap, target)
        if not ok:
            raise RuntimeError(f"{type(cache).__name__} cannot commit to offset {target}")


def _accept(
    logits: torch.Tensor, draft: Draft, policy: TargetPolicy, emit: Emit | None
) -> tuple[list[int], int, int, bool]:
    """Walk the verify logits [N+1, V] position by position; returns (emitted tokens, accepted
    drafts, tokens to keep in the caches, stopped)."""
    # Without an adjustment every greedy choice is known up front: one argmax for all positions.
    argmax = greedy(logits).tolist() if policy.greedy and policy.adjust is None else None
    stop_after = emit if emit is not None else lambda token, row: False
    tokens: list[int] = []
    for i, d in enumerate(draft.tokens):
        token, ok = _choose(logits[i], d, _draft_row(draft, i, logits.shape[-1]), policy, argmax, i)
        tokens.append(token)
        stop = stop_after(token, logits[i])
        if stop or not ok:
            # The stop token, or the target's correction, is emitted but does not enter the caches.
            return tokens, i + ok, i + 1, stop
    n = len(draft)
    bonus, _ = _choose(logits[n], None, None, policy, argmax, n)
    tokens.append(bonus)
    return tokens, n, n + 1, stop_after(bonus, logits[n])


def _choose(
    raw: torch.Tensor,
    d: int | None,
    q: torch.Tensor | None,
    policy: TargetPolicy,
    argmax: list[int] | None,
    i: int,
) -> tuple[int, bool]:
    """The target's token at position i given draft `d` (None: the bonus position) drawn from `q`
    (None: one-hot): (token, whether it is the accepted draft)."""
    if policy.greedy:
        token = argmax[i] if argmax is not None else int(greedy(policy.logits(raw)))
        return token, token == d
    p = policy.probs(policy.logits(raw))
    if d is None:
        return _sample(p, policy.generator), False
    if _accepts(p, q, d, policy.generator):
        return d, True
    return _sample(_residual(p, q, d), policy.generator), False


def _draft_row(draft: Draft, i: int, vocab: int) -> torch.Tensor | None:
    """q for position i over the target's vocabulary [V] (None: one-hot at the draft token)."""
    if draft.probs is None or i >= len(draft):
        return None
    q = draft.probs[i].float()
    if q.shape[0] >= vocab:
        return q[:vocab]  # ids the target lacks have p = 0: only the residual would see them
    return torch.nn.functional.pad(q, (0, vocab - q.shape[0]))


def _accepts(p: torch.Tensor, q: torch.Tensor | None, d: int, generator) -> bool:
    """Accept draft `d` with probability min(1, p(d) / q(d))."""
    p_d = float(p[d]) if d < p.shape[0] else 0.0
    q_d = 1.0 if q is None else float(q[d])
    u = float(torch.rand((), generator=generator, device=p.device))
    return u * q_d < p_d


def _residual(p: torch.Tensor, q: torch.Tensor | None, d: int) -> torch.Tensor:
    """max(p − q, 0) (unnormalised); for a one-hot q that is p without `d`."""
    if q is None:
        r = p.clone()
        if d < r.shape[0]:
            r[d] = 0.0
    else:
        r = (p - q).clamp_min(0.0)
    # p == q to rounding leaves nothing: then rejection had (numerically) zero probability anyway.
    return r if float(r.sum()) > 0.0 else p


def _sample(weights: torch.Tensor, generator) -> int:
    """One id drawn from unnormalised non-negative `weights` [V]."""
    return int(torch.multinomial(weights, 1, generator=generator))
