"""The agent session that `bench multiturn --trace agents` and `benchmarks/llama_cpp.py agent` replay."""

from __future__ import annotations

from hybridlm.bench.agents import agent_session, replay
from hybridlm.engine import Engine, SamplingParams
from hybridlm.models import load_model
from hybridlm.prefix.cache import PrefixCache


def test_the_session_has_the_shape_it_promises():
    s = agent_session(seed=3, vocab=500, agents=2, requests=8, preamble=100, task=10, tool=20, growth=5)
    assert s.requests == 16 and len(s.preamble) == 100
    for steps in s.agents:
        assert [x.kind for x in steps] == ["task"] + ["tool_result"] * 5 + ["compact", "tool_result"]
        tools = [len(x.tokens) for x in steps if x.kind == "tool_result"]
        assert tools == [20 + 5 * i for i in (0, 1, 2, 3, 4, 6)]
    assert s.agents[0][0].tokens != s.agents[1][0].tokens


def test_prompts_grow_with_each_answer_and_restart_from_the_preamble_after_compaction():
    s = agent_session(
        seed=1, vocab=500, agents=1, requests=4, preamble=30, task=5, tool=7, growth=0, compact_at=2
    )
    sent: list[list[int]] = []

    def send(prompt):
        sent.append(prompt)
        return [1000 + len(sent), 2000 + len(sent)], len(prompt)

    replay(s, send)
    steps = s.agents[0]
    assert sent[0] == s.preamble + steps[0].tokens
    assert sent[1] == sent[0] + [1001, 2001] + steps[1].tokens
    assert sent[2] == sent[1] + [1002, 2002] + steps[2].tokens  # the request for a summary
    assert sent[3] == s.preamble + [1003, 2003] + steps[3].tokens  # the summary replaces the history


def test_the_oracle_counts_only_what_no_earlier_sequence_covers():
    """Each request's fewest prefilled tokens: its prompt less the longest prefix it shares with an
    answered request's prompt + answer, the answer's last token excluded (no engine has run it)."""
    s = agent_session(
        seed=2, vocab=500, agents=1, requests=4, preamble=40, task=6, tool=9, growth=3, compact_at=2
    )
    result = replay(s, lambda prompt: ([7, 8, 9], 0))
    # all 46 new; the tool result and the answer's last token; the summary request's 40 and the
    # same; after compaction only the preamble is known (the summary never followed it)
    assert [r[1] for r in result.requests] == [46, 46 + 3 + 9, 58 + 3 + 40, 40 + 3 + 15]
    assert [r[3] for r in result.requests] == [46, 9 + 1, 40 + 1, 3 + 15]


def test_the_engine_prefills_exactly_the_oracles_fewest_tokens(demo_dir):
    """Two agents at once through the engine and its prefix cache: every shared prefix (the preamble,
    each agent's history with its own answers, the summary after compaction) is reused, none
    recomputed."""
    model = load_model(demo_dir)
    s = agent_session(seed=0, vocab=model.vocab_size, agents=2, requests=4, preamble=64, task=8, tool=12,
                      growth=4, compact_at=2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with Engine(model, None, prefix=PrefixCache(model)) as engine:

        def send(prompt):
            done = engine.generate(prompt, params)
            return done.token_ids, done.usage.prefilled_tokens

        summary = replay(s, send).summary()
    assert summary["prefilled_tokens"] == summary["oracle_min_prefilled_tokens"]
    assert summary["prefilled_tokens"] < summary["prompt_tokens"] / 2
