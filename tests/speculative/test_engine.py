"""Speculative decoding inside the engine and the server: stop rules see every emitted token in
order (stop strings, stop ids / EOS and max_tokens inside a draft), the prefix cache stores only
committed tokens, penalties and logprobs, per-request opt-out, `usage.speculative`, `/metrics`."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

import hybridlm
from hybridlm.demo import write_demo_model
from hybridlm.engine import Engine, SamplingParams
from hybridlm.prefix.cache import PrefixCache
from hybridlm.server.app import create_app
from hybridlm.speculative import DraftModel, NgramDrafter, Speculator
from tests.speculative.helpers import OracleDrafter, generate, ids_for, same_output, speculator
from tests.speculative.test_verify import FAMILIES


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo model (hybrid, real tokenizer) in float32, so argmax comparisons hold."""
    return hybridlm.load_model(write_demo_model(tmp_path_factory.mktemp("demo")), dtype=torch.float32)


@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_stop_rules_inside_drafts_match_plain_decoding(demo, drafter):
    tok = demo.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Count: one two three one two"}]))
    base = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = generate(demo.lm, tok, ids, base)
    truth = plain.token_ids
    make = NgramDrafter if drafter == "ngram" else lambda: OracleDrafter(ids, truth, vocab=demo.lm.vocab_size)
    middle = len(plain.text) // 2
    stops = [
        base,
        SamplingParams(temperature=0.0, max_tokens=29, ignore_eos=True),
        SamplingParams(
            temperature=0.0, max_tokens=48, ignore_eos=True, stop=[plain.text[middle : middle + 3]]
        ),
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, stop_token_ids=[truth[30]]),
    ]
    for params in stops:
        expected = generate(demo.lm, tok, ids, params)
        got = generate(demo.lm, tok, ids, params, speculative=make)
        same_output(got, expected)
        spec = got.usage.speculative
        assert spec.verify_passes > 0 and 0 <= spec.accepted_tokens <= spec.drafted_tokens
        assert got.usage.completion_tokens == len(got.token_ids)
    if drafter == "oracle":  # every draft right: a stop landed inside accepted drafts
        assert spec.accepted_tokens >= 0.5 * len(got.token_ids)


@pytest.mark.parametrize("name", FAMILIES)
def test_prefix_cache_holds_only_committed_tokens(models, name):
    """A stop id accepted inside a draft ends the request; the trie then holds the prompt and the
    committed output, so follow-up prompts that extend it (or diverge inside it) are served from
    the cache and still decode exactly as without any cache."""
    model = models(name)
    prompt = ids_for(37, seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    truth = generate(model, None, prompt, greedy).token_ids
    spec = speculator(DraftModel(models(name, int8=True)))
    at = next(i for i in range(12, 40) if truth[i] not in truth[:i])  # a stop id first seen late
    stop = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[truth[at]])
    follow_ups = [prompt + truth[:at] + ids_for(9, seed=6), prompt[:30] + ids_for(12, seed=7)]
    with Engine(model, None, prefix=PrefixCache(model), speculative=spec) as engine:
        first = engine.generate(prompt, stop)
        assert first.token_ids == truth[: at + 1]
        assert first.usage.speculative.accepted_tokens > 0
        results = [engine.generate(ids, greedy) for ids in follow_ups]
    assert results[0].usage.cached_tokens >= len(prompt) + len(first.token_ids) - 1
    assert results[1].usage.cached_tokens >= 30
    for ids, got in zip(follow_ups, results, strict=True):
        same_output(got, generate(model, None, ids, greedy))


def test_penalties_and_logprobs_match_plain_decoding(demo):
    tok = demo.tokenizer
    ids = tok.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):")
    params = SamplingParams(
        temperature=0.0,
        max_tokens=32,
        ignore_eos=True,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        logprobs=3,
    )
    expected = generate(demo.lm, tok, ids, params)
    got = generate(demo.lm, tok, ids, params, speculative=NgramDrafter)
    same_output(got, expected)
    for a, b in zip(got.logprobs, expected.logprobs, strict=True):
        assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_seeded_sampling_is_reproducible(demo):
    tok = demo.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a story."}]))
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=40, ignore_eos=True)
    speculator = Speculator(DraftModel(demo.lm))
    with Engine(demo.lm, tok, speculative=speculator) as engine:
        a, b = engine.generate(ids, params), engine.generate(ids, params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 40
    assert a.usage.speculative.verify_passes > 0


def test_server_reports_usage_metrics_and_honours_opt_out(demo):
    tok = demo.tokenizer
    prompt = tok.encode("one two three one two three one two three one two three")
    with Engine(demo.lm, tok, speculative=speculator(NgramDrafter)) as engine:
        client = TestClient(create_app(engine, "demo"))
        body = {"model": "demo", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        usage = client.post("/v1/completions", json=body).json()["usage"]
        spec = usage["speculative"]
        assert spec["verify_passes"] > 0 and 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
        opted_out = client.post("/v1/completions", json={**body, "speculative": False}).json()["usage"]
        assert "speculative" not in opted_out and opted_out["completion_tokens"] == 24
        metrics = client.get("/metrics").text
    lines = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
    assert int(float(lines["hybridlm_speculative_verify_passes_total"])) == spec["verify_passes"]
    assert int(float(lines["hybridlm_speculative_drafted_tokens_total"])) == spec["drafted_tokens"]
    assert int(float(lines["hybridlm_speculative_accepted_tokens_total"])) == spec["accepted_tokens"]
    assert 0.0 <= float(lines["hybridlm_speculative_acceptance_rate"]) <= 1.0


def test_cli_builds_the_speculator(demo):
    from hybridlm.settings import Settings, make_speculator

    parse = lambda *flags: Settings.parse(flags)
    assert make_speculator(demo, parse()) is None
    ngram = make_speculator(demo, parse("--speculative", "ngram", "--num-draft", "5"))
    assert ngram.controller.max_depth == 5 and isinstance(ngram.make_drafter(), NgramDrafter)
    with pytest.raises(SystemExit, match="--draft-model"):
        make_speculator(demo, parse("--speculative", "draft"))
    for bad in ("0", "17"):  # beyond 16 drafts a verify pass leaves the per-token kernels
        with pytest.raises(SystemExit, match=r"--num-draft must be in \[1, 16\]"):
            make_speculator(demo, parse("--speculative", "ngram", "--num-draft", bad))
    flags = ("--speculative", "draft", "--draft-model", str(demo.path), "--draft-quantize", "int8")
    draft = make_speculator(demo, parse(*flags))
    assert draft.make_drafter().model.lm_head.qweight.dtype == torch.int8
