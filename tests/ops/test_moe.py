"""`ops.moe`: `combine` gives its definition's bits (`combine_reference`: index_add_ of the weighted
outputs in float32) at every ISA level, for bf16 and float32 routing weights; `quantized_experts`
gives each product the bits of its layer's decode kernel, rows independent of each other, and the
activation torch's bf16 rounding of silu / relu²."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridlm.models.layers import relu2
from hybridlm.ops import moe, quant_gemm
from hybridlm.ops import quant as quant_module
from hybridlm.ops.elementwise import gated_rows
from hybridlm.ops.linear import linear, rowwise
from hybridlm.ops.moe import (
    Pairs,
    bf16_experts,
    combine,
    combine_reference,
    integer_experts,
    quantized_experts,
)
from hybridlm.ops.native import FEW_TOKENS
from hybridlm.ops.quant import QuantLinear
from hybridlm.ops.quant_gemm import int4_prefill

BF16 = torch.bfloat16

needs_kernel = pytest.mark.skipif(moe.COMBINE_KERNEL.get() is None, reason="moe kernel could not be built")


def routed(tokens: int, k: int, d: int, weights_dtype, seed: int):
    """Pairs as `dispatch` orders them (by expert: a token's pairs scattered over the call)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(tokens, k, generator=gen).to(weights_dtype)
    w_at = torch.randperm(tokens * k, generator=gen)
    ys = (4 * torch.randn(tokens * k, d, generator=gen)).bfloat16()
    return ys, weights, w_at, w_at // k


@needs_kernel
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "k", "d"), [(1, 8, 1024), (3, 2, 40), (64, 5, 300)])
def test_combine_gives_the_bits_of_its_definition(isa, weights_dtype, tokens, k, d):
    ys, weights, w_at, rows = routed(tokens, k, d, weights_dtype, seed=tokens)
    want = combine_reference(ys, weights, w_at, rows, tokens)
    assert torch.equal(combine(ys, weights, w_at, rows, tokens), want)
    assert torch.equal(combine(ys, weights, w_at.tolist(), rows.tolist(), tokens), want)


@needs_kernel
def test_combine_adds_a_rows_pairs_in_their_order_rounding_each_bf16_product(isa):
    """The definition spelled out for one row: with bf16 weights each product is rounded to bf16,
    then the products are added in float32 from zero, in pair order, and the sum rounded once."""
    ys, weights, w_at, _ = routed(1, 6, 256, torch.bfloat16, seed=7)
    total = torch.zeros(256)
    for p, j in enumerate(w_at.tolist()):
        total = total + (ys[p] * weights[0, j]).float()
    assert torch.equal(combine(ys, weights, w_at, [0] * 6, 1)[0], total.bfloat16())


def test_the_reference_serves_float32_outputs():
    ys, weights, w_at, rows = routed(2, 3, 16, torch.float32, seed=1)
    ys = ys.float()
    want = torch.zeros(2, 16).index_add_(0, rows, ys * weights.reshape(-1)[w_at, None])
    assert torch.equal(combine(ys, weights, w_at, rows, 2), want)


needs_experts_kernel = pytest.mark.skipif(
    moe.EXPERTS_KERNEL.get() is None, reason="quant kernel could not be built"
)


def quantized(weight: torch.Tensor, scheme: str, scale_dtype) -> QuantLinear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight)
    out = QuantLinear.from_linear(layer, scheme, group_size=8)
    out.scales = out.scales.to(scale_dtype) if scheme == "int4" else out.scales
    return out


def experts(n: int, d: int, inter: int, schemes: tuple[str, str], gated: bool, seed: int, scales=BF16):
    """n experts: first products [2·inter or inter, d], down products [d, inter], quantized by `schemes`."""
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * inter if gated else inter
    first = [torch.randn(rows, d, generator=gen) / d**0.5 for _ in range(n)]
    down = [torch.randn(d, inter, generator=gen) / inter**0.5 for _ in range(n)]
    return [quantized(w, schemes[0], scales) for w in first], [quantized(w, schemes[1], scales) for w in down]


def each_its_own(xs: list[torch.Tensor]) -> Pairs:
    """Every row its own token with weight 1: the combined rows are the experts' stacked outputs."""
    rows = sum(x.shape[0] for x in xs)
    return Pairs(torch.ones(rows, 1), list(range(rows)), list(range(rows)), rows)


def rows_of(counts: list[int], d: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(2 * torch.randn(m, d, generator=gen)).bfloat16() for m in counts]


@pytest.fixture
def float_decode_tiles(monkeypatch):
    """The layers' own forward takes the float decode tiles for int4 rows too (the experts kernel's
    products), also at the ISA levels whose int4 decode rows take the integer kernel."""
    monkeypatch.setattr(quant_module, "integer_int4_decode", lambda: False)


@needs_experts_kernel
@pytest.mark.parametrize(
    ("schemes", "scale_dtype"),
    [
        (("int4", "int4"), torch.bfloat16),
        (("int8", "int8"), torch.bfloat16),
        (("int4", "int8"), torch.float16),
    ],
)
@pytest.mark.parametrize("counts", [[1] * 8, [3, 1, 20, 2]])
def test_experts_kernel_gives_each_product_its_layers_decode_bits(
    isa, float_decode_tiles, schemes, scale_dtype, counts
):
    """relu² (non-gated: Nemotron-H's experts) rounds as torch's bf16 relu and square do, so the whole
    call equals each expert's own layers on its rows (decode kernels, each row as alone), bit for bit:
    odd output widths (a short int4 panel), mixed int4 / int8 projections, fp16 scales, and an expert
    with more rows than a decode call takes."""
    first, down = experts(len(counts), 104, 40, schemes, gated=False, seed=len(counts), scales=scale_dtype)
    xs = rows_of(counts, 104, seed=3)
    with rowwise():
        want = torch.cat([down_i(relu2(up(x))) for up, down_i, x in zip(first, down, xs, strict=True)])
    assert torch.equal(quantized_experts(first, down, xs, False, each_its_own(xs)), want)


def assert_rows_independent(call) -> None:
    """`call` (an experts kernel's wrapper) on 4 int4 experts of 5, 1, 19 and 2 rows gives each row what it
    gives that row alone."""
    first, down = experts(4, 64, 48, ("int4", "int4"), gated=True, seed=5)
    counts = [5, 1, 19, 2]
    xs = rows_of(counts, 64, seed=9)
    together = call(first, down, xs, True, each_its_own(xs)).split(counts)
    for f, dn, x, got in zip(first, down, xs, together, strict=True):
        alone = [call([f], [dn], [row], True, each_its_own([row])) for row in x.split(1)]
        assert torch.equal(got, torch.cat(alone))


@needs_experts_kernel
def test_experts_kernel_rows_do_not_depend_on_the_rows_beside_them(isa, float_decode_tiles):
    assert_rows_independent(quantized_experts)


def assert_bf16_silu_times_up(got: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    """got = bf16(bf16(silu(gate)) · up), against silu in float64: a kernel's exp may differ from the
    exact value in the last float32 bits, so a bf16 rounding may go the other way only where silu(gate)
    lies within 1e-6 (relative) of a rounding boundary (and such gates must be rare, or the check
    would prove nothing)."""
    silu = gate.double() * torch.sigmoid(gate.double())
    want = (silu.float().bfloat16() * up).bfloat16()
    near_boundary = (silu * (1 + 1e-6)).float().bfloat16() != (silu * (1 - 1e-6)).float().bfloat16()
    assert ((got == want) | near_boundary).all()
    assert near_boundary.float().mean() < 0.01


def exact_identity(width: int) -> QuantLinear:
    """An int8 layer whose product returns its bf16 input exactly (weights 1 on the diagonal, scale 1)."""
    layer = QuantLinear(width, width, bits=8, group_size=0, bias=False)
    layer.qweight.copy_(torch.eye(width, dtype=torch.int8))
    return layer


@needs_experts_kernel
def test_experts_kernel_gated_silu_is_bf16_silu_of_the_gate_times_the_up_rows(isa, float_decode_tiles):
    """With an identity down product the call returns its activations: bf16(bf16(silu(g)) · u) against
    silu in float64; the kernel's exp may differ from the exact value in the last float32 bits, so a
    bf16 rounding may go the other way only where silu(g) lies within 1e-6 (relative) of a rounding
    boundary."""
    width = 64
    first, _ = experts(1, width, width, ("int4", "int8"), gated=True, seed=11)
    x = rows_of([FEW_TOKENS], width, seed=2)[0]
    got = quantized_experts(first, [exact_identity(width)], [x], True, each_its_own([x]))
    with rowwise():
        gate, up = first[0](x).chunk(2, dim=-1)
    assert_bf16_silu_times_up(got, gate, up)


@needs_experts_kernel
def test_experts_of_different_kinds_are_not_computed_in_one_call():
    int4, _ = experts(1, 64, 32, ("int4", "int4"), gated=True, seed=1)
    int8, down = experts(1, 64, 32, ("int8", "int8"), gated=True, seed=1)
    xs = rows_of([1, 1], 64, seed=1)
    assert quantized_experts([*int4, *int8], down * 2, xs, True, each_its_own(xs)) is None


needs_bf16_experts_kernel = pytest.mark.skipif(
    moe.BF16_EXPERTS_KERNEL.get() is None, reason="linear kernel could not be built"
)


def bf16_stacks(n: int, d: int, inter: int, gated: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * inter if gated else inter
    first = (torch.randn(n, rows, d, generator=gen) / d**0.5).bfloat16()
    return first, (torch.randn(n, d, inter, generator=gen) / inter**0.5).bfloat16()


@needs_bf16_experts_kernel
@pytest.mark.parametrize("counts", [[1] * 8, [3, 1, 20, 2]])
def test_bf16_experts_kernel_gives_each_product_the_decode_kernels_bits(isa, counts):
    """relu² (exact in torch's bf16 ops): the call equals each chosen expert's `linear` calls (the decode
    kernel, each row as alone) on its rows, bit for bit; odd widths, experts picked out of order."""
    first, down = bf16_stacks(6, 104, 40, gated=False, seed=len(counts))
    es = [5, 0, 3, 1, 2, 4, 1, 0][: len(counts)]
    xs = rows_of(counts, 104, seed=4)
    with rowwise():
        want = torch.cat([linear(relu2(linear(x, first[e])), down[e]) for e, x in zip(es, xs, strict=True)])
    assert torch.equal(bf16_experts(first, down, es, xs, False, each_its_own(xs)), want)


@needs_bf16_experts_kernel
def test_bf16_experts_kernel_rows_do_not_depend_on_the_rows_beside_them(isa):
    first, down = bf16_stacks(4, 64, 48, gated=True, seed=5)
    counts = [5, 1, 19, 2]
    xs = rows_of(counts, 64, seed=9)
    together = bf16_experts(first, down, [0, 1, 2, 3], xs, True, each_its_own(xs)).split(counts)
    for e, (x, got) in enumerate(zip(xs, together, strict=True)):
        alone = [bf16_experts(first, down, [e], [row], True, each_its_own([row])) for row in x.split(1)]
        assert torch.equal(got, torch.cat(alone))


@needs_bf16_experts_kernel
def test_bf16_experts_kernel_gated_silu_is_bf16_silu_of_the_gate_times_the_up_rows(isa):
    """As for the quantized kernel: an identity down product returns the activations."""
    width = 64
    first, _ = bf16_stacks(1, width, width, gated=True, seed=12)
    x = rows_of([FEW_TOKENS], width, seed=2)[0]
    got = bf16_experts(first, torch.eye(width, dtype=BF16)[None], [0], [x], True, each_its_own([x]))
    with rowwise():
        gate, up = linear(x, first[0]).chunk(2, dim=-1)
    assert_bf16_silu_times_up(got, gate, up)


@needs_experts_kernel
@needs_bf16_experts_kernel
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_experts_kernels_add_the_pairs_into_their_tokens_rows_as_combine_does(
    isa, float_decode_tiles, weights_dtype
):
    """The kernels' last step is `combine`: 4 tokens × 2 experts each, the pairs in dispatch's order
    (by expert), against `combine_reference` of the same experts' stacked outputs."""
    tokens, k, counts = 4, 2, [3, 1, 2, 2]
    _, weights, w_at, rows = routed(tokens, k, 64, weights_dtype, seed=3)
    xs = rows_of(counts, 64, seed=6)
    first, down = experts(4, 64, 32, ("int4", "int8"), gated=True, seed=2)
    stacked = quantized_experts(first, down, xs, True, each_its_own(xs))
    want = combine_reference(stacked, weights, w_at, rows, tokens)
    assert torch.equal(quantized_experts(first, down, xs, True, Pairs(weights, w_at, rows, tokens)), want)
    first, down = bf16_stacks(4, 64, 32, gated=True, seed=2)
    stacked = bf16_experts(first, down, [0, 1, 2, 3], xs, True, each_its_own(xs))
    want = combine_reference(stacked, weights, w_at, rows, tokens)
    pairs = Pairs(weights, w_at.tolist(), rows.tolist(), tokens)
    assert torch.equal(bf16_experts(first, down, [0, 1, 2, 3], xs, True, pairs), want)


@pytest.fixture
def integer_tiles(isa):
    """`isa`, at the levels that have the integer kernels (AVX-512 VNNI, AVX2)."""
    if moe.INT4_EXPERTS_KERNEL.get() is None or not quant_gemm.integer_prefill():
        pytest.skip(f"no integer kernels at {isa}")
    return isa


def integer_layer(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """An int4 layer on rows x by its integer kernel, each row's activations quantized as a prompt row's."""
    return int4_prefill(x, layer.qweight, layer.scales, layer.group_size, None)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("counts", [[1] * 8, [3, 1, 20, 2]])
def test_integer_experts_kernel_gives_each_product_its_layers_integer_bits(
    integer_tiles, scale_dtype, counts
):
    """relu² (exact in torch's bf16 ops): the call equals each expert's own integer products on its rows
    (the hidden rows quantized again, as a prompt row's are), bit for bit; odd output widths (short
    panels, few-row units of several panels), fp16 scales, an expert with more rows than a decode call
    takes, and 8 experts sharing one token's row."""
    first, down = experts(len(counts), 104, 40, ("int4", "int4"), gated=False, seed=len(counts),
                          scales=scale_dtype)
    xs = rows_of(counts, 104, seed=3)
    if counts == [1] * 8:
        xs = [xs[0]] * 8  # a decode step: every expert on the token's one row
    want = torch.cat(
        [integer_layer(dn, relu2(integer_layer(up, x))) for up, dn, x in zip(first, down, xs, strict=True)]
    )
    assert torch.equal(integer_experts(first, down, xs, False, each_its_own(xs)), want)


def test_integer_experts_kernel_rows_do_not_depend_on_the_rows_beside_them(integer_tiles):
    assert_rows_independent(integer_experts)


def test_integer_experts_kernel_gated_experts_take_silu_of_the_gate_rows_times_the_up_rows(integer_tiles):
    """Gated: the hidden row is bf16(bf16(silu(gate)) · up) of the first product's halves (the float
    kernel's `expert_hidden`, checked bit for bit there), then the down product. Against torch's silu on
    the same integer products: an exp that differs in the last float32 bit may round a hidden value the
    other way (and so move the down product's row a little), so this compares within bf16 precision;
    swapping the halves or dropping the silu misses by far more."""
    first, down = experts(3, 64, 32, ("int4", "int4"), gated=True, seed=11)
    xs = rows_of([1, 4, 2], 64, seed=2)
    want = []
    for f, dn, x in zip(first, down, xs, strict=True):
        gate, up = integer_layer(f, x).chunk(2, dim=-1)
        want.append(integer_layer(dn, (torch.nn.functional.silu(gate.float()).bfloat16() * up)))
    want = torch.cat(want).float()
    got = integer_experts(first, down, xs, True, each_its_own(xs)).float()
    torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-6 * want.abs().max().item())


def test_integer_experts_refuse_int8_and_mixed_layers(integer_tiles):
    int4, down4 = experts(2, 64, 32, ("int4", "int4"), gated=True, seed=1)
    int8, down8 = experts(2, 64, 32, ("int8", "int8"), gated=True, seed=1)
    xs = rows_of([1, 1], 64, seed=1)
    assert integer_experts(int8, down8, xs, True, each_its_own(xs)) is None
    assert integer_experts(int4, down8, xs, True, each_its_own(xs)) is None
    assert integer_experts([int4[0], int8[1]], down4, xs, True, each_its_own(xs)) is None


@needs_bf16_experts_kernel
def test_gated_rows_give_the_experts_kernels_hidden_rows(isa):
    """`gated_rows` of a fused product's halves (strided views) equals the hidden rows the experts kernel
    computes from the same product (an identity down product returns them), bit for bit, and torch's
    bf16 silu times up within its rounding."""
    width = 48
    first, _ = bf16_stacks(1, width, width, gated=True, seed=13)
    x = rows_of([FEW_TOKENS], width, seed=3)[0]
    hidden = bf16_experts(first, torch.eye(width, dtype=BF16)[None], [0], [x], True, each_its_own([x]))
    with rowwise():
        gate, up = torch.split_with_sizes(linear(x, first[0]), [width, width], dim=-1)
    got = gated_rows(torch.nn.functional.silu, gate, up)
    assert torch.equal(got, hidden)
    assert_bf16_silu_times_up(got, gate, up)


@needs_bf16_experts_kernel
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_late_pairs_are_added_after_the_rounded_sum_as_torch_adds_an_output_computed_apart(
    isa, weights_dtype
):
    """A shared expert in the experts call (`shared`, expert id E, its pairs last and `late`): each
    token's row is the routed experts' combined row, rounded, plus the shared output times its weight,
    added by torch in bf16: what `SparseMoE` computes with the shared expert apart."""
    tokens, k, d, inter = 3, 2, 64, 32
    first, down = bf16_stacks(5, d, inter, gated=True, seed=4)
    shared = bf16_stacks(1, d, inter, gated=True, seed=5)
    x = rows_of([tokens], d, seed=8)[0]
    gen = torch.Generator().manual_seed(2)
    weights = torch.rand(tokens, k + 1, generator=gen).to(weights_dtype)
    es, xs = [0, 3, 4, 5], [x[:2], x[1:], x[[0]], x]  # routed: (t0, t1) (t1, t2) (t0); shared: all
    w_at = [0, 3, 4, 6, 1, 2, 5, 8]
    rows = [0, 1, 1, 2, 0, 0, 1, 2]
    routed_rows = bf16_experts(first, down, es[:3], xs[:3], True, Pairs(weights, w_at[:5], rows[:5], tokens))
    apart = bf16_experts(shared[0], shared[1], [0], [x], True, each_its_own([x]))
    want = routed_rows + apart * weights[:, k:].to(BF16) if weights_dtype is BF16 else routed_rows + apart
    if weights_dtype is torch.float32:  # an ungated shared expert: weight 1
        weights[:, k] = 1
    pairs = Pairs(weights, w_at, rows, tokens, late=tokens)
    assert torch.equal(bf16_experts(first, down, es, xs, True, pairs, (shared[0][0], shared[1][0])), want)


needs_route_kernel = pytest.mark.skipif(
    moe.ROUTE_KERNEL.get() is None, reason="linear kernel could not be built"
)

# (sigmoid, normalize, with a selection bias, scaling, eps, float32 logits, groups, best groups): Qwen's,
# unnormalised softmax, LFM2-MoE's, raw sigmoid, Kimi's (float32 logits), Ling's (and 4 of 8 groups)
ROUTERS = {
    "softmax": (False, True, False, 1.0, 0.0, False, 1, 1),
    "softmax-raw": (False, False, False, 1.0, 0.0, False, 1, 1),
    "sigmoid-bias": (True, True, True, 2.5, 1e-6, False, 1, 1),
    "sigmoid-raw": (True, False, False, 1.0, 0.0, False, 1, 1),
    "sigmoid-float32": (True, True, True, 2.4, 1e-20, True, 1, 1),
    "sigmoid-groups": (True, True, True, 2.5, 1e-20, True, 8, 4),
}


def assert_routes_by_the_rule(logits, index, weights, sigmoid, normalize, bias, scaling, eps, groups=(1, 1)):
    """Each row's k choices are a top k of its ranking in float64 (ties, and float32's rounding of the
    logits, either way), among the best groups where there are groups, and their weights the rule's
    (scores of the chosen, normalised, scaled) within float32's error."""
    logits = logits.double()
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    rank = scores + (0 if bias is None else bias.double())
    n_group, best = groups
    slack = 1e-5
    for r in range(logits.shape[0]):
        chosen = index[r].tolist()
        allowed = set(range(logits.shape[1]))
        if n_group > 1:
            size = logits.shape[1] // n_group
            rating = rank[r].view(n_group, size).topk(2).values.sum(-1)
            kept = set(rating.topk(best).indices.tolist())
            close = rating >= rating.topk(best).values[-1] - slack  # groups a rounding could keep
            assert {e // size for e in chosen} <= {g for g in range(n_group) if close[g]}
            allowed = {e for e in allowed if e // size in kept or close[e // size]}
        unchosen = [e for e in allowed if e not in chosen]
        assert len(set(chosen)) == len(chosen)
        assert rank[r, chosen].min() >= rank[r, unchosen].max() - slack
        want = scores[r, chosen]
        if normalize:
            want = want / (want.sum() + (eps if sigmoid else 0.0))
        torch.testing.assert_close(weights[r].double(), want * scaling, rtol=1e-5, atol=0)


@needs_route_kernel
@pytest.mark.parametrize("rule", ROUTERS)
@pytest.mark.parametrize("tokens", [1, FEW_TOKENS, 23])
def test_router_kernel_picks_the_rules_experts_with_their_weights(isa, rule, tokens):
    """40 experts, top 3, on the logits the decode kernel gives (or float32 ones): the rule's experts and
    weights in float64, each row as alone; with the shared expert joined, one more choice weighted by its
    gate's scale, sigmoid of the gate row's logit within bf16 rounding."""
    sigmoid, normalize, biased, scaling, eps, logits32, n_group, best = ROUTERS[rule]
    gen = torch.Generator().manual_seed(tokens)
    router = (torch.randn(40, 96, generator=gen) / 4).bfloat16()
    gate = (torch.randn(1, 96, generator=gen) / 4).bfloat16()
    bias = torch.randn(40, generator=gen) / 10 if biased else None
    x = rows_of([tokens], 96, seed=tokens)[0]
    settings = (3, sigmoid, normalize, bias, scaling, eps, gate, None, 40, torch.float32, logits32, n_group,
                best)
    with rowwise():
        logits = x.double() @ router.double().T if logits32 else linear(x, router)
        gate_logits = linear(x, gate)
        weights, index, scale = moe.route_rows(x, router, *settings)
        alone = [moe.route_rows(row, router, *settings) for row in x.split(1)]
    assert_routes_by_the_rule(
        logits, index[:, :3], weights[:, :3], sigmoid, normalize, bias, scaling, eps, (n_group, best)
    )
    assert (index[:, 3] == 40).all() and torch.equal(weights[:, 3:], scale.float())
    sigmoid_gate = torch.sigmoid(gate_logits.double())
    assert ((scale.double() - sigmoid_gate).abs() <= sigmoid_gate * 2**-8).all()
    for t, (w, i, s) in enumerate(alone):
        assert torch.equal(w, weights[t : t + 1]) and torch.equal(i, index[t : t + 1])
        assert torch.equal(s, scale[t : t + 1])


@needs_route_kernel
def test_router_kernel_rounds_bf16_weights_and_takes_a_given_scale(isa):
    """bf16 routing weights are the float32 ones rounded; without a gate row the joined column carries
    the caller's scale (a quantized gate's), and without either it is 1."""
    x = rows_of([5], 64, seed=2)[0]
    router = (torch.randn(9, 64, generator=torch.Generator().manual_seed(3)) / 4).bfloat16()
    given = torch.rand(5, 1).bfloat16()
    w32, i32, _ = moe.route_rows(x, router, 2, False, True, None, 1.0, 0.0, None, given, 9, torch.float32)
    w16, i16, scale = moe.route_rows(x, router, 2, False, True, None, 1.0, 0.0, None, given, 9, BF16)
    assert torch.equal(i16, i32) and torch.equal(w16, w32.bfloat16()) and scale is given
    assert torch.equal(w16[:, 2:], given)
    w, i, scale = moe.route_rows(x, router, 2, False, True, None, 1.0, 0.0, None, None, 9, BF16)
    assert scale is None and (w[:, 2] == 1).all() and torch.equal(i, i16)
