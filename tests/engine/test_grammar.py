"""Grammar-constrained decoding in the engine: the output matches the grammar on the greedy and the
sampled path and on prefix-cache hits; with speculative decoding a draft the grammar forbids is
rejected and the greedy output equals the non-speculative constrained output token for token;
logprobs stay the model's own; a bad grammar is an InvalidParameter naming its field."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from hybridlm.engine import Engine, InvalidParameter, SamplingParams
from hybridlm.engine.grammar import Grammar, GrammarCompiler
from hybridlm.prefix.cache import PrefixCache
from hybridlm.speculative import Draft, Drafter, NgramDrafter, TargetPolicy
from tests.speculative.helpers import OracleDrafter, generate, same_output, speculator

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
GRAMMAR = Grammar.json_schema(SCHEMA, "response_format")


class Replay(Drafter):
    """Drafts whatever `tokens` hold at the request's position, right or wrong."""

    def __init__(self, prompt: list[int], tokens: list[int]):
        self.prompt, self.tokens = prompt, tokens

    def propose(self, tokens: list[int], k: int, policy: TargetPolicy) -> Draft:
        done = len(tokens) - len(self.prompt)
        return Draft(self.tokens[done : done + k])

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def prompt(model32):
    tok = model32.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}]))


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=120, grammar=GRAMMAR, **kw)


def valid(result) -> dict:
    assert result.finish_reason == "stop", result
    value = json.loads(result.text)
    jsonschema.validate(value, SCHEMA)
    return value


def test_greedy_and_sampled_outputs_match_the_schema(model32, prompt):
    free = generate(model32.lm, model32.tokenizer, prompt, SamplingParams(temperature=0.0, max_tokens=30))
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.text)  # a random-weight model writes no JSON by itself
    valid(generate(model32.lm, model32.tokenizer, prompt, greedy()))
    with Engine(model32.lm, model32.tokenizer) as engine:
        for seed in range(4):
            params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=120, grammar=GRAMMAR)
            valid(engine.generate(prompt, params))


def test_logprobs_stay_the_models_own(model32, prompt):
    constrained = generate(model32.lm, model32.tokenizer, prompt, greedy(logprobs=2))
    first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2)
    free = generate(model32.lm, model32.tokenizer, prompt, first)
    # The first position's distribution is the same; only the choice was constrained.
    assert constrained.logprobs[0].top == free.logprobs[0].top
    assert constrained.logprobs[0].token_id != free.logprobs[0].token_id


@pytest.mark.parametrize("drafter", ["forbidden", "wrong", "ngram"])
def test_speculative_greedy_equals_plain_constrained_greedy(model32, prompt, drafter):
    tok = model32.tokenizer
    plain = generate(model32.lm, tok, prompt, greedy())
    valid(plain)
    if drafter == "forbidden":  # drafts the unconstrained continuation: the grammar forbids it
        unconstrained = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        free = generate(model32.lm, tok, prompt, unconstrained)
        make = lambda: Replay(prompt, free.token_ids)
    elif drafter == "wrong":  # the right answer with a third of the drafts replaced
        make = lambda: OracleDrafter(prompt, plain.token_ids, wrong=0.3, seed=1, vocab=model32.lm.vocab_size)
    else:
        make = NgramDrafter
    got = generate(model32.lm, tok, prompt, greedy(), speculative=speculator(make, depth=4))
    same_output(got, plain)
    spec = got.usage.speculative
    assert spec.verify_passes > 0
    if drafter != "ngram":
        assert spec.drafted_tokens > spec.accepted_tokens


def test_constraint_holds_on_prefix_cache_hits(model32, prompt):
    tok = model32.tokenizer
    expected = generate(model32.lm, tok, prompt, greedy())
    with Engine(model32.lm, tok, prefix=PrefixCache(model32.lm)) as engine:
        free = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20))
        hit = engine.generate(prompt, greedy())
        again = engine.generate(prompt + free.token_ids[:5], greedy())
    assert hit.usage.cached_tokens == len(prompt) - 1
    same_output(hit, expected)
    assert again.usage.cached_tokens > 0
    valid(again)


def test_bad_grammars_are_invalid_parameters_naming_the_field(model32, prompt):
    with Engine(model32.lm, model32.tokenizer) as engine:
        for grammar in (
            Grammar.json_schema({"type": "objekt"}, "response_format"),
            Grammar("lark", "start: missing_rule", "tools"),
        ):
            with pytest.raises(InvalidParameter) as e:
                engine.submit(prompt, SamplingParams(grammar=grammar), lambda event: None)
            assert e.value.param == grammar.param and str(e.value).startswith(grammar.param)
        with pytest.raises(InvalidParameter) as e:
            engine.submit(prompt, SamplingParams(grammar=GRAMMAR, ignore_eos=True), lambda event: None)
        assert e.value.param == "ignore_eos"
        # The engine is unharmed.
        valid(engine.generate(prompt, greedy()))


def test_mask_forbids_exactly_what_the_matcher_rejects(model32):
    grammars = GrammarCompiler(model32.tokenizer, model32.lm.vocab_size)
    matcher = grammars.matcher(Grammar("lark", 'start: "ab" | "ac"'))
    allowed = matcher.allowed()
    assert allowed.shape == (model32.lm.vocab_size,) and allowed.dtype == torch.bool
    masked = matcher.mask(torch.zeros(1, model32.lm.vocab_size))
    assert torch.equal(torch.isfinite(masked[0]), allowed)
    for token in allowed.nonzero().flatten().tolist():
        assert model32.tokenizer.decode([token]) in ("a", "ab", "ac")
