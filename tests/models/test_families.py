"""Every family against transformers on random checkpoints, and every cache path against
recomputation from scratch (DESIGN.md §5)."""

from __future__ import annotations

import random

import pytest
import torch

from hybridlm.batch import Batch
from hybridlm.models import load_model
from tests.oracles.checkpoints import BUILDERS, REPRESENTATIVE

FAMILIES = list(BUILDERS)
ONE_PER_FAMILY = REPRESENTATIVE


def ids_for(n: int, seed: int = 0, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """[L, V] logits of one uncached forward."""
    return model(Batch.single(ids, device=model.device), model.make_caches(1), logits="all")[0]


def run_chunks(model, ids: list[int], chunk: int, caches=None) -> torch.Tensor:
    caches = caches if caches is not None else model.make_caches(1)
    out, pos = [], 0
    while pos < len(ids):
        piece = ids[pos : pos + chunk]
        out.append(model(Batch.single(piece, offset=pos, device=model.device), caches, logits="all")[0])
        pos += len(piece)
    return torch.cat(out)


def assert_close_to_scale(ours: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3e} > {rel:g} × logit scale {scale:.3f}"


@pytest.mark.parametrize("name", FAMILIES)
def test_float32_logits_match_transformers(checkpoints, name):
    ckpt = checkpoints(name)
    ref = ckpt.reference(torch.float32)
    ours = load_model(ckpt.path, dtype=torch.float32, device="cpu")
    ids = ids_for(37, seed=1)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()
    assert_close_to_scale(full_logits(ours, ids), expected, 1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_bfloat16_argmax_agrees_with_transformers(checkpoints, name):
    ckpt = checkpoints(name)
    ref = ckpt.reference(torch.bfloat16)
    ours = load_model(ckpt.path, device="cpu")
    assert ours.dtype == torch.bfloat16
    ids = ids_for(200, seed=2)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()
        exact = ckpt.reference(torch.float32)(torch.tensor([ids])).logits[0]
    truth = exact.argmax(-1)
    got = full_logits(ours, ids)
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    # Where the CPU's float32 GEMM is the faster one, prompts multiply bf16 values in float32
    # (`ops.linear`) while transformers uses oneDNN's bf16 GEMM: both accumulate in float32 but in
    # another order, which flips a few near-tied argmaxes of random weights (up to 3 in 200 measured)
    # either way: each is as close to the float32 model as the other. transformers' LFM2-MoE router
    # rounds its sigmoid scores to bf16 before the top-k (ours keeps them in float32), which ties and
    # flips more experts: where it is itself further from the float32 model, ours must be closer.
    # A checkpoint whose bf16 logits are themselves far from float32 ties more often: Kimi Linear's
    # random KDA layers move transformers' bf16 argmax off the float32 one at 12 % of positions, and
    # ours agrees with it at exactly 98 % (4 near-ties in 200) here, one flip from failing on another
    # CPU. Two bf16 evaluations may then disagree at a quarter of the positions where bf16 departs.
    ours_right = (got.argmax(-1) == truth).float().mean().item()
    theirs_right = (expected.argmax(-1) == truth).float().mean().item()
    allowed = max(0.02, (1.0 - theirs_right) / 4)
    assert agree >= 1.0 - allowed or ours_right > theirs_right, (
        f"argmax agreement {agree:.3f}; vs float32: ours {ours_right:.3f}, theirs {theirs_right:.3f}"
    )
    assert ours_right >= theirs_right - 0.015, f"vs float32: ours {ours_right:.3f}, theirs {theirs_right:.3f}"
    # A routed MoE turns a one-ulp difference upstream into another expert where two router
    # probabilities nearly tie; that token (and a few after it) may then differ by more. Where
    # transformers' bf16 routing is itself further from the float32 model (above), our distance from
    # the float32 model must be no larger than its.
    outliers = positions_beyond(got, expected)
    bar = max(0.02, positions_beyond(expected, exact))
    assert outliers <= 0.02 or positions_beyond(got, exact) <= bar, (
        f"{outliers:.1%} of positions beyond 5e-2 x logit scale"
    )


def positions_beyond(logits: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of positions of logits [L, V] farther than 5e-2 × ref's logit scale from ref [L, V]."""
    per_token = (logits - ref).abs().amax(-1)
    return (per_token > 5e-2 * ref.abs().max()).float().mean().item()


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
@pytest.mark.parametrize("chunk", [1, 7, 64, 300])
def test_chunked_prefill_equals_one_piece(checkpoints, name, chunk):
    model = load_model(checkpoints(name).path, dtype=torch.float32, device="cpu")
    ids = ids_for(330 if chunk >= 64 else 90, seed=3)
    whole = full_logits(model, ids)
    assert_close_to_scale(run_chunks(model, ids, chunk), whole, 2e-5)


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_restore_inside_any_snapshot_equals_recompute(checkpoints, name):
    """Captures at random offsets during a chunked prefill, then more tokens; restoring every
    cache to an offset inside a captured range (recurrent: by replay) gives the logits of
    recomputing that prefix from scratch."""
    model = load_model(checkpoints(name).path, dtype=torch.float32, device="cpu")
    rng = random.Random(4)
    ids = ids_for(150, seed=4)
    cuts = sorted(rng.sample(range(5, 100), 4)) + [100]
    caches = model.make_caches(1)
    stateful = [c for c in caches if c is not None]  # Gemma 4's KV-shared layers hold no state
    for c in stateful:
        c.prepare_snapshots(cuts, ranges=True)
    run_chunks(model, ids[:100], 23, caches)
    snaps = [c.take_snapshots() for c in stateful]
    assert all(len(s) == len(cuts) for s in snaps)
    run_chunks(model, ids[100:], 50, caches)
    for target in [cuts[0], rng.randrange(cuts[1] + 1, cuts[2]), cuts[3] - 1, 100]:
        seg = next(i for i, c in enumerate(cuts) if target <= c)
        for cache, layer_snaps in zip(stateful, snaps, strict=True):
            for i in range(seg):
                assert cache.restore(layer_snaps[i], layer_snaps[i].end)
            assert cache.restore(layer_snaps[seg], target), type(cache).__name__
        nxt = ids[target]
        got = model(Batch.single([nxt], offset=target), caches)[0]
        expected = full_logits(model, ids[: target + 1])[-1]
        assert_close_to_scale(got, expected, 2e-5)
    for layer_snaps in snaps:
        for s in layer_snaps:
            s.free()


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_ragged_batch_rows_equal_their_own_runs(checkpoints, name):
    model = load_model(checkpoints(name).path, dtype=torch.float32, device="cpu")
    rows = [ids_for(n, seed=10 + n) for n in (13, 5, 9)]
    caches = model.make_caches(3)
    got = model(Batch.ragged(rows), caches, logits="all")
    nxt = [[7], [8], [9]]
    got_next = model(Batch.ragged(nxt, offsets=[len(r) for r in rows]), caches)
    for b, row in enumerate(rows):
        alone = full_logits(model, row)
        assert_close_to_scale(got[b, : len(row)], alone, 2e-5)
        expected_next = full_logits(model, row + nxt[b])[-1]
        assert_close_to_scale(got_next[b], expected_next, 2e-5)
