import pytest
import torch
from torch import nn

import hybridlm.ops.quant as quant_mod
from hybridlm.ops.linear import rowwise
from hybridlm.ops.native import FEW_TOKENS, NativeKernel
from hybridlm.ops.quant import QuantLinear, from_panels, pack_int4, quantize_, to_panels, unpack_int4
from hybridlm.ops.quant_gemm import quantize_activations

SCHEMES = ["int8", "int4"]
# int4 with fp16 scales, as a GPTQ checkpoint loads
KERNEL_SCHEMES = [*SCHEMES, "int4-fp16"]
needs_kernels = pytest.mark.skipif(
    quant_mod.INT8_KERNEL.get() is None or quant_mod.INT4_KERNEL.get() is None,
    reason="the quantized kernels could not be built",
)


def _layer(n: int, k: int, bias: bool, seed: int = 0) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if bias:
            layer.bias.copy_(torch.randn(n, generator=g))
    return layer.to(torch.bfloat16)


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _quantized(layer: nn.Linear, scheme: str) -> QuantLinear:
    q = QuantLinear.from_linear(layer, scheme.removesuffix("-fp16"))
    if scheme.endswith("-fp16"):
        q.scales = q.scales.half()
    return q


def _reference(q: QuantLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 x @ W^T + b with W the exact dequantized weight, and the bound of |x| @ |W|^T. Where
    int4 decode rows take the integer kernel (AVX-512 VNNI, AVX2), x is what that kernel multiplies: its int8
    quantization per group, xq · xs."""
    w = q.dequantized(torch.float64)
    x = x.double()
    if q._decodes_in_integers():
        xq, xs = quantize_activations(x.to(torch.bfloat16), q.group_size)
        x = (xq.double().view(*xs.shape, -1) * xs.double()[..., None]).view(x.shape)
    ref = x @ w.T + (0 if q.bias is None else q.bias.double())
    return ref, x.abs() @ w.abs().T


@needs_kernels
@pytest.mark.parametrize("scheme", KERNEL_SCHEMES)
@pytest.mark.parametrize("rows", [1, 3, 6, FEW_TOKENS])
# out: several int4 panels and a short last one, one short panel, whole panels; several groups
# whole panels and a short last one (even and odd counts of whole panels: one-row calls tile panels in pairs)
@pytest.mark.parametrize("shape", [(37, 128), (22, 128), (8, 192), (64, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_decode_kernel_equals_float64_reference_rounded_once(scheme, rows, shape, bias, isa):
    q = _quantized(_layer(*shape, bias), scheme)
    x = _x(rows, shape[1])
    y = q(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, shape[0])
    ref, size = _reference(q, x)
    # float32 accumulation (error ~1e-6 of the magnitudes summed), then one rounding to bf16
    err = (y.double() - ref).abs()
    assert torch.all(err <= ref.abs() * 2**-8 + size * 1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("out", [48, 37, 22])  # whole panels; a short last panel after 2 / 1 whole ones
def test_int4_kernel_reads_nothing_past_the_packed_weight(rows, out, isa):
    """The tiles read each block again 1..3 bytes further on (quant.c): a weight that ends where an
    unreadable page begins is computed without a fault, as the reference."""
    import ctypes
    import mmap

    q = _quantized(_layer(out, 128, False), "int4")
    page, nbytes = mmap.PAGESIZE, q.qweight.numel()
    size = -(-nbytes // page) * page
    region = mmap.mmap(-1, size + page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + size, page, 0) == 0, ctypes.get_errno()  # PROT_NONE
    guarded = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=size - nbytes)
    guarded.copy_(q.qweight.view(-1))
    q.qweight = guarded.view_as(q.qweight)
    x = _x(rows, 128)
    ref, bound = _reference(q, x)
    assert torch.all((q(x).double() - ref).abs() <= ref.abs() * 2**-8 + bound * 1e-5)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prefill_dequantizes_to_bf16_and_matches_reference(scheme):
    q = QuantLinear.from_linear(_layer(40, 256, True), scheme)
    x = _x(FEW_TOKENS + 8, 256)
    ref, size = _reference(q, x)
    # the weight rounded to bf16 (2^-9 relative) then a bf16 GEMM
    assert torch.all((q(x).double() - ref).abs() <= ref.abs() * 2**-8 + size * 2**-8)


@needs_kernels
@pytest.mark.parametrize("scheme", KERNEL_SCHEMES)
def test_the_c_dequantization_equals_torch_bit_for_bit(scheme, isa):
    q = _quantized(_layer(37, 320, False), scheme)
    whole = q.dequantized(torch.bfloat16)
    for n0, n1 in [(0, 37), (16, 32), (16, 37), (32, 37)] + ([(3, 17)] if scheme == "int8" else []):
        assert torch.equal(q._dequantized_slab(n0, n1), whole[n0:n1])
    assert torch.equal(q.dequantized(torch.bfloat16, slice(3, 20)), whole[3:20])


def test_prefill_in_slabs_equals_one_slab(monkeypatch):
    q = QuantLinear.from_linear(_layer(70, 128, True), "int4")
    x = _x(30, 128)
    whole = q(x)
    monkeypatch.setattr(quant_mod, "SLAB_ELEMENTS", 128 * 16)  # 16 rows a slab: 5 slabs
    assert torch.equal(q(x), whole)


@needs_kernels
@pytest.mark.parametrize("scheme", KERNEL_SCHEMES)
def test_a_row_is_computed_as_it_would_be_alone(scheme, isa):
    q = _quantized(_layer(45, 256, True), scheme)
    x = _x(FEW_TOKENS, 256)
    alone = torch.cat([q(x[i : i + 1]) for i in range(FEW_TOKENS)])
    for m in range(2, FEW_TOKENS + 1):
        assert torch.equal(q(x[:m]), alone[:m])
    assert torch.equal(q(x.view(1, FEW_TOKENS, 256))[0], alone)  # leading dims are rows too


@pytest.mark.parametrize("scheme", SCHEMES)
def test_without_kernels_the_dequantized_path_agrees(monkeypatch, scheme):
    q = QuantLinear.from_linear(_layer(37, 128, True), scheme)
    x = _x(3, 128)
    ref, size = _reference(q, x)
    monkeypatch.setenv("HYBRIDLM_COMPILE", "0")
    for name in ("INT8_KERNEL", "INT4_KERNEL", "DEQUANT_INT8", "DEQUANT_INT4"):
        k = getattr(quant_mod, name)
        fresh = NativeKernel(k.name, k.file, k.symbol, k.argtypes, k.restype, k.fallback)
        monkeypatch.setattr(quant_mod, name, fresh)
    assert torch.all((q(x).double() - ref).abs() <= ref.abs() * 2**-8 + size * 2**-8)


def test_float32_inputs_use_float32_weights():
    layer = _layer(12, 64, True).float()
    q = QuantLinear.from_linear(layer, "int8")
    x = torch.randn(2, 5, 64)
    y = q(x)
    assert y.dtype == torch.float32 and y.shape == (2, 5, 12)
    torch.testing.assert_close(y, x @ q.dequantized(torch.float32).T + q.bias)


def test_int8_is_per_channel_symmetric_within_half_a_step():
    layer = _layer(16, 96, False)
    q = QuantLinear.from_linear(layer, "int8")
    w = layer.weight.detach().float()
    assert q.qweight.dtype == torch.int8 and q.scales.shape == (16,)
    torch.testing.assert_close(q.scales, w.abs().amax(1) / 127)
    assert torch.all((q.dequantized(torch.float32) - w).abs() <= q.scales[:, None] / 2 + 1e-7)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_groups_use_all_16_levels_within_half_a_step_but_at_the_clamped_ends(group):
    layer = _layer(8, 256, False)
    q = QuantLinear.from_linear(layer, "int4", group_size=group)
    assert q.qweight.shape == (8, 128) and q.scales.shape == (8, 256 // group)
    assert q.scales.dtype == torch.bfloat16
    levels = unpack_int4(q.qweight)
    assert levels.min() == -8  # every group's largest-magnitude weight maps to -8
    step = from_panels(q.scales).float().abs().repeat_interleave(group, dim=1)
    err = (q.dequantized(torch.float32) - layer.weight.detach().float()).abs()
    inner = (levels > -8) & (levels < 7)  # the ends also take what rounding past them clamps
    assert torch.all(err[inner] <= step[inner] / 2 + 1e-6) and torch.all(err <= step + 1e-6)


@pytest.mark.parametrize("rows", [16, 37, 5])
def test_int4_packing_round_trips_and_follows_the_documented_layout(rows):
    q = torch.randint(-8, 8, (rows, 64), generator=torch.Generator().manual_seed(rows), dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.shape == (rows, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    flat = packed.reshape(-1)
    for n, k in [(0, 0), (3, 13), (rows - 1, 63), (rows // 2, 38)]:
        # panel p = n // 16 starts at byte 16p * 32; 16 rows wide, the last one N % 16 if short;
        # 32-bit little-endian words (k-block, row), weight 8b + s in bits 4s .. 4s + 3
        p = n // 16
        width = min(16, rows - 16 * p)
        byte = 16 * p * 32 + 4 * (k // 8 * width + n % 16) + k % 8 // 2
        assert (int(flat[byte]) >> (4 * (k % 2))) & 15 == int(q[n, k]) + 8


@pytest.mark.parametrize("rows", [16, 48, 37, 5])
def test_panel_order_stores_each_slab_of_16_rows_column_by_column(rows):
    t = torch.arange(rows * 3).view(rows, 3)
    panels = to_panels(t)
    assert panels.shape == t.shape and torch.equal(from_panels(panels), t)
    flat = panels.reshape(-1)
    for p in range(-(-rows // 16)):
        slab = t[16 * p : 16 * p + 16]
        assert torch.equal(flat[16 * p * 3 : 16 * p * 3 + slab.numel()], slab.T.reshape(-1))


def test_quantize_replaces_every_linear_but_skipped_ones():
    inner = nn.Sequential(_layer(4, 8, False))
    model = nn.Sequential(_layer(8, 128, True), nn.ReLU(), inner, _layer(5, 128, False))
    assert quantize_(model, "int4", skip=("3",)) is model
    assert isinstance(model[0], QuantLinear) and model[0].bits == 4
    # in_features 8 is no multiple of 64: int8 instead
    assert isinstance(model[2][0], QuantLinear) and model[2][0].bits == 8
    assert isinstance(model[3], nn.Linear)
    assert isinstance(quantize_(_layer(4, 64, False), "int8"), QuantLinear)
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_(model, "int3")


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_under_rowwise_many_rows_are_each_computed_as_alone(scheme, dtype):
    """A packed forward of many sequences' decode rows (more than a kernel call takes) computes each
    row as a one-row call would, on the kernel path and on the dequantized one."""
    q = QuantLinear.from_linear(_layer(45, 256, True), scheme)
    x = _x(3 * FEW_TOKENS + 2, 256).to(dtype)
    alone = torch.cat([q(x[i : i + 1]) for i in range(x.shape[0])])
    with rowwise():
        assert torch.equal(q(x), alone)
        assert torch.equal(q(x.view(1, *x.shape))[0], alone)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_converting_the_module_keeps_the_scales_dtype(scheme):
    """model.to(dtype) after quantizing leaves the scales as the kernels read them: same output."""
    q = QuantLinear.from_linear(_layer(45, 256, True), scheme)
    x = _x(3, 256)
    before, dtype = q(x), q.scales.dtype
    for to in (torch.float32, torch.float16, torch.bfloat16):
        q.to(to)
        assert q.scales.dtype is dtype
        q.bias.data = q.bias.data.to(torch.bfloat16)
        assert torch.equal(q(x), before)


@needs_kernels
@pytest.mark.parametrize("scheme", KERNEL_SCHEMES)
@pytest.mark.parametrize("rows", [1, 3, FEW_TOKENS, 40])
def test_concatenated_layers_compute_each_output_as_the_separate_layers_do(scheme, rows, isa):
    """Sizes off the 16-row panels (int4 panels re-cut at the joins); decode rows bit for bit,
    integer prefill rows too (exact integer sums); `split` gives back the very same tensors."""
    sizes = [40, 7, 16, 9]
    layers = [_quantized(_layer(n, 128, bias=True, seed=i), scheme) for i, n in enumerate(sizes)]
    joined = QuantLinear.concat(layers)
    assert joined.out_features == sum(sizes) and joined.scales.dtype == layers[0].scales.dtype
    x = _x(rows, 128)
    want = torch.cat([q(x) for q in layers], dim=-1)
    assert torch.equal(joined(x), want)
    for part, q in zip(joined.split(sizes), layers, strict=True):
        for name in ("qweight", "scales", "bias"):
            assert torch.equal(getattr(part, name), getattr(q, name)), name


def test_layers_of_different_kinds_do_not_concatenate():
    with pytest.raises(ValueError, match="different"):
        QuantLinear.concat([_quantized(_layer(16, 128, False), s) for s in ("int8", "int4")])
    with pytest.raises(ValueError, match="add up"):
        _quantized(_layer(16, 128, False), "int8").split([8, 9])


@needs_kernels
@pytest.mark.parametrize("scheme", KERNEL_SCHEMES)
@pytest.mark.parametrize("shape", [(37, 128), (64, 256)])
def test_grouped_products_give_each_layers_own_bits(scheme, shape, isa):
    """Several layers of one shape in one call (a token's experts) equal each layer's own call bit for
    bit: one, several and the most decode rows, a short last panel / row block; an input of more
    rows than the decode kernel takes (and not the integer path) is refused, not computed otherwise."""
    n, k = shape
    layers = [_quantized(_layer(n, k, bias=False, seed=i), scheme) for i in range(3)]
    xs = [_x(rows, k, seed=rows) for rows in (1, 4, FEW_TOKENS)]
    ys = quant_mod.grouped_quantized(layers, xs)
    assert ys is not None
    assert torch.equal(ys, torch.cat([q(x) for q, x in zip(layers, xs, strict=True)]))
    many = _x(FEW_TOKENS + 1, k)
    if not (layers[0]._decodes_in_integers() and layers[0]._integer_applies(many)):
        assert quant_mod.grouped_quantized(layers[:1], [many]) is None


def test_layers_of_different_kinds_are_not_grouped():
    layers = [_quantized(_layer(16, 128, False), s) for s in ("int8", "int4")]
    assert quant_mod.grouped_quantized(layers, [_x(1, 128)] * 2) is None
    biased = [_quantized(_layer(16, 128, True), "int8")]
    assert quant_mod.grouped_quantized(biased, [_x(1, 128)]) is None
