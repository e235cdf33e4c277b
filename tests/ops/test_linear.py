"""hybridlm.ops.linear: the bf16 matvec kernel against F.linear, and its fallbacks."""

import logging
import threading
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.ops import linear as linear_mod
from hybridlm.ops import native
from hybridlm.ops.linear import (
    MAX_FAST_ROWS,
    Linear,
    fast_path_available,
    kernel_rows,
    linear,
    linear_grouped,
    rowwise,
)
from hybridlm.ops.native import NativeKernel

needs_kernel = pytest.mark.skipif(not fast_path_available(), reason="bf16 matvec kernel could not be built")

# (out, in): odd sizes on both sides exercise the kernel's row-block and 32-column tails.
SHAPES = [(77, 1000), (130, 96), (16, 64), (5, 33), (3, 7)]


def _layer(out_f: int, in_f: int, bias: bool, dtype: torch.dtype) -> Linear:
    torch.manual_seed(out_f * 1000 + in_f)
    layer = Linear(in_f, out_f, bias=bias).to(dtype)
    with torch.no_grad():  # unit-scale values so outputs are O(sqrt(in)), not O(1)
        layer.weight.normal_()
        if bias:
            layer.bias.normal_()
    return layer.requires_grad_(False)


def _assert_rounded(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """y is the exact x @ w.T + b rounded once to x's dtype, up to fp32 accumulation noise.

    Compared with the fp64 result rather than with F.linear, which is not always that exact:
    for a strided 3-D bf16 input it is off by up to ~200 bf16 ulps.
    """
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert y.shape == ref.shape and y.dtype == x.dtype
    # Half an ulp is at most 2^-8 (bf16) / 2^-24 (fp32) of the value; fp32 sums add ~1e-5.
    rtol = 2**-8 if y.dtype == torch.bfloat16 else 2**-20
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=1e-3)


@pytest.fixture
def no_f_linear(monkeypatch):
    """Makes any F.linear call inside hybridlm.ops.linear fail, proving the kernel ran."""

    def boom(*args, **kwargs):
        raise AssertionError("F.linear called on the fast path")

    monkeypatch.setattr(linear_mod, "F", types.SimpleNamespace(linear=boom))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 9, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_f_linear(dtype, rows, bias, shape):
    layer = _layer(*shape, bias, dtype)
    x = torch.randn(rows, shape[1]).to(dtype)
    _assert_rounded(layer(x), x, layer.weight, layer.bias)


@needs_kernel
@pytest.mark.parametrize("rows", range(1, MAX_FAST_ROWS + 1))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_path(rows, bias, shape, no_f_linear, isa):
    if rows > kernel_rows():
        pytest.skip(f"this CPU's kernel takes {kernel_rows()} rows")
    layer = _layer(*shape, bias, torch.bfloat16)
    x = torch.randn(rows, shape[1]).to(torch.bfloat16)
    _assert_rounded(layer(x), x, layer.weight, layer.bias)


@needs_kernel
@pytest.mark.parametrize("lead", [(1, 1), (2, 2), (1, 3)])
def test_kernel_3d_and_strided_input(lead, no_f_linear):
    layer = _layer(40, 256, True, torch.bfloat16)
    wide = torch.randn(*lead, 512).to(torch.bfloat16)
    x = wide[..., ::2]  # [B, L, in], not contiguous
    y = layer(x)
    assert y.shape == (*lead, 40)
    _assert_rounded(y, x, layer.weight, layer.bias)


@needs_kernel
def test_a_row_gives_the_same_bits_whatever_rows_share_the_call(no_f_linear, isa):
    """Batch invariance: a verify pass must compute each position as a one-row decode does."""
    layer = _layer(77, 1000, True, torch.bfloat16)
    x = torch.randn(kernel_rows(), 1000).to(torch.bfloat16)
    together = layer(x)
    for i in range(x.shape[0]):
        assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])


@needs_kernel
@pytest.mark.parametrize("shape", [(77, 1000), (5, 33)])
def test_grouped_products_give_each_products_own_bits(shape, no_f_linear, isa):
    """Several products of one shape in one call (a token's experts) equal each computed by `linear`,
    bit for bit: 1, several and the most rows the kernel takes; each a short last row block."""
    n, k = shape
    ws = [torch.randn(n, k).to(torch.bfloat16) for _ in range(3)]
    xs = [torch.randn(rows, k).to(torch.bfloat16) for rows in (1, 4, kernel_rows())]
    ys = linear_grouped(xs, ws)
    assert ys is not None
    assert torch.equal(ys, torch.cat([linear(x, w) for x, w in zip(xs, ws, strict=True)]))
    assert linear_grouped([torch.randn(kernel_rows() + 1, k).to(torch.bfloat16)], ws[:1]) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_under_rowwise_many_rows_are_each_computed_as_alone(dtype, isa):
    """A packed forward of many sequences' decode rows (more than a kernel call takes): each row's
    result is a one-row call's, on the kernel path (bf16) and the F.linear one (float32)."""
    layer = _layer(77, 1000, True, dtype)
    x = torch.randn(2 * MAX_FAST_ROWS + 3, 1000).to(dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    with rowwise():
        assert torch.equal(layer(x), alone)
        assert torch.equal(layer(x.view(1, *x.shape))[0], alone)


def test_large_rows_3d_uses_f_linear():
    layer = _layer(24, 64, True, torch.bfloat16)
    x = torch.randn(2, 9, 64).to(torch.bfloat16)  # 18 rows > MAX_FAST_ROWS
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(64,), (2, 40)])
def test_prefill_rows_multiply_in_float32_where_that_gemm_is_faster(monkeypatch, no_f_linear, bias, lead):
    monkeypatch.setattr(linear_mod, "float32_min_rows", lambda: linear_mod.FLOAT32_MIN_ROWS)
    monkeypatch.setattr(linear_mod, "FLOAT32_SLAB_ELEMENTS", 40 * 96)  # 40 weight rows a slab: 4 slabs
    layer = _layer(130, 96, bias, torch.bfloat16)
    x = torch.randn(*lead, 96).to(torch.bfloat16)
    y = layer(x)
    assert y.shape == (*lead, 130)
    _assert_rounded(y, x, layer.weight, layer.bias)


def test_prefill_rows_keep_the_bf16_gemm_where_it_is_faster_or_rows_are_few(monkeypatch):
    layer = _layer(130, 96, True, torch.bfloat16)
    monkeypatch.setattr(linear_mod, "float32_min_rows", lambda: None)
    x = torch.randn(80, 96).to(torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    monkeypatch.setattr(linear_mod, "float32_min_rows", lambda: linear_mod.FLOAT32_MIN_ROWS)
    few = x[: linear_mod.FLOAT32_MIN_ROWS - 1]
    assert torch.equal(layer(few), F.linear(few, layer.weight, layer.bias))


# (bf16 seconds per row, float32 seconds per call + per row) -> rows from which float32 is chosen
CHOICES = [
    ((1e-3, 1e-3, 0.0), MAX_FAST_ROWS + 1),  # bf16 emulated (AVX2): float32 from the first GEMM row
    ((1e-4, 5e-3, 1e-5), linear_mod.FLOAT32_MIN_ROWS),  # vdpbf16ps: the conversion pays from 64 rows
    ((1e-5, 1e-3, 1e-4), None),  # AMX: never
]


@pytest.mark.parametrize(("costs", "least"), CHOICES)
def test_the_gemm_choice_is_the_one_measured_faster(monkeypatch, costs, least):
    # A clock that only the two products advance: the choice follows the measured times, whatever
    # else the machine is running (a real sleep lost to a loaded machine's GEMM jitter).
    now = [0.0]
    bf16_row, fp32_call, fp32_row = costs

    def costing(fixed, per_row):
        def run(x, *args):
            now[0] += fixed + per_row * x.shape[0]

        return run

    monkeypatch.setattr(linear_mod, "F", types.SimpleNamespace(linear=costing(0.0, bf16_row)))
    monkeypatch.setattr(linear_mod, "_linear_float32", costing(fp32_call, fp32_row))
    monkeypatch.setattr(linear_mod, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    linear_mod.float32_min_rows.cache_clear()
    try:
        assert linear_mod.float32_min_rows() == least
    finally:
        linear_mod.float32_min_rows.cache_clear()


def test_autograd_uses_f_linear():
    layer = Linear(32, 8).to(torch.bfloat16)
    x = torch.randn(1, 32, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_meta_device():
    layer = Linear(32, 8, device="meta", dtype=torch.bfloat16)
    assert layer(torch.empty(1, 32, device="meta", dtype=torch.bfloat16)).shape == (1, 8)


def test_state_dict_compatible_with_nn_linear():
    ref = nn.Linear(12, 5)
    layer = Linear(12, 5)
    layer.load_state_dict(ref.state_dict())
    assert isinstance(layer, nn.Linear)
    x = torch.randn(2, 12)
    torch.testing.assert_close(layer(x), ref(x))


def fresh_kernel(monkeypatch) -> NativeKernel:
    """An unbuilt copy of the linear kernel, installed in place of the module's."""
    k = linear_mod.KERNEL
    kernel = NativeKernel(k.name, k.file, k.symbol, k.argtypes, k.restype, k.fallback)
    monkeypatch.setattr(linear_mod, "KERNEL", kernel)
    return kernel


def test_disabled_by_env(monkeypatch):
    monkeypatch.setenv("HYBRIDLM_COMPILE", "0")
    fresh_kernel(monkeypatch)
    assert not fast_path_available()
    w = torch.randn(20, 64).to(torch.bfloat16)
    x = torch.randn(1, 64).to(torch.bfloat16)
    assert torch.equal(linear(x, w), F.linear(x, w))


def test_build_failure_falls_back_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("HYBRIDLM_COMPILE", raising=False)
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("HYBRIDLM_CACHE_DIR", str(tmp_path))
    fresh_kernel(monkeypatch)
    w = torch.randn(20, 64).to(torch.bfloat16)
    x = torch.randn(1, 64).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        for _ in range(3):
            assert torch.equal(linear(x, w), F.linear(x, w))
    assert len(caplog.records) == 1 and "F.linear" in caplog.records[0].getMessage()


@needs_kernel
def test_lazy_build_is_thread_safe(monkeypatch):
    builds = []
    kernel = fresh_kernel(monkeypatch)
    build = kernel.build

    def counting_build(level):
        builds.append(level)
        return build(level)

    monkeypatch.setattr(kernel, "build", counting_build)
    w = torch.randn(64, 128).to(torch.bfloat16)
    x = torch.randn(1, 128).to(torch.bfloat16)
    results = [None] * 4

    def run(i):
        results[i] = linear(x, w)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    for y in results:
        _assert_rounded(y, x, w, None)
