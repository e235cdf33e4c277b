"""The Mamba-2 mixer with its cache (`Mamba2Cache`): every path to a token's state — one forward,
forwards cut anywhere, captures inside a forward, replay of the logged xBC / dt from a checkpoint,
speculative restore points, a store round trip — gives the same bits as running the tokens one at
a time; the chunked form (long prompts nobody restores into) within float32 rounding. Then the
Mamba-2 families against transformers beyond test_families: prompts shorter than a chunk, greedy
decoding, and bad checkpoints."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridlm.batch import Batch
from hybridlm.cache import Mamba2Cache, ScanSnapshot
from hybridlm.models import CheckpointError, load_model
from hybridlm.models.mamba2 import Mamba2Mixer
from hybridlm.ops.conv import CONV_KERNEL

torch.set_flush_denormal(True)

HEADS, HEAD_DIM, GROUPS, STATE, KERNEL = 6, 4, 2, 5, 4
TOKENS = 60
# Bits are the same on every path where the conv runs its C kernel (rows' arithmetic independent of
# the call's length); torch's fallback convolves a decode step and a prompt differently (a float32
# weighted sum against oneDNN), so without kernels a replay is exact to float rounding only.
needs_conv_kernel = pytest.mark.skipif(CONV_KERNEL.get() is None, reason="the conv kernel could not be built")


def mixer(dtype=torch.float32) -> Mamba2Mixer:
    torch.manual_seed(0)
    m = Mamba2Mixer(16, HEADS, HEAD_DIM, GROUPS, STATE, KERNEL, eps=1e-5, dt_limit=(0.0, 1.5))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) * 0.3 + (0.5 if p.dim() == 1 else 0.0))
    return m.to(dtype).eval()


def scan_inputs(m: Mamba2Mixer, n: int = TOKENS, seed: int = 0, dtype=torch.float32):
    """Per-token scan inputs: pre-conv xBC [1, n, conv_dim] and raw dt [1, n, H]."""
    g = torch.Generator().manual_seed(seed)
    xbc = torch.randn(1, n, m.conv_dim, generator=g).to(dtype)
    return xbc, torch.randn(1, n, HEADS, generator=g).to(dtype)


def run(m, cache, xbc, dt, a: int, b: int) -> torch.Tensor:
    """Tokens [a, b) through `m.scan` as one forward at offset a."""
    with torch.no_grad():
        return m.scan(Batch.single([0] * (b - a), offset=a), cache, xbc[:, a:b], dt[:, a:b])


def one_at_a_time(m, xbc, dt, dtype=torch.float32):
    """(outputs [1, n, H, P], [(tail, state) after each prefix length 0..n]) stepping token by token."""
    cache = m.make_cache(1, dtype, "cpu")
    states = [(cache.conv_tail.clone(), cache.state.clone())]
    ys = []
    for t in range(xbc.shape[1]):
        ys.append(run(m, cache, xbc, dt, t, t + 1))
        states.append((cache.conv_tail.clone(), cache.state.clone()))
    return torch.cat(ys, dim=1), states


@pytest.fixture(scope="module")
def layer():
    m = mixer()
    xbc, dt = scan_inputs(m)
    return m, xbc, dt, one_at_a_time(m, xbc, dt)


def assert_at(cache: Mamba2Cache, truth, t: int) -> None:
    assert cache.offset == t
    assert cache.conv_tail.equal(truth[t][0]), f"conv tail differs at {t}"
    assert cache.state.equal(truth[t][1]), f"state differs at {t}"


@needs_conv_kernel
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cuts=st.lists(st.integers(1, TOKENS - 1), max_size=4, unique=True),
    captures=st.lists(st.integers(1, TOKENS), min_size=1, max_size=4, unique=True),
    data=st.data(),
)
def test_replay_from_any_capture_lands_on_any_token_bit_for_bit(layer, cuts, captures, data):
    """Forwards cut at random points with captures at random offsets, recording: each capture's
    checkpoint, and a replay from its start to any token inside it, equal the token-by-token state
    bit for bit (the step form everywhere a restore can land)."""
    m, xbc, dt, (ys, truth) = layer
    cache = m.make_cache(1, torch.float32, "cpu")
    cache.prepare_snapshots(sorted(captures), ranges=True)
    points = [0, *sorted(cuts), TOKENS]
    out = torch.cat([run(m, cache, xbc, dt, a, b) for a, b in zip(points, points[1:], strict=False)], dim=1)
    assert out.equal(ys)
    snaps = cache.take_snapshots()
    assert [s.end for s in snaps] == sorted(captures)
    for s in snaps:
        assert s.has_log and s.inputs.shape == (1, s.end - s.start, m.conv_dim) and s.gates.shape[-1] == HEADS
        target = data.draw(st.integers(s.start, s.end))
        fresh = m.make_cache(1, torch.float32, "cpu")
        start = ScanSnapshot(0, s.start, tail=truth[s.start][0].clone(), state=truth[s.start][1].clone())
        assert fresh.restore(start, s.start)
        if target < s.end:
            assert fresh.restore(s, target)  # replay from the start's state
        else:
            assert fresh.restore(s, s.end)  # the checkpoint
        assert_at(fresh, truth, target)
        start.free()
        s.free()


@needs_conv_kernel
@pytest.mark.parametrize("drafts", [1, 4, 16])
def test_speculative_restore_points_commit_any_accepted_prefix(layer, drafts):
    """A verify-shaped forward (current token + drafts) with restore points after each: restoring the
    capture of `accepted` tokens equals the token-by-token state (bits), for every accepted count."""
    m, xbc, dt, (_, truth) = layer
    p = 12  # a prompt of decode size: the step form (a longer unrecorded one is chunked, see below)
    for accepted in range(drafts + 1):
        cache = m.make_cache(1, torch.float32, "cpu")
        run(m, cache, xbc, dt, 0, p)
        cache.prepare_snapshots(list(range(p + 1, p + drafts + 2)))
        run(m, cache, xbc, dt, p, p + drafts + 1)
        caps = cache.take_snapshots()
        assert cache.restore(caps[accepted], p + 1 + accepted)
        assert_at(cache, truth, p + 1 + accepted)
        for c in caps:
            c.free()


@needs_conv_kernel
def test_a_long_prompt_nobody_restores_into_takes_the_chunked_form(layer):
    """Without recording or captures a long forward runs the chunked form: its outputs and final
    state equal the step form's within float32 rounding, not necessarily bit for bit; from that
    state on, everything replays as usual."""
    m, xbc, dt, (ys, truth) = layer
    cache = m.make_cache(1, torch.float32, "cpu")
    y = run(m, cache, xbc, dt, 0, 40)
    torch.testing.assert_close(y, ys[:, :40], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.state, truth[40][1], rtol=1e-4, atol=1e-4)
    assert cache.conv_tail.equal(truth[40][0])


def test_snapshot_bytes_and_store_round_trip(layer):
    """A range snapshot holds per token the pre-conv xBC row (activation dtype) and the raw dt of
    every head, plus the tail and float32 state; to_state / from_state rebuild it exactly."""
    m, xbc, dt, (_, truth) = layer
    bf = mixer(torch.bfloat16)
    xbc16, dt16 = scan_inputs(bf, 30, dtype=torch.bfloat16)
    cache = bf.make_cache(1, torch.bfloat16, "cpu")
    cache.prepare_snapshots([30], ranges=True)
    run(bf, cache, xbc16, dt16, 0, 30)
    (snap,) = cache.take_snapshots()
    per_token = (bf.conv_dim + HEADS) * 2
    live = (KERNEL - 1) * bf.conv_dim * 2 + HEADS * HEAD_DIM * STATE * 4
    assert cache.state.dtype == torch.float32 and cache.nbytes == live
    assert snap.nbytes == 30 * per_token + live
    fields, tensors = snap.to_state()
    copies = {k: v.clone() for k, v in tensors.items()}
    again = ScanSnapshot.from_state(json.loads(json.dumps(fields)), copies)
    for target in (0, 13, 30):
        a, b = bf.make_cache(1, torch.bfloat16, "cpu"), bf.make_cache(1, torch.bfloat16, "cpu")
        assert a.restore(snap, target) and b.restore(again, target)
        assert a.conv_tail.equal(b.conv_tail) and a.state.equal(b.state)
    snap.free()
    again.free()


# ---- the families against transformers ------------------------------------------------------------
MAMBA2_FAMILIES = ["bamba", "granitemoehybrid_moe", "nemotron_h", "falcon_h1"]


def ids_for(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


@pytest.mark.parametrize("name", MAMBA2_FAMILIES)
def test_prompt_shorter_than_a_chunk_and_greedy_decoding_match_transformers(checkpoints, name):
    """A 9-token prompt (shorter than the checkpoint's 16-token chunk) within 1e-4 of the logit scale,
    then 12 greedy tokens equal transformers' `generate` (its decode steps run its step kernels)."""
    ckpt = checkpoints(name)
    ref = ckpt.reference(torch.float32)
    ours = load_model(ckpt.path, dtype=torch.float32, device="cpu")
    ids = ids_for(9, seed=5)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
        want = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, 9:].tolist()
    got = ours(Batch.single(ids), ours.make_caches(1), logits="all")[0]
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    caches = ours.make_caches(1)
    logits = ours(Batch.single(ids), caches)
    out = []
    for _ in range(12):
        out.append(int(logits[0].argmax()))
        logits = ours(Batch.single([out[-1]], offset=len(ids) + len(out) - 1), caches)
    assert out == want


def test_bad_checkpoints_are_refused_naming_the_tensor(checkpoints, tmp_path):
    """A missing tensor, or a config whose SSM state size disagrees with the tensors, is a
    CheckpointError naming a tensor, never a partial load."""
    src = checkpoints("bamba").path
    shrunk = tmp_path / "state"
    shutil.copytree(src, shrunk)
    raw = json.loads((shrunk / "config.json").read_text())
    raw["mamba_d_state"] += 1
    (shrunk / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mamba\.(in_proj|conv1d)"):
        load_model(shrunk, dtype=torch.float32, device="cpu")

    from safetensors.torch import load_file, save_file

    missing = tmp_path / "missing"
    shutil.copytree(src, missing)
    (file,) = missing.glob("*.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.2.mamba.A_log"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.mamba\.A_log'"):
        load_model(missing, dtype=torch.float32, device="cpu")


def test_nemotron_h_refuses_an_unknown_layer_letter_and_a_missing_expert(checkpoints, tmp_path):
    """A pattern letter outside M * E - is a CheckpointError naming it; so is a checkpoint missing one
    expert's tensor (published checkpoints store experts one by one)."""
    src = checkpoints("nemotron_h").path
    odd = tmp_path / "letter"
    shutil.copytree(src, odd)
    raw = json.loads((odd / "config.json").read_text())
    raw.pop("layers_block_type")
    raw["hybrid_override_pattern"] = "M*X-M"
    (odd / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="unknown layer letter 'X'"):
        load_model(odd, dtype=torch.float32, device="cpu")

    from safetensors.torch import load_file, save_file

    missing = tmp_path / "expert"
    shutil.copytree(src, missing)
    (file,) = missing.glob("*.safetensors")
    tensors = load_file(file)
    del tensors["backbone.layers.2.mixer.experts.5.down_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mixer\.experts\.5\.down_proj"):
        load_model(missing, dtype=torch.float32, device="cpu")
