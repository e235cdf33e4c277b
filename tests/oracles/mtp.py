"""Qwen3.5 / Qwen3-Next checkpoints with a multi-token-prediction head, and a reference for it.

transformers ignores `mtp.*` tensors (it has no MTP head), so `add_mtp` writes random ones into a
checkpoint transformers saved, with the published names and shapes: the decoder layer is
transformers' own decoder layer of the family (a full-attention layer built with layer 0's
feed-forward block, as vLLM builds `mtp.layers.0`; Qwen3-Next experts stored one by one, as
published), the norms its zero-centred RMSNorm, `fc` a 2d -> d projection. `MTPReference` runs
the published structure from those transformers modules, in float64: embedding of the next token
and the target's final-normed hidden state, each RMS-normed, concatenated (embedding first),
projected, one causal full-attention decoder layer, the head's norm, the target's LM head.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.oracles import qwen3_5, qwen3_5_moe, qwen3_next
from tests.oracles.common import Checkpoint, randomize

LAYER_COUNT_FIELD = {
    "qwen3_5_text": "mtp_num_hidden_layers",
    "qwen3_next": "num_nextn_predict_layers",
    "qwen3_5_moe_text": "mtp_num_hidden_layers",
}


def modules(hf_config, model_type: str) -> dict[str, nn.Module]:
    """transformers modules of the head, by checkpoint name without `mtp.` (weights uninitialised)."""
    config = copy.deepcopy(hf_config)
    config.layer_types = ["full_attention", *config.layer_types[1:]]
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the grouped-mm path has no float64
    if model_type == "qwen3_5_text":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer as Layer
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm as Norm
    elif model_type == "qwen3_5_moe_text":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer as Layer
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm as Norm
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer as Layer
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm as Norm
    d, eps = config.hidden_size, config.rms_norm_eps
    return {
        "pre_fc_norm_embedding": Norm(d, eps=eps),
        "pre_fc_norm_hidden": Norm(d, eps=eps),
        "fc": nn.Linear(2 * d, d, bias=False),
        "layers.0": Layer(config, 0),
        "norm": Norm(d, eps=eps),
    }


def published_tensors(head: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """The head's tensors as published checkpoints name them (experts one by one)."""
    out = {}
    for prefix, module in head.items():
        for name, t in module.state_dict().items():
            full = f"mtp.{prefix}.{name}"
            if full.endswith("mlp.experts.gate_up_proj"):
                base = full.removesuffix("gate_up_proj")
                gate, up = t.chunk(2, dim=1)
                for e in range(t.shape[0]):
                    out[f"{base}{e}.gate_proj.weight"] = gate[e].contiguous()
                    out[f"{base}{e}.up_proj.weight"] = up[e].contiguous()
            elif full.endswith("mlp.experts.down_proj"):
                base = full.removesuffix("down_proj")
                for e in range(t.shape[0]):
                    out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
            else:
                out[full] = t.contiguous()
    return out


def fused(
    tensors: dict[str, torch.Tensor], head: dict[str, nn.Module]
) -> dict[str, dict[str, torch.Tensor]]:
    """Published `mtp.*` tensors -> state dicts of `head`'s modules (experts stacked again)."""
    states: dict[str, dict[str, torch.Tensor]] = {}
    for prefix, module in head.items():
        state = {}
        for name in module.state_dict():
            full = f"mtp.{prefix}.{name}"
            if full.endswith("mlp.experts.gate_up_proj"):
                base, n = full.removesuffix("gate_up_proj"), module.mlp.experts.gate_up_proj.shape[0]
                gate = torch.stack([tensors[f"{base}{e}.gate_proj.weight"] for e in range(n)])
                up = torch.stack([tensors[f"{base}{e}.up_proj.weight"] for e in range(n)])
                state[name] = torch.cat([gate, up], dim=1)
            elif full.endswith("mlp.experts.down_proj"):
                base, n = full.removesuffix("down_proj"), module.mlp.experts.down_proj.shape[0]
                state[name] = torch.stack([tensors[f"{base}{e}.down_proj.weight"] for e in range(n)])
            else:
                state[name] = tensors[full]
        states[prefix] = state
    return states


def add_mtp(ckpt: Checkpoint, model_type: str, shard: bool, seed: int = 2) -> Checkpoint:
    """Write random `mtp.*` tensors into a saved checkpoint: into model.safetensors, or (`shard`) into
    a second file named by a new model.safetensors.index.json; set the config's MTP layer count."""
    hf_config = ckpt.hf_class.config_class.from_pretrained(ckpt.path)
    head = modules(hf_config, model_type)
    for i, module in enumerate(head.values()):
        randomize(module, seed + i)
    extra = published_tensors(head)
    main = ckpt.path / "model.safetensors"
    if shard:
        save_file(extra, ckpt.path / "mtp.safetensors", metadata={"format": "pt"})
        names = dict.fromkeys(load_file(main), "model.safetensors") | dict.fromkeys(extra, "mtp.safetensors")
        index = {"metadata": {}, "weight_map": names}
        (ckpt.path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(load_file(main) | extra, main, metadata={"format": "pt"})
    config_file = ckpt.path / "config.json"
    config = json.loads(config_file.read_text())
    config[LAYER_COUNT_FIELD[model_type]] = 1
    config_file.write_text(json.dumps(config, indent=2))
    return Checkpoint(ckpt.path, ckpt.hf_class, ckpt.family + "_mtp")


def qwen3_5_text(out: Path) -> Checkpoint:
    return add_mtp(qwen3_5.text(out), "qwen3_5_text", shard=False)


def qwen3_next_moe(out: Path) -> Checkpoint:
    """Layer 0 is sparse in this config: the head's layer has the MoE block."""
    return add_mtp(qwen3_next.untied(out), "qwen3_next", shard=True)


def qwen3_5_moe_text(out: Path) -> Checkpoint:
    """Every layer is sparse: the head's layer has the MoE block."""
    return add_mtp(qwen3_5_moe.text(out), "qwen3_5_moe_text", shard=False)


BUILDERS = {
    "qwen3_5_text_mtp": qwen3_5_text,
    "qwen3_next_mtp": qwen3_next_moe,
    "qwen3_5_moe_text_mtp": qwen3_5_moe_text,
}
REPRESENTATIVE: list[str] = []
MODEL_TYPE = {
    "qwen3_5_text_mtp": "qwen3_5_text",
    "qwen3_next_mtp": "qwen3_next",
    "qwen3_5_moe_text_mtp": "qwen3_5_moe_text",
}


class MTPReference:
    """The published MTP structure over transformers' target and modules, float64, no caches."""

    def __init__(self, ckpt: Checkpoint, model_type: str):
        hf = ckpt.hf_class.from_pretrained(ckpt.path, dtype=torch.float64, experts_implementation="eager")
        self.target = hf.eval()
        self.head = modules(self.target.config, model_type)
        files = sorted(ckpt.path.glob("*.safetensors"))
        tensors = {k: v for f in files for k, v in load_file(f).items() if k.startswith("mtp.")}
        for prefix, state in fused(tensors, self.head).items():
            self.head[prefix].load_state_dict(state)
            self.head[prefix].double().eval()

    @torch.no_grad()
    def target_hidden(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), d] the target's final-normed hidden states."""
        return self.target.model(torch.tensor([ids])).last_hidden_state[0]

    @torch.no_grad()
    def logits(self, run: list[int], drafts: list[int], start: int = 0) -> torch.Tensor:
        """[len(drafts) + 1, V] float64: the head's logits for each draft position after `run` (the
        target holds run[:-1]) when it drafts `drafts`, then the logits after the last draft. The head
        sees positions start … (its context begins there, as after a prefix-cache hit)."""
        hidden = self.target_hidden(run[:-1])[start:]
        tokens = list(run[start + 1 :])
        out = []
        for i in range(len(drafts) + 1):
            h = self._head(hidden, tokens, start)
            out.append(self.target.lm_head(h[-1]))
            if i < len(drafts):
                hidden = torch.cat([hidden, h[-1:]])
                tokens.append(drafts[i])
        return torch.stack(out)

    def _head(self, hidden: torch.Tensor, tokens: list[int], start: int) -> torch.Tensor:
        """Head outputs [L, d] for positions start … start+L-1 from hidden [L, d] and the tokens after."""
        n = hidden.shape[0]
        embeds = self.target.get_input_embeddings()(torch.tensor([tokens]))
        normed = [self.head["pre_fc_norm_embedding"](embeds), self.head["pre_fc_norm_hidden"](hidden[None])]
        x = self.head["fc"](torch.cat(normed, dim=-1))
        positions = torch.arange(start, start + n)[None]
        causal = torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1)[None, None]
        rope = self.target.model.rotary_emb(x, positions)
        x = self.head["layers.0"](x, position_embeddings=rope, attention_mask=causal, position_ids=positions)
        return self.head["norm"](x)[0]
