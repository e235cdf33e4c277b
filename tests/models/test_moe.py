"""The MoE building blocks (`models.moe`): routers against a brute-force float64 reference and against
transformers' own routers, the routed experts against a dense per-token float64 computation, the
sparse block's shared expert, the stacking of per-expert checkpoint tensors, and the routing
settings a router refuses."""

from __future__ import annotations

import json
import shutil
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from hybridlm.models import load_model
from hybridlm.models.checkpoint import CheckpointError
from hybridlm.models.fused import fuse_projections
from hybridlm.models.layers import GatedMLP
from hybridlm.models.moe import (
    SIGMOID,
    SOFTMAX,
    Experts,
    QuantExperts,
    Router,
    SparseMoE,
    check_routing,
    dispatch,
    sigmoid_topk,
    softmax_topk,
    stack_experts,
)
from hybridlm.ops.linear import rowwise
from hybridlm.ops.native import FEW_TOKENS
from hybridlm.ops.quant import quantize_
from hybridlm.ops.quant_gemm import ACT_BLOCK, integer_prefill, prompt_rows, quantize_activations


def brute_force_route(
    logits: torch.Tensor, top_k: int, scoring: str, bias=None, n_group=1, topk_group=1,
    normalize=True, scaling=1.0, eps=1e-20,
) -> list[dict[int, float]]:
    """Per token {expert: weight} in float64, by sorting Python lists: the definition of each rule."""
    out = []
    for row in logits.double().tolist():
        e = len(row)
        if scoring == SOFTMAX:
            top = max(row)
            exp = [pow(2.718281828459045, v - top) for v in row]
            scores = [v / sum(exp) for v in exp]
            choice = scores
        else:
            scores = [1 / (1 + pow(2.718281828459045, -v)) for v in row]
            choice = [s + (0.0 if bias is None else float(bias[j])) for j, s in enumerate(scores)]
        allowed = set(range(e))
        if n_group > 1:
            size = e // n_group
            rating = {g: sum(sorted(choice[g * size : (g + 1) * size])[-2:]) for g in range(n_group)}
            best = sorted(rating, key=rating.get)[-topk_group:]
            allowed = {j for g in best for j in range(g * size, (g + 1) * size)}
        chosen = sorted(allowed, key=lambda j: choice[j])[-top_k:]
        weights = {j: scores[j] for j in chosen}
        if normalize:
            total = sum(weights.values()) + (eps if scoring == SIGMOID else 0.0)
            weights = {j: w / total for j, w in weights.items()}
        out.append({j: w * scaling for j, w in weights.items()})
    return out


def assert_routes(weights: torch.Tensor, index: torch.Tensor, want: list[dict[int, float]], tol: float):
    """The same experts chosen per token (in any order) with the reference's weights."""
    assert weights.dtype is torch.float32 and weights.shape == index.shape
    for w_row, i_row, ref in zip(weights.tolist(), index.tolist(), want, strict=True):
        assert sorted(i_row) == sorted(ref)
        for j, w in zip(i_row, w_row, strict=True):
            assert w == pytest.approx(ref[j], rel=tol, abs=tol)


def logits_for(n: int, e: int, seed: int) -> torch.Tensor:
    return torch.randn(n, e, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_topk_picks_the_most_probable_experts_and_renormalises_their_weights(normalize):
    logits = logits_for(12, 7, seed=1)
    weights, index = softmax_topk(logits, 3, normalize)
    assert_routes(weights, index, brute_force_route(logits, 3, SOFTMAX, normalize=normalize), 1e-6)
    if normalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(12))


@pytest.mark.parametrize(
    ("e", "k", "n_group", "topk_group", "normalize", "scaling", "eps"),
    [
        (6, 2, 1, 1, True, 1.0, 1e-6),  # LFM2-MoE's rule
        (12, 3, 4, 2, True, 2.5, 1e-20),  # DeepSeek-V3's kin: groups, scaling
        (10, 4, 5, 3, False, 1.5, 1e-20),  # experts not a power of two, no normalisation
    ],
)
def test_sigmoid_topk_selects_by_biased_scores_and_weights_by_unbiased_ones(
    e, k, n_group, topk_group, normalize, scaling, eps
):
    logits = logits_for(16, e, seed=e + k)
    # a bias large enough to change the choice of many tokens
    bias = torch.randn(e, generator=torch.Generator().manual_seed(3)) * 0.5
    weights, index = sigmoid_topk(logits, k, bias, n_group, topk_group, normalize, scaling, eps)
    want = brute_force_route(logits, k, SIGMOID, bias, n_group, topk_group, normalize, scaling, eps)
    assert_routes(weights, index, want, 1e-6)
    unbiased = sigmoid_topk(logits, k, None, n_group, topk_group, normalize, scaling, eps)[1]
    assert not torch.equal(index.sort(-1).values, unbiased.sort(-1).values)


def test_group_limited_selection_never_leaves_the_chosen_groups():
    logits = logits_for(32, 16, seed=5)
    _, index = sigmoid_topk(logits, 4, None, n_group=4, topk_group=1)
    # one group of four experts kept: every token's four experts are that group
    assert torch.equal(index.sort(-1).values % 4, torch.arange(4).expand(32, 4))


def hf_config(**kw):
    from types import SimpleNamespace

    return SimpleNamespace(hidden_size=8, **kw)


def test_routers_equal_transformers_qwen3_5_moe_lfm2_moe_and_deepseek_v3():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeTopKRouter
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(20, 8, generator=gen)
    cases = [
        (
            Qwen3_5MoeTopKRouter(hf_config(num_experts_per_tok=3, num_experts=7)),
            Router(8, 7, 3, SOFTMAX),
        ),
        (
            Lfm2MoeTopKRouter(hf_config(num_experts_per_tok=2, num_experts=6, norm_topk_prob=True,
                                        routed_scaling_factor=1.7, use_expert_bias=True)),
            Router(8, 6, 2, SIGMOID, bias=True, scaling=1.7, eps=1e-6),
        ),
        (
            DeepseekV3TopkRouter(hf_config(num_experts_per_tok=3, num_local_experts=12, n_group=4,
                                           topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
            Router(8, 12, 3, SIGMOID, bias=True, n_group=4, topk_group=2, scaling=2.5, float32_logits=True),
        ),
    ]
    for theirs, ours in cases:
        e = ours.weight.shape[0]
        w = torch.randn(e, 8, generator=gen)
        bias = torch.randn(e, generator=gen) * 0.3
        theirs.weight.data.copy_(w)
        ours.weight.data.copy_(w)
        if ours.e_score_correction_bias is not None:
            ours.e_score_correction_bias.copy_(bias)
        if isinstance(theirs, Lfm2MoeTopKRouter):
            _, want_w, want_i = theirs(x, bias)
        else:
            if hasattr(theirs, "e_score_correction_bias"):
                theirs.e_score_correction_bias.copy_(bias)
            _, want_w, want_i = theirs(x)
        got_w, got_i = ours(x)
        got_i, order = got_i.sort(-1)
        want_i, want_order = want_i.sort(-1)
        assert torch.equal(got_i, want_i), type(theirs).__name__
        want_w = want_w.float().gather(1, want_order)
        torch.testing.assert_close(got_w.gather(1, order), want_w, rtol=1e-6, atol=1e-7)


def dense_experts_reference(
    x, first, down, index, weights, block: int | None = None, gated: bool = True
) -> torch.Tensor:
    """Every token through its own k experts, one at a time, in float64: silu(gate) · up (`first` the
    gate / up rows), or relu(up)² (non-gated, `first` the up rows); with `block`, each projection's
    input as the integer kernels multiply it: quantized to int8 per `block` inputs."""

    def seen(v: torch.Tensor) -> torch.Tensor:
        if block is None:
            return v
        xq, xs = quantize_activations(v.to(torch.bfloat16)[None], block)
        return (xq.double().view(xs.shape[1], block) * xs.double()[0, :, None]).view(-1)

    x, first, down, weights = x.double(), first.double(), down.double(), weights.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(index[t].tolist()):
            y = first[e] @ seen(x[t])
            if gated:
                gate, up = y.chunk(2)
                hidden = F.silu(gate) * up
            else:
                hidden = F.relu(y) ** 2
            out[t] += weights[t, j] * (down[e] @ seen(hidden))
    return out


def random_experts(e: int, d: int, inter: int, seed: int, gated: bool = True) -> Experts:
    """Gated silu experts, or non-gated relu² ones (Nemotron's)."""
    experts = Experts(e, d, inter, "silu" if gated else "relu2", gated=gated)
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * inter if gated else inter
    getattr(experts, experts.first).data = torch.randn(e, rows, d, generator=gen) * d**-0.5
    experts.down_proj.data = torch.randn(e, d, inter, generator=gen) * inter**-0.5
    return experts


@pytest.mark.parametrize("tokens", [1, 8, 64])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_dispatch_adds_a_tokens_outputs_in_ascending_expert_order_in_float32(tokens, weights_dtype):
    """Bit for bit the definition: per token, from 0, each chosen expert's output times its weight
    (in the weights' dtype) added in float32 in ascending expert order, rounded once."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 48, generator=gen).bfloat16()
    weights, index = softmax_topk(torch.randn(tokens, 12, generator=gen), 5)
    weights = weights.to(weights_dtype)

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:  # row-independent, distinct per expert
        return (rows.float() * (e - 5.5) + e).bfloat16()

    want = torch.zeros(tokens, 48)
    for t in range(tokens):
        for j in index[t].argsort().tolist():
            e = int(index[t, j])
            want[t] += (expert(e, x[t : t + 1]) * weights[t, j : j + 1]).float()[0]
    assert torch.equal(dispatch(x, index, weights, expert), want.bfloat16())


@pytest.mark.parametrize("gated", [True, False])
def test_experts_equal_each_tokens_own_experts_computed_densely(gated):
    experts = random_experts(5, 16, 12, seed=1, gated=gated)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 16, generator=gen)
    weights, index = softmax_topk(torch.randn(9, 5, generator=gen), 2)
    got = experts(x, index, weights)
    first = getattr(experts, experts.first)
    want = dense_experts_reference(x, first, experts.down_proj, index, weights, gated=gated)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def dequantized(experts: QuantExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantized experts' weights as float64 stacks [E, 2·I or I, d], [E, d, I]."""
    first = torch.stack([q.dequantized(torch.float64) for q in getattr(experts, experts.first)])
    return first, torch.stack([q.dequantized(torch.float64) for q in experts.down_proj])


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [1, FEW_TOKENS, 40])  # decode, a verify pass, a prompt chunk
def test_quantized_experts_equal_their_dequantized_weights_computed_densely(scheme, tokens, gated):
    """int8 / int4 experts, gated and non-gated (through the quantized kernels: decode, few-row and
    prompt paths) against every token's own experts in float64 on the dequantized weights, the
    activations as the kernels take them: bf16, or int8 per group where the rows take the integer
    kernel (int4 where the integer kernels are built)."""
    experts = QuantExperts.from_experts(random_experts(6, 64, 64, seed=5, gated=gated), scheme)
    firsts = getattr(experts, experts.first)
    assert {q.bits for q in [*firsts, *experts.down_proj]} == {8 if scheme == "int8" else 4}
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=gen).bfloat16()
    weights, index = softmax_topk(torch.randn(tokens, 6, generator=gen), 3)
    got = experts(x, index, weights).double()
    first = firsts[0]
    integer = first._decodes_in_integers() or (tokens > FEW_TOKENS and integer_prefill())
    block = (first.group_size if first.bits == 4 else ACT_BLOCK) if integer else None
    want = dense_experts_reference(x, *dequantized(experts), index, weights, block, gated)
    # bf16 rounding of the activations between the projections and of the output
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("quantized", [False, True])
def test_a_step_reads_only_the_chosen_experts_each_once(quantized):
    """Unchosen experts' weights set to NaN leave the output finite and unchanged; each chosen expert
    runs once per forward, whatever the number of its tokens (the 8-row step of a batch)."""
    experts = random_experts(8, 64, 64, seed=6).bfloat16()
    if quantized:
        experts = QuantExperts.from_experts(experts, "int4")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, 64, generator=gen).bfloat16()
    weights, index = softmax_topk(torch.randn(8, 8, generator=gen), 2)
    index[:, 0], index[:, 1] = 2, torch.tensor([5, 5, 6, 6, 5, 6, 5, 6])  # experts 2, 5, 6 only
    experts.requires_grad_(False)  # as in a loaded model: the experts may then run grouped
    want = experts(x, index, weights)
    calls = []
    expert = experts.expert
    experts.expert = lambda e, rows: calls.append(e) or expert(e, rows)

    def counted(run):
        def grouped(es, *rows_and_pairs):
            ys = run(es, *rows_and_pairs)
            calls.extend(es if ys is not None else [])
            return ys

        return grouped

    # the grouped products, or the quantized experts' one kernel call for decode rows
    for name in ("grouped", "fused"):
        if hasattr(experts, name):
            setattr(experts, name, counted(getattr(experts, name)))
    with torch.no_grad():
        for e in (0, 1, 3, 4, 7):
            if quantized:
                for q in (experts.gate_up_proj[e], experts.down_proj[e]):
                    q.scales.fill_(float("nan"))
            else:
                experts.gate_up_proj[e].fill_(float("nan"))
                experts.down_proj[e].fill_(float("nan"))
    got = experts(x, index, weights)
    assert torch.equal(got, want) and sorted(calls) == [2, 5, 6]


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("scheme", ["bf16", "int8", "int4", "int4-prompt"])
@pytest.mark.parametrize("tokens", [1, 8])  # a decode step, a batched step's rows
def test_grouped_experts_give_each_experts_own_bits(scheme, tokens, gated):
    """Experts, gated or not, computed in two grouped kernel calls (bf16, int8 and int4 on the decode
    kernels; int4 on the integer path as prompt rows) equal each expert run on its own, bit for bit,
    and so does the whole routed forward."""
    experts = random_experts(8, 64, 64, seed=8, gated=gated).bfloat16().requires_grad_(False)
    rows_kind = nullcontext()
    if scheme == "int4-prompt":
        if not integer_prefill():
            pytest.skip("no integer kernels on this CPU")
        experts, rows_kind = QuantExperts.from_experts(experts, "int4"), prompt_rows()
    elif scheme != "bf16":
        experts = QuantExperts.from_experts(experts, scheme)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=gen).bfloat16()
    weights, index = softmax_topk(torch.randn(tokens, 8, generator=gen), 3)
    with rows_kind:
        got = experts(x, index, weights)
        chosen, rows = [1, 4, 6], [x, x[:1], x]
        ys = experts.grouped(chosen, rows)
        assert ys is not None, "the grouped kernels did not take the experts"
        assert torch.equal(ys, torch.cat([experts.expert(e, r) for e, r in zip(chosen, rows, strict=True)]))
        experts.grouped = lambda es, rows: None  # one expert at a time
        assert torch.equal(got, experts(x, index, weights))


@pytest.mark.parametrize("quantized", [False, True])
def test_a_tokens_experts_output_does_not_depend_on_the_other_tokens(quantized):
    """Inside `rowwise` (a packed step of many sequences) each token's output equals its own forward,
    bit for bit, however many tokens share its experts."""
    experts = random_experts(5, 64, 64, seed=8).bfloat16()
    if quantized:
        experts = QuantExperts.from_experts(experts, "int8")
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(23, 64, generator=gen).bfloat16()
    weights, index = softmax_topk(torch.randn(23, 5, generator=gen), 2)
    with rowwise():
        together = experts(x, index, weights)
        alone = torch.cat([experts(x[t : t + 1], index[t : t + 1], weights[t : t + 1]) for t in range(23)])
    assert torch.equal(together, alone)


def test_sparse_block_adds_the_sigmoid_gated_shared_expert():
    router, experts = Router(16, 5, 2, SOFTMAX), random_experts(5, 16, 12, seed=3)
    router.weight.data = torch.randn(5, 16, generator=torch.Generator().manual_seed(5))  # built empty
    shared = GatedMLP(16, 8)
    block = SparseMoE(router, experts, shared, "shared_expert", gated_shared=True)
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(4))
    flat = x.reshape(-1, 16)
    weights, index = router(flat)
    want = experts(flat, index, weights) + torch.sigmoid(block.shared_expert_gate(flat)) * shared(flat)
    torch.testing.assert_close(block(x), want.view(x.shape), rtol=0, atol=1e-6)
    names = {"gate.weight", "shared_expert_gate.weight", "shared_expert.up_proj.weight"}
    assert names <= set(block.state_dict())


def test_stacking_per_expert_tensors_gives_the_fused_layout_and_checks_shapes():
    e, d, inter = 3, 4, 6
    state = {}
    for j in range(e):
        state[f"p.{j}.w1.weight"] = torch.full((inter, d), j + 0.1)
        state[f"p.{j}.w3.weight"] = torch.full((inter, d), j + 0.3)
        state[f"p.{j}.w2.weight"] = torch.full((d, inter), j + 0.2)
    stack_experts(state, "p", e, d, inter, ("w1", "w3", "w2"))
    assert set(state) == {"p.gate_up_proj", "p.down_proj"}
    assert state["p.gate_up_proj"].shape == (e, 2 * inter, d)
    # gate rows first, then up rows, expert by expert
    assert state["p.gate_up_proj"][2, 0, 0] == pytest.approx(2.1)
    assert state["p.gate_up_proj"][2, -1, 0] == pytest.approx(2.3)
    bad = {f"p.{j}.gate_proj.weight": torch.zeros(inter, d) for j in range(e)}
    with pytest.raises(CheckpointError, match="missing tensor 'p.0.up_proj.weight'"):
        stack_experts(bad, "p", e, d, inter)
    bad = {f"p.{j}.{n}.weight": torch.zeros(inter, d) for j in range(e) for n in ("gate_proj", "up_proj")}
    bad |= {f"p.{j}.down_proj.weight": torch.zeros(d, inter + 1) for j in range(e)}
    with pytest.raises(CheckpointError, match="has shape"):
        stack_experts(bad, "p", e, d, inter)


@pytest.mark.parametrize(
    ("e", "k", "n_group", "topk_group", "message"),
    [
        (4, 5, 1, 1, "num_experts_per_tok=5"),
        (4, 0, 1, 1, "num_experts_per_tok=0"),
        (10, 2, 3, 1, "n_group=3"),
        (12, 5, 4, 1, "topk_group=1"),
    ],
)
def test_impossible_routing_settings_are_a_checkpoint_error(e, k, n_group, topk_group, message):
    with pytest.raises(CheckpointError, match=message):
        check_routing(e, k, n_group, topk_group)
    with pytest.raises(CheckpointError, match=message):
        Router(8, e, k, SIGMOID, n_group=n_group, topk_group=topk_group)


def copy_checkpoint(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """`src` copied to `dst`, config.json passed through `config(raw) -> raw` and the single
    model.safetensors through `tensors(state) -> state`."""
    shutil.copytree(src, dst)
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(config(raw)))
    if tensors is not None:
        file = dst / "model.safetensors"
        save_file(tensors(load_file(file)), file, metadata={"format": "pt"})
    return dst


# checkpoint name, one sparse layer's experts as saved, the gate / up / down names of an expert
MOE_CHECKPOINTS = [
    ("qwen3_5_moe_text", "model.layers.2.mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    ("lfm2_moe", "model.layers.3.feed_forward.experts", ("w1", "w3", "w2")),
]


@pytest.mark.parametrize(("name", "experts", "names"), MOE_CHECKPOINTS)
def test_bad_expert_checkpoints_are_refused_with_a_checkpoint_error(checkpoints, tmp_path, name, experts,
                                                                    names):
    src = checkpoints(name).path
    too_many = copy_checkpoint(src, tmp_path / "k", config=lambda raw: raw | {"num_experts_per_tok": 9})
    with pytest.raises(CheckpointError, match="num_experts_per_tok=9"):
        load_model(too_many, dtype=torch.float32, device="cpu")
    up, down = f"{experts}.4.{names[1]}.weight", f"{experts}.4.{names[2]}.weight"
    gone = copy_checkpoint(src, tmp_path / "gone", tensors=lambda s: {k: v for k, v in s.items() if k != up})
    with pytest.raises(CheckpointError, match="missing tensor"):
        load_model(gone, dtype=torch.float32, device="cpu")
    narrow = lambda s: s | {down: s[down][:, :-1].contiguous()}  # noqa: E731
    wrong = copy_checkpoint(src, tmp_path / "wrong", tensors=narrow)
    with pytest.raises(CheckpointError, match="has shape"):
        load_model(wrong, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize(("name", "experts", "names"), MOE_CHECKPOINTS)
def test_checkpoints_with_stacked_experts_load_to_the_same_model(checkpoints, tmp_path, name, experts, names):
    """Per-expert tensors (as transformers saves them) and the stacked `gate_up_proj` / `down_proj`
    layout (as some conversions write them) load to the same weights."""
    src = checkpoints(name).path
    per_expert = load_model(src, dtype=torch.float32, device="cpu")
    c = per_expert.config

    def stacked(state):
        stack_experts(state, experts, c.num_experts, c.hidden_size, c.moe_intermediate_size, names)
        assert f"{experts}.gate_up_proj" in state
        return state

    fused = copy_checkpoint(src, tmp_path / "fused", tensors=stacked)
    fused = load_model(fused, dtype=torch.float32, device="cpu")
    want = per_expert.state_dict()
    got = fused.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(v, got[k]), k


def test_the_selection_bias_stays_float32_in_a_bf16_model(checkpoints):
    """A bf16 load keeps the router's selection bias bit for bit as the checkpoint holds it (float32),
    also through a later change of dtype; the router's weight takes the model's dtype."""
    path = checkpoints("lfm2_moe").path
    name = "model.layers.2.feed_forward.expert_bias"
    stored = load_file(path / "model.safetensors")[name]
    model = load_model(path, dtype=torch.bfloat16, device="cpu")
    router = model.model.layers[2].mlp.gate
    assert stored.dtype is torch.float32 and router.weight.dtype is torch.bfloat16
    assert torch.equal(router.e_score_correction_bias, stored)
    model.to(torch.float16)
    assert torch.equal(router.e_score_correction_bias, stored)


def shared_block(gated_shared: bool, scheme: str | None) -> SparseMoE:
    """A loaded MoE block (bf16, fused, quantized by `scheme`) whose shared expert has the routed experts'
    shape: Qwen's sigmoid-gated shared expert with bf16 routing weights, or Kimi's / Ling's ungated one
    with float32 weights."""
    d, inter, e = 128, 64, 6
    router = Router(d, e, 2, SOFTMAX)
    gen = torch.Generator().manual_seed(21)
    router.weight.data = torch.randn(e, d, generator=gen) * d**-0.5
    shared = GatedMLP(d, inter)
    for layer in (shared.gate_proj, shared.up_proj, shared.down_proj):
        layer.weight.data = torch.randn(layer.weight.shape, generator=gen) * layer.in_features**-0.5
    weights_dtype = "activation" if gated_shared else "float32"
    block = SparseMoE(router, random_experts(e, d, inter, seed=22), shared, "shared_expert", gated_shared,
                      weights_dtype)
    if gated_shared:
        block.shared_expert_gate.weight.data = torch.randn(1, d, generator=gen) * d**-0.5
    block = block.bfloat16().requires_grad_(False)
    if scheme is not None:
        quantize_(block, scheme)
        block.experts = QuantExperts.from_experts(block.experts, scheme)
    return fuse_projections(block)


@pytest.mark.parametrize("scheme", [None, "int8", "int4"])
@pytest.mark.parametrize("gated_shared", [True, False])
@pytest.mark.parametrize("tokens", [1, FEW_TOKENS, 23])  # a decode step, a verify pass, a packed step
def test_a_shared_expert_in_the_experts_call_has_the_bits_it_has_computed_apart(tokens, gated_shared, scheme):
    """Decode rows take the shared expert into the routed experts' one kernel call (`Experts.joins`): the
    block's output equals, bit for bit, the routed experts plus the shared expert computed by its own
    module and added by torch."""
    block = shared_block(gated_shared, scheme)
    x = (2 * torch.randn(tokens, 128, generator=torch.Generator().manual_seed(tokens))).bfloat16()
    joined, fused = [], block.experts.fused

    def spied(es, xs, pairs, shared=None):
        joined.append(shared)
        return fused(es, xs, pairs, shared)

    block.experts.fused = spied
    with rowwise() if tokens > FEW_TOKENS else nullcontext():
        got = block(x)
        block.experts.joins = lambda *args: False
        want = block(x)
    assert joined[0] is block.shared_expert and joined[-1] is None
    assert torch.equal(got, want)


@pytest.mark.parametrize("tokens", [1, FEW_TOKENS])
def test_granites_decode_rows_route_by_its_rule_in_the_router_kernel(checkpoints, monkeypatch, tokens):
    """Granite's softmax of its top-k logits is the top k of the softmax renormalised: decode rows through
    the router call give the experts and weights its torch rule gives (weights within bf16 rounding)."""
    import hybridlm.models.granitemoehybrid as granite

    model = load_model(checkpoints("granitemoehybrid_moe").path, torch.bfloat16, "cpu")
    block = next(m for m in model.modules() if isinstance(m, granite.SoftmaxTopKMoE))
    x = torch.randn(tokens, block.router.in_features, generator=torch.Generator().manual_seed(3)).bfloat16()
    seen = []
    forward = block.experts.forward

    def spied(rows, index, weights, *rest):
        seen.append((index.sort(dim=-1), weights))
        return forward(rows, index, weights, *rest)

    block.experts.forward = spied
    with torch.no_grad():
        assert granite.routes_in_kernel(x, block.router.weight)
        block(x)
        monkeypatch.setattr(granite, "routes_in_kernel", lambda *args: False)
        block(x)
    ((got_ids, got_at), got_w), ((want_ids, want_at), want_w) = seen
    assert torch.equal(got_ids, want_ids)
    got_w, want_w = got_w.gather(1, got_at).float(), want_w.gather(1, want_at).float()
    torch.testing.assert_close(got_w, want_w, rtol=2**-7, atol=0)
