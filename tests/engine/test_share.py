"""The decode-priority time share: late prefill seconds stay within share × decode seconds (plus the
first chunk, run before any cost was measured), and a waiting prompt is never starved."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.engine.share import PrefillShare


@given(
    share=st.floats(0.05, 2.0),
    per_token=st.floats(1e-4, 1e-2),
    steps=st.lists(st.tuples(st.floats(1e-3, 0.5), st.integers(1, 512)), min_size=1, max_size=200),
)
def test_late_prefill_seconds_stay_within_the_share(share, per_token, steps):
    """Chunks of a fixed cost per token, offered after every decode step: what ran is charged in full,
    and never exceeds share × decode seconds by more than the first chunk."""
    budget = PrefillShare(share)
    decoded = prefilled = 0.0
    first = None
    for decode_seconds, tokens in steps:
        budget.open(decode_seconds, waiting=True)
        decoded += decode_seconds
        if budget.allows(tokens):
            seconds = tokens * per_token
            budget.ran(tokens, seconds, late=True)
            prefilled += seconds
            first = seconds if first is None else first
    assert prefilled <= share * decoded + (first or 0.0) + 1e-9


@settings(deadline=None)  # up to ~8,000 steps of waiting
@given(share=st.floats(0.05, 1.0), decode_seconds=st.floats(0.01, 0.2), chunk_seconds=st.floats(1e-3, 2.0))
def test_a_waiting_prompt_runs_within_its_cost_over_the_share(share, decode_seconds, chunk_seconds):
    """After a chunk was charged, the next one runs once the debt is repaid and its expected cost
    earned: within 2 × chunk ÷ (share × decode step) steps (+ rounding)."""
    budget = PrefillShare(share)
    budget.open(decode_seconds, waiting=True)
    assert budget.allows(64)  # nothing measured yet: the first chunk runs
    budget.ran(64, chunk_seconds, late=True)
    steps = 0
    while not budget.allows(64):
        budget.open(decode_seconds, waiting=True)
        steps += 1
    assert steps <= 2 * chunk_seconds / (share * decode_seconds) + 2


def test_surplus_lapses_and_debt_stays_when_nothing_waits():
    budget = PrefillShare(0.5)
    budget.open(1.0, waiting=True)
    budget.open(1.0, waiting=False)
    assert budget.credit == 0.0  # credit earned while waiting is not kept for a later prompt
    budget.ran(10, 3.0, late=True)
    budget.open(1.0, waiting=False)
    assert budget.credit == -3.0  # what a late chunk took is still owed to the streams


def test_chunks_of_early_prompts_teach_the_cost_but_are_not_charged():
    budget = PrefillShare(0.5)
    budget.ran(100, 1.0, late=False)
    assert budget.credit == 0.0 and budget.seconds_per_token == 0.01
    assert not budget.allows(100)
    budget.open(2.0, waiting=True)
    assert budget.allows(100)
