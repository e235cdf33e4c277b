"""Next-token selection from logits: greedy, temperature, top-k, top-p, min-p; penalties; logprobs."""

from __future__ import annotations

import torch


def filter_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """[..., V] float32 logits -> tempered logits with filtered entries set to -inf."""
    # A tiny temperature or repetition penalty overflows logits to inf (and softmax to nan):
    # saturate at the largest float instead.
    big = torch.finfo(torch.float32).max
    logits = (logits.float() / max(temperature, 1e-6)).clamp(-big, big)
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        floor = probs.max(-1, keepdim=True).values * min_p
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        # top_p below float32's smallest normal flushes to 0, and 0 >= 0 would drop every token.
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] index of the first maximum (argmax). `max` reads the row once and
    is ~3x faster than `argmax` on the CPU (248k logits: 100 µs against 310, torch 2.13)."""
    return logits.max(-1).indices


def sample(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """[B, V] logits -> [B] token ids; temperature 0 is greedy (argmax). `generator` lives on the
    logits' device."""
    if temperature <= 0.0:
        return greedy(logits)
    probs = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).view(-1)


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    seen: torch.Tensor,
    *,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> torch.Tensor:
    """Penalised copy of [B, V] float32 `logits` (the convention of vLLM and OpenAI).

    output_counts: [B, V] float32, how often each id was generated so far; presence and frequency
        penalties read it: `logit - presence · [count > 0] - frequency · count`.
    seen: [B, V] bool, ids in the prompt or the output; the repetition penalty (CTRL) divides their
        positive logits and multiplies their negative ones by `repetition_penalty`.
    """
    logits = logits.float().clone()
    if repetition_penalty != 1.0:
        scaled = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    if frequency_penalty != 0.0:
        logits -= frequency_penalty * output_counts
    if presence_penalty != 0.0:
        logits -= presence_penalty * (output_counts > 0).float()
    return logits


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top_n: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the model's distribution (log-softmax of the raw float32 logits).

    logits: [B, V]; tokens: [B] chosen ids. Returns (chosen [B], top_ids [B, top_n] int64,
    top_logprobs [B, top_n]), the top entries in descending order.
    """
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(-1, tokens.view(-1, 1).to(logp.device)).view(-1)
    top = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)
    return chosen, top.indices, top.values
