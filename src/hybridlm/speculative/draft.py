"""A draft model: any supported checkpoint sharing the target's tokenizer proposes tokens with its
own caches, kept level with the target's committed tokens.

Per proposal the drafter first rolls its caches back to the longest prefix of the run it holds
(the target accepted some of the previous drafts and rejected the rest), then feeds the tokens it
lacks in one forward and drafts k tokens one at a time, with a restore point scheduled after each
fed draft token — the same capture mechanism as the target's verify pass, so the rollback works
on every cache kind (KV rewinds, recurrent / conv layers restore a captured checkpoint).

With a prefix cache that has a draft companion, `resume(session)` hands the drafter the request's
draft session: its caches, restored to a stored prefix of the prompt, replace the drafter's own, so
the first proposal feeds only the rest. The captures that session scheduled inside the prompt are
set aside around the drafter's own restore points and left in the caches for `session.close()`;
`close()` brings the caches back to the last committed run and records it in the session.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridlm.batch import Batch
from hybridlm.cache.base import LayerCache, Snapshot
from hybridlm.models.base import CausalLM
from hybridlm.ops.quant import QUANTIZATIONS
from hybridlm.prefix.session import Session, common_prefix
from hybridlm.speculative.base import Draft, Drafter, TargetPolicy, draw
from hybridlm.speculative.verify import commit_caches

if TYPE_CHECKING:
    from hybridlm.speculative.assistant import Assistant


def load_draft(
    path: str | Path, target: CausalLM, dtype: torch.dtype | None = None, quantize: str | None = None
) -> DraftModel | Assistant:
    """The drafter factory for draft checkpoint directory `path`: an
    `Assistant` when it holds a Gemma 4 assistant (it drafts from `target`'s caches and hidden states,
    in the target's dtype; ValueError unless `target` is a Gemma 4 it fits), else a `DraftModel` in
    `dtype` on the target's device. `quantize` ("int8" / "int4"): weight-only quantized linear layers."""
    from hybridlm.speculative.assistant import Assistant, is_assistant  # it imports this module

    if is_assistant(path):
        return Assistant.load(path, target, quantize)
    return DraftModel.load(path, dtype=dtype, device=target.device, quantize=quantize)


class DraftModel:
    """A loaded draft model shared by every request; calling it makes one request's drafter.

    prefill_chunk: most tokens per catch-up forward (a first proposal feeds the whole prompt).
    """

    def __init__(self, model: CausalLM, prefill_chunk: int = 512):
        self.model = model
        self.prefill_chunk = prefill_chunk

    @classmethod
    def load(
        cls, path: str | Path, dtype: torch.dtype | None = None, device=None, quantize: str | None = None
    ) -> DraftModel:
        """Load a checkpoint directory; `quantize` ("int8" / "int4") makes every linear layer
        weight-only quantized (`models.quantized`): a bf16 draft step reads half (a quarter) the bytes."""
        from hybridlm.models import load_model

        if quantize not in (None, *QUANTIZATIONS):
            raise ValueError(f"unknown draft quantization {quantize!r}; known: {', '.join(QUANTIZATIONS)}")
        return cls(load_model(path, dtype=dtype, device=device, quantize=quantize))

    def __call__(self) -> DraftModelDrafter:
        return DraftModelDrafter(self.model, self.prefill_chunk)


class DraftModelDrafter(Drafter):
    """One request's draft-model state: caches holding `fed` (a prefix of the run plus the drafts
    of the last proposal but the final one) and the restore points of that proposal."""

    def __init__(self, model: CausalLM, prefill_chunk: int = 512):
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.caches: list[LayerCache | None] = model.make_caches(1)
        self.fed: list[int] = []
        self._captures: list[list[Snapshot]] = []
        self._session: Session | None = None
        self._committed = 0  # length of the run shown to the last proposal (committed by the target)

    def resume(self, session: Session) -> None:
        """Draft from `session`'s caches (a prefix-cache draft session over this drafter's model,
        restored to `session.offset` tokens of the prompt) instead of fresh ones; call before the
        first proposal. A session over another model is ignored."""
        if session.owner.model is not self.model:
            return
        for c in self._stateful:
            c.free()
        self.caches, self.fed, self._session = session.caches, list(session.fed), session
        self._committed = len(session.fed)

    @property
    def _stateful(self) -> list[LayerCache]:
        return [c for c in self.caches if c is not None]

    def propose(self, tokens: list[int], k: int, policy: TargetPolicy) -> Draft:
        """k tokens drawn greedily (greedy policy: deterministic, no q) or from the draft's own
        distribution under the policy's temperature and filters (q returned)."""
        keep = self._rollback(tokens)
        end = len(tokens)
        stateful = self._stateful
        # The prompt a draft session scheduled captures in goes in first, under that schedule; its
        # captures are then set aside so that the drafter's restore points neither replace that
        # schedule nor mix with its captures (the prompt ends before `end`: one token was emitted).
        prompt_end = min(max(keep, len(self._session.prompt) if self._session is not None else 0), end - 1)
        for pos in range(keep, prompt_end, self.prefill_chunk):
            piece = tokens[pos : min(pos + self.prefill_chunk, prompt_end)]
            self.model(Batch.single(piece, offset=pos, device=self.model.device), self.caches)
        held = [c.take_snapshots() for c in stateful]
        logits = None
        for pos in range(prompt_end, end, self.prefill_chunk):
            piece = tokens[pos : pos + self.prefill_chunk]
            if pos + len(piece) == end:
                # Restore points after `end` and each fed draft but the last (the live state): only the
                # last chunk is scheduled, so a sliding cache keeps no more rows than it needs.
                for c in stateful:
                    c.prepare_snapshots(list(range(end, end + k - 1)))
            logits = self.model(Batch.single(piece, offset=pos, device=self.model.device), self.caches)
        self.fed = list(tokens)
        self._committed = end
        drafts, rows = [], []
        for i in range(k):
            token, q = draw(logits[0], policy)
            drafts.append(token)
            rows.append(q)
            if i + 1 < k:
                batch = Batch.single([token], offset=end + i, device=self.model.device)
                logits = self.model(batch, self.caches)
                self.fed.append(token)
        self._captures = [c.take_snapshots() for c in stateful]
        for c, snaps in zip(stateful, held, strict=True):
            c.give_back(snaps)  # for the prefix session's close (none without one)
        return Draft(drafts, None if policy.greedy else torch.stack(rows))

    def _rollback(self, tokens: list[int]) -> int:
        """Bring the caches to the longest prefix of `tokens[:-1]` they can reach (the last token
        is always fed: its logits start the draft); returns that offset."""
        keep = common_prefix(self.fed, tokens[: len(tokens) - 1])
        if not self._restore(keep):  # diverged before the last proposal's restore points: start over
            if self._session is not None:
                self._drop_session()
            for c in self._stateful:
                c.free()
            keep = 0
        self.fed = self.fed[:keep]
        return keep

    def _restore(self, keep: int) -> bool:
        """Bring the caches to `keep` tokens of `fed` with a live rewind or the last proposal's restore
        points (freed either way); False, the caches unchanged, where some cache cannot reach it."""
        stateful = self._stateful
        captures = self._captures or [[] for _ in stateful]
        reachable = all(
            c.offset == keep or c.can_rewind(keep) or any(s.end == keep for s in snaps)
            for c, snaps in zip(stateful, captures, strict=True)
        )
        if reachable:
            commit_caches(stateful, captures, keep)
        self._free_captures()
        return reachable

    def _free_captures(self) -> None:
        for snaps in self._captures:
            for snap in snaps:
                snap.free()
        self._captures = []

    def close(self) -> None:
        """Free the restore points and the caches; caches of a prefix session are instead brought
        back to the run the last proposal was shown (committed) and left to that session."""
        session, self._session = self._session, None
        if session is None or session.closed:
            self._free_captures()
            if session is None:
                for c in self._stateful:
                    c.free()
        elif self._restore(self._committed):
            session.advance(self.fed[len(session.fed) : self._committed])
        else:  # a failed draft forward left the caches where nothing brings them back
            session.abandon()
        self.fed = []

    def _drop_session(self) -> None:
        """Give up the draft session (its work is dropped, the trie keeps what it stored before) and
        go on with fresh caches of the drafter's own."""
        self._session.abandon()
        self._session, self.caches = None, self.model.make_caches(1)
