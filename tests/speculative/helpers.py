"""Shared pieces of the speculative tests: plain and speculative greedy loops without the engine,
and a drafter that knows the answer (and can be told to get parts of it wrong)."""

from __future__ import annotations

import random

from hybridlm.batch import Batch
from hybridlm.speculative import Draft, Drafter, Speculator, TargetPolicy, verify_and_commit
from hybridlm.speculative.controller import DepthController


def ids_for(n: int, seed: int, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, one forward per token."""
    caches = model.make_caches(1)
    logits = model(Batch.single(prompt, device=model.device), caches)
    out = []
    for i in range(n):
        out.append(int(logits.argmax()))
        logits = model(Batch.single([out[-1]], offset=len(prompt) + i, device=model.device), caches)
    return out


def speculative_greedy(model, prompt: list[int], n: int, drafter: Drafter, seed: int = 0) -> list[int]:
    """n greedy tokens by propose → verify rounds with a random draft length per round (1..6)."""
    rng = random.Random(seed)
    caches = model.make_caches(1)
    logits = model(Batch.single(prompt, device=model.device), caches)
    out, offset = [int(logits.argmax())], len(prompt)
    while len(out) < n:
        k = min(rng.randint(1, 6), n - len(out))
        draft = drafter.propose(prompt + out, k, TargetPolicy())
        result = verify_and_commit(model, caches, out[-1], draft, offset)
        assert result.committed[0] == out[-1] and result.offset == offset + len(result.committed)
        offset = result.offset
        out += result.tokens
    drafter.close()
    return out[:n]


class OracleDrafter(Drafter):
    """Proposes the known continuation `truth` of `prompt`, replacing each draft token with a wrong
    one with probability `wrong` (seeded), so verification sees arbitrary accept / reject patterns."""

    def __init__(
        self, prompt: list[int], truth: list[int], wrong: float = 0.0, seed: int = 0, vocab: int = 512
    ):
        self.prompt, self.truth, self.wrong, self.vocab = prompt, truth, wrong, vocab
        self.rng = random.Random(seed)

    def propose(self, tokens: list[int], k: int, policy: TargetPolicy) -> Draft:
        assert tokens[: len(self.prompt)] == self.prompt
        done = len(tokens) - len(self.prompt)
        assert tokens[len(self.prompt) :] == self.truth[:done], "drafters see only committed tokens"
        out = []
        for t in self.truth[done : done + k]:
            out.append(
                (t + self.rng.randrange(1, self.vocab)) % self.vocab if self.rng.random() < self.wrong else t
            )
        return Draft(out)

    def close(self) -> None:
        pass


class AlwaysDraft(DepthController):
    """Drafts `max_depth` tokens every round it may: these tests must see drafts whatever the
    timings (the adaptive controller backs off where drafting does not pay on a busy machine)."""

    def depth(self, state, limit: int) -> int:
        return min(self.max_depth, limit)


def speculator(make_drafter, depth: int = 6) -> Speculator:
    return Speculator(make_drafter, controller=AlwaysDraft(max_depth=depth))
