"""The KDA + MLA layers (models/kda.py) on their own: KDA's cache restored at any token by replay
and MLA's latent cache restored at any row, each against recomputation from scratch (property-based);
MLA's absorbed decode form against its expanded form; their snapshots through serialization; the
router's rejection of configs it cannot run."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.batch import Batch
from hybridlm.cache import LatentCache, RecurrentCache, RowsSnapshot, ScanSnapshot
from hybridlm.models import CheckpointError, Config
from hybridlm.models.kda import (
    KimiDeltaAttention,
    KimiGate,
    KimiOutGate,
    LatentAttention,
    SafeGate,
    routed_moe,
)
from hybridlm.ops.linear import Linear
from hybridlm.ops.rope import Rotary, inv_freq_from_params

torch.set_flush_denormal(True)
D = 32


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0))
    return module.eval()


def kda_layer(kind: str) -> KimiDeltaAttention:
    heads, dim = 3, 8
    if kind == "kimi":
        gate, out_gate = KimiGate(D, heads, dim), KimiOutGate(D, heads * dim, dim)
    else:
        gate, out_gate = SafeGate(D, heads, dim, True, -5.0), Linear(D, heads * dim, bias=False)
    return randomized(KimiDeltaAttention(D, heads, dim, 4, gate, out_gate, 1e-6), seed=1)


def mla_layer(rotary: bool) -> LatentAttention:
    rope = {"rope_theta": 10000.0, "rope_type": "default"}
    rot = Rotary(*inv_freq_from_params(4, rope)) if rotary else None
    layer = LatentAttention(D, 3, 6, 4, 5, 12, 1e-6, rot, 10**-0.5, head_gate=rotary)
    return randomized(layer, seed=2)


def run(layer, x: torch.Tensor, cache, offset: int, chunk: int) -> torch.Tensor:
    """The layer over x [1, n, D] from `offset`, in pieces of `chunk` tokens -> [1, n, D]."""
    out = []
    for lo in range(0, x.shape[1], chunk):
        piece = x[:, lo : lo + chunk]
        out.append(layer(piece, Batch.single([1] * piece.shape[1], offset=offset + lo), cache))
    return torch.cat(out, dim=1)


def inputs(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, n, D, generator=torch.Generator().manual_seed(seed))


LAYERS = {
    "kda-kimi": lambda: kda_layer("kimi"),
    "kda-ling": lambda: kda_layer("ling"),
    "mla-kimi": lambda: mla_layer(False),
    "mla-ling": lambda: mla_layer(True),
}


@settings(deadline=None, max_examples=12)
@given(
    name=st.sampled_from(sorted(LAYERS)),
    n=st.integers(2, 40),
    chunk=st.sampled_from([1, 3, 17, 64]),
    data=st.data(),
)
@torch.no_grad()
def test_property_restore_at_any_token_equals_recompute(name, n, chunk, data):
    """Range captures during a chunked run, more tokens, then a restore to a random token inside a
    captured range (KDA: checkpoint + replay of the logged pre-conv rows, decay and β; MLA: rows):
    the next tokens' outputs equal a run over the prefix from scratch."""
    layer = LAYERS[name]()
    x = inputs(n + 4, seed=n)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n), min_size=1, max_size=3), label="cuts")))
    cache = layer.make_cache(1, torch.float32, "cpu")
    cache.prepare_snapshots(cuts, ranges=True)
    run(layer, x[:, :n], cache, 0, chunk)
    snaps = cache.take_snapshots()
    assert [s.end for s in snaps] == cuts
    run(layer, x[:, n:], cache, n, 4)
    seg = data.draw(st.integers(0, len(cuts) - 1), label="segment")
    target = data.draw(st.integers(snaps[seg].start, snaps[seg].end), label="target")
    cache.free()  # restore root-first, as the prefix trie does
    for s in snaps[:seg]:
        assert cache.restore(s, s.end)
    assert cache.restore(snaps[seg], target)
    got = run(layer, x[:, target : target + 3], cache, target, 3)
    fresh = layer.make_cache(1, torch.float32, "cpu")
    expected = run(layer, x[:, : target + 3], fresh, 0, 64)[:, target:]
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    for s in snaps:
        s.free()


@pytest.mark.parametrize("rotary", [False, True])
@torch.no_grad()
def test_mla_absorbed_form_equals_expanded_form(rotary):
    """Decode-sized queries over a 30-row latent history: attention through the absorbed projections
    (latent rows only) equals attention over the expanded keys and values."""
    layer = mla_layer(rotary)
    x = inputs(33, seed=5)
    caches = [layer.make_cache(1, torch.float32, "cpu") for _ in range(2)]
    for cache in caches:
        layer(x[:, :30], Batch.single([1] * 30), cache)
    batch = Batch.single([1] * 3, offset=30)
    b, length, _ = x[:, 30:].shape
    q = layer.q_proj(x[:, 30:]).view(b, length, 3, -1).transpose(1, 2)
    latent, k_rot = layer.kv_a_proj_with_mqa(x[:, 30:]).split([12, 4], dim=-1)
    latent = layer.kv_a_layernorm(latent)[:, None]
    k_rot = k_rot[:, None]
    absorbed = layer.attend(batch, caches[0], q, latent, k_rot, absorbed=True)
    expanded = layer.attend(batch, caches[1], q, latent, k_rot, absorbed=False)
    assert absorbed.shape == expanded.shape == (1, 3, 3, 5)
    torch.testing.assert_close(absorbed, expanded, atol=1e-6, rtol=1e-5)


@torch.no_grad()
def test_mla_cache_holds_the_latent_and_shared_key_rows_only():
    layer = mla_layer(True)
    cache = layer.make_cache(1, torch.float32, "cpu")
    assert isinstance(cache, LatentCache)
    layer(inputs(10), Batch.single([1] * 10), cache)
    snap = cache.snapshot(0)
    fields, tensors = snap.to_state()
    assert tensors["k"].shape == (1, 1, 10, 12) and tensors["v"].shape == (1, 1, 10, 4)
    snap.free()


@pytest.mark.parametrize("name", sorted(LAYERS))
@torch.no_grad()
def test_snapshots_survive_serialization_split_and_merge(name):
    """A range snapshot written out (`to_state`) and read back, split at a token and merged again,
    restores a cache to a token inside it as the original does."""
    layer = LAYERS[name]()
    x = inputs(24, seed=9)
    cache = layer.make_cache(1, torch.float32, "cpu")
    cache.prepare_snapshots([20], ranges=True)
    run(layer, x[:, :20], cache, 0, 7)
    (snap,) = cache.take_snapshots()
    fields, tensors = snap.to_state()
    kind = ScanSnapshot if isinstance(cache, RecurrentCache) else RowsSnapshot
    copy = kind.from_state(fields, {k: t.clone() for k, t in tensors.items()})
    left, right = cache.split(copy, 9)
    merged = cache.merge(left, right)
    outs = []
    for s in (snap, merged):
        fresh = layer.make_cache(1, torch.float32, "cpu")
        assert fresh.restore(s, 13)
        outs.append(run(layer, x[:, 13:16], fresh, 13, 3))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    snap.free()
    merged.free()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_experts_per_token": 7}, "num_experts_per_tok=7 must be between 1 and num_experts=6"),
        ({"num_expert_group": 4}, "n_group=4 must divide num_experts=6"),
        ({"topk_group": 4}, "topk_group=4 of n_group=3"),
    ],
)
def test_a_router_config_it_cannot_run_is_a_checkpoint_error(fields, message):
    c = Config(hidden_size=D, moe_intermediate_size=8, routed_scaling_factor=1.0, num_experts=6,
               num_experts_per_token=2, num_expert_group=3, topk_group=2)
    c.update(fields)
    with pytest.raises(CheckpointError, match=message):
        routed_moe(c)


def damaged_copy(src, dst, drop: str | None = None, config: dict | None = None):
    """The checkpoint in `src` copied to `dst` without tensor `drop` and with `config` fields changed."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if drop is not None:
        tensors = load_file(dst / "model.safetensors")
        del tensors[drop]
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config:
        raw = json.loads((dst / "config.json").read_text())
        raw.update(config)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize(
    "name, drop, config, message",
    [
        ("kimi_linear", "model.layers.2.block_sparse_moe.experts.4.w3.weight", None, "experts.4.w3"),
        ("bailing_hybrid", "model.layers.1.mlp.experts.5.down_proj.weight", None, "experts.5.down_proj"),
        ("kimi_linear", None, {"kv_lora_rank": 24}, "kv_a_proj_with_mqa"),
        ("bailing_hybrid", None, {"num_experts_per_token": 9}, "num_experts_per_tok=9"),
        ("kimi_linear", None, {"q_lora_rank": 16}, "q_lora_rank"),
    ],
)
def test_bad_checkpoints_are_refused_whole(checkpoints, tmp_path, name, drop, config, message):
    """A missing expert tensor, an MLA rank that disagrees with the weights, a top-k above the expert
    count, a query path this implementation lacks: a `CheckpointError` naming the problem, no model."""
    from hybridlm.models import load_model

    path = damaged_copy(checkpoints(name).path, tmp_path / "ckpt", drop, config)
    with pytest.raises(CheckpointError, match=message):
        load_model(path, dtype=torch.float32, device="cpu")


@torch.no_grad()
def test_kda_logs_per_token_the_pre_conv_rows_and_float32_decay_and_beta():
    """What a KDA range snapshot holds per token (and counts in `nbytes`): the pre-conv q‖k‖v row in
    the activation dtype and the post-gate decay‖β row in float32, beside one conv tail and state."""
    layer = kda_layer("kimi").to(torch.bfloat16)
    cache = layer.make_cache(1, torch.bfloat16, "cpu")
    cache.prepare_snapshots([11], ranges=True)
    layer(inputs(11).to(torch.bfloat16), Batch.single([1] * 11), cache)
    (snap,) = cache.take_snapshots()
    heads, dim = 3, 8
    assert snap.inputs.shape == (1, 11, 3 * heads * dim) and snap.inputs.dtype == torch.bfloat16
    assert snap.gates.shape == (1, 11, heads * dim + heads) and snap.gates.dtype == torch.float32
    assert (snap.gates[..., : heads * dim] < 0).all() and ((snap.gates[..., heads * dim :] > 0).all())
    per_token = 3 * heads * dim * 2 + (heads * dim + heads) * 4
    checkpoint = 3 * 3 * heads * dim * 2 + heads * dim * dim * 4
    assert snap.nbytes == 11 * per_token + checkpoint
    snap.free()
