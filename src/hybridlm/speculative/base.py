"""Contracts of speculative decoding: what a drafter proposes (`Draft`), how the target picks tokens
(`TargetPolicy`), the `Drafter` interface every drafter implements, `HiddenStateDrafter` for
drafters that read the target's hidden states (MTP heads) and `TargetCacheDrafter` for those that
also read its caches (the Gemma 4 assistant)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridlm.cache.base import LayerCache
from hybridlm.ops.sampling import filter_logits, greedy


@dataclass(frozen=True)
class Draft:
    """Proposed continuation `d1..dN` of the tokens a drafter was shown.

    tokens: the N draft ids, in order.
    probs: [N, V'] float32, row i the distribution `d_{i+1}` was drawn from (V' may differ from the
        target's vocabulary; missing ids count as probability 0). None: the drafts are deterministic
        (one-hot q), as for prompt lookup or a greedy draft model.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class TargetPolicy:
    """How the target model turns logits into a token: the request's sampling parameters.

    temperature 0 is greedy (argmax of the adjusted logits); otherwise tokens follow
    softmax(filter_logits(adjusted logits)). `adjust` ([1, V] float32 -> [1, V]), e.g. repetition
    penalties, is called for a position only after every earlier token was emitted, so it may read
    state that emission updates. `generator` drives every random draw (acceptance tests, residual
    and bonus samples, and sampled drafts).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    generator: torch.Generator | None = None
    adjust: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def logits(self, raw: torch.Tensor) -> torch.Tensor:
        """[V] raw float32 logits -> [V] adjusted logits (before temperature and filters)."""
        return raw if self.adjust is None else self.adjust(raw[None])[0]

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] adjusted logits -> [..., V] float32 sampling distribution (temperature, top-k,
        top-p, min-p applied)."""
        kw = dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)
        return filter_logits(logits, **kw).softmax(-1)


class Drafter(ABC):
    """Proposes draft tokens for one request. Drafters are told only committed tokens: `tokens` in
    `propose` is always the request's run so far (prompt, then every emitted token), which the
    target has verified; speculative tokens a drafter made up itself are never in it unless they
    were accepted."""

    @abstractmethod
    def propose(self, tokens: list[int], k: int, policy: TargetPolicy) -> Draft:
        """Up to `k` (≥ 1) tokens continuing `tokens` (possibly none)."""

    @abstractmethod
    def close(self) -> None:
        """Release per-request state (an index, a draft model's caches)."""


class HiddenStateDrafter(Drafter):
    """A drafter that reads the target's hidden states (an MTP head, the Gemma 4 assistant). Whoever
    runs the target hands it every committed target forward, in order: each prefill chunk, each
    plain decode step, the committed positions of each verify pass. Positions the target never
    computed (a prefix-cache hit restores them) have none: the first report may start anywhere.

    hidden_rows: which hidden states a report carries: "all" (every position's) or "last" (the last
    position's only, so the target may skip computing the others; `CausalLM.forward(hidden=...)`).
    """

    hidden_rows = "all"

    @abstractmethod
    def observe(self, offset: int, tokens: list[int], hidden: torch.Tensor) -> None:
        """The target was fed `tokens` at positions offset … offset+L-1 (all committed); hidden: [L, d]
        its final-normed hidden states there ([1, d], position offset+L-1's, when hidden_rows is
        "last")."""


class TargetCacheDrafter(HiddenStateDrafter):
    """A hidden-state drafter that also reads the target's caches (the Gemma 4 assistant attends over
    the target's keys/values). It is handed the request's live target caches once, before the
    target's first forward for the request; it reads them only inside `propose`, which always runs
    between two target forwards, so they hold exactly the committed run."""

    @abstractmethod
    def attach(self, caches: Sequence[LayerCache | None]) -> None:
        """The target caches this request's forwards advance (one per target layer, None where
        stateless)."""


def draw(logits: torch.Tensor, policy: TargetPolicy) -> tuple[int, torch.Tensor | None]:
    """One draft token from a drafter's raw [V] logits: (token, None) greedily when the policy is
    greedy, else (token, q [V]) drawn from q = the drafter's distribution under the policy's
    temperature and filters."""
    if policy.greedy:
        return int(greedy(logits)), None
    q = policy.probs(logits)
    return int(torch.multinomial(q, 1, generator=policy.generator)), q
