"""Sampling parameters, penalties and logprobs against direct computations."""

from __future__ import annotations

import math

import pytest
import torch

from hybridlm.engine import Engine, InvalidParameter, SamplingParams
from hybridlm.ops.sampling import apply_penalties, token_logprobs


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("seed", 2**64),
        ("seed", True),
        ("max_tokens", 0),
        ("stop", ["ok", ""]),
        ("stop", [3]),
        ("stop", 5),
        ("stop", {"a": 1}),
        ("stop_token_ids", 3),
        ("stop_token_ids", [-1]),
        ("logprobs", 21),
        ("logprobs", -1),
        ("ignore_eos", "yes"),
    ],
)
def test_invalid_values_name_the_parameter(field, value):
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and field in str(e.value)
    assert isinstance(e.value, ValueError)


def test_defaults_and_normalisation():
    p = SamplingParams(top_k=-1, stop="END", stop_token_ids=[3, 4])
    assert (p.top_k, p.stop, p.stop_token_ids) == (0, ("END",), (3, 4))
    assert not p.greedy and not p.penalised
    assert SamplingParams(temperature=0).greedy and SamplingParams(presence_penalty=0.5).penalised


def direct_penalties(logits, prompt, output, repetition, presence, frequency):
    """Per-entry Python reference of the penalties (vLLM / OpenAI conventions)."""
    out = logits.clone()
    for v in range(logits.shape[-1]):
        x = float(logits[0, v])
        if v in prompt or v in output:
            x = x / repetition if x > 0 else x * repetition
        count = output.count(v)
        x -= frequency * count + presence * (count > 0)
        out[0, v] = x
    return out


def test_apply_penalties_matches_direct_computation():
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn(1, vocab, generator=gen) * 3
    prompt, output = [1, 2, 3, 7], [3, 3, 9, 11, 9, 9]
    counts = torch.zeros(1, vocab)
    seen = torch.zeros(1, vocab, dtype=torch.bool)
    seen[0, prompt] = True
    for t in output:
        counts[0, t] += 1
        seen[0, t] = True
    got = apply_penalties(
        logits, counts, seen, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25
    )
    want = direct_penalties(logits, prompt, output, 1.3, 0.4, 0.25)
    torch.testing.assert_close(got, want)
    assert torch.equal(apply_penalties(logits, counts, seen), logits)  # all off: unchanged


def test_token_logprobs_matches_log_softmax():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([4, 17])
    chosen, top_ids, top_lp = token_logprobs(logits, tokens, 3)
    ref = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(chosen.double(), ref[[0, 1], tokens], atol=1e-6, rtol=0)
    assert top_ids.tolist() == ref.topk(3, -1).indices.tolist()
    torch.testing.assert_close(top_lp.double(), ref.topk(3, -1).values, atol=1e-6, rtol=0)


def test_engine_logprobs_and_penalised_greedy_match_a_direct_recompute(model32, chat_ids):
    """Each step's logprobs equal a from-scratch forward's log-softmax; penalised greedy picks the argmax of
    the directly penalised logits."""
    ids = chat_ids("Repeat after me: hello hello hello.")
    params = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        ignore_eos=True,
        logprobs=3,
        repetition_penalty=1.5,
        presence_penalty=0.5,
        frequency_penalty=0.3,
    )
    with Engine(model32.lm, model32.tokenizer) as engine:
        result = engine.generate(ids, params)
    assert len(result.logprobs) == len(result.token_ids) == 10
    for i, (token, lp) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        logits = model32.logits(ids + result.token_ids[:i])[-1:].double()
        ref = torch.log_softmax(logits, -1)[0]
        assert lp.token_id == token
        assert math.isclose(lp.logprob, float(ref[token]), abs_tol=1e-3)
        assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
        penalised = direct_penalties(logits.float(), ids, result.token_ids[:i], 1.5, 0.5, 0.3)
        assert token == int(penalised.argmax())


def test_frequency_penalty_reduces_repetition(engine, chat_ids):
    ids = chat_ids("Say something.")
    plain = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)).token_ids
    penalised = engine.generate(
        ids, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, frequency_penalty=2.0)
    ).token_ids
    assert len(set(penalised)) > len(set(plain))
