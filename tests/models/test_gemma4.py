"""Gemma 4 specifics beyond the family-wide tests: KV-shared layers computed on the last tokens
only (also when the last hidden states are asked for), and configurations it refuses by name
rather than computing something else."""

from __future__ import annotations

import pytest
import torch

from hybridlm.batch import Batch
from hybridlm.models import load_model
from hybridlm.models.gemma4 import Gemma4, with_defaults
from tests.models.test_families import assert_close_to_scale, full_logits, ids_for

S, F = "sliding_attention", "full_attention"


def test_shared_layers_have_no_cache_and_the_producers_keep_the_state(checkpoints):
    model = load_model(checkpoints("gemma4_text").path, dtype=torch.float32, device="cpu")
    caches = model.make_caches(1)
    shared = model.config.num_kv_shared_layers
    assert shared > 0 and all(c is None for c in caches[-shared:])
    assert all(c is not None for c in caches[:-shared])
    assert sorted(model.kv_producers) == [F, S]


def test_last_token_logits_of_a_ragged_prefill_equal_the_full_run(checkpoints):
    """With logits="last" the KV-shared layers run on each row's last token alone."""
    model = load_model(checkpoints("gemma4_text").path, dtype=torch.float32, device="cpu")
    rows = [ids_for(n, seed=20 + n) for n in (40, 7, 23)]
    got = model(Batch.ragged(rows), model.make_caches(3))
    for b, row in enumerate(rows):
        assert_close_to_scale(got[b], full_logits(model, row)[-1], 2e-5)


@pytest.mark.parametrize("logits", ["last", "all"])
def test_hidden_states_asked_of_forward_are_the_full_runs_rows(checkpoints, logits):
    """forward(hidden="all") gives every position's final-normed hidden state, hidden="last" each
    row's last one (the KV-shared layers running on the last tokens alone), beside unchanged logits."""
    model = load_model(checkpoints("gemma4_text").path, dtype=torch.float32, device="cpu")
    rows = [ids_for(n, seed=30 + n) for n in (23, 6)]
    full = [model.hidden_states(Batch.single(row), model.make_caches(1))[0] for row in rows]
    plain = model(Batch.ragged(rows), model.make_caches(2), logits=logits)
    for hidden in ["all", "last"]:
        got, states = model(Batch.ragged(rows), model.make_caches(2), logits=logits, hidden=hidden)
        torch.testing.assert_close(got, plain, rtol=0, atol=2e-5)
        for b, states_b in enumerate(full):
            want = states_b if hidden == "all" else states_b[-1:]
            torch.testing.assert_close(states[b, : want.shape[0]], want, rtol=0, atol=2e-5)
        assert states.shape[1] == (max(map(len, rows)) if hidden == "all" else 1)


def tiny(**kw) -> dict:
    base = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        layer_types=[S, F, S, F],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        global_head_dim=16,
        hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=64,
    )
    base.update(kw)
    return base


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
        (dict(per_layer_config={"0": {"intermediate_size": 8}}), "intermediate_size"),
        (dict(rope_parameters={S: {"rope_type": "yarn", "rope_theta": 1e4}, F: {"rope_theta": 1e6}}), "yarn"),
        (dict(layer_types=[S, F, F, F], num_kv_shared_layers=3), "num_kv_shared_layers"),
        (dict(layer_types=[S, "chunked_attention", S, F]), "chunked_attention"),
    ],
)
def test_unsupported_configurations_raise_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        Gemma4(with_defaults(tiny(**fields)))


def test_global_layers_default_to_head_dim_512_without_per_layer_fields():
    """Published configs may leave out `global_head_dim`; transformers then gives global layers 512."""
    model = Gemma4(with_defaults({k: v for k, v in tiny().items() if k != "global_head_dim"}))
    assert [layer.self_attn.head_dim for layer in model.model.layers] == [8, 512, 8, 512]
