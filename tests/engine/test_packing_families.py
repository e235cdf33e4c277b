"""Every family through the engine: concurrent requests decode in packed steps and each output equals
its solo run (bf16), greedy, seeded and speculative alike."""

from __future__ import annotations

import random

import pytest

import hybridlm.engine.step as engine_module
from hybridlm.engine import Engine, SamplingParams
from hybridlm.models import load_model
from hybridlm.speculative import NgramDrafter, Speculator
from tests.engine.test_batching import run_together
from tests.engine.test_batching_machine import run_machine

FAMILIES = [
    "qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "lfm2", "lfm2_moe", "gemma3_text", "gemma4_text",
    "gemma4_moe", "dense_qwen3", "kimi_linear", "bailing_hybrid", "bamba", "nemotron_h", "falcon_h1",
]


def jobs() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(3)
    # Few distinct ids in the speculative prompt: its n-gram drafts get accepted.
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (5, 19, 11)] + [[7, 8, 9] * 6]
    return [
        (prompts[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, speculative=False)),
        (prompts[1], SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True,
                                    speculative=False)),
        (prompts[2], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, speculative=False)),
        (prompts[3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    ]


@pytest.mark.parametrize("name", FAMILIES)
def test_concurrent_requests_of_every_family_equal_their_solo_runs(checkpoints, name, monkeypatch):
    lm = load_model(checkpoints(name).path, device="cpu")
    assert lm.packs

    def engine(max_running: int) -> Engine:
        drafts = Speculator(NgramDrafter, max_depth=4)
        return Engine(lm, None, prefill_chunk=8, max_running=max_running, speculative=drafts)

    with engine(1) as solo_engine:
        solo = [solo_engine.generate(ids, params).token_ids for ids, params in jobs()]
    packed_rows: list[int] = []
    real = engine_module.forward_packed

    def spy(model, segments, *rest):
        packed_rows.append(len(segments))
        return real(model, segments, *rest)

    monkeypatch.setattr(engine_module, "forward_packed", spy)
    with engine(4) as together:
        results = run_together(together, jobs())
    assert [r.token_ids for r in results] == solo
    assert packed_rows and max(packed_rows) > 1  # decode rows of several sequences did share forwards


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2", "gemma3_text", "gemma4_text"])
def test_random_arrivals_and_cancellations_leave_every_family_exact(checkpoints, name, monkeypatch):
    """The stateful batching property (random arrivals, cancellations, speculative / plain requests;
    each output equals its solo run in bf16) on the families beside the demo model's; verify rows
    (multi-row segments) share packed forwards."""
    seen = run_machine(monkeypatch, load_model(checkpoints(name).path, device="cpu"), False)
    assert seen["running"] > 1 and seen["cancelled"] and seen["verify_segments"] >= 1, seen


@pytest.mark.parametrize("name", FAMILIES)
def test_choices_of_every_family_share_the_prompts_rows_and_equal_their_seeded_requests(checkpoints, name):
    """n = 3 after a 100-token prompt: the choices read the prompt's KV rows from one shared buffer
    (copy-on-write; sliding, KV-shared and soft-capped layers too) and each equals the request with
    n = 1 and seed + i alone, bit for bit in bf16."""
    lm = load_model(checkpoints(name).path, device="cpu")
    ids = [random.Random(4).randrange(1, 500) for _ in range(100)]
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True, n=3)
    shared = []
    fork = engine_module.fork_caches

    def watched(caches, fresh):
        out = fork(caches, fresh)
        shared.extend(seg for c in out for seg in getattr(c, "segments", ()))
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "fork_caches", watched)
        with Engine(lm, None, prefill_chunk=32, max_running=3) as engine:
            choices = [c.token_ids for c in engine.generate_choices(ids, params)]
    want = []
    for i in range(3):
        alone = SamplingParams(**{**params.__dict__, "n": 1, "seed": params.choice_seed(i)})
        with Engine(lm, None, prefill_chunk=32, max_running=1) as engine:
            want.append(engine.generate(ids, alone).token_ids)
    assert choices == want
    assert shared and all(s.end == 64 for s in shared)
