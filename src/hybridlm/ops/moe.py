"""The routed experts on the CPU: `quantized_experts` / `bf16_experts` (every chosen expert of a few
tokens, both projections, the activation and the weighted sum into the tokens' rows in one C call)
and `combine` (the experts' outputs added into their tokens' rows, the C kernel) beside
`combine_reference` (its definition, torch's `index_add_`).

The definition's ops (zeroed accumulator, weighting, float32 staging, `index_add_`, cast) measured
51 µs for one token's 8 experts at width 1024 on 2 Xeon cores, 19 % of a Qwen3.5-MoE int4 layer's
expert time in a py-spy profile.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from hybridlm.ops.native import NativeKernel, int64_array
from hybridlm.ops.quant import QuantLinear, kind_addresses

_p, _i64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _Projection(ctypes.Structure):
    """quant.c's `projection`: one projection of the experts (bits, fp16 scales, int4 group size, and
    per expert the addresses of its weight and scales)."""

    _fields_ = [("bits", _int), ("fp16", _int), ("G", _i64), ("q", _p), ("scales", _p)]


EXPERTS_KERNEL = NativeKernel(
    "quant", "quant.c", "hybridlm_moe_experts",
    [_p, _p, _i64, _Projection, _Projection, _int, _p, _int, _p, _p, _i64, _p, _i64, _i64, _i64, _int], _int,
    fallback="the experts' products one projection at a time",
)
INT4_EXPERTS_KERNEL = NativeKernel(
    "quant_prefill", "quant_prefill.c", "hybridlm_moe_experts_int4",
    [_p, _p, _i64, _p, _p, _i64, _p, _p, _i64, _int, _int, _p, _int, _p, _p, _i64, _p, _i64, _i64, _i64,
     _int],
    _int,
    fallback="the experts' integer products one projection at a time",
)
BF16_EXPERTS_KERNEL = NativeKernel(
    "linear_bf16", "linear.c", "hybridlm_moe_experts_bf16",
    [_p, _p, _i64, _p, _p, _int, _p, _int, _p, _p, _i64, _p, _i64, _i64, _i64, _int], _int,
    fallback="the experts' products one projection at a time",
)
ROUTE_KERNEL = NativeKernel(
    "linear_bf16", "linear.c", "hybridlm_moe_route",
    [_p, _i64, _i64, _p, _i64, _int, _p, _int, _p, _int, _int, _int, _int, _float, _float, _i64, _int, _p, _p,
     _p],
    _int,
    fallback="torch's routing ops",
)
# The activations the experts kernels compute, with whether the expert is gated (its first product holds
# gate rows then up rows).
KERNEL_ACTIVATIONS = {("silu", True), ("relu2", False)}

COMBINE_KERNEL = NativeKernel(
    "moe", "moe.c", "hybridlm_moe_combine", [_p, _p, _int, _p, _p, _i64, _p, _i64, _i64, _int], _int,
    fallback="index_add_",
)


@dataclass(frozen=True)
class Pairs:
    """How a call's expert rows combine into its tokens' rows (`models.moe.dispatch`): pair p (row p of
    the experts' stacked outputs) is token `tokens[p]`'s product with the expert its routing weight
    `weights.flatten()[w_at[p]]` belongs to; weights [N, k] float32 or bf16, `n` tokens. The last `late`
    pairs (a shared expert joined to the call) are added after the others' sum is rounded, as torch adds
    an output computed apart (combine.h)."""

    weights: torch.Tensor
    w_at: list[int] | torch.Tensor
    tokens: list[int] | torch.Tensor
    n: int
    late: int = 0

    def arguments(self) -> tuple[tuple, tuple]:
        """The kernels' arguments (the weights' address, whether they are bf16, w_at and tokens as C
        arrays or addresses, `late`), and what must stay alive until the call returns."""
        weights, w_at, tokens = self.weights.contiguous(), _int64(self.w_at), _int64(self.tokens)
        bf16 = int(weights.dtype is torch.bfloat16)
        arguments = (weights.data_ptr(), bf16, _address(w_at), _address(tokens), self.late)
        return arguments, (weights, w_at, tokens)


def quantized_experts(
    first: list[QuantLinear], down: list[QuantLinear], xs: list[torch.Tensor], gated: bool, pairs: Pairs
) -> torch.Tensor | None:
    """Experts i on rows xs[i] [M_i, d] bf16 (CPU, contiguous): first[i] [2·I or I, d] (gate rows then
    up rows when `gated`: silu(gate) · up; else relu(up)²), down[i] [d, I]; their outputs (stacked,
    expert i's rows after expert i - 1's) combined into the tokens' rows by `pairs` -> [pairs.n, d]
    bf16, by one `EXPERTS_KERNEL` call (callers check it is built, and that the weights are float32 or
    bf16 and contiguous); None unless the first layers are of one kind, the down layers of one kind,
    none with a bias. Each product has the bits of its layer's decode kernel on those rows; the
    activation rounds where torch's bf16 ops round, its exp by the kernels' `exp_fast`; the sum is
    `combine`'s."""
    arrays = [kind_addresses(layers) for layers in (first, down)]  # alive until the call returns
    if None in arrays:
        return None
    rows = [x.shape[0] for x in xs]
    d, inter = first[0].in_features, down[0].in_features
    out = xs[0].new_empty((pairs.n, d))
    projections = [
        _Projection(
            layers[0].bits, int(layers[0]._buffers["scales"].dtype is torch.float16), layers[0].group_size,
            ctypes.addressof(q), ctypes.addressof(s),
        )
        for layers, (q, s) in zip((first, down), arrays, strict=True)
    ]
    combining, _alive = pairs.arguments()
    EXPERTS_KERNEL.get()(
        int64_array([x.data_ptr() for x in xs]), int64_array(rows), len(xs), *projections, int(gated),
        *combining, out.data_ptr(), pairs.n, d, inter, torch.get_num_threads(),
    )
    return out


def integer_experts(
    first: list[QuantLinear], down: list[QuantLinear], xs: list[torch.Tensor], gated: bool, pairs: Pairs
) -> torch.Tensor | None:
    """`quantized_experts` on the integer tiles (where int4 decode rows take them, `ops.quant_gemm`), by
    one `INT4_EXPERTS_KERNEL` call (callers check it is built): each row's activations, and each hidden
    row, quantized per group as a prompt row's are, so every product has the bits of its layer's
    integer kernel on those rows. None unless every first and down layer is int4 of one kind, without
    bias, their scales of one dtype."""
    if first[0].bits != 4 or down[0].bits != 4:
        return None
    fp16 = first[0]._buffers["scales"].dtype is torch.float16
    if (down[0]._buffers["scales"].dtype is torch.float16) is not fp16:
        return None
    arrays = kind_addresses(first), kind_addresses(down)
    if None in arrays:
        return None
    (q1, s1), (q2, s2) = arrays
    d, inter = first[0].in_features, down[0].in_features
    out = xs[0].new_empty((pairs.n, d))
    combining, _alive = pairs.arguments()
    INT4_EXPERTS_KERNEL.get()(
        int64_array([x.data_ptr() for x in xs]), int64_array([x.shape[0] for x in xs]), len(xs),
        q1, s1, first[0].group_size, q2, s2, down[0].group_size, int(fp16), int(gated),
        *combining, out.data_ptr(), pairs.n, d, inter, torch.get_num_threads(),
    )
    return out


def bf16_experts(
    first: torch.Tensor, down: torch.Tensor, es: list[int], xs: list[torch.Tensor], gated: bool, pairs: Pairs,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`quantized_experts` with bf16 weights: experts es[i] of the stacks first [E, 2·I or I, d] and down
    [E, d, I] (CPU, contiguous) on rows xs[i] [M_i, d] bf16 (contiguous), combined by `pairs` ->
    [pairs.n, d] by one `BF16_EXPERTS_KERNEL` call (callers check it is built); each product with the
    bits of `ops.linear.linear`'s decode kernel on those rows. `shared`: the first and down weights
    ([2·I or I, d], [d, I], contiguous) of the expert es names E (a shared expert)."""
    rows = [x.shape[0] for x in xs]
    d, inter = first.shape[2], down.shape[2]
    out = xs[0].new_empty((pairs.n, d))
    # an expert's weights by address: a view per expert would cost microseconds each
    first_at, first_step = first.data_ptr(), first.stride(0) * first.element_size()
    down_at, down_step = down.data_ptr(), down.stride(0) * down.element_size()
    shared_id = first.shape[0] if shared is not None else -1
    firsts = [shared[0].data_ptr() if e == shared_id else first_at + e * first_step for e in es]
    downs = [shared[1].data_ptr() if e == shared_id else down_at + e * down_step for e in es]
    combining, _alive = pairs.arguments()
    BF16_EXPERTS_KERNEL.get()(
        int64_array([x.data_ptr() for x in xs]), int64_array(rows), len(xs), int64_array(firsts),
        int64_array(downs), int(gated), *combining, out.data_ptr(), pairs.n, d, inter,
        torch.get_num_threads(),
    )
    return out


def route_rows(
    x: torch.Tensor, router: torch.Tensor, k: int, sigmoid: bool, normalize: bool, bias: torch.Tensor | None,
    scaling: float, eps: float, gate: torch.Tensor | None, scale: torch.Tensor | None, shared_id: int,
    dtype: torch.dtype, float32_logits: bool = False, n_group: int = 1, topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A router on decode rows x [M, d] bf16 by one `ROUTE_KERNEL` call (callers check it is built; x,
    router [E, d] bf16 and bias [E] float32 contiguous CPU tensors): `softmax_topk`, or (`sigmoid`)
    `sigmoid_topk` (with `n_group` groups of which the `topk_group` best compete), on the logits the decode
    kernel gives, or on float32 logits (`float32_logits`: 16-lane float32 dot products of the bf16
    values), each row alone, exp by the kernels' `exp_fast`. With `shared_id` >= 0 each row gets one more
    choice, the shared expert, weighted by its gate's scale (or 1 without a gate;
    `models.moe.join_shared`). The scale [M, 1] bf16 is computed from the gate row [1, d] (bf16: sigmoid
    of its decode-kernel logit, rounded to bf16), or taken as given (a quantized gate's, computed by the
    caller), or None without a gate. Returns (weights [M, k or k + 1] in `dtype` (float32 or bf16),
    expert ids, scale)."""
    m, d = x.shape
    width = k + 1 if shared_id >= 0 else k
    weights = torch.empty(m, width, dtype=dtype)
    index = torch.empty(m, width, dtype=torch.int64)
    if gate is not None:
        scale = torch.empty(m, 1, dtype=torch.bfloat16)
    elif scale is not None:
        scale = scale.contiguous()
    ROUTE_KERNEL.get()(
        x.data_ptr(), m, d, router.data_ptr(), router.shape[0], int(float32_logits),
        None if gate is None else gate.data_ptr(), int(sigmoid), None if bias is None else bias.data_ptr(),
        n_group, topk_group, k, int(normalize), scaling, eps, shared_id, int(dtype is torch.bfloat16),
        weights.data_ptr(), index.data_ptr(), None if scale is None else scale.data_ptr(),
    )
    return weights, index, scale


def combine_reference(ys: torch.Tensor, weights: torch.Tensor, w_at, tokens, n: int) -> torch.Tensor:
    """ys [P, d] (pair p: a token's output of one expert), weights [N, k] (float32 or ys' dtype),
    w_at / tokens [P] (int64 tensors or lists: pair p's index into the flattened weights, its token)
    -> [n, d] in ys' dtype: each pair's output times its weight (in the weights' dtype), the pairs of
    a row added in float32 in pair order, rounded once."""
    w_at, tokens = torch.as_tensor(w_at, device=ys.device), torch.as_tensor(tokens, device=ys.device)
    out = torch.zeros((n, ys.shape[1]), dtype=torch.float32, device=ys.device)
    out.index_add_(0, tokens, (ys * weights.reshape(-1)[w_at, None]).float())
    return out.to(ys.dtype)


def combine(ys: torch.Tensor, weights: torch.Tensor, w_at, tokens, n: int) -> torch.Tensor:
    """`combine_reference`, by the C kernel where it applies (bf16 outputs on the CPU, weights float32
    or bf16): one call instead of five ops."""
    fn = COMBINE_KERNEL.get() if ys.dtype is torch.bfloat16 and ys.is_cpu else None
    if fn is None or weights.dtype not in (torch.float32, torch.bfloat16):
        return combine_reference(ys, weights, w_at, tokens, n)
    ys = ys.contiguous()
    out = ys.new_empty((n, ys.shape[1]))
    (weights_at, bf16, w_at, tokens, _), _alive = Pairs(weights, w_at, tokens, n).arguments()
    fn(ys.data_ptr(), weights_at, bf16, w_at, tokens, ys.shape[0], out.data_ptr(), n, ys.shape[1],
       torch.get_num_threads())
    return out


def _int64(v):
    """A list as is (`_address` makes it a C array), a tensor as contiguous int64."""
    return v if isinstance(v, list) else v.to(torch.int64).contiguous()


def _address(v):
    return int64_array(v) if isinstance(v, list) else v.data_ptr()
