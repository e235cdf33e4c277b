"""Fusing the linear layers that read the same input, once a model is loaded.

A layer class lists its fusable groups in ``FUSED`` (``{"gate_up": ("gate_proj", "up_proj")}``):
`fuse_projections` replaces each group's layers by one `FusedLinear` under the group's name, whose
weight holds their output rows one after another. The layer's forward calls the fused layer when it
is there and the separate ones otherwise (a model built in code and never fused). Checkpoints keep
the separate layers' names: loading fuses after the tensors are in place, and `unfused_state` gives
the state dict a saved checkpoint holds.

Numbers: each output row is the same dot product of the same weights, and the decode kernels
(`ops.linear`, `ops.quant`) compute one output's sum by the same instructions whatever rows share the
call, so decode and verify rows are bit-identical to the separate layers; so are integer-prefill
rows (`ops.quant_gemm`: exact integer sums). The bf16 / float32 GEMMs of a prefill may block the
reduction differently for a wider output and round differently in the last bit.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.models.checkpoint import placed
from hybridlm.ops.linear import FusedLinear, Linear
from hybridlm.ops.quant import QuantLinear

__all__ = ["fuse_projections", "unfused_modules", "unfused_state"]


def _joined(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing `layers`' outputs side by side, or None when they do not fuse (mixed
    kinds: a GPTQ checkpoint's quantized layer beside a float one, or dtypes, devices, biases)."""
    if all(type(m) is QuantLinear for m in layers):
        try:
            joined = QuantLinear.concat(layers)
        except ValueError:
            return None
        for name in ("qweight", "scales"):
            t = joined._buffers[name]
            joined._buffers[name] = placed(t, t.device, t.dtype)
        return joined
    if not all(type(m) in (Linear, nn.Linear) for m in layers):
        return None
    weights = [m.weight for m in layers]
    biases = [m.bias for m in layers]
    first = weights[0]
    if any(w.dtype != first.dtype or w.device != first.device for w in weights):
        return None
    if any((b is None) != (biases[0] is None) for b in biases):
        return None
    with torch.device("meta"):
        joined = Linear(first.shape[1], sum(w.shape[0] for w in weights), bias=biases[0] is not None)
    with torch.no_grad():
        weight = placed(torch.cat(weights), first.device, first.dtype)
        joined.weight = nn.Parameter(weight, requires_grad=first.requires_grad)
        if biases[0] is not None:
            joined.bias = nn.Parameter(torch.cat(biases), requires_grad=biases[0].requires_grad)
    return joined


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse, in place, every group a module of `model` lists in ``FUSED`` whose layers are all there
    and fuse (see `_joined`); returns `model`."""
    for module in list(model.modules()):
        for group, names in getattr(module, "FUSED", {}).items():
            layers = [module._modules.get(name) for name in names]
            if any(m is None for m in layers) or module._modules.get(group) is not None:
                continue
            joined = _joined(layers)
            if joined is None:
                continue
            parts = tuple((name, m.out_features) for name, m in zip(names, layers, strict=True))
            for name in names:
                delattr(module, name)
            setattr(module, group, FusedLinear(joined, parts))
    return model


def _split(fused: FusedLinear) -> dict[str, nn.Module]:
    """The separate layers a `FusedLinear` was made of, by name."""
    proj, sizes = fused.proj, fused.sizes
    names = [name for name, _ in fused.parts]
    if isinstance(proj, QuantLinear):
        return dict(zip(names, proj.split(sizes), strict=True))
    weights = proj.weight.split(sizes)
    biases = proj.bias.split(sizes) if proj.bias is not None else [None] * len(sizes)
    layers = {}
    for name, w, b in zip(names, weights, biases, strict=True):
        with torch.device("meta"):
            layer = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
        layer.weight = nn.Parameter(w.detach(), requires_grad=w.requires_grad)
        if b is not None:
            layer.bias = nn.Parameter(b.detach(), requires_grad=b.requires_grad)
        layers[name] = layer
    return layers


def _fused(model: nn.Module):
    """(path of each `FusedLinear` in `model`, the prefix of its owner's names, the module)."""
    for path, module in model.named_modules():
        if isinstance(module, FusedLinear):
            owner = path.rpartition(".")[0]
            yield path, f"{owner}." if owner else "", module


def unfused_modules(model: nn.Module) -> dict[str, nn.Module]:
    """`model.named_modules()` as a dict, with each fused group's separate layers (split copies) in
    place of its `FusedLinear`, under their names in the unfused model."""
    groups = list(_fused(model))
    modules = {
        name: m for name, m in model.named_modules()
        if not any(name == path or name.startswith(f"{path}.") for path, _, _ in groups)
    }
    for _, prefix, fused in groups:
        modules.update({f"{prefix}{name}": layer for name, layer in _split(fused).items()})
    return modules


def unfused_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict with every fused group under its separate layers' names (as a checkpoint
    of the unfused model holds it)."""
    state = model.state_dict()
    for path, prefix, fused in list(_fused(model)):
        for key in [k for k in state if k.startswith(f"{path}.")]:
            del state[key]
        for name, layer in _split(fused).items():
            for key, t in layer.state_dict().items():
                state[f"{prefix}{name}.{key}"] = t
    return state
