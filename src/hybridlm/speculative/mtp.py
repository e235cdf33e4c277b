"""The MTP drafter: a checkpoint's multi-token-prediction head (`models.mtp`) drafts from the target's
own hidden states.

Pairing: head position i reads the target's hidden state at position i and the embedding of token
i+1, and predicts token i+2; the head therefore lags the target by one token. Every committed
target forward is reported to `observe` (tokens and hidden states), which feeds the head every
position whose next token is known — all but the last reported one — so the head's work per
committed token is paid where the target's is, and a proposal does only its own steps. Drafting k
tokens after a run of n tokens (the target holds n-1 of them): feed position n-2 with the last
token of the run (its output gives d1), then k-1 steps on the head's own output hidden state and
the previous draft token.

Rollback: the head's KV cache rows up to position n-2 are fed with the target's hidden states and
stay; the rows of a proposal's own steps are never right for the committed run (even an accepted
draft is fed again, with the target's hidden state), so the next report rewinds them
(`commit_caches`, the draft model's rollback).

Context: the head's positions start at the first target hidden state it was given — position 0,
or after a prefix-cache hit the first recomputed position, for the target never recomputes a
restored prefix. The head then attends only from there on; its cache counts positions from that
start (rotary attention depends only on distances, so the shift changes nothing else). When the
prefix cache stored the target's hidden states of the restored prefix (`Session.hidden`), `resume`
rebuilds the head's context from them instead: positions [0, t-1) fed in a few batched head
forwards, h_{t-1} pending, exactly the state reports of those positions would have left.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridlm.batch import Batch
from hybridlm.models.base import CausalLM
from hybridlm.models.mtp import MTPHead, load_mtp_head
from hybridlm.speculative.base import Draft, HiddenStateDrafter, TargetPolicy, draw
from hybridlm.speculative.verify import commit_caches

# Head positions per forward when `resume` rebuilds a restored prefix's context (bounds its memory).
RESUME_CHUNK = 2048


class MTP:
    """A target's MTP head, shared by every request; calling it makes one request's drafter."""

    def __init__(self, target: CausalLM, head: MTPHead):
        self.target = target
        self.head = head

    @classmethod
    def load(cls, path: str | Path, target: CausalLM) -> MTP:
        """The MTP head of checkpoint directory `path`, which `target` was loaded from (raises
        `CheckpointError` when there is none)."""
        return cls(target, load_mtp_head(path, target))

    def __call__(self) -> MTPDrafter:
        return MTPDrafter(self.target, self.head)


class MTPDrafter(HiddenStateDrafter):
    """One request's MTP state: the head's KV cache over head positions [start, start + fed) (fed
    with the target's hidden states), plus those the last proposal drafted on top; and `pending`
    [1, d], the hidden state of the last reported position while it is not fed (its next token is
    not known yet)."""

    def __init__(self, target: CausalLM, head: MTPHead):
        self.target = target
        self.head = head
        self.cache = head.make_cache()
        self.start: int | None = None  # absolute position of the head's first position
        self.fed = 0
        self.pending: torch.Tensor | None = None

    @property
    def known(self) -> int | None:
        """End (absolute, exclusive) of the positions reported so far (None: none yet)."""
        if self.start is None:
            return None
        return self.start + self.fed + (0 if self.pending is None else 1)

    @torch.no_grad()
    def observe(self, offset: int, tokens: list[int], hidden: torch.Tensor) -> None:
        if offset != self.known:
            # First report, or one after positions never reported: the head's context starts here.
            self.cache.free()
            self.start, self.fed, self.pending = offset, 0, None
        commit_caches([self.cache], [[]], self.fed)  # drop the last proposal's own rows
        if self.pending is not None:
            hidden = torch.cat([self.pending, hidden])
        else:  # position `offset` is the first not fed: it pairs with the second of `tokens`
            tokens = tokens[1:]
        if tokens:
            self._step(tokens, hidden[:-1], self.start + self.fed)
            self.fed += len(tokens)
        self.pending = hidden[-1:]

    @torch.no_grad()
    def resume(self, tokens: list[int], hidden: torch.Tensor) -> None:
        """Take up the context of a restored prefix before the first report: tokens: the t tokens
        the target's caches were restored to; hidden: [t, d] the target's hidden states there."""
        if len(hidden) != len(tokens) or not tokens:
            raise ValueError(f"{len(hidden)} hidden states for a prefix of {len(tokens)} tokens")
        self.cache.free()
        self.start, self.fed, self.pending = 0, 0, None
        for at in range(0, len(tokens) - 1, RESUME_CHUNK):
            end = min(at + RESUME_CHUNK, len(tokens) - 1)
            self._step(tokens[at + 1 : end + 1], hidden[at:end], at)
            self.fed = end
        self.pending = hidden[-1:]

    @torch.no_grad()
    def propose(self, tokens: list[int], k: int, policy: TargetPolicy) -> Draft:
        """k tokens: greedy (no q) under a greedy policy, else drawn from the head's distribution under
        the policy's temperature and filters (q returned)."""
        end = len(tokens) - 1  # the target holds tokens[:end]; the last one is not in its caches yet
        if self.pending is None or self.known != end:
            raise RuntimeError(
                f"the MTP drafter was told of target positions up to {self.known}, but the run needs "
                f"{end} (is every committed target forward reported to observe?)"
            )
        out = self._step(tokens[end:], self.pending, end - 1)
        self.fed, self.pending = self.fed + 1, None  # that row is the target's: it stays
        drafts, rows = [], []
        for i in range(k):
            token, q = draw(self.target.head(out)[0], policy)
            drafts.append(token)
            rows.append(q)
            if i + 1 < k:
                out = self._step([token], out, end + i)
        return Draft(drafts, None if policy.greedy else torch.stack(rows))

    def _step(self, next_tokens: list[int], hidden: torch.Tensor, at: int) -> torch.Tensor:
        """Head positions at … at+L-1 (absolute) from the hidden states there [L, d] and the tokens
        after them; returns the head's hidden states [L, d]."""
        batch = Batch.single(next_tokens, offset=at - self.start, device=self.head.device)
        return self.head(self.target.embed(batch), hidden[None], batch, self.cache)[0]

    def close(self) -> None:
        self.cache.free()
        self.start, self.fed, self.pending = None, 0, None
