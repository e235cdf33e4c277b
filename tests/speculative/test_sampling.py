"""Rejection sampling keeps the target's distribution (issue 5, acceptance 2): with a fixed seed
the empirical distribution of the first two emitted tokens matches the target's joint
distribution (chi-square, p > 0.01) for draft distributions close to and far from it, sampled or
deterministic, with temperature and top-k on the target side."""

from __future__ import annotations

import pytest
import torch

from hybridlm.speculative import Draft, TargetPolicy, verify_and_commit

V = 5  # a small vocabulary: 25 cells for the joint of two tokens
TRIALS = 12000
DRAFTS = 3


class Bigram:
    """A stand-in target whose next-token logits depend only on the previous token: `table`
    [V, V] float32, row = previous token. Stateless (no caches)."""

    device = torch.device("cpu")

    def __init__(self, table: torch.Tensor):
        self.table = table

    def __call__(self, batch, caches, logits="last"):
        return self.table[batch.input_ids]  # [1, L, V]


def chi_square_p(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts against probabilities (cells of probability 0 must be empty)."""
    support = probs > 0
    assert observed[~support].sum() == 0, "a token outside the target's support was emitted"
    expected = probs[support] * observed.sum()
    stat = ((observed[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(support.sum() - 1))
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def run(target: torch.Tensor, q_table: torch.Tensor | None, policy: TargetPolicy, draft_gen) -> torch.Tensor:
    """Counts [V, V] of (first, second) emitted token after token 0 over TRIALS verify passes.
    q_table: the draft's bigram distribution (None: a deterministic draft, the greedy chain of
    the target's own logits' least likely tokens, which it usually rejects)."""
    model = Bigram(target)
    counts = torch.zeros(V, V)
    for _ in range(TRIALS):
        tokens, rows, prev = [], [], 0
        for _ in range(DRAFTS):
            if q_table is None:
                token = int(target[prev].argmin())
            else:
                rows.append(q_table[prev])
                token = int(torch.multinomial(q_table[prev], 1, generator=draft_gen))
            tokens.append(token)
            prev = token
        draft = Draft(tokens, torch.stack(rows) if rows else None)
        out = verify_and_commit(model, [], 0, draft, 0, policy).tokens
        first = out[0]
        # Only one token emitted (first draft rejected): the second comes from the target itself.
        second = (
            out[1]
            if len(out) > 1
            else int(torch.multinomial(policy.probs(target[first]), 1, generator=policy.generator))
        )
        counts[first, second] += 1
    return counts


def joint(target: torch.Tensor, policy: TargetPolicy) -> torch.Tensor:
    """The target's P(first, second | previous token 0) [V, V]."""
    p = policy.probs(target)  # row r: next-token distribution after r
    return p[0][:, None] * p


@pytest.mark.parametrize(
    ("draft", "temperature", "top_k"),
    [("close", 1.0, 0), ("far", 1.0, 0), ("far", 0.7, 3), ("deterministic", 1.0, 0)],
)
def test_emitted_distribution_equals_the_targets(draft, temperature, top_k):
    g = torch.Generator().manual_seed(1234)
    target = torch.randn(V, V, generator=g) * 1.5
    if draft == "close":
        q_table = (target + 0.3 * torch.randn(V, V, generator=g)).softmax(-1)
    elif draft == "far":
        q_table = (-2.0 * target).softmax(-1)  # mass where the target has least
    else:
        q_table = None
    policy = TargetPolicy(temperature=temperature, top_k=top_k, generator=torch.Generator().manual_seed(5))
    counts = run(target, q_table, policy, torch.Generator().manual_seed(6))
    p = chi_square_p(counts.flatten(), joint(target, policy).flatten())
    assert p > 0.01, f"chi-square p = {p:.2e}"
