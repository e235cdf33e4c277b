"""Every sampling setting the validator accepts yields a valid distribution (no inf / nan)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.engine import SamplingParams
from hybridlm.ops.sampling import apply_penalties, filter_logits, sample

V = 50
SMALLEST_NORMAL_F32 = 1.1754943508222875e-38


def floats(low: float, high: float, edges: list[float], low_open: bool = False):
    """Floats in [low, high] plus `edges`. Hypothesis draws no subnormals under flush-to-zero (which
    the engine thread sets), so the tiny values come in as edges."""
    drawn = st.floats(SMALLEST_NORMAL_F32 if low_open else low, high, allow_subnormal=False)
    return st.one_of(st.sampled_from(edges), drawn)


TINY = [1e-300, 1e-45, 1e-40, SMALLEST_NORMAL_F32, 1e-30]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    temperature=floats(0.0, 100.0, [0.0, *TINY, 1e-7, 100.0]),
    top_k=st.integers(0, V + 5),
    top_p=floats(0.0, 1.0, [*TINY, 0.5, 1.0], low_open=True),
    min_p=floats(0.0, 1.0, [0.0, *TINY, 1.0]),
    repetition_penalty=floats(0.0, 100.0, [*TINY, 100.0], low_open=True),
    presence=floats(-2.0, 2.0, [-2.0, 2.0]),
    frequency=floats(-2.0, 2.0, [-2.0, 2.0]),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
)
def test_accepted_settings_give_a_valid_distribution(
    temperature, top_k, top_p, min_p, repetition_penalty, presence, frequency, scale
):
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence,
        frequency_penalty=frequency,
    )
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 3, (1, V), generator=g).float()
    logits = apply_penalties(
        torch.randn(1, V, generator=g) * scale,
        counts,
        counts > 0,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
    )
    kw = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
    if params.temperature > 0:
        probs = filter_logits(logits, **kw).softmax(-1)
        assert torch.isfinite(probs).all() and abs(probs.sum().item() - 1) < 1e-5
    assert 0 <= int(sample(logits, **kw, generator=g)[0]) < V
