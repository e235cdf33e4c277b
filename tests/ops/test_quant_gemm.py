"""Integer prefill (ops.quant_gemm): int8 activations × int8 / int4 weights against float64 references
of the same quantized math, and row independence."""

import pytest
import torch
from torch import nn

from hybridlm.ops import quant_gemm
from hybridlm.ops.native import FEW_TOKENS
from hybridlm.ops.quant import QuantLinear, from_panels, unpack_int4
from hybridlm.ops.quant_gemm import int4_prefill, int4_prefill_grouped, int8_prefill, quantize_activations

needs_integer = pytest.mark.skipif(
    not quant_gemm.integer_prefill(), reason="integer prefill needs AVX-512 VNNI or AVX2"
)


@pytest.fixture
def integer_isa(isa):
    """`isa`, for kernels that exist at that level only where it has integer dot products."""
    if not quant_gemm.integer_prefill():
        pytest.skip(f"no integer prefill kernels at {isa}")
    return isa


def _layer(k: int, n: int, scheme: str, bias: bool = True, seed: int = 0) -> QuantLinear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    return QuantLinear.from_linear(lin, scheme)


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]  # rows of very different scales
    x[m // 2] = 0  # an all-zero row: the smallest normal scale, zero output but the bias
    return x.to(torch.bfloat16)


def test_quantize_activations_maps_each_block_peak_to_127_and_roundtrips_within_half_a_step():
    x = _x(9, 128)
    xq, xs = quantize_activations(x, 32)
    blocks = x.float().view(9, 4, 32)
    assert xs.shape == (9, 4)
    assert (xq.view(9, 4, 32).abs().amax(-1)[blocks.abs().amax(-1) > 0] == 127).all()
    err = (xq.float().view(9, 4, 32) * xs[..., None] - blocks).abs()
    assert (err <= xs[..., None] / 2 * (1 + 1e-6)).all()


# vector blocks and scalar tails (36: four 8-float vectors and 4 left)
@pytest.mark.parametrize("k, block", [(128, 128), (128, 64), (40, 40), (48, 16), (36, 36)])
def test_c_activation_quantization_equals_the_torch_definition(k, block, isa):
    x = _x(21, k)
    x[1, :block] = torch.arange(block) / 2 - 0.5  # halves: round-to-even ties at scale 1 (peak 127 next)
    x[1, block - 1] = 127
    got, want = quant_gemm._quantized(x, block), quantize_activations(x, block)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _int8_reference64(x, layer):
    """float64 of the quantized math: s[n] · Σ_b xs[m, b] Σ_{k ∈ b} xq[m, k] q[n, k] + bias[n]; and the
    sum of the terms' magnitudes (float32 accumulation error scales with it)."""
    m, k = x.shape
    b = quant_gemm.ACT_BLOCK if k % quant_gemm.ACT_BLOCK == 0 else k
    xq, xs = quantize_activations(x, b)
    q = layer.qweight.double().view(-1, k // b, b)
    part = torch.einsum("mbk,nbk->mnb", xq.double().view(m, k // b, b), q)  # exact integers
    terms = part * xs.double()[:, None, :] * layer.scales.double()[None, :, None]
    bias = 0 if layer.bias is None else layer.bias.double()
    return terms.sum(-1) + bias, terms.abs().sum(-1)


# whole-row scales (96 is no multiple of ACT_BLOCK), ACT_BLOCK blocks; a short last panel; no bias
@pytest.mark.parametrize("k, n, bias", [(96, 48, True), (256, 37, True), (256, 32, False)])
@pytest.mark.parametrize("rows", [1, 2, 3, 9, 30])  # AVX2: in-place rows (≤ 8, in pairs) and 6-row tiles
def test_int8_prefill_equals_a_float64_reference_of_the_quantized_math(k, n, bias, rows, integer_isa):
    layer = _layer(k, n, "int8", bias=bias)
    x = _x(rows, k)
    y = int8_prefill(x, layer.qweight, layer.scales, layer.bias).double()
    ref, magnitude = _int8_reference64(x, layer)
    # one bf16 rounding of the result plus float32 rounding of each block's term and running sum
    tolerance = ref.abs() * 2.0**-8 + magnitude * 2.0**-21
    assert ((y - ref).abs() <= tolerance).all()


@needs_integer
def test_int8_prefill_leaves_inputs_not_a_multiple_of_4_to_the_dequantized_path():
    layer = _layer(42, 20, "int8")
    x = _x(FEW_TOKENS + 3, 42)
    assert int8_prefill(x, layer.qweight, layer.scales, layer.bias) is None
    assert torch.equal(layer(x), layer._forward_dequantized(x))


def _int4_reference64(x, layer):
    """float64 of the quantized math: Σ_g xs[m, g] s[n, g] Σ_{k ∈ g} xq[m, k] q[n, k] + bias[n]; and the
    sum of the terms' magnitudes (float32 accumulation error scales with it)."""
    m, k = x.shape
    n, g = layer.out_features, layer.group_size
    xq, xs = quantize_activations(x, g)
    q = unpack_int4(layer.qweight).double().view(n, k // g, g)
    s = from_panels(layer.scales).double()
    part = torch.einsum("mgk,ngk->mng", xq.double().view(m, k // g, g), q)  # exact integers
    terms = part * xs.double()[:, None, :] * s[None]
    bias = 0 if layer.bias is None else layer.bias.double()
    return terms.sum(-1) + bias, terms.abs().sum(-1)


# full panels, a short last one, GPTQ's fp16 scales, several few-row units of 4 panels and a short one
@pytest.mark.parametrize("n, fp16", [(48, False), (37, False), (40, True), (200, False)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 30])  # every tile height (AVX2: 6 rows)
def test_int4_prefill_equals_a_float64_reference_of_the_quantized_math(n, fp16, rows, integer_isa):
    layer = _layer(256, n, "int4")
    if fp16:
        layer.scales = layer.scales.to(torch.float16)
    x = _x(rows, 256)
    y = int4_prefill(x, layer.qweight, layer.scales, layer.group_size, layer.bias).double()
    ref, magnitude = _int4_reference64(x, layer)
    # one bf16 rounding of the result plus float32 rounding of each group's term and running sum
    tolerance = ref.abs() * 2.0**-8 + magnitude * 2.0**-21
    assert ((y - ref).abs() <= tolerance).all()


@pytest.mark.parametrize("n, fp16", [(48, False), (37, True)])
def test_grouped_int4_products_give_each_products_own_bits(n, fp16, integer_isa):
    """Several int4 products of one shape in one call (a token's experts) equal each computed alone."""
    layers = [_layer(128, n, "int4", bias=False, seed=s) for s in range(3)]
    if fp16:
        for layer in layers:
            layer.scales = layer.scales.to(torch.float16)
    xs = [_x(rows, 128, seed=rows) for rows in (1, 4, 9)]
    group = layers[0].group_size
    ys = int4_prefill_grouped(xs, [q.qweight for q in layers], [q.scales for q in layers], group)
    alone = [int4_prefill(x, q.qweight, q.scales, group, None) for x, q in zip(xs, layers, strict=True)]
    assert torch.equal(ys, torch.cat(alone))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("n", [45, 200])  # 200: several few-row units of 4 panels, then a short panel
def test_prefill_row_never_depends_on_the_rows_beside_it(scheme, n, integer_isa):
    layer = _layer(128, n, scheme)
    x = _x(40, 128)
    run = layer._forward_integer
    whole = run(x)
    parts = torch.cat([run(x[i : i + c]) for i, c in zip((0, 1, 3, 10, 19), (1, 2, 7, 9, 21), strict=True)])
    assert torch.equal(parts, whole)


@needs_integer
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quant_linear_prefill_rows_take_the_integer_path(scheme):
    layer = _layer(128, 45, scheme)
    x = _x(2 * FEW_TOKENS, 128).view(2, FEW_TOKENS, 128)
    want = layer._forward_integer(x.reshape(-1, 128)).view(2, FEW_TOKENS, 45)
    assert torch.equal(layer(x), want)
    few = layer(x[0, :3])
    if layer._decodes_in_integers():  # int4 (integer kernels): decode rows are prefill rows
        assert torch.equal(few, want[0, :3])
        return
    # decode-shaped calls keep bf16 activations: the quantized activations' error is absent there
    dense = x.float() @ layer.dequantized(torch.float32).T + layer.bias.float()
    assert (few.float() - dense[0, :3]).abs().max() < (want[0, :3].float() - dense[0, :3]).abs().max()


@needs_integer
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_prompt_rows_take_the_integer_path_however_few(scheme):
    """Inside `prompt_rows` a call of 1 or 5 rows computes them as the one-piece prefill does, bit for
    bit; outside, the same rows take the decode kernel (bf16 activations) and differ, but where int4
    decode rows take the integer kernel too (int4)."""
    layer = _layer(128, 45, scheme)
    x = _x(35, 128)
    whole = layer(x)
    with quant_gemm.prompt_rows():
        assert quant_gemm.prompt_rows_on()
        assert torch.equal(layer(x[30:]), whole[30:])
        assert torch.equal(layer(x[None, 3:4]), whole[None, 3:4])
    assert not quant_gemm.prompt_rows_on()
    assert torch.equal(layer(x[30:]), whole[30:]) == layer._decodes_in_integers()


def test_quant_linear_float32_prefill_keeps_the_dequantized_path():
    layer = _layer(64, 20, "int8")
    x = _x(FEW_TOKENS + 3, 64).float()
    want = x @ layer.dequantized(torch.float32).T + layer.bias.float()
    torch.testing.assert_close(layer(x), want)


def test_int8_prefill_can_be_turned_off_for_the_dequantized_path(monkeypatch):
    layer = _layer(64, 20, "int4")
    x = _x(FEW_TOKENS + 3, 64)
    monkeypatch.setenv("HYBRIDLM_INT8_PREFILL", "0")
    assert torch.equal(layer(x), layer._forward_dequantized(x))
