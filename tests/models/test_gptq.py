"""Published GPTQ int4 checkpoints: a checkpoint written tensor by tensor from the documented GPTQ
formulas (AutoGPTQ's packing: eight 4-bit values per int32 along the input, zero points minus one in
the v1 format) loads into int4 layers equal to its dequantized weights, and unsupported variants are
refused."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridlm.batch import Batch
from hybridlm.bench.quality import DecodeRows, compare, sequences
from hybridlm.models import CheckpointError, load_model
from hybridlm.models.fused import unfused_modules
from hybridlm.models.gptq import dequantize_gptq
from hybridlm.models.quantized import save_quantized
from hybridlm.ops.quant import QuantLinear
from tests.oracles.common import save
from tests.speculative.helpers import ids_for, plain_greedy

GROUP = 128


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random Qwen3.5 text checkpoint whose linear layers all fit 4-bit GPTQ with groups of 128
    (in % 128 == 0, out % 8 == 0)."""
    from transformers import Qwen3_5ForCausalLM

    from tests.oracles.qwen3_5 import MIX, text_config

    torch.manual_seed(0)
    cfg = text_config(False, MIX[:3], hidden_size=128, intermediate_size=256, linear_num_value_heads=8,
                      linear_value_head_dim=16)
    return save(Qwen3_5ForCausalLM(cfg), tmp_path_factory.mktemp("gptq") / "src", "qwen3_5_gptq_src").path


def _words(values: torch.Tensor) -> torch.Tensor:
    """int64 [..., 8m, ...] 4-bit values along dim 0 -> int32 words [m, ...]: value j of a word in
    bits 4j .. 4j + 3 (AutoGPTQ's `pack`), reinterpreted as signed 32-bit."""
    v = values.view(-1, 8, *values.shape[1:])
    word = sum(v[:, j] << (4 * j) for j in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()


def write_gptq(src, out, fmt="gptq", lm_head=False, **config_changes):
    """Quantize every linear weight of checkpoint `src` (but the LM head unless `lm_head`) into GPTQ
    tensors written to `out`; returns {layer: W [out, in] float64 by the formula}."""
    shutil.copytree(src, out)
    state = load_file(out / "model.safetensors")
    expected = {}
    for name in [n for n in state if n.endswith(".weight") and state[n].dim() == 2]:
        layer = name.removesuffix(".weight")
        if "embed_tokens" in layer or (layer == "lm_head" and not lm_head) or "conv1d" in layer:
            continue
        w = state.pop(name).double().T  # [in, out]
        k, n = w.shape
        groups = w.view(k // GROUP, GROUP, n)
        scales = (groups.abs().amax(dim=1) / 7).to(torch.float16)  # [in / G, out]
        s = scales.double().repeat_interleave(GROUP, dim=0)
        q = (torch.round(w / s) + 8).clamp(0, 15).long()  # unsigned, zero point 8
        zero_stored = 7 if fmt == "gptq" else 8  # v1 stores zero - 1
        state[f"{layer}.qweight"] = _words(q)
        zeros = torch.full((n, k // GROUP), zero_stored, dtype=torch.long)  # packed along the output
        state[f"{layer}.qzeros"] = _words(zeros).T.contiguous()
        state[f"{layer}.scales"] = scales
        state[f"{layer}.g_idx"] = (torch.arange(k) // GROUP).to(torch.int32)
        expected[layer] = (s * (q - 8).double()).T.contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True,
                                     "desc_act": False, "checkpoint_format": fmt, "lm_head": lm_head,
                                     **config_changes}
    (out / "config.json").write_text(json.dumps(config))
    return expected


def _reference(src, tmp_path, expected):
    """`src` with each quantized layer's weight replaced by its float64 dequantization, loaded in
    float32."""
    out = tmp_path / "reference"
    shutil.copytree(src, out)
    state = load_file(out / "model.safetensors")
    for layer, w in expected.items():
        state[f"{layer}.weight"] = w.float()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return load_model(out, torch.float32, "cpu")


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_a_gptq_checkpoint_loads_as_int4_layers_equal_to_its_dequantized_weights(source, tmp_path, fmt):
    expected = write_gptq(source, tmp_path / "gptq", fmt)
    model = load_model(tmp_path / "gptq", torch.bfloat16, "cpu")
    assert model.quantization == {"scheme": "int4", "group_size": GROUP}
    # fused groups (models.fused) by their layers' names
    layers = {n: m for n, m in unfused_modules(model).items() if isinstance(m, QuantLinear)}
    # checkpoint names ("model.layers...") are the implementation's for this family
    assert set(layers) == set(expected) and not isinstance(model.lm_head, QuantLinear)
    for name, layer in layers.items():
        assert layer.scales.dtype == torch.float16
        assert torch.equal(layer.dequantized(torch.float64), expected[name]), name
    parts = {p: load_file(tmp_path / "gptq" / "model.safetensors")[f"{name}.{p}"]
             for p in ("qweight", "qzeros", "scales", "g_idx")}
    assert torch.equal(dequantize_gptq(parts, v1=fmt == "gptq"), expected[name])

    # float32 activations: the dequantized weights exactly, as the float32 reference model
    reference = _reference(source, tmp_path, expected)
    ids = ids_for(24, seed=3)
    as_f32 = load_model(tmp_path / "gptq", torch.float32, "cpu")
    want = reference(Batch.single(ids), reference.make_caches(1), logits="all")
    torch.testing.assert_close(as_f32(Batch.single(ids), as_f32.make_caches(1), logits="all"), want,
                               rtol=1e-5, atol=1e-5)
    # bf16 activations through the int4 decode kernels: close to the float32 reference; prefill's int8
    # activations (ops.quant_gemm, where the CPU has VNNI or AVX2) add their own error (measured KL
    # 0.003), and so do decode rows where they take the same integer kernel (AVX2)
    seqs = sequences(reference.vocab_size, 64, 32, seed=1)
    stats = compare(reference, {"decode": DecodeRows(model), "prefill": model}, seqs)
    assert stats["prefill"]["kl_mean"] < 6e-3 and stats["prefill"]["top1_agreement"] >= 0.8, stats
    if next(iter(layers.values()))._decodes_in_integers():
        assert stats["decode"]["kl_mean"] == pytest.approx(stats["prefill"]["kl_mean"], rel=1e-3), stats
    else:
        assert stats["decode"]["kl_mean"] < 1e-3 and stats["decode"]["top1_agreement"] >= 0.9, stats
    assert len(plain_greedy(model, ids_for(9, seed=4), 5)) == 5


def test_a_quantized_lm_head_loads_too_and_saves_to_bit_identical_logits(source, tmp_path):
    expected = write_gptq(source, tmp_path / "gptq", lm_head=True)
    model = load_model(tmp_path / "gptq", torch.bfloat16, "cpu")
    assert isinstance(model.lm_head, QuantLinear)
    assert torch.equal(model.lm_head.dequantized(torch.float64), expected["lm_head"])
    # hybridlm's own quantized checkpoint keeps the fp16 scales: the same logits, bit for bit
    saved = load_model(save_quantized(model, tmp_path / "gptq", tmp_path / "ours"), torch.bfloat16, "cpu")
    ids = ids_for(20, seed=5)
    assert torch.equal(saved(Batch.single(ids), saved.make_caches(1), logits="all"),
                       model(Batch.single(ids), model.make_caches(1), logits="all"))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sym": False}, "sym=false"),
        ({"desc_act": True}, "desc_act=true"),
        ({"bits": 8}, "bits 8"),
        ({"checkpoint_format": "marlin"}, "format 'marlin'"),
        ({"dynamic": {"-:.*mlp.*": {}}}, "dynamic"),
    ],
)
def test_unsupported_gptq_settings_are_refused_clearly(source, tmp_path, change, message):
    write_gptq(source, tmp_path / "gptq", **change)
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path / "gptq", torch.bfloat16, "cpu")


def test_asymmetric_zero_points_and_act_order_indices_are_refused(source, tmp_path):
    write_gptq(source, tmp_path / "gptq")
    path = tmp_path / "gptq" / "model.safetensors"
    clean = load_file(path)
    name = next(n for n in clean if n.endswith(".qzeros"))
    state = dict(clean)
    state[name] = state[name].clone()
    state[name][0, 0] = 0x77777776  # one zero point 7 (stored 6)
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match="zero points other than 8"):
        load_model(tmp_path / "gptq", torch.bfloat16, "cpu")
    state = dict(clean)
    g_idx = next(n for n in clean if n.endswith(".g_idx") and int(clean[n].max()) > 0)  # several groups
    state[g_idx] = state[g_idx].flip(0).contiguous()
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match="act-order"):
        load_model(tmp_path / "gptq", torch.bfloat16, "cpu")
    with pytest.raises(CheckpointError, match="cannot load it as int8"):
        load_model(tmp_path / "gptq", torch.bfloat16, "cpu", quantize="int8")
