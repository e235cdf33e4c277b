"""`bench forward`'s model accounting: the weight bytes a decode step reads, against the bytes the
step's expert calls actually touched."""

from __future__ import annotations

import pytest
import torch

from hybridlm.batch import Batch
from hybridlm.bench.forward import weight_bytes_per_token
from hybridlm.models import load_model
from hybridlm.models.moe import Experts, QuantExperts


def touched_expert_bytes(model, steps: list[int]) -> list[int]:
    """Per decode step of `steps` (token ids), the bytes of the routed experts the step ran."""
    stacks = [m for m in model.modules() if isinstance(m, (Experts, QuantExperts))]
    ran: set[tuple[int, int]] = set()

    def seen(i: int, fused):
        def run(es, rows, pairs):
            ran.update((i, e) for e in es)
            return fused(es, rows, pairs)

        return run

    for i, stack in enumerate(stacks):
        expert = stack.expert
        stack.expert = lambda e, rows, i=i, expert=expert: ran.add((i, e)) or expert(e, rows)
        stack.grouped = lambda es, rows: None  # every expert through `expert`, so each is seen
        stack.fused = seen(i, stack.fused)  # ... or all at once by the experts kernel (decode rows)

    def expert_bytes(stack, e: int) -> int:
        if isinstance(stack, Experts):
            return sum(p[e].numel() * p.element_size() for p in stack.parameters())
        layers = (getattr(stack, stack.first)[e], stack.down_proj[e])
        return sum(t.numel() * t.element_size() for layer in layers for t in layer.buffers())

    caches = model.make_caches(1)
    model(Batch.single([1, 2, 3]), caches)
    out = []
    for offset, token in enumerate(steps, start=3):
        ran.clear()
        model(Batch.single([token], offset=offset), caches)
        out.append(sum(expert_bytes(stacks[i], e) for i, e in ran))
    return out


@pytest.mark.parametrize("scheme", [None, "int4"])
def test_a_decode_step_reads_the_bytes_bench_forward_counts(checkpoints, scheme):
    """The count `bench forward` divides the bandwidth by: all weights but the unchosen experts (k of
    E a layer) and the embedding table; a step's expert calls touch exactly k experts' bytes a layer."""
    model = load_model(checkpoints("qwen3_5_moe_text").path, torch.bfloat16, "cpu", quantize=scheme)
    stacks = [m for m in model.modules() if isinstance(m, (Experts, QuantExperts))]
    everything = weight_bytes_per_token(model, active=False)
    stack_bytes = sum(t.numel() * t.element_size() for m in stacks for t in (*m.parameters(), *m.buffers()))
    for touched in touched_expert_bytes(model, [5, 9, 11]):
        assert weight_bytes_per_token(model) == pytest.approx(everything - stack_bytes + touched, rel=1e-9)
