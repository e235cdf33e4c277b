"""Decode steps as straight-line kernel calls (`DecodePlan`).

A decode step of a model built from the shared layers is ~300 module calls, each checking its inputs
and choosing a path before it reaches its kernel. At a few bf16 rows on the CPU (a decode step, a
speculative verify pass: up to `FEW_TOKENS` tokens of one sequence) every call reaches the same
kernel step after step, and the choosing costs ≈ 5 ms a step on the Qwen3.5-0.8B preset (a fifth of
an int4 step). A plan makes the choices once per model and calls the linear and norm kernels
directly, on the inputs the layers would hand them (and a Gated DeltaNet's conv and scan kernels);
between its projections a mixer or MoE block runs its own code (`GatedDeltaNet.scan_projected`,
`Attention.attend_projected`, `SparseMoE.routed`) with the plan's norms and products (a Mamba-2
mixer's conv, step and norm kernels are the plan's calls too). A block that only composes its
children (`DecoderLayer` and its kin) has a `run(parts, ...)` over them by name, which its forward
calls with its modules and the plan with their ops. The same
kernels on the same inputs: the same bits as the module path (tests/models/test_decode.py). Caches
advance through the layers' own code, so captures, recording and copy-on-write behave as in any
forward.

What the plan does not know runs as its module: a block without `run` whose type the plan has no op
for, a linear or norm of another kind or without its kernel, a scan step that must report split
states. `CausalLM.hidden_states` takes a plan for a
B = 1 batch of 1 to `FEW_TOKENS` tokens, or a `Packed` batch of such segments, on a bf16 CPU model,
with autograd off, outside `prompt_rows` (whose rows take prefill's integer path) and `without_plans`;
``HYBRIDLM_DECODE_PLAN=0`` turns plans off.

A plan holds the modules it was built from and checks each step that they are still in place (a
module swapped by `quantize_` or fusion builds a new plan); it reads parameters from their modules'
dicts at every call, so reassigned weights are read as they are.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from hybridlm.batch import Batch, Packed
from hybridlm.models.layers import Attention, GatedDeltaNet, GatedMLP, few_segments, per_segment
from hybridlm.models.mamba2 import Mamba2Mixer
from hybridlm.models.moe import SparseMoE
from hybridlm.ops.conv import CONV_KERNEL
from hybridlm.ops.elementwise import gated_rows
from hybridlm.ops.gated_delta import GDN_KERNEL
from hybridlm.ops.linear import KERNEL as BF16_KERNEL
from hybridlm.ops.linear import FusedLinear, Linear, kernel_rows
from hybridlm.ops.mamba2 import GATED_NORM_KERNEL, STEP_KERNEL
from hybridlm.ops.native import FEW_TOKENS, ThreadFlag
from hybridlm.ops.norms import (
    FLOAT32,
    GATED,
    NORM_KERNEL,
    OFFSET,
    RMS,
    Float32RMSNorm,
    GatedRMSNorm,
    OffsetRMSNorm,
    RMSNorm,
)
from hybridlm.ops.quant import INT4_KERNEL, INT8_KERNEL, QuantLinear
from hybridlm.ops.quant_gemm import prompt_rows_on

BF16 = torch.bfloat16
Op = Callable[..., torch.Tensor]

_PLANS: weakref.WeakKeyDictionary[nn.Module, DecodePlan | None] = weakref.WeakKeyDictionary()
_OFF = ThreadFlag()


def without_plans() -> AbstractContextManager[None]:
    """Inside, (on this thread) decode steps run through the modules: the path a plan replaces, for
    profiles and comparisons."""
    return _OFF.raised()


def decode_plan(model: nn.Module, batch: Batch) -> DecodePlan | None:
    """`model`'s plan when `batch` is 1 to `FEW_TOKENS` tokens of one sequence, or a `Packed` batch of
    such segments (the decode and verify rows of several sequences: every op of a plan takes any number
    of rows, its linears and norms computing each row alone, its mixers and caches per segment), and a
    plan applies; else None."""
    b, length = batch.input_ids.shape
    if type(batch) is Packed:
        few = len(few_segments(batch)) == len(batch.segments)
    else:
        few = type(batch) is Batch and b == 1 and 0 < length <= FEW_TOKENS and batch.query_lens[0] == length
    if not few or prompt_rows_on() or _OFF or torch.is_grad_enabled():  # no kernel is differentiable
        return None
    if model not in _PLANS:
        _PLANS[model] = DecodePlan.build(model)
    plan = _PLANS[model]
    if plan is not None and not plan.current():
        plan = _PLANS[model] = DecodePlan.build(model)
    return plan


def forget_plan(model: nn.Module) -> None:
    """Drop `model`'s plan (its dtype or device is changing); the next decode step builds another."""
    _PLANS.pop(model, None)


class DecodePlan:
    """The decode step of one model: per layer a function (h [1, L, d], batch, cache) -> h. It holds
    the model's modules, not the model (whose entry in the plans' weak table would then never die)."""

    def __init__(self, layers: list[Op], norm: Op, watch: list):
        self.layers, self.norm, self.watch = layers, norm, watch

    @classmethod
    def build(cls, model: nn.Module) -> DecodePlan | None:
        """The plan of `model` (a `CausalLM` with `model.layers` and `model.norm`), or None where none
        applies: plans turned off, weights not bf16 on the CPU."""
        if os.environ.get("HYBRIDLM_DECODE_PLAN", "1") == "0":
            return None
        embed = model.model.embed_tokens.weight
        if embed.dtype is not BF16 or not embed.is_cpu:
            return None
        watch: list[tuple[dict, str, nn.Module]] = []
        stack = model.model.layers
        layers = [_op(_child(stack, str(i), watch), watch) for i in range(len(stack))]
        return cls(layers, _norm_op(_child(model.model, "norm", watch)), watch)

    def current(self) -> bool:
        """Whether every module the plan runs is still where it was when the plan was built."""
        return all(modules.get(name) is module for modules, name, module in self.watch)

    def __call__(self, model: nn.Module, batch: Batch, caches: list) -> torch.Tensor:
        """`model.hidden_states` of a few-token batch: [1, L, d] final-normed; advances the caches."""
        model.prepare(batch)
        h = model.embed(batch)
        for layer, cache in zip(self.layers, caches, strict=True):
            h = layer(h, batch, cache)
        return self.norm(h)


def _child(parent: nn.Module, name: str, watch: list) -> nn.Module | None:
    """`parent`'s submodule `name`, remembered so the plan notices when it is replaced."""
    module = parent._modules[name]
    watch.append((parent._modules, name, module))
    return module


def _op(module: nn.Module | None, watch: list) -> Op | None:
    """What runs `module` in a plan: its kernels called directly where the plan knows its type; a
    module whose forward is `run` over its children (`DecoderLayer` and the like) as that `run` over
    their ops; anything else as the module itself."""
    kind = type(module)
    if kind in _NORM_MODES:
        return _norm_op(module)
    if kind in (Linear, QuantLinear, FusedLinear):
        return _linear_op(module, watch)
    special = _SPECIAL.get(kind)
    if special is not None:
        return special(module, watch)
    if _composes(kind):
        parts = {name: _op(_child(module, name, watch), watch) for name in module._modules}
        return lambda *args: module.run(parts, *args)
    return module


def _composes(kind: type) -> bool:
    """Whether a module of `kind` computes its forward as its `run`: the nearest class defining either
    defines `run` (a subclass that overrides `forward` alone computes otherwise)."""
    owner = next((c for c in kind.__mro__ if "forward" in vars(c) or "run" in vars(c)), None)
    return owner is not None and "run" in vars(owner)


def _linear_op(module: nn.Module, watch: list) -> Op:
    """x [1, L, in] bf16 -> what `module(x)` returns, by its decode kernel's call alone."""
    if type(module) is FusedLinear:
        proj, sizes = _linear_op(_child(module, "proj", watch), watch), module.sizes
        return lambda x: torch.split_with_sizes(proj(x), sizes, dim=-1)
    if type(module) not in (QuantLinear, Linear):
        return module
    params, n, k = module._parameters, module.out_features, module.in_features
    bias = params.get("bias")
    if bias is not None and bias.dtype is not BF16:
        return module
    if type(module) is QuantLinear:
        buffers = module._buffers
        if not buffers["qweight"].is_cpu:
            return module
        bits, fn = module.bits, (INT8_KERNEL if module.bits == 8 else INT4_KERNEL).get()
        fp16, group = int(buffers["scales"].dtype is torch.float16), module.group_size
        if fn is None:
            return module
        if module._decodes_in_integers():  # this CPU's int4 decode rows take prefill's integer kernel
            return lambda x: module._forward_integer(x.reshape(-1, k)).view(*x.shape[:-1], n)

        def quantized(x: torch.Tensor) -> torch.Tensor:
            if x.numel() > FEW_TOKENS * k:  # more rows than the kernel takes: the layer's row groups
                return module(x)
            if not x.is_contiguous():
                x = x.contiguous()
            y = x.new_empty((*x.shape[:-1], n))
            b = params.get("bias")
            b = None if b is None else b.data_ptr()
            q, s = buffers["qweight"].data_ptr(), buffers["scales"].data_ptr()
            threads = torch.get_num_threads()
            if bits == 8:
                fn(x.data_ptr(), x.numel() // k, q, s, b, y.data_ptr(), n, k, threads)
            else:
                fn(x.data_ptr(), x.numel() // k, q, s, fp16, b, y.data_ptr(), n, k, group, threads)
            return y

        return quantized
    return _dense_op(params, n, k, module)


def _dense_op(params: dict, n: int, k: int, fallback: Op) -> Op:
    """x [..., k] bf16 -> x · params["weight"]ᵀ (+ params["bias"]) [..., n] by the bf16 decode kernel's
    call alone, as `ops.linear.linear` computes it; `fallback` (what the layer would run) where the
    kernel does not take the weights, or x has more rows than it takes."""
    weight, bias, fn, most = params.get("weight"), params.get("bias"), BF16_KERNEL.get(), kernel_rows()
    if (
        fn is None
        or most < 1
        or weight.dtype is not BF16
        or not weight.is_cpu
        or not weight.is_contiguous()
        or (bias is not None and not bias.is_contiguous())
    ):
        return fallback

    def dense(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // k
        if rows > most:  # more rows than this CPU's kernel takes: F.linear, as `linear` does
            return fallback(x)
        if not x.is_contiguous():
            x = x.contiguous()
        y = torch.empty((*x.shape[:-1], n), dtype=BF16)
        b = params.get("bias")
        b = None if b is None else b.data_ptr()
        fn(x.data_ptr(), rows, params["weight"].data_ptr(), b, y.data_ptr(), n, k, torch.get_num_threads())
        return y

    return dense


_NORM_MODES = {RMSNorm: RMS, OffsetRMSNorm: OFFSET, GatedRMSNorm: GATED, Float32RMSNorm: FLOAT32}


def _norm_op(module: nn.Module) -> Op:
    """x [..., D] (gated: and the gate) -> what `module` returns, by the fused norm's call alone."""
    mode, fn = _NORM_MODES.get(type(module)), NORM_KERNEL.get()
    params = module._parameters
    weight = params.get("weight")
    if mode is None or fn is None or weight.dtype is not BF16:
        return module
    eps = module.eps

    def norm(x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        if gate is not None:
            gate = gate.contiguous()
        out = torch.empty_like(x)
        d = x.shape[-1]
        g = None if gate is None else gate.data_ptr()
        fn(x.data_ptr(), params["weight"].data_ptr(), g, out.data_ptr(), x.numel() // d, d, eps, mode, 1,
           torch.get_num_threads())
        return out

    return norm


def _projections(module: nn.Module, fused: str, parts: tuple[str, ...], watch: list) -> Op:
    """x -> the outputs of `parts` (one call of the fused projection where the module has one)."""
    if module._modules.get(fused) is not None:
        return _linear_op(_child(module, fused, watch), watch)
    ops = [_linear_op(_child(module, name, watch), watch) for name in parts]
    return lambda x: tuple(op(x) for op in ops)


def _mlp_op(mlp: GatedMLP, watch: list) -> Op:
    """`GatedMLP.forward` of a few rows."""
    gate_up = _projections(mlp, "gate_up", ("gate_proj", "up_proj"), watch)
    down, act = _linear_op(_child(mlp, "down_proj", watch), watch), mlp.act

    def ffn(x: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up(x)
        return down(gated_rows(act, gate, up))

    return ffn


def _moe_op(moe: SparseMoE, watch: list) -> Op:
    """`SparseMoE.forward`: the block's own routing and dispatch (`SparseMoE.routed`) around the plan's
    router product and shared expert."""
    router = _child(moe, "gate", watch)
    _child(moe, "experts", watch)  # a swapped expert stack (quantize_) builds a new plan
    logits = router.logits
    if not router.float32_logits:  # float32 logits take `linear`'s float32 path, not a decode kernel
        logits = _dense_op(router._parameters, *router.weight.shape, router.logits)
    shared = gate = None
    if moe.shared_name is not None:
        shared = _op(_child(moe, moe.shared_name, watch), watch)
    if moe.shared_expert_gate is not None:
        gate = _linear_op(_child(moe, "shared_expert_gate", watch), watch)
    return lambda x: moe.routed(x, logits, shared, gate)


def _gdn_op(m: GatedDeltaNet, watch: list) -> Op:
    """`GatedDeltaNet.forward` of a few tokens: the layer's `scan_projected` between the plan's
    projections and norm, its conv and scan kernels called directly when the cache asks for no split
    states (else the layer's own `scan_history`). The wrappers' checks cost ≈ 0.6 ms of a
    Qwen3.5-0.8B step (18 layers)."""
    project = _projections(m, "in_proj", ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"), watch)
    out_proj = _linear_op(_child(m, "out_proj", watch), watch)
    norm = _norm_op(_child(m, "norm", watch))
    conv_params, params = _child(m, "conv1d", watch)._parameters, m._parameters
    conv_fn, scan_fn = CONV_KERNEL.get(), GDN_KERNEL.get()
    channels, width, hk, hv, dk, dv = m.conv_dim, m.kernel, m.k_heads, m.v_heads, m.k_dim, m.v_dim
    fused = (
        conv_fn is not None
        and scan_fn is not None
        and width > 1
        and conv_params["weight"].dtype is BF16
        and conv_params.get("bias") is None
        and params["A_log"].dtype in (BF16, torch.float32)
        and params["dt_bias"].dtype is params["A_log"].dtype
    )
    a_bf16 = int(params["A_log"].dtype is BF16)

    def scan(batch: Batch, cache, qkv: torch.Tensor, ab: torch.Tensor) -> torch.Tensor:
        hist = cache.get(batch)
        state, prior = hist.state, hist.conv_tail
        if not (fused and not hist.splits and prior.dtype is BF16 and state.dtype is torch.float32
                and state.is_contiguous()):
            return m.scan_history(batch, cache, hist, qkv, ab)
        threads, length = torch.get_num_threads(), qkv.shape[1]
        qkv, prior = qkv.contiguous(), prior.contiguous()
        x = torch.empty(1, length, channels, dtype=BF16)
        tail = torch.empty(1, width - 1, channels, dtype=BF16)
        conv_fn(qkv.data_ptr(), prior.data_ptr(), conv_params["weight"].data_ptr(), None, x.data_ptr(),
                tail.data_ptr(), None, None, 0, None, 1, length, channels, width, 1, 1, threads)
        o = torch.empty(1, length, hv, dv, dtype=BF16)
        scan_fn(x.data_ptr(), ab.data_ptr(), params["A_log"].data_ptr(), params["dt_bias"].data_ptr(),
                state.data_ptr(), o.data_ptr(), None, None, 0, None, 1, length, hk, hv, dk, dv, dk**-0.5, 1,
                a_bf16, threads)
        record = hist.record
        cache.put(batch, tail, state, [], inputs=qkv if record else None, gates=ab if record else None)
        return o

    return lambda x, batch, cache: out_proj(m.scan_projected(*project(x), batch, cache, norm, scan))


def _attention_op(m: Attention, watch: list) -> Op:
    """`Attention.forward` of a few tokens: the plan's projections and q / k norms around the layer's
    own rotary and attention (`attend_projected`)."""
    project = _projections(m, "qkv_proj", ("q_proj", "k_proj", "v_proj"), watch)
    o_proj = _linear_op(_child(m, "o_proj", watch), watch)
    q_norm = k_norm = None
    if m.q_norm is not None:
        q_norm, k_norm = _norm_op(_child(m, "q_norm", watch)), _norm_op(_child(m, "k_norm", watch))
    return lambda x, batch, cache: o_proj(m.attend_projected(*project(x), batch, cache, q_norm, k_norm))


def _mamba2_op(m: Mamba2Mixer, watch: list) -> Op:
    """`Mamba2Mixer.forward` of a few tokens of one sequence or of packed segments (no padding to mask):
    the plan's in / out projections around the layer's conv, step and gated norm kernels, called
    directly for one sequence when its cache asks for no split states (else the layer's own
    `scan_history`; packed segments: the layer's `scan_packed`, one call of each kernel for them all),
    with A = -exp(A_log), dt_bias and D in float32 computed once per parameter version. The wrappers'
    checks and conversions cost ≈ 4 ms of a ~95 ms Granite-4.0-H-Tiny-shaped bf16 step (18 Mamba-2
    layers)."""
    in_proj = _linear_op(_child(m, "in_proj", watch), watch)
    out_proj = _linear_op(_child(m, "out_proj", watch), watch)
    conv_params, params = _child(m, "conv1d", watch)._parameters, m._parameters
    gate = _child(m, "norm", watch)
    fns = conv_fn, step_fn, norm_fn = CONV_KERNEL.get(), STEP_KERNEL.get(), GATED_NORM_KERNEL.get()
    bias = conv_params.get("bias")
    if (
        None in fns
        or m.kernel < 2
        or conv_params["weight"].dtype is not BF16
        or (bias is not None and bias.dtype is not BF16)
        or gate._parameters["weight"].dtype is not BF16
        or m.inner % gate.groups
    ):
        return lambda x, batch, cache: out_proj(m.mixed(in_proj(x), batch, cache, x.dtype))
    sizes, lo, hi = [m.inner, m.conv_dim, m.heads], *m.dt_limit
    shape = (m.heads, m.head_dim, m.groups, m.state_size)
    held: list = [(None,) * 3, ()]  # the parameters (A_log, dt_bias, D) the constants are of, their versions
    constants: list = []  # A, dt_bias, D in float32

    def floats() -> list[torch.Tensor]:
        now = (params["A_log"], params["dt_bias"], params["D"])
        versions = tuple(t._version for t in now)
        if any(t is not u for t, u in zip(now, held[0], strict=True)) or versions != held[1]:
            a_log, dt_bias, d = now
            held[:], constants[:] = [now, versions], [-a_log.float().exp(), dt_bias.float(), d.float()]
        return constants

    def scan(batch: Batch, cache, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        hist = cache.get(batch)
        state, prior = hist.state, hist.conv_tail
        own = prior.dtype is BF16 and state.dtype is torch.float32 and state.is_contiguous()
        if hist.splits or not own:
            return m.scan_history(batch, cache, hist, xbc, dt)
        threads, length, channels = torch.get_num_threads(), xbc.shape[1], m.conv_dim
        x, steps, prior = xbc.contiguous(), dt.contiguous(), prior.contiguous()
        conv = torch.empty(1, length, channels, dtype=BF16)
        tail = torch.empty(1, m.kernel - 1, channels, dtype=BF16)
        b = conv_params.get("bias")
        conv_fn(x.data_ptr(), prior.data_ptr(), conv_params["weight"].data_ptr(),
                None if b is None else b.data_ptr(), conv.data_ptr(), tail.data_ptr(), None, None, 0, None, 1,
                length, channels, m.kernel, 1, 1, threads)
        a, dt_bias, d = floats()
        y = torch.empty(1, length, m.inner, dtype=torch.float32)
        step_fn(conv.data_ptr(), steps.data_ptr(), a.data_ptr(), dt_bias.data_ptr(), d.data_ptr(),
                state.data_ptr(), y.data_ptr(), None, None, 0, None, 1, length, *shape, lo, hi, 1, threads)
        record = hist.record
        cache.put(batch, tail, state, [], inputs=xbc if record else None, gates=dt if record else None)
        return y

    def gated(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        out, weight = torch.empty(y.shape, dtype=BF16), gate._parameters["weight"]
        norm_fn(y.data_ptr(), z.data_ptr(), z.stride(1), weight.data_ptr(), out.data_ptr(), y.shape[1],
                m.inner, gate.groups, gate.eps, int(gate.norm_before_gate), torch.get_num_threads())
        return out

    def mixer(x: torch.Tensor, batch: Batch, cache) -> torch.Tensor:
        z, xbc, dt = torch.split_with_sizes(in_proj(x), sizes, dim=-1)
        packed = lambda few, *rows: m.scan_packed(batch, cache, few, *rows, constants=floats())
        y = per_segment(batch, cache, scan, xbc, dt, packed=packed)
        return out_proj(gated(y.view(z.shape), z))

    return mixer


# The blocks whose kernels a plan calls itself, by exact type (a subclass may compute otherwise).
_SPECIAL = {
    GatedMLP: _mlp_op,
    SparseMoE: _moe_op,
    GatedDeltaNet: _gdn_op,
    Attention: _attention_op,
    Mamba2Mixer: _mamba2_op,
}
