"""Decode plans (`models.decode`): a decode or verify step (1 to FEW_TOKENS tokens of one sequence) run
by the model's plan equals the same step through its modules bit for bit (logits, hidden states, every
cache and capture), for every family, weight format and cache situation a step meets; and the plan
really runs in place of the modules."""

from __future__ import annotations

import gc
import random
import weakref
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from hybridlm.batch import Batch, Packed
from hybridlm.cache import KVCache
from hybridlm.cache.recurrent import ScanCache
from hybridlm.models import decode, load_model
from hybridlm.models.base import forward_packed
from hybridlm.models.granitemoehybrid import SoftmaxTopKMoE
from hybridlm.models.layers import Attention, DecoderLayer, GatedDeltaNet, GatedMLP
from hybridlm.models.mamba2 import Mamba2Mixer
from hybridlm.models.moe import SparseMoE
from hybridlm.models.nemotron_h import NemotronBlock, NemotronMoE, Relu2MLP
from hybridlm.ops.native import FEW_TOKENS
from hybridlm.ops.quant import quantize_
from hybridlm.ops.quant_gemm import prompt_rows

FAMILIES = [
    "qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "lfm2", "lfm2_moe", "gemma3_text", "gemma4_text",
    "dense_qwen3", "dense_llama", "kimi_linear", "bailing_hybrid", "bamba", "granitemoehybrid",
    "granitemoehybrid_moe", "nemotron_h", "nemotron_h_latent", "falcon_h1",
]
# The families whose every layer the plan runs without a module call.
PLANNED = ["qwen3_5_text", "qwen3_5_moe_text", "lfm2_moe", "dense_qwen3", "dense_llama", "bamba",
           "granitemoehybrid_moe", "nemotron_h_latent"]
# Tokens per step: decode steps and verify passes (a current token and its drafts) up to FEW_TOKENS.
STEPS = [1, 4, 1, FEW_TOKENS, 2, 1]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(n)]


def cache_tensors(cache) -> list[torch.Tensor]:
    """What a cache holds for the next forward: a scan cache's conv tail and state, a KV cache's rows."""
    if isinstance(cache, ScanCache):
        return [t for t in (cache.conv_tail, cache.state) if t is not None]
    if isinstance(cache, KVCache):
        return list(cache.rows(cache.first_held, cache.offset))
    return []


def snapshot_tensors(snaps) -> list[torch.Tensor]:
    out = []
    for snap in snaps:
        _, tensors = snap.to_state()
        out += [tensors[k] for k in sorted(tensors)]
    return out


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), what
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, what
        assert g.equal(w), f"{what}: max |diff| {(g.float() - w.float()).abs().max():.3e}"


def run_steps(model, prompt, steps, *, planned: bool, prepare=None, hidden=None):
    """Prefill `prompt`, then decode `steps` one token at a time with or without plans: (per step output,
    caches)."""
    caches = model.make_caches(1)
    model(Batch.single(prompt), caches)
    if prepare is not None:
        prepare(caches)
    outs, offset = [], len(prompt)
    with nullcontext() if planned else decode.without_plans():
        for ids in steps:
            rows = "last" if len(ids) == 1 else "all"
            out = model(Batch.single(ids, offset=offset), caches, logits=rows, hidden=hidden)
            outs.append(out if hidden else (out,))
            offset += len(ids)
    return outs, caches


def check(model, *, prepare=None, hidden=None, seed=3):
    rng = random.Random(seed)
    prompt, steps = tokens(rng, 11), [tokens(rng, n) for n in STEPS]
    kw = dict(prepare=prepare, hidden=hidden)
    got, got_caches = run_steps(model, prompt, steps, planned=True, **kw)
    want, want_caches = run_steps(model, prompt, steps, planned=False, **kw)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(list(g), list(w), f"step {i}")
    assert_same_caches(got_caches, want_caches)
    for i, (g, w) in enumerate(zip(got_caches, want_caches, strict=True)):
        if g is not None:
            snaps = [snapshot_tensors(c.take_snapshots()) for c in (g, w)]
            assert_same(*snaps, f"layer {i} captures")
    return got_caches


def assert_same_caches(got: list, want: list) -> None:
    """Every layer's cache (None for a layer without state) at the same offset with the same tensors."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g is not None:
            assert g.offset == w.offset
            assert_same(cache_tensors(g), cache_tensors(w), f"layer {i} cache")


@pytest.mark.parametrize("name", FAMILIES)
def test_planned_steps_equal_the_modules_bitwise(checkpoints, name):
    """Decode steps and verify passes of 2 to FEW_TOKENS tokens after an 11-token prefill: logits and
    every layer's cache equal, bit for bit, those of the same steps through the modules."""
    model = load_model(checkpoints(name).path, dtype=torch.bfloat16, device="cpu")
    check(model)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize(
    "name", ["qwen3_5_text", "dense_llama", "lfm2", "qwen3_5_moe_text", "granitemoehybrid_moe", "nemotron_h"]
)
def test_quantized_planned_steps_equal_the_modules_bitwise(checkpoints, name, quantize):
    """The same with int8 / int4 weights (the quantized decode kernels' calls)."""
    model = load_model(checkpoints(name).path, dtype=torch.bfloat16, device="cpu", quantize=quantize)
    check(model)


# Per packed step, (sequence, tokens) in packing order: decode rows beside verify passes.
PACKED_STEPS = [[(0, 1), (1, 3), (2, 1)], [(2, FEW_TOKENS), (0, 1)], [(1, 1), (0, 2), (2, 1)]]


def run_packed(model, prompts, *, planned: bool):
    """Prefill each prompt alone, then run `PACKED_STEPS` through `forward_packed` with or without plans:
    (per step the segments' logits, each sequence's caches)."""
    rng = random.Random(5)
    caches = [model.make_caches(1) for _ in prompts]
    for ids, c in zip(prompts, caches, strict=True):
        model(Batch.single(ids), c)
    offsets, outs = [len(p) for p in prompts], []
    with nullcontext() if planned else decode.without_plans():
        for step in PACKED_STEPS:
            pieces = [(i, tokens(rng, n)) for i, n in step]
            segments = [Batch.single(ids, offset=offsets[i]) for i, ids in pieces]
            rows = ["all"] * len(pieces)
            outs.append(forward_packed(model, segments, [caches[i] for i, _ in pieces], rows))
            for i, ids in pieces:
                offsets[i] += len(ids)
    return outs, caches


@pytest.mark.parametrize("quantize", [None, "int4"])
@pytest.mark.parametrize(
    "name", ["qwen3_5_moe_text", "lfm2", "gemma3_text", "granitemoehybrid_moe", "nemotron_h", "kimi_linear"]
)
def test_packed_planned_steps_equal_the_modules_bitwise(checkpoints, name, quantize, monkeypatch):
    """The decode and verify rows of three sequences packed in one forward (`forward_packed`, what
    continuous batching runs) go through the plan, and every segment's logits and every sequence's
    caches equal, bit for bit, the same packed steps through the modules."""
    model = load_model(checkpoints(name).path, dtype=torch.bfloat16, device="cpu", quantize=quantize)
    rng = random.Random(4)
    prompts = [tokens(rng, n) for n in (FEW_TOKENS + 3, 31, FEW_TOKENS + 8)]  # prefills the modules run
    runs = []
    monkeypatch.setattr(decode.DecodePlan, "__call__", counted(decode.DecodePlan.__call__, runs))
    got, got_caches = run_packed(model, prompts, planned=True)
    assert len(runs) == len(PACKED_STEPS) and all(type(b) is Packed for b in runs)
    runs.clear()
    want, want_caches = run_packed(model, prompts, planned=False)
    assert runs == []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"step {i}")
    for g, w in zip(got_caches, want_caches, strict=True):
        assert_same_caches(g, w)


def counted(fn, calls: list):
    """`DecodePlan.__call__` that also appends each call's batch to `calls`."""

    def wrapper(*args, **kwargs):
        calls.append(args[2])
        return fn(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("hidden", ["last", "all"])
def test_planned_steps_return_the_modules_hidden_states(checkpoints, hidden):
    """forward(hidden=...) (what a drafter reading the target's states asks for) returns the same
    logits and final-normed hidden states."""
    model = load_model(checkpoints("qwen3_5_text").path, dtype=torch.bfloat16, device="cpu")
    check(model, hidden=hidden)


@pytest.mark.parametrize("name", ["qwen3_5_text", "nemotron_h"])
def test_captures_and_recorded_inputs_equal_the_modules(checkpoints, name):
    """Range captures scheduled inside the decode steps (recurrent layers record their scan inputs and
    report the states at the split points, which the plan hands to the layer's own scan) give the same
    snapshots as the modules."""
    model = load_model(checkpoints(name).path, dtype=torch.bfloat16, device="cpu")

    def prepare(caches):
        for cache in caches:
            if cache is not None:  # a layer without state (Nemotron-H's MLP and MoE layers)
                cache.prepare_snapshots([12, 14, 15, 30, 35], ranges=True)

    caches = check(model, prepare=prepare)
    assert any(isinstance(c, ScanCache) and c.record for c in caches)


@pytest.mark.parametrize("name", PLANNED)
def test_the_plan_runs_no_layer_module(checkpoints, name, monkeypatch):
    """With a plan a decode step or verify pass calls none of the layers' forwards (it is not the module
    path under another name); a longer prefill still does."""
    model = load_model(checkpoints(name).path, dtype=torch.bfloat16, device="cpu", quantize="int4")
    calls = []
    blocks = (DecoderLayer, GatedDeltaNet, Attention, GatedMLP, SparseMoE, Mamba2Mixer, SoftmaxTopKMoE,
              NemotronBlock, NemotronMoE, Relu2MLP)
    for cls in blocks:
        def counted(self, *args, _forward=cls.forward, **kwargs):
            calls.append(self)
            return _forward(self, *args, **kwargs)

        monkeypatch.setattr(cls, "forward", counted)
    caches = model.make_caches(1)
    prompt = list(range(5, 5 + FEW_TOKENS + 3))
    model(Batch.single(prompt), caches)
    assert calls
    calls.clear()
    model(Batch.single([8], offset=len(prompt)), caches)
    model(Batch.single([9, 10, 11], offset=len(prompt) + 1), caches, logits="all")
    assert calls == []


@torch.no_grad()  # as inside `CausalLM.forward`
def test_prompt_rows_and_longer_batches_take_the_modules(checkpoints):
    """A prompt suffix (under `prompt_rows`: prefill's integer path), batches of more than FEW_TOKENS
    tokens or of several sequences, steps with autograd on and steps inside `without_plans` get no
    plan."""
    model = load_model(checkpoints("qwen3_5_text").path, dtype=torch.bfloat16, device="cpu", quantize="int8")
    assert decode.decode_plan(model, Batch.single([5], offset=2)) is not None
    with prompt_rows():
        assert decode.decode_plan(model, Batch.single([5], offset=2)) is None
    with decode.without_plans():
        assert decode.decode_plan(model, Batch.single([5], offset=2)) is None
    with torch.enable_grad():
        assert decode.decode_plan(model, Batch.single([5], offset=2)) is None
    assert decode.decode_plan(model, Batch.single([5] * FEW_TOKENS)) is not None
    assert decode.decode_plan(model, Batch.single([5] * (FEW_TOKENS + 1))) is None
    assert decode.decode_plan(model, Batch.ragged([[5], [6]])) is None


@torch.no_grad()  # as inside `CausalLM.forward`
def test_a_plan_follows_modules_swapped_after_it_was_built(checkpoints):
    """Quantizing a model in place after a planned step builds a new plan: the next steps read the new
    layers, equal to their module path."""
    model = load_model(checkpoints("dense_llama").path, dtype=torch.bfloat16, device="cpu")
    first = decode.decode_plan(model, Batch.single([5], offset=2))
    quantize_(model.model, "int8")
    assert not first.current()
    assert decode.decode_plan(model, Batch.single([5], offset=2)) is not first
    check(model)


def test_a_plan_rereads_mamba2_constants_changed_in_place(checkpoints):
    """A Mamba-2 layer's A_log, dt_bias and D changed in place after a planned step (the plan holds
    their float32 copies) are read anew: the next steps equal their module path."""
    model = load_model(checkpoints("nemotron_h").path, dtype=torch.bfloat16, device="cpu")
    check(model)
    with torch.no_grad():
        for mixer in (m for m in model.modules() if isinstance(m, Mamba2Mixer)):
            for p in (mixer.A_log, mixer.dt_bias, mixer.D):
                p.mul_(0.75)
    check(model)


@torch.no_grad()  # as inside `CausalLM.forward`
def test_no_plan_for_float32_models_or_when_turned_off(checkpoints, monkeypatch):
    """float32 weights take the modules (the plan calls the bf16 kernels); so does every model with
    HYBRIDLM_DECODE_PLAN=0. Converting a model drops its plan."""
    model = load_model(checkpoints("qwen3_5_text").path, dtype=torch.float32, device="cpu")
    batch = Batch.single([5], offset=2)
    assert decode.decode_plan(model, batch) is None
    model.to(torch.bfloat16)
    assert decode.decode_plan(model, batch) is not None
    monkeypatch.setenv("HYBRIDLM_DECODE_PLAN", "0")
    other = load_model(checkpoints("qwen3_5_text").path, dtype=torch.bfloat16, device="cpu")
    assert decode.decode_plan(other, batch) is None


def test_a_plan_does_not_keep_its_model_alive(checkpoints):
    """Plans live in a weak table keyed by the model: a model dropped after decoding is freed."""
    model = load_model(checkpoints("qwen3_5_text").path, dtype=torch.bfloat16, device="cpu")
    caches = model.make_caches(1)
    model(Batch.single([5, 6]), caches)
    model(Batch.single([7], offset=2), caches)
    alive = weakref.ref(model)
    del model, caches
    gc.collect()
    assert alive() is None


def test_modules_the_plan_does_not_know_run_as_themselves(checkpoints):
    """A projection of a kind the plan does not know (here a wrapper without `in_features`) inside a
    layer it knows is called as its module: the plan builds, and its steps equal the module path."""
    model = load_model(checkpoints("dense_llama").path, dtype=torch.bfloat16, device="cpu")
    mlp = model.model.layers[0].mlp
    mlp.down_proj = Halved(mlp.down_proj)
    with torch.no_grad():
        assert decode.decode_plan(model, Batch.single([5], offset=2)) is not None
    check(model)


class Halved(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 0.5


def test_a_subclass_that_overrides_forward_alone_runs_as_its_module():
    """`run` stands for a block's forward only while no subclass replaces the forward without it."""

    class Doubled(DecoderLayer):
        def forward(self, h, batch, cache):
            return 2 * super().forward(h, batch, cache)

    assert decode._composes(DecoderLayer) and not decode._composes(Doubled)
    layer = Doubled("mixer", nn.Identity(), nn.Identity(), torch.nn.LayerNorm, 4, 1e-6)
    assert decode._op(layer, []) is layer
