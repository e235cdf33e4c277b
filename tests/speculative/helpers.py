"""Shared pieces of the speculative tests: plain and speculative greedy loops without the engine,
and a drafter that knows the answer (and can be told to get parts of it wrong)."""

from __future__ import annotations

import random

from hybridlm.batch import Batch
from hybridlm.engine import Engine, SamplingParams
from hybridlm.prefix.cache import PrefixCache
from hybridlm.speculative import Draft, Drafter, Speculator, TargetPolicy, verify_and_commit
from hybridlm.speculative.base import TargetCacheDrafter
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

    def depth(self, state, limit: int, share=None) -> int:
        return min(self.max_depth, limit)


def speculator(make_drafter, depth: int = 6) -> Speculator:
    return Speculator(make_drafter, controller=AlwaysDraft(max_depth=depth))


def generate(model, tokenizer, ids, params, **engine_kw):
    """One request through an engine of its own."""
    with Engine(model, tokenizer, **engine_kw) as engine:
        return engine.generate(ids, params)


def same_output(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert (a.text, a.finish_reason, a.stop_reason) == (b.text, b.finish_reason, b.stop_reason)


def hidden_prefill(model, prompt: list[int], drafter, start: int = 0, chunk: int = 16):
    """Target caches over `prompt` (attached first to a drafter that reads them), fed in chunks,
    each chunk's hidden states (the rows `drafter.hidden_rows` asks for) reported from `start` on:
    positions before it stand for a restored prefix and are never reported. Returns (caches,
    logits of the last prompt token)."""
    caches = model.make_caches(1)
    if isinstance(drafter, TargetCacheDrafter):
        drafter.attach(caches)
    if start:
        model(Batch.single(prompt[:start]), caches)
    for pos in range(start, len(prompt), chunk):
        piece = prompt[pos : pos + chunk]
        logits, hidden = model(Batch.single(piece, offset=pos), caches, hidden=drafter.hidden_rows)
        drafter.observe(pos, piece, hidden[0])
    return caches, logits


def hidden_greedy(model, prompt: list[int], n: int, drafter, seed: int = 0, start: int = 0):
    """n greedy tokens by rounds of propose → verify (1..6 drafts, never past n tokens) or plain steps
    (one in four), every committed target forward reported to the drafter, as the engine does.
    Returns (tokens, target caches)."""
    rng = random.Random(seed)
    caches, logits = hidden_prefill(model, prompt, drafter, start)
    out, offset = [int(logits.argmax())], len(prompt)
    while len(out) < n:
        k = min(rng.randint(1, 6), n - len(out) - 1)
        if k < 1 or rng.random() < 0.25:
            logits, hidden = model(Batch.single([out[-1]], offset=offset), caches, hidden=drafter.hidden_rows)
            drafter.observe(offset, out[-1:], hidden[0])
            out.append(int(logits.argmax()))
            offset += 1
            continue
        draft = drafter.propose(prompt + out, k, TargetPolicy())
        result = verify_and_commit(model, caches, out[-1], draft, offset, hidden=True)
        assert result.hidden.shape[0] == len(result.committed)
        reported = result.hidden if drafter.hidden_rows == "all" else result.hidden[-1:]
        drafter.observe(offset, result.committed, reported)
        offset = result.offset
        out += result.tokens
    return out, caches


def prefix_hit_scenario(model, record):
    """Three greedy requests through an engine with a prefix cache and speculation: a first prompt,
    one extending it with its own output (and more), one diverging inside it. `record(prompt,
    truth, i)` makes request i's drafter, told its prompt and plain greedy output. Returns
    (prompts, truths, results, drafters)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=30)
    prompt = ids_for(37, seed=5)
    first = generate(model, None, prompt, greedy).token_ids
    prompts = [prompt, prompt + first + ids_for(9, seed=6), prompt[:30] + ids_for(12, seed=7)]
    truths = [generate(model, None, ids, greedy).token_ids for ids in prompts]
    drafters = []

    def make():
        i = len(drafters)
        drafters.append(record(prompts[i], truths[i], i))
        return drafters[-1]

    with Engine(model, None, prefix=PrefixCache(model), speculative=speculator(make)) as engine:
        results = [engine.generate(ids, greedy) for ids in prompts]
    return prompts, truths, results, drafters
