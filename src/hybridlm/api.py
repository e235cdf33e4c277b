"""The Python API for library users: `hybridlm.load_model(path)` -> `Model`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from hybridlm.batch import Batch
from hybridlm.models import CausalLM
from hybridlm.models import load_model as load_weights
from hybridlm.models.tokenizer import Tokenizer
from hybridlm.ops.sampling import sample

PREFILL_CHUNK = 2048


class Model:
    """A loaded checkpoint: the network, its tokenizer and config.

    `generate` and `logits` allocate fresh caches per call, so calls never affect each other.
    """

    def __init__(self, lm: CausalLM, tokenizer: Tokenizer | None, path: Path):
        self.lm = lm
        self.tokenizer = tokenizer
        self.path = path

    @property
    def config(self):
        return self.lm.config

    @property
    def device(self) -> torch.device:
        return self.lm.device

    def logits(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab] float32 logits of one full forward (no cache side effects)."""
        if not ids:
            raise ValueError("ids must not be empty")
        return self.lm(Batch.single(ids, device=self.device), self.lm.make_caches(1), logits="all")[0]

    def warm_up(self) -> None:
        """One short prefill and one decode step on throw-away caches, so the first real request does not
        pay one-time costs (kernel selection, allocator growth) in its time to first token."""
        caches = self.lm.make_caches(1)
        self.lm(Batch.single(list(range(8)), device=self.device), caches)
        self.lm(Batch.single([0], offset=8, device=self.device), caches)

    def stream(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_at_eos: bool = True,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> Iterator[int]:
        """Yield generated ids one by one (greedy when temperature is 0); an EOS id ends the stream
        without being yielded when `stop_at_eos`."""
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        caches = self.lm.make_caches(1)
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed if seed is not None else torch.seed())
        eos = self.tokenizer.eos_token_ids if (self.tokenizer and stop_at_eos) else set()
        pos = 0
        while True:
            piece = prompt_ids[pos : pos + PREFILL_CHUNK]
            logits = self.lm(Batch.single(piece, offset=pos, device=self.device), caches)
            pos += len(piece)
            if pos >= len(prompt_ids):
                break
        for _ in range(max_tokens):
            token = int(
                sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)[0]
            )
            if token in eos:
                return
            yield token
            logits = self.lm(Batch.single([token], offset=pos, device=self.device), caches)
            pos += 1

    def generate(
        self, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int | None = None
    ) -> list[int]:
        """The generated ids only (greedy by default; stops at an EOS id, which is not included)."""
        return list(self.stream(prompt_ids, max_tokens, temperature=temperature, seed=seed))


def load_model(
    path: str | Path | None = None, dtype: torch.dtype | None = None, device=None, quantize: str | None = None
) -> Model:
    """Load a checkpoint directory (the embedded demo model when `path` is None); `quantize` ("int8" /
    "int4") makes every linear layer weight-only quantized (see `models.quantized`)."""
    if path is None:
        from hybridlm.demo import demo_model_dir

        path = demo_model_dir()
    path = Path(path)
    lm = load_weights(path, dtype=dtype, device=device, quantize=quantize)
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    return Model(lm, tokenizer, path)
