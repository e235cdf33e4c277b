"""Mixture-of-experts building blocks shared by the MoE families: the routed expert stacks, the
routers, and the sparse block with its optional shared expert.

Routers (each returns routing weights [N, k] float32 and expert ids [N, k]):

- `softmax_topk`: softmax over the experts, top-k, optionally renormalised over the k (Qwen3-Next,
  Qwen3.5-MoE, Gemma 4);
- `sigmoid_topk`: sigmoid scores; a per-expert bias (DeepSeek-V3's `e_score_correction_bias`,
  LFM2-MoE's `expert_bias`) added for *selection only*; optional group-limited selection (`n_group`
  groups of experts ranked by the sum of their two best biased scores, the best `topk_group` kept);
  the weights are the unbiased scores of the chosen experts, optionally renormalised, times
  `routed_scaling_factor` (DeepSeek-V3, Kimi Linear, Ling, LFM2-MoE).

`Router` holds a router's weight (`gate.weight` [E, d] in the checkpoints) and its bias buffer;
`SparseMoE` joins a router, `Experts` (or their int8 / int4 form, `QuantExperts`) and an optional
shared expert (sigmoid-gated where the family says) under the checkpoints' attribute names. Routers
are not linear layers: quantizing a model leaves them in its dtype (their logits make discrete
choices).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hybridlm.models.checkpoint import CheckpointError, take
from hybridlm.models.layers import ACTIVATIONS, GatedMLP
from hybridlm.ops.elementwise import elementwise_rows, gated_rows
from hybridlm.ops.linear import Linear, linear, linear_grouped, rowwise_applies
from hybridlm.ops.moe import (
    BF16_EXPERTS_KERNEL,
    EXPERTS_KERNEL,
    INT4_EXPERTS_KERNEL,
    KERNEL_ACTIVATIONS,
    ROUTE_KERNEL,
    Pairs,
    bf16_experts,
    combine,
    integer_experts,
    quantized_experts,
    route_rows,
)
from hybridlm.ops.native import FEW_TOKENS
from hybridlm.ops.quant import INT4_GROUP, QuantLinear, grouped_quantized, one_kind
from hybridlm.ops.quant_gemm import integer_int4_decode, prompt_rows_on

SOFTMAX, SIGMOID = "softmax", "sigmoid"


def dispatch(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
    experts: Callable[[list[int], list[torch.Tensor]], torch.Tensor | None] | None = None,
    combined: Callable[[list[int], list[torch.Tensor], Pairs], torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Routed experts over tokens: x [N, d], index / weights [N, k] (expert ids; routing weights,
    float32 or x's dtype: each expert's output is multiplied in that dtype), `expert(e, rows)` the
    output [n, d] of expert e on rows [n, d] -> [N, d] in x's dtype. `experts(es, rows)`, where given,
    computes every chosen expert at once with the bits `expert` gives each, their outputs stacked
    [Σ n, d] in the order of es (None: it does not apply); `combined(es, rows, pairs)`, where given,
    also adds them into the tokens' rows as `ops.moe.combine` does, returning [N, d] (None: it does
    not apply).

    Tokens are grouped by expert and only the experts some token selected run, each once over all
    its tokens: at decode that reads exactly the k selected experts' weights, in a batched step or a
    prompt chunk each chosen expert's weights once. A token's result does not depend on the other
    tokens: its row of each expert's products is computed as the kernels compute a row (alone, or
    inside `rowwise` in groups that give the same bits), and its k outputs are added in expert order.
    """
    k = index.shape[1]
    if x.shape[0] == 1:
        # One token (a decode step): its k experts in ascending order, without the pairs' sort.
        pairs = sorted(zip(index[0].tolist(), range(k), strict=True))
        chosen, w_at, tokens = [e for e, _ in pairs], [j for _, j in pairs], [0] * k
        inputs = [x] * k
    else:
        flat = index.reshape(-1)
        w_at = flat.argsort(stable=True)
        hit, sizes = torch.unique_consecutive(flat[w_at], return_counts=True)
        tokens = w_at // k
        chosen, bounds = hit.tolist(), [0, *torch.cumsum(sizes, 0).tolist()]
        inputs = [x[tokens[a:b]] for a, b in zip(bounds, bounds[1:], strict=False)]
    pairs = Pairs(weights, w_at, tokens, x.shape[0])
    if combined is not None:
        out = combined(chosen, inputs, pairs)
        if out is not None:
            return out
    ys = experts(chosen, inputs) if experts is not None else None
    if ys is None:
        ys = torch.cat([expert(e, xe) for e, xe in zip(chosen, inputs, strict=True)])
    # Each expert's output is weighted in the routing weights' dtype, the k of a token summed in
    # float32 in ascending expert order and rounded once (transformers' default grouped_mm path does
    # the same): `ops.moe.combine`.
    return combine(ys, weights, w_at, tokens, x.shape[0])


def kernel_decode_rows(x: torch.Tensor, weights_dtype: torch.dtype = torch.float32) -> bool:
    """Whether x [N, d]'s rows are decode rows the MoE kernels take: bf16 on the CPU, few (or any
    number inside `rowwise`), outside `prompt_rows` and torch.compile, routing weights float32 or bf16
    (`ops.moe.Pairs`)."""
    return (
        x.dtype is torch.bfloat16
        and x.is_cpu
        and weights_dtype in (torch.float32, torch.bfloat16)
        and (x.shape[0] <= FEW_TOKENS or rowwise_applies(x))
        and not prompt_rows_on()
        and not torch.compiler.is_compiling()
    )


def grouped_experts(
    act, gated: bool, first: list, down: list, xs: list[torch.Tensor], products, product
) -> torch.Tensor | None:
    """Experts i on rows xs[i] (`first[i]` the gate / up rows [2·I, d], gate rows first, or the up rows
    [I, d] of a non-gated expert; `down[i]` [d, I]) with every first product in one call, then every
    down product: `products(weights, inputs)` computes them at once ([Σ rows, out], each product's rows
    after the one before; None where it does not apply), `product(weight, rows)` one. Returns the
    experts' outputs so stacked, or None where the first call does not apply (callers run the experts
    one by one)."""
    y = products(first, xs)
    if y is None:
        return None
    sizes = [x.shape[0] for x in xs]
    if y.shape[0] <= FEW_TOKENS or rowwise_applies(y):
        # elementwise_rows computes each of these rows as alone: one call gives each expert's rows the
        # bits of a call of its own, without a call per expert
        hidden = activated(act, gated, y).split(sizes)
    else:
        hidden = [activated(act, gated, h) for h in y.split(sizes)]
    out = products(down, hidden)
    return out if out is not None else torch.cat([product(w, h) for w, h in zip(down, hidden, strict=True)])


def activated(act, gated: bool, y: torch.Tensor) -> torch.Tensor:
    """An expert's hidden rows from its first product y: act(gate) · up of y's two halves (gated), or
    act(y)."""
    if not gated:
        return elementwise_rows(act, y)
    gate, up = y.chunk(2, dim=-1)
    return gated_rows(act, gate, up)


def join_shared(
    index: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor | None, shared_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's choices [N, k] with the shared expert as one more, `shared_id` (past the routed
    experts', so `dispatch` orders it last), weighted by scale [N, 1] (its sigmoid gate, in the weights'
    dtype) or 1 -> index, weights [N, k + 1]."""
    n = index.shape[0]
    extra = weights.new_ones((n, 1)) if scale is None else scale
    return torch.cat([index, index.new_full((n, 1), shared_id)], 1), torch.cat([weights, extra], 1)


def joined_dispatch(experts: nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                    shared: GatedMLP) -> torch.Tensor:
    """`dispatch` of routed experts whose choices hold the shared expert `shared` as expert
    `experts.num_experts` (`join_shared`), on rows `experts.joins`: one experts call computes it with
    the chosen experts and adds it into each token's row after their sum is rounded (`Pairs.late`), the
    bits of `shared` computed apart and added by torch. Where the call does not apply after all, each
    runs on its own, the shared expert by its module."""
    shared_id = experts.num_experts

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return shared(rows) if e == shared_id else experts.expert(e, rows)

    def fused(es: list[int], xs: list[torch.Tensor], pairs: Pairs) -> torch.Tensor | None:
        return experts.fused(es, xs, pairs, shared)

    return dispatch(x.contiguous(), index, weights, expert, None, fused)


def joined_pairs(pairs: Pairs, xs: list[torch.Tensor]) -> Pairs:
    """`pairs` with the last product's (the joined shared expert's, on every token) added late."""
    return Pairs(pairs.weights, pairs.w_at, pairs.tokens, pairs.n, xs[-1].shape[0])


def _joinable(experts: nn.Module, mlp: nn.Module) -> bool:
    """A `GatedMLP` with a fused gate / up product, of gated experts' activation."""
    return type(mlp) is GatedMLP and experts.gated and mlp.act is experts.act and mlp.gate_up is not None


def _bf16_row(layer: nn.Module) -> torch.Tensor | None:
    """A bf16 CPU `Linear`'s weight [1, d] (contiguous, no bias, outside autograd): a gate row the router
    kernel reads."""
    if not isinstance(layer, nn.Linear):  # a QuantLinear is not one
        return None
    params = layer._parameters
    weight = params["weight"]
    ok = weight.dtype is torch.bfloat16 and weight.is_cpu and weight.is_contiguous()
    ok = ok and params["bias"] is None and not (torch.is_grad_enabled() and weight.requires_grad)
    return weight if ok else None


def _layers_of(mlp: GatedMLP) -> tuple[nn.Module, nn.Module]:
    """A fused `GatedMLP`'s gate / up layer (gate rows then up rows, an expert's first product) and down
    layer."""
    return mlp.gate_up._modules["proj"], mlp._modules["down_proj"]


class Experts(nn.Module):
    """The routed experts, stored as transformers holds them: gated (SwiGLU and the like)
    `gate_up_proj` [E, 2·I, d] (gate rows first), or non-gated (Nemotron's relu² experts) `up_proj`
    [E, I, d]; then `down_proj` [E, d, I]. `first` names the first projection."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str, gated: bool = True):
        super().__init__()
        self.num_experts, self.act_name, self.gated = num_experts, act, gated
        self.first = "gate_up_proj" if gated else "up_proj"
        rows = 2 * intermediate if gated else intermediate
        self.register_parameter(self.first, nn.Parameter(torch.empty(num_experts, rows, hidden)))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = ACTIVATIONS[act]

    def forward(
        self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, shared: GatedMLP | None = None
    ) -> torch.Tensor:
        """x [N, d], index / weights [N, k] -> [N, d] (see `dispatch`). Each expert runs as one matmul
        per projection over its tokens on a view of its weights (`ops.linear.linear`, so few-token
        bf16 calls take the decode kernel); decode rows of bf16 experts whose activation the experts
        kernel computes take one call of it for every chosen expert (`ops.moe.bf16_experts`). `shared`:
        a shared expert that `joins` these rows, chosen as expert `num_experts` (`join_shared`)."""
        if shared is not None:
            return joined_dispatch(self, x, index, weights, shared)
        if self._fuses(x, weights.dtype):
            return dispatch(x.contiguous(), index, weights, self.expert, self.grouped, self.fused)
        return dispatch(x, index, weights, self.expert, self.grouped)

    def joins(self, mlp: nn.Module, x: torch.Tensor, weights_dtype: torch.dtype) -> bool:
        """Whether shared expert `mlp` runs as one more expert in the experts kernel's call on x's rows:
        they are rows the call takes (`_fuses`), and `mlp` is a `GatedMLP` of this stack's activation
        whose fused gate / up product and down product have one expert's bf16 layout, without bias."""
        if not _joinable(self, mlp):
            return False
        proj, out = _layers_of(mlp)
        if isinstance(proj, QuantLinear) or isinstance(out, QuantLinear):
            return False
        first, down = self._parameters[self.first], self._parameters["down_proj"]
        p, o = proj._parameters, out._parameters
        w1, w2 = p["weight"], o["weight"]
        return (
            p.get("bias") is None
            and o.get("bias") is None
            and w1.dtype is w2.dtype is torch.bfloat16
            and w1.shape == first.shape[1:]
            and w2.shape == down.shape[1:]
            and w1.is_contiguous()
            and w2.is_contiguous()
            and self._fuses(x, weights_dtype)
        )

    def _fuses(self, x: torch.Tensor, weights_dtype: torch.dtype) -> bool:
        """Whether x's rows are decode rows the experts kernel computes: few (or inside `rowwise`),
        outside `prompt_rows`, bf16 on the CPU with contiguous bf16 weights, routing weights float32 or
        bf16, outside autograd and torch.compile."""
        first, down = self._parameters[self.first], self._parameters["down_proj"]
        grad = torch.is_grad_enabled()
        return (
            (self.act_name, self.gated) in KERNEL_ACTIVATIONS
            and kernel_decode_rows(x, weights_dtype)
            and first.dtype is torch.bfloat16
            and first.is_cpu
            and first.is_contiguous()
            and down.is_contiguous()
            and not (grad and (first.requires_grad or down.requires_grad or x.requires_grad))
            and BF16_EXPERTS_KERNEL.get() is not None
        )

    def fused(
        self, es: list[int], xs: list[torch.Tensor], pairs: Pairs, shared: GatedMLP | None = None
    ) -> torch.Tensor:
        """Experts es[i] on rows xs[i] combined by `pairs`, by the experts kernel: [pairs.n, d]; with
        `shared`, the last of es is the shared expert (added late: `Pairs.late`)."""
        first, down = self._parameters[self.first], self._parameters["down_proj"]
        if shared is None:
            return bf16_experts(first, down, es, xs, self.gated, pairs)
        proj, out = _layers_of(shared)
        extra = (proj._parameters["weight"], out._parameters["weight"])
        return bf16_experts(first, down, es, xs, self.gated, joined_pairs(pairs, xs), extra)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on rows x [n, d] -> [n, d]."""
        y = linear(x, getattr(self, self.first)[e])
        return linear(activated(self.act, self.gated, y), self.down_proj[e])

    def grouped(self, es: list[int], xs: list[torch.Tensor]) -> torch.Tensor | None:
        """Experts es[i] on rows xs[i] as `expert` computes each, stacked [Σ rows, d], in two kernel
        calls (every first product, then every down product: at decode a token's k experts would
        otherwise wake the threads 2·k times); None where the decode kernel does not take them
        (`linear_grouped`)."""
        first = getattr(self, self.first)
        return grouped_experts(
            self.act, self.gated, [first[e] for e in es], [self.down_proj[e] for e in es], xs,
            lambda ws, rows: linear_grouped(rows, ws), lambda w, rows: linear(rows, w),
        )


class QuantExperts(nn.Module):
    """Routed experts with int8 / int4 weights: per expert a `QuantLinear` in `gate_up_proj[e]`
    ([2·I, d], gate rows first; `up_proj[e]` [I, d] for non-gated experts) and `down_proj[e]` ([d, I]),
    so every path of the quantized linear layers serves them (int8-activation GEMMs on prompt chunks,
    the decode kernels). Decode rows (a few, or any number inside `rowwise`; not `prompt_rows`) take
    one call of the experts kernel for every chosen expert where it computes the activation
    (`ops.moe.quantized_experts`; +10.8 % a Qwen3.5-MoE int4 decode step on 2 Xeon cores against two
    grouped calls with torch's activation and a combine call between). A quantized checkpoint names
    their tensors `experts.gate_up_proj.{e}.qweight` / `.scales` and likewise for the others."""

    def __init__(self, first: list[QuantLinear], down: list[QuantLinear], act: str, gated: bool = True):
        super().__init__()
        self.num_experts, self.act_name, self.gated = len(first), act, gated
        self.first = "gate_up_proj" if gated else "up_proj"
        self.add_module(self.first, nn.ModuleList(first))
        self.down_proj = nn.ModuleList(down)
        self.act = ACTIVATIONS[act]
        self.int4 = 4 in (first[0].bits, down[0].bits)

    @classmethod
    @torch.no_grad()
    def from_experts(cls, experts: Experts, scheme: str, group_size: int = INT4_GROUP) -> QuantExperts:
        """`experts` quantized by `scheme` ("int8" / "int4"; a projection whose input width is not a
        multiple of `group_size` gets int8, as `ops.quant.quantize_` does for linear layers)."""

        def quantized(w: torch.Tensor) -> QuantLinear:
            layer = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            layer.weight = nn.Parameter(w, requires_grad=False)
            fits = scheme == "int8" or w.shape[1] % group_size == 0
            return QuantLinear.from_linear(layer, scheme if fits else "int8", group_size)

        first = getattr(experts, experts.first)
        firsts = [quantized(first[e]) for e in range(experts.num_experts)]
        down = [quantized(experts.down_proj[e]) for e in range(experts.num_experts)]
        return cls(firsts, down, experts.act_name, experts.gated)

    def forward(
        self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, shared: GatedMLP | None = None
    ) -> torch.Tensor:
        """x [N, d], index / weights [N, k] -> [N, d] (see `dispatch`); `shared` as `Experts.forward`."""
        if shared is not None:
            return joined_dispatch(self, x, index, weights, shared)
        if self._fuses(x, weights.dtype):
            return dispatch(x.contiguous(), index, weights, self.expert, self.grouped, self.fused)
        return dispatch(x, index, weights, self.expert, self.grouped)

    def joins(self, mlp: nn.Module, x: torch.Tensor, weights_dtype: torch.dtype) -> bool:
        """`Experts.joins` for quantized experts: the shared expert's fused gate / up and down layers are
        of the kind of the experts' own (`ops.quant.one_kind`)."""
        if not _joinable(self, mlp):
            return False
        proj, out = _layers_of(mlp)
        if not (isinstance(proj, QuantLinear) and isinstance(out, QuantLinear)):
            return False
        first, down = self._modules[self.first]._modules["0"], self.down_proj._modules["0"]
        return one_kind([first, proj]) and one_kind([down, out]) and self._fuses(x, weights_dtype)

    def _fuses(self, x: torch.Tensor, weights_dtype: torch.dtype) -> bool:
        """Whether x's rows are decode rows the experts kernel computes: few (or inside `rowwise`), bf16
        on the CPU, routing weights float32 or bf16, outside `prompt_rows`, on a CPU whose int4 decode
        rows take the kernel's tiles (float, or integer with `integer_experts`)."""
        return (
            (self.act_name, self.gated) in KERNEL_ACTIVATIONS
            and kernel_decode_rows(x, weights_dtype)
            and self.down_proj[0]._buffers["qweight"].is_cpu
            and (INT4_EXPERTS_KERNEL if self._integer() else EXPERTS_KERNEL).get() is not None
        )

    def _integer(self) -> bool:
        """Whether this CPU's int4 decode rows take the integer tiles (`integer_int4_decode`)."""
        return self.int4 and integer_int4_decode()

    def fused(
        self, es: list[int], xs: list[torch.Tensor], pairs: Pairs, shared: GatedMLP | None = None
    ) -> torch.Tensor | None:
        """Experts es[i] on rows xs[i] combined by `pairs`, by the experts kernel: [pairs.n, d] (None:
        the chosen experts' layers differ in kind, see `quantized_experts` / `integer_experts`); with
        `shared`, the last of es is the shared expert (added late: `Pairs.late`)."""
        first, down = self._modules[self.first]._modules, self.down_proj._modules
        keys = [str(e) for e in (es if shared is None else es[:-1])]
        firsts, downs = [first[k] for k in keys], [down[k] for k in keys]
        if shared is not None:
            proj, out = _layers_of(shared)
            firsts, downs, pairs = [*firsts, proj], [*downs, out], joined_pairs(pairs, xs)
        experts = integer_experts if self._integer() else quantized_experts
        return experts(firsts, downs, xs, self.gated, pairs)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on rows x [n, d] -> [n, d]."""
        y = getattr(self, self.first)[e](x)
        return self.down_proj[e](activated(self.act, self.gated, y))

    def grouped(self, es: list[int], xs: list[torch.Tensor]) -> torch.Tensor | None:
        """Experts es[i] on rows xs[i] as `expert` computes each, stacked [Σ rows, d], in two kernel
        calls where the quantized kernels take them (`ops.quant.grouped_quantized`); None otherwise."""
        first = getattr(self, self.first)
        return grouped_experts(
            self.act, self.gated, [first[e] for e in es], [self.down_proj[e] for e in es], xs,
            grouped_quantized, lambda layer, rows: layer(rows),
        )


def softmax_topk(
    logits: torch.Tensor, top_k: int, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, top_k] float32, expert ids [N, top_k]): the `top_k` largest
    softmax probabilities (computed in float32), renormalised to sum to 1 when `normalize`."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    weights, index = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, index


def sigmoid_topk(
    logits: torch.Tensor,
    top_k: int,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    normalize: bool = True,
    scaling: float = 1.0,
    eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, top_k] float32, expert ids [N, top_k]).

    Scores are sigmoid(logits) in float32. Selection ranks `scores + bias` (bias [E] or None);
    with `n_group` > 1 the E experts form `n_group` consecutive groups, each rated by the sum of its
    two best biased scores, and only the experts of the best `topk_group` groups compete. The
    weights are the chosen experts' unbiased scores, divided by their sum (+ `eps`: DeepSeek-V3
    and its kin add 1e-20, LFM2-MoE 1e-6) when `normalize`, then multiplied by `scaling`
    (`routed_scaling_factor`).
    """
    # elementwise_rows: a row's scores are the bits it gets alone (row independence in packed steps)
    scores = elementwise_rows(torch.sigmoid, logits.float())
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        n, e = choice.shape
        group_scores = choice.view(n, n_group, e // n_group).topk(2, dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // n_group, dim=1), float("-inf"))
    index = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, index)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    return weights * scaling, index


def check_routing(num_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1) -> None:
    """Raise `CheckpointError` unless a router can pick `top_k` of `num_experts` experts (in
    `topk_group` of `n_group` groups)."""
    if not 0 < top_k <= num_experts:
        raise CheckpointError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
    if n_group > 1:
        if num_experts % n_group or num_experts // n_group < 2:
            raise CheckpointError(
                f"n_group={n_group} must divide num_experts={num_experts} into groups of 2 or more experts"
            )
        if not 0 < topk_group <= n_group or top_k > topk_group * (num_experts // n_group):
            raise CheckpointError(
                f"topk_group={topk_group} of n_group={n_group} groups cannot hold "
                f"num_experts_per_tok={top_k} experts"
            )


def routes_in_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `ops.moe.route_rows` takes a router of `weight` [E, d] (and selection `bias`) on x's rows:
    decode rows (`kernel_decode_rows`), a bf16 contiguous weight, a float32 bias, outside autograd."""
    return (
        kernel_decode_rows(x)
        and weight.dtype is torch.bfloat16
        and weight.is_contiguous()
        and (bias is None or (bias.dtype is torch.float32 and bias.is_contiguous() and bias.is_cpu))
        and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
        and ROUTE_KERNEL.get() is not None
    )


class Router(nn.Module):
    """A router's parameters (`weight` [E, d], the checkpoints' `gate.weight`; with `bias`, the
    selection bias buffer `e_score_correction_bias` [E], float32 in a model of any dtype) and its
    rule: `scoring` SOFTMAX (`softmax_topk`) or SIGMOID (`sigmoid_topk` with the group,
    normalisation and scaling settings). `float32_logits`: the logits multiply in float32
    (DeepSeek-V3's kin), else in the activation dtype (Qwen, LFM2)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        scoring: str = SOFTMAX,
        normalize: bool = True,
        bias: bool = False,
        n_group: int = 1,
        topk_group: int = 1,
        scaling: float = 1.0,
        eps: float = 1e-20,
        float32_logits: bool = False,
    ):
        super().__init__()
        if scoring not in (SOFTMAX, SIGMOID):
            raise ValueError(f"router scoring {scoring!r}: expected {SOFTMAX!r} or {SIGMOID!r}")
        if scoring == SOFTMAX and (bias or n_group > 1 or scaling != 1.0):
            raise ValueError("a softmax router takes no selection bias, groups or scaling")
        check_routing(num_experts, top_k, n_group, topk_group)
        self.top_k, self.scoring, self.normalize = top_k, scoring, normalize
        self.n_group, self.topk_group, self.scaling, self.eps = n_group, topk_group, scaling, eps
        self.float32_logits = float32_logits
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        if bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse: bool = True):
        # The selection bias stays float32 when the model changes dtype (see checkpoint.FLOAT32_SUFFIXES);
        # only its device follows.
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        if bias is not None:
            self.e_score_correction_bias = bias.to(device=self.weight.device, dtype=torch.float32)
        return self

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, d] -> router logits [N, E] (float32 or x's dtype, see `float32_logits`)."""
        if self.float32_logits:
            return linear(x.float(), self.weight.float())
        return linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> (routing weights [N, k] float32, expert ids [N, k])."""
        return self.route(self.logits(x))

    def routes_rows(self, x: torch.Tensor) -> bool:
        """Whether the router kernel computes this router on x's rows (`route_rows`, `routes_in_kernel`)."""
        return routes_in_kernel(x, self._parameters["weight"], self.e_score_correction_bias)

    def route_rows(
        self, x: torch.Tensor, gate: torch.Tensor | None, scale: torch.Tensor | None, shared_id: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`route` of this router's logits on rows `routes_rows` takes, by one kernel call
        (`ops.moe.route_rows`: with the shared expert joined where `shared_id` >= 0, and its gate's scale
        from the gate row or as given) -> (weights in `dtype`, expert ids, scale)."""
        return route_rows(
            x.contiguous(), self._parameters["weight"], self.top_k, self.scoring == SIGMOID, self.normalize,
            self.e_score_correction_bias, self.scaling, self.eps, gate, scale, shared_id, dtype,
            self.float32_logits, self.n_group, self.topk_group,
        )

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This router's rule over its logits [N, E] -> (routing weights [N, k] float32, expert ids)."""
        if self.scoring == SOFTMAX:
            return softmax_topk(logits, self.top_k, self.normalize)
        return sigmoid_topk(
            logits, self.top_k, self.e_score_correction_bias, self.n_group, self.topk_group,
            self.normalize, self.scaling, self.eps,
        )


class SparseMoE(nn.Module):
    """`gate` (a `Router`) picks experts of `experts` per token; plus, when given, a shared expert under
    attribute `shared_name` (`shared_expert` in Qwen, `shared_experts` in DeepSeek's kin) added to
    every token, scaled by sigmoid(`shared_expert_gate`(x)) [N, 1] when `gated_shared`.

    `weights_dtype`: the dtype the routing weights multiply the experts' outputs in: "float32"
    (DeepSeek-V3's kin, Gemma 4) or "activation" (Qwen, LFM2-MoE: transformers rounds them first).
    """

    UNQUANTIZED = ("shared_expert_gate",)  # a [1, d] gate the router kernel computes: see models.quantized

    def __init__(
        self,
        gate: Router,
        experts: Experts,
        shared: nn.Module | None = None,
        shared_name: str = "shared_expert",
        gated_shared: bool = False,
        weights_dtype: str = "float32",
    ):
        super().__init__()
        if weights_dtype not in ("float32", "activation"):
            raise ValueError(f"weights_dtype {weights_dtype!r}: expected 'float32' or 'activation'")
        self.gate, self.experts = gate, experts
        self.shared_name = shared_name if shared is not None else None
        if shared is not None:
            setattr(self, shared_name, shared)
        hidden = gate.weight.shape[1]
        gated = shared is not None and gated_shared
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if gated else None
        self.weights_in_activation_dtype = weights_dtype == "activation"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] -> [..., d]."""
        shared = None if self.shared_name is None else getattr(self, self.shared_name)
        return self.routed(x, self.gate.logits, shared, self.shared_expert_gate)

    def routed(self, x: torch.Tensor, logits, shared, shared_gate) -> torch.Tensor:
        """`forward` with the router's logits, the shared expert and its gate given as functions (the
        modules, or a decode plan's direct kernel calls; None where the block has none)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        dtype = x.dtype if self.weights_in_activation_dtype else torch.float32
        mlp = None if shared is None else getattr(self, self.shared_name)
        # scale · y rounds to bf16 in torch; the kernels round a product so only with bf16 weights
        join = (
            mlp is not None
            and (shared_gate is None or dtype is torch.bfloat16)
            and self.experts.joins(mlp, x, dtype)
        )
        weights, index, scale = self._route(x, logits, shared_gate, join, dtype)
        if mlp is None or join:
            return self.experts.forward(x, index, weights, mlp if join else None).view(shape)
        y = shared(x)
        return (self.experts.forward(x, index, weights) + (y if scale is None else scale * y)).view(shape)

    def _route(
        self, x: torch.Tensor, logits, shared_gate, join: bool, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [N, d]'s routing weights [N, k] in `dtype` and expert ids, with the shared expert as one more
        choice where it `join`s (`join_shared`), and the shared expert's gate scale [N, 1] (None without
        a gate): by one router kernel call on decode rows (`Router.routes_rows`), else torch's ops."""
        shared_id = self.experts.num_experts if join else -1
        gate_row = None if shared_gate is None else _bf16_row(self.shared_expert_gate)
        scale = None
        if shared_gate is not None and gate_row is None:  # a quantized gate: its own kernel
            scale = elementwise_rows(torch.sigmoid, shared_gate(x))
        if self.gate.routes_rows(x):
            return self.gate.route_rows(x, gate_row, scale, shared_id, dtype)
        weights, index = self.gate.route(logits(x))
        weights = weights.to(dtype)
        if shared_gate is not None and scale is None:
            scale = elementwise_rows(torch.sigmoid, shared_gate(x))
        if join:
            index, weights = join_shared(index, weights, scale, shared_id)
        return weights, index, scale


def stack_experts(
    state: dict[str, torch.Tensor],
    prefix: str,
    num_experts: int,
    hidden: int,
    intermediate: int,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> None:
    """Stack the per-expert tensors `{prefix}.{e}.{gate,up,down}.weight` of `state` (in place) into
    `Experts`' `{prefix}.gate_up_proj` [E, 2·I, d] and `{prefix}.down_proj` [E, d, I]. `names`: the
    checkpoint's gate / up / down names (LFM2-MoE and Kimi: w1 / w3 / w2). A state already holding
    the stacked tensors (checkpoints written fused) is left as it is; a missing or misshapen expert
    tensor raises `CheckpointError`."""
    gate_name, up_name, down_name = names
    if f"{prefix}.0.{gate_name}.weight" not in state:
        return
    n = range(num_experts)
    gate = [take(state, f"{prefix}.{e}.{gate_name}.weight", (intermediate, hidden)) for e in n]
    up = [take(state, f"{prefix}.{e}.{up_name}.weight", (intermediate, hidden)) for e in n]
    down = [take(state, f"{prefix}.{e}.{down_name}.weight", (hidden, intermediate)) for e in n]
    state[f"{prefix}.gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
    state[f"{prefix}.down_proj"] = torch.stack(down)
